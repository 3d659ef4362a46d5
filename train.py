"""Train a nail segmentation model. `python train.py model=segformer aug=heavy`; `-m` sweeps."""

import hydra
from omegaconf import DictConfig

from nailseg.config import CONF_DIR


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    # imported here: --help, --cfg and a config error answer before torch and Lightning load
    from nailseg.training.run import run_job

    return run_job(cfg)


if __name__ == "__main__":
    main()

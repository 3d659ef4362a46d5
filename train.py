"""Train a nail segmentation model. `python train.py model=segformer aug=heavy`; `-m` sweeps."""

import hydra
from omegaconf import DictConfig

from nailseg.config import CONF_DIR
from nailseg.training.run import run_job


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_job(cfg)


if __name__ == "__main__":
    main()

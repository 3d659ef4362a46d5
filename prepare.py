"""Images + masks → npy + CSV. `python prepare.py input_dir=RAW output_dir=PREPARED`."""

import sys

import hydra
from omegaconf import DictConfig

import nailseg.config  # noqa: F401  (registers the schemas)
from nailseg.data.prepare import PrepareError, run


@hydra.main(version_base="1.3", config_path="conf", config_name="prepare")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except PrepareError as err:
        sys.exit(f"prepare failed: {err}")


if __name__ == "__main__":
    main()

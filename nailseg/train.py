"""`nailseg train` (`python train.py` in the checkout): train, evaluate or sweep (`-m`)."""

import os
import sys

import hydra
from omegaconf import DictConfig

from nailseg.config import CONF_DIR
from nailseg.errors import UserError, refusal


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    # imported here: --help, --cfg and a config error answer before torch and Lightning load
    from nailseg.training.run import run_job

    try:
        return run_job(cfg)
    except UserError as err:  # a single run's (a sweep's job records its error and goes on)
        sys.exit(refusal(os.path.basename(sys.argv[0]), err))

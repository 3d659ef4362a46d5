"""`nailseg prepare` (`python prepare.py` in the checkout): images + masks -> npy + CSVs."""

import sys

import hydra
from omegaconf import DictConfig

from nailseg.config import CONF_DIR


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="prepare")
def main(cfg: DictConfig) -> None:
    # imported here: --help, --cfg and a config error answer before the image libraries load
    from nailseg.errors import UserError
    from nailseg.prep.prepare import run

    try:
        run(cfg)
    except UserError as err:
        sys.exit(f"prepare failed: {err}")
    except KeyboardInterrupt:
        sys.exit(
            f"prepare interrupted: {cfg.output_dir} keeps the pairs converted so far; run the "
            "same command again to finish"
        )

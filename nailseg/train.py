"""`nailseg train` (`python train.py` in the checkout): train, evaluate or sweep (`-m`)."""

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
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


class SweepReport(Callback):
    """A sweep's end: its folder and comparison printed, its failed jobs named (exit 1). Listed
    first in conf/train.yaml: Hydra ends callbacks in reverse, after RunFolders releases the folder."""

    def on_multirun_end(self, config: DictConfig, **_: Any) -> None:
        from nailseg.compare import sweep_end  # pandas and matplotlib: only for a sweep's end

        sweep_end(Path(config.hydra.sweep.dir))

"""`python -m nailseg.synth out=DIR [n=200] [seed=0] [num_workers=0]`: a synthetic set on its own
(prepare.py makes one by itself for dataset=synthetic)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from nailseg.config import CONF_DIR, require_values
from nailseg.io.atomic import NotOursError
from nailseg.synth.scene import generate, is_current


@dataclass
class SyntheticCliConfig:
    """`python -m nailseg.synth`; values in conf/synthetic.yaml."""

    out: str = MISSING
    n: int = MISSING
    seed: int = MISSING
    num_workers: int = MISSING


ConfigStore.instance().store(name="synthetic_schema", node=SyntheticCliConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="synthetic")
def main(cfg: DictConfig) -> None:
    """Generate a set into `out`, with a one-line report; a current set is left as it is."""
    require_values(cfg, "nailseg.synth")
    out = Path(cfg.out)
    if is_current(out, cfg.n, cfg.seed):
        print(f"{out}: already holds n={cfg.n} seed={cfg.seed}; nothing written")
        return
    start = time.perf_counter()
    try:
        generate(out, cfg.n, cfg.seed, cfg.num_workers)
    except NotOursError as err:
        sys.exit(f"synthetic failed: {err}")
    except KeyboardInterrupt:
        sys.exit(f"synthetic interrupted: {out} is left incomplete; run it again to finish it")
    seconds = time.perf_counter() - start
    print(
        f"wrote {cfg.n} images to {out} in {seconds:.2f} s "
        f"({cfg.n / seconds:.1f} images/s, {cfg.num_workers} workers)"
    )


if __name__ == "__main__":
    main()

"""prepare's settings as one typed object, built from a composed conf/prepare.yaml (the one
source of their values)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from nailseg.config import CONF_DIR
from nailseg.prep.splits import SplitSettings


@dataclass(frozen=True)
class PrepareSettings:
    """How prepare converts, checks and splits (conf/prepare.yaml's keys of the same names)."""

    mask_threshold: int  # a mask value above it is nail; {0, 1} masks are taken as they are
    strict: bool  # any excluded file fails the run
    prune: bool  # delete the outputs of pairs gone from the input (else kept, unlisted)
    num_workers: int | None  # processes; None: one per CPU core
    split: SplitSettings

    @classmethod
    def from_config(cls, cfg: DictConfig) -> PrepareSettings:
        """The settings of a composed conf/prepare.yaml."""
        split = OmegaConf.to_container(cfg.split, resolve=True)
        split["holdout_groups"] = tuple(split["holdout_groups"])
        return cls(
            mask_threshold=cfg.mask_threshold,
            strict=cfg.strict,
            prune=cfg.prune,
            num_workers=cfg.num_workers,
            split=SplitSettings(**split),
        )


def compose_prepare(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/prepare.yaml with Hydra `overrides`, composed inside a Hydra app or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose("prepare", overrides=list(overrides))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("prepare", overrides=list(overrides))

"""From a training checkpoint to a ready network: the one loader that predict and export share.

A checkpoint holds the SegModule's weights (`net.*` keys) but not how to build the net; that is in
the training run's config, `<run>/.hydra/config.yaml` beside `<run>/checkpoints/`. `load_net`
builds the net from a model config and loads the weights with `weights_only=True`; when the two
disagree (a checkpoint of another architecture) it says so in one sentence naming a few keys,
instead of raising PyTorch's wall of missing and unexpected keys.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

NET_PREFIX = "net."  # SegModule keeps the network under `self.net`
RUN_CONFIG = Path(".hydra") / "config.yaml"
_SHOWN_KEYS = 3


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says what to pass instead."""


class ArchitectureMismatch(CheckpointError):
    """The checkpoint's weights do not fit the net built from the model config."""


def run_dir_of(ckpt: Path) -> Path | None:
    """The training run a checkpoint belongs to (`<run>/checkpoints/<name>.ckpt` with
    `<run>/.hydra/config.yaml`), or None for a checkpoint kept elsewhere."""
    run_dir = Path(ckpt).absolute().parent.parent
    return run_dir if (run_dir / RUN_CONFIG).is_file() else None


def load_run_config(run_dir: Path) -> DictConfig:
    """The run's config as Hydra saved it (interpolations unresolved, read lazily)."""
    cfg = OmegaConf.load(run_dir / RUN_CONFIG)
    if not isinstance(cfg, DictConfig):
        raise CheckpointError(f"{run_dir / RUN_CONFIG} is not a config mapping")
    return cfg


def load_net(ckpt: str | Path, model_cfg: Mapping[str, Any]) -> nn.Module:
    """The net described by `model_cfg` (a `model=` config) with the checkpoint's weights, in
    eval mode on the CPU.

    Pretrained encoder weights are never downloaded here (`encoder_weights` is forced to None):
    every weight comes from the checkpoint.
    """
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise CheckpointError(f"ckpt={ckpt}: no such checkpoint")
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{ckpt} cannot be loaded as a checkpoint: {err}") from err
    state = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint (it has no state_dict)")
    weights = {k.removeprefix(NET_PREFIX): v for k, v in state.items() if k.startswith(NET_PREFIX)}
    net: nn.Module = instantiate(model_cfg, encoder_weights=None)
    _check_fits(ckpt, model_cfg, weights, net.state_dict())
    net.load_state_dict(weights)
    return net.eval()


def _check_fits(
    ckpt: Path,
    model_cfg: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
) -> None:
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    reshaped = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(expected[k].shape)}"
        for k in sorted(expected.keys() & weights.keys())
        if weights[k].shape != expected[k].shape
    ]
    if not (missing or unexpected or reshaped):
        return
    problems = [
        _listing(items, what)
        for items, what in (
            (missing, "missing keys"),
            (unexpected, "unexpected keys"),
            (reshaped, "keys of another shape"),
        )
        if items
    ]
    options = OmegaConf.to_container(OmegaConf.create(dict(model_cfg.get("options") or {})))
    model = f"{model_cfg.get('arch')}/{model_cfg.get('encoder_name')}" + (
        f" {options}" if options else ""
    )
    raise ArchitectureMismatch(
        f"checkpoint {ckpt} was trained with a different architecture than model {model}: "
        f"{'; '.join(problems)}; "
        "pass model=… matching the run that wrote it (see that run's .hydra/config.yaml)"
    )


def _listing(items: Sequence[str], what: str) -> str:
    shown = ", ".join(items[:_SHOWN_KEYS])
    more = f", … {len(items) - _SHOWN_KEYS} more" if len(items) > _SHOWN_KEYS else ""
    return f"{what} ({len(items)}): {shown}{more}"

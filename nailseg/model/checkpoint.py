"""What a checkpoint carries, and from a checkpoint to a ready network, without running its config.

Every checkpoint that training writes holds a card under `CARD_KEY`: the architecture and its plain
arguments, the input size, the normalisation, the threshold, the group names, the prepared data
root, the nailseg version and the whole resolved config, all as plain data. So a checkpoint copied
anywhere can be predicted with or exported on its own, and `torch.load(weights_only=True)` reads
it.

Nothing read off disk is ever instantiated: a `_target_` in a checkpoint or in a run folder's
`.hydra/config.yaml` could name any callable (`torch.load` with `weights_only: false` runs
arbitrary code). The net is built by `plain_model` + `build_net` from an allow-list instead: an
smp architecture, an encoder name and keyword arguments that are plain values. Checkpoints written
before cards existed are still read, through the same allow-list, from their run folder's config.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import segmentation_models_pytorch as smp
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from nailseg.model.net import build_net, state_dict_mismatch

CARD_KEY = "nailseg"
CARD_FORMAT = 1
NET_PREFIX = "net."  # SegModule keeps the network under `self.net`
RUN_CONFIG = Path(".hydra") / "config.yaml"
_PLAIN = (str, int, float, bool, type(None))


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says what to pass instead."""


class ArchitectureMismatch(CheckpointError):
    """The checkpoint's weights do not fit the net built from the model description."""


def nailseg_version() -> str:
    try:
        return version("nailseg")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def make_card(cfg: DictConfig, group_names: Sequence[str]) -> dict[str, Any]:
    """The card for checkpoints of a training run composed as `cfg` (plain data only)."""
    return {
        "format": CARD_FORMAT,
        "nailseg_version": nailseg_version(),
        "model": plain_model(cfg.model, "model"),
        "image_size": [int(v) for v in cfg.dataset.image_size],
        "mean": [float(v) for v in cfg.normalize.mean],
        "std": [float(v) for v in cfg.normalize.std],
        "threshold": float(cfg.module.threshold),
        "group_names": [str(g) for g in group_names],
        "data_root": str(Path(cfg.dataset.root).absolute()),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def read_checkpoint(ckpt: str | Path) -> Mapping[str, Any]:
    """The checkpoint's contents (tensors memory-mapped), read with `weights_only=True`."""
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise CheckpointError(f"ckpt={ckpt}: no such checkpoint")
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{ckpt} cannot be loaded as a checkpoint: {err}") from err
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint (it has no state_dict)")
    return checkpoint


def card_of(checkpoint: Mapping[str, Any]) -> Mapping[str, Any] | None:
    card = checkpoint.get(CARD_KEY)
    return card if isinstance(card, Mapping) else None


def run_dir_of(ckpt: Path) -> Path | None:
    """The training run a checkpoint sits in (`<run>/checkpoints/<name>.ckpt` with
    `<run>/.hydra/config.yaml`), or None for a checkpoint kept elsewhere."""
    run_dir = Path(ckpt).absolute().parent.parent
    return run_dir if (run_dir / RUN_CONFIG).is_file() else None


def legacy_card(run_dir: Path) -> dict[str, Any]:
    """A card from the plain values of a run folder's `.hydra/config.yaml`, for checkpoints
    written before cards existed. Interpolations are not resolved and nothing is instantiated."""
    raw = OmegaConf.to_container(OmegaConf.load(run_dir / RUN_CONFIG), resolve=False)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{run_dir / RUN_CONFIG} is not a config mapping")
    where = str(run_dir / RUN_CONFIG)
    aug = raw.get("aug") or {}
    card: dict[str, Any] = {
        "model": plain_model(raw.get("model"), f"model in {where}"),
        "image_size": (raw.get("dataset") or {}).get("image_size"),
        "mean": aug.get("mean"),
        "std": aug.get("std"),
        "threshold": (raw.get("module") or {}).get("threshold"),
        "data_root": (raw.get("dataset") or {}).get("root"),
    }
    # a key the old config lacks (or sets to null) is left out: the caller's default applies
    return {key: value for key, value in card.items() if value is not None and _is_plain(value)}


def plain_model(model: Any, where: str) -> dict[str, Any]:
    """`{arch, encoder_name, options}` of a model description, refused unless `arch` is an smp
    architecture, `encoder_name` a string and `options` plain values (no `_target_` or other
    `_`-keys anywhere). Any `_target_` of the description itself is ignored, never called."""
    if isinstance(model, DictConfig):
        model = OmegaConf.to_container(model, resolve=True)
    if not isinstance(model, Mapping):
        raise CheckpointError(f"{where}: no model description (arch, encoder_name) found")
    arch, encoder, options = model.get("arch"), model.get("encoder_name"), model.get("options")
    if not isinstance(arch, str) or arch.lower() not in smp.MODEL_ARCHITECTURES_MAPPING:
        raise CheckpointError(
            f"{where}: arch={arch!r} is not one of smp's architectures "
            f"({', '.join(sorted(smp.MODEL_ARCHITECTURES_MAPPING))})"
        )
    if not isinstance(encoder, str) or not encoder:
        raise CheckpointError(f"{where}: encoder_name={encoder!r} is not an encoder name")
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise CheckpointError(f"{where}: options={options!r} is not a mapping")
    _check_plain(options, f"{where}: options")
    return {"arch": arch, "encoder_name": encoder, "options": dict(options)}


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or key.startswith("_"):
                raise CheckpointError(
                    f"{where}: key {key!r} is refused (only plain keyword arguments are allowed; "
                    "nothing read from a file is instantiated)"
                )
            _check_plain(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise CheckpointError(f"{where}: {value!r} is not a plain value")


def _is_plain(value: Any) -> bool:
    try:
        _check_plain(value, "")
    except CheckpointError:
        return False
    return not (isinstance(value, str) and "${" in value)


def load_net(ckpt: str | Path, model: Mapping[str, Any]) -> nn.Module:
    """The net `model` describes (`plain_model`'s form) with the checkpoint's weights, in eval
    mode on the CPU. Pretrained encoder weights are never downloaded here: every weight comes from
    the checkpoint."""
    ckpt = Path(ckpt)
    state = read_checkpoint(ckpt)["state_dict"]
    weights = {k.removeprefix(NET_PREFIX): v for k, v in state.items() if k.startswith(NET_PREFIX)}
    spec = plain_model(model, f"model for {ckpt}")
    net = build_net(**spec, encoder_weights=None)
    _check_fits(ckpt, spec, weights, net.state_dict())
    net.load_state_dict(weights)
    return net.eval()


def _check_fits(
    ckpt: Path,
    spec: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
) -> None:
    problems = state_dict_mismatch(weights, expected)
    if not problems:
        return
    options = spec["options"]
    model = f"{spec['arch']}/{spec['encoder_name']}" + (f" {options}" if options else "")
    raise ArchitectureMismatch(
        f"checkpoint {ckpt} was trained with a different architecture than model {model}: "
        f"{'; '.join(problems)}; pass model=… matching the run that wrote it, or leave model "
        "unset to use the checkpoint's own"
    )

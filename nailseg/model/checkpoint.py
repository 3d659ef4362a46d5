"""What a checkpoint carries, and from a checkpoint to a ready network, without running its config:
every checkpoint holds a card under `CARD_KEY`, plain data that `torch.load(weights_only=True)`
reads; `validate_card` checks every key before any is used, the net is built from an allow-list
(`plain_model`). Checkpoints older than cards are read from their run folder's config.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from nailseg import __version__
from nailseg.errors import UserError
from nailseg.io.folder import read_regular
from nailseg.model import PLAIN, import_smp, refusal
from nailseg.model.scales import NAIL_QUANTILES, training_nail_sizes
from nailseg.prep.format import SPLITS, split_file

if TYPE_CHECKING:
    from torch import nn

CARD_KEY = "nailseg"
CARD_FILE = "nailseg_card.json"  # beside smp's files in a folder `export format=smp` wrote
CARD_FORMAT = 1
NET_PREFIX = "net."  # SegModule keeps the network under `self.net`
RUN_CONFIG = Path(".hydra") / "config.yaml"
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_WANDB_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # W&B names a folder after it
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BUILD_ERRORS = (ValueError, TypeError, KeyError, RuntimeError, AssertionError)


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used as asked; the message says what to pass instead."""


class ArchitectureMismatch(CheckpointError):
    """The checkpoint's weights do not fit the net built from the model description."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def make_card(
    cfg: DictConfig, group_names: Sequence[str], run_id: str | None = None
) -> dict[str, Any]:
    """The card of a training run composed as `cfg`; `run_id` names its run folder (None: a new
    run). A model a card could not hold is refused now, not when the checkpoint is used."""
    model = _model(cfg.model, "this run's checkpoint card: card key ")
    return {
        "format": CARD_FORMAT,
        "nailseg_version": __version__,
        "run_id": run_id or new_run_id(),
        "model": model,
        "image_size": [int(v) for v in cfg.dataset.image_size],
        "mean": [float(v) for v in cfg.normalize.mean],
        "std": [float(v) for v in cfg.normalize.std],
        "threshold": float(cfg.module.threshold),
        "group_names": [str(g) for g in group_names],
        "data_root": str(Path(cfg.dataset.root).absolute()),
        "data": data_identity(cfg.dataset.root, cfg.dataset.mix),
        # how large the nails it learnt were: predict's auto scale brings a photo's to it
        "nail_size": training_nail_sizes(
            {cfg.dataset.root: cfg.dataset.weight} | {m.root: m.weight for m in cfg.dataset.mix},
            cfg.dataset.image_size,
        ),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def data_identity(root: str | Path, mix: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Which prepared data a fit trains on, compared on resume: the root, each split file's
    SHA-256 (None: no such split) and each `dataset.mix` source's name, weight, root, train's."""
    root = Path(root).expanduser().resolve()
    identity: dict[str, Any] = {
        "root": str(root),
        "splits": {split: _digest(root / split_file(split)) for split in SPLITS},
    }
    if mix:
        identity["mix"] = [
            {
                "name": str(source["name"]),
                "weight": float(source["weight"]),
                "root": str(Path(source["root"]).expanduser().resolve()),
                "train": _digest(Path(source["root"]).expanduser() / split_file("train")),
            }
            for source in mix
        ]
    return identity


def checkpoint_file(ckpt: str) -> Path:
    """`ckpt`, checked without torch: a file torch.save could have written (a zip archive holding
    a data.pkl) or a folder `export format=smp` wrote; else a CheckpointError naming it."""
    path = Path(ckpt)
    if path.is_dir():
        if (path / CARD_FILE).exists():
            return path
        raise CheckpointError(
            f"ckpt={ckpt} is a folder: pass a checkpoint file (a run keeps its checkpoints in "
            "<run>/checkpoints/) or a folder `nailseg export format=smp` wrote"
        )
    if not path.is_file():
        raise CheckpointError(f"ckpt={ckpt}: no such checkpoint")
    if path.suffix.lower() == ".onnx":
        raise CheckpointError(
            f"ckpt={ckpt} is an ONNX model, not a training checkpoint: pass the checkpoint it "
            "was exported from (predict's engine=onnx runs that with ONNX Runtime)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        raise CheckpointError(
            f"ckpt={ckpt} is not a checkpoint (torch.save writes a zip archive)"
        ) from None
    except OSError as err:
        raise CheckpointError(f"ckpt={ckpt} cannot be read: {err.strerror}") from err
    if not any(name.rpartition("/")[2] == "data.pkl" for name in names):
        raise CheckpointError(
            f"ckpt={ckpt} cannot be loaded as a checkpoint: a zip archive torch.save did not write"
        )
    return path


def read_checkpoint(ckpt: str | Path) -> Mapping[str, Any]:
    """The checkpoint's contents (tensors memory-mapped), read with `weights_only=True`."""
    import torch

    ckpt = checkpoint_file(str(ckpt))
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # whatever fails reading a file off disk is said in one line
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise CheckpointError(f"ckpt={ckpt} cannot be loaded as a checkpoint: {first}") from err
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise CheckpointError(f"ckpt={ckpt} is not a Lightning checkpoint (it has no state_dict)")
    return checkpoint


def card_of(checkpoint: Mapping[str, Any], ckpt: str | Path) -> dict[str, Any] | None:
    """The checkpoint's card, validated; None for a checkpoint older than cards."""
    card = checkpoint.get(CARD_KEY)
    return None if card is None else validate_card(card, str(ckpt))


def _refused(where: str, key: str, value: Any, problem: str) -> CheckpointError:
    return CheckpointError(refusal(where, key, value, problem))


def validate_card(card: Any, where: str) -> dict[str, Any]:
    """`card` with every key checked before any is used: the first wrong value fails as one
    line, `WHERE: card key K=V: what is wrong`. A missing key takes the caller's default."""
    where = f"{where}: card key "
    if not isinstance(card, Mapping):
        raise _refused(where, CARD_KEY, card, "the card is not a mapping")
    unknown = sorted(str(key) for key in card if key not in _CARD_CHECKS)
    if unknown:
        raise _refused(where, unknown[0], card[unknown[0]], "not a key nailseg writes")
    for key, (holds, problem) in _CARD_CHECKS.items():
        if card.get(key) is not None and not holds(card[key]):
            raise _refused(where, key, card[key], problem)
    if card.get("model") is not None:
        unknown = sorted(set(card["model"]) - {"arch", "encoder_name", "options"})
        if unknown:
            raise _refused(
                where, f"model.{unknown[0]}", card["model"][unknown[0]], "not a model key"
            )
        _model(card["model"], where)
        if card.get("image_size") is not None:
            _check_stride(card["model"], card["image_size"], where)
    return dict(card)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(value: Any, n: int, least: float = -math.inf) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) == n
        and all(_number(v) and v > least for v in value)
    )


def _sha256(value: Any) -> bool:
    return value is None or (isinstance(value, str) and _SHA256.fullmatch(value) is not None)


def _data(value: Any) -> bool:
    """{root, splits: {split: SHA-256 or None}[, mix: [{name, weight, root, train}]]}."""
    try:
        sources = list(value.get("mix", []))
        return (
            isinstance(value["root"], str)
            and set(value) <= {"root", "splits", "mix"}
            and set(value["splits"]) <= set(SPLITS)
            and all(map(_sha256, value["splits"].values()))
            and all(set(s) == {"name", "weight", "root", "train"} for s in sources)
            and all(
                isinstance(s["name"] + s["root"], str) and _number(s["weight"]) for s in sources
            )
            and all(_sha256(s["train"]) for s in sources)
        )
    except (AttributeError, KeyError, TypeError):
        return False


# each key a card may hold: what a value must be, and what is wrong with one that is not
_CARD_CHECKS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "format": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= CARD_FORMAT,
        f"must be a card format this nailseg reads (1 to {CARD_FORMAT})",
    ),
    "nailseg_version": (lambda v: isinstance(v, str), "must be text"),
    "run_id": (lambda v: isinstance(v, str) and _RUN_ID.fullmatch(v), "must be 32 hex digits"),
    "wandb_run_id": (
        lambda v: isinstance(v, str) and _WANDB_RUN_ID.fullmatch(v),
        "must be a W&B run id (letters, digits, _ and -)",
    ),
    "model": (
        lambda v: isinstance(v, Mapping),
        "must be a mapping of arch, encoder_name and options",
    ),
    "image_size": (
        lambda v: _numbers(v, 2, 0) and all(isinstance(x, int) for x in v),
        "must be [height, width], both positive integers",
    ),
    "mean": (lambda v: _numbers(v, 3), "must be a list of 3 numbers, one per RGB channel"),
    "std": (lambda v: _numbers(v, 3, 0), "must be a list of 3 numbers above 0 (it divides)"),
    # a pixel is foreground above it: at 0 every pixel is, at 1 none
    "threshold": (lambda v: _number(v) and 0 < v < 1, "must be a number in (0, 1)"),
    "group_names": (
        lambda v: isinstance(v, list | tuple) and all(isinstance(x, str) for x in v),
        "must be a list of names",
    ),
    "data_root": (lambda v: isinstance(v, str) and bool(v), "must be a path"),
    "data": (
        _data,
        "must be {root: a path, splits: {split: its SHA-256 or null}, mix: [{name, weight, root, "
        "train: its SHA-256 or null}]}",
    ),
    "nail_size": (
        lambda v: _numbers(v, len(NAIL_QUANTILES), 0) and list(v) == sorted(v),
        f"must be {len(NAIL_QUANTILES)} sizes > 0, each at least the one before (quantiles)",
    ),
    # compared with the config, never instantiated: its `_target_`s are text here
    "config": (
        lambda v: isinstance(v, Mapping) and _plain_data(v),
        "refused: must be a mapping of plain data (the run's resolved config)",
    ),
}


def _check_stride(model: Mapping[str, Any], image_size: Sequence[int], where: str) -> None:
    """Sides divisible by the encoder's stride where the architecture needs it."""
    smp = import_smp()
    if not smp.MODEL_ARCHITECTURES_MAPPING[model["arch"].lower()].requires_divisible_input_shape:
        return
    net = _built(model, f"{where}model")
    stride = net.encoder.output_stride
    if net.requires_divisible_input_shape and any(side % stride for side in image_size):
        raise _refused(
            where,
            "image_size",
            list(image_size),
            f"{model['arch']}/{model['encoder_name']} needs sides that are multiples of {stride}",
        )


def _built(model: Mapping[str, Any], where: str) -> nn.Module:
    """The net a plain model describes, without weights; what only the architecture checks
    (decoder_channels of another length, ...) fails naming `where`."""
    from nailseg.model.net import build_net

    try:
        return build_net(
            model["arch"], model["encoder_name"], None, dict(model.get("options") or {})
        )
    except _BUILD_ERRORS as err:
        raise CheckpointError(f"{where}: {type(err).__name__}: {err}".replace("\n", " ")) from err


def run_dir_of(ckpt: Path) -> Path | None:
    """The run folder of `<run>/checkpoints/<name>.ckpt` (it holds `RUN_CONFIG`), else None."""
    run_dir = Path(ckpt).absolute().parent.parent
    return run_dir if (run_dir / RUN_CONFIG).is_file() else None


def legacy_card(run_dir: Path) -> dict[str, Any]:
    """A card from the plain values of a run folder's `.hydra/config.yaml`, for checkpoints
    written before cards existed. Interpolations are not resolved and nothing is instantiated."""
    raw = OmegaConf.to_container(OmegaConf.load(run_dir / RUN_CONFIG), resolve=False)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{run_dir / RUN_CONFIG} is not a config mapping")
    where = str(run_dir / RUN_CONFIG)
    aug, dataset = raw.get("aug") or {}, raw.get("dataset") or {}
    card: dict[str, Any] = {
        "model": plain_model(raw.get("model"), f"model in {where}"),
        "image_size": dataset.get("image_size"),
        "mean": aug.get("mean"),
        "std": aug.get("std"),
        "threshold": (raw.get("module") or {}).get("threshold"),
        "data_root": dataset.get("root"),
    }
    # a key the old config lacks (or sets to null) is left out: the caller's default applies
    card = {
        key: value
        for key, value in card.items()
        if value is not None and _plain_data(value) and "${" not in str(value)
    }
    return validate_card(card, where)


def plain_model(model: Any, where: str) -> dict[str, Any]:
    """`{arch, encoder_name, options}` of a model description; a CheckpointError names `where`."""
    return _model(model, f"{where}: " if where else "")


def _model(model: Any, where: str) -> dict[str, Any]:
    """`net.plain_model`, its refusal a CheckpointError."""
    from nailseg.model.net import ModelError, plain_model

    try:
        return plain_model(model, where)
    except ModelError as err:
        raise CheckpointError(str(err)) from None


def _plain_data(value: Any) -> bool:
    """Mappings with text keys, lists and plain values only: data to compare, never to build."""
    if isinstance(value, Mapping):
        return all(isinstance(key, str) and _plain_data(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return all(map(_plain_data, value))
    return isinstance(value, PLAIN)


def load_net(ckpt: str | Path, model: Mapping[str, Any]) -> nn.Module:
    """The net `model` describes with the checkpoint's weights (never downloaded ones), in eval
    mode on the CPU; a folder `export format=smp` wrote: its safetensors, smp's names."""
    import safetensors.torch

    from nailseg.model.net import state_dict_mismatch

    if Path(ckpt).is_dir():
        try:
            weights = safetensors.torch.load(read_regular(Path(ckpt) / "model.safetensors"))
        except (OSError, safetensors.SafetensorError) as err:
            raise CheckpointError(f"{ckpt}/model.safetensors cannot be loaded: {err}") from err
    else:
        state = read_checkpoint(ckpt)["state_dict"]
        weights = {
            k.removeprefix(NET_PREFIX): v for k, v in state.items() if k.startswith(NET_PREFIX)
        }
    spec = plain_model(model, f"model for {ckpt}")
    net = _built(spec, f"model for {ckpt}")
    problems = state_dict_mismatch(weights, net.state_dict())
    if problems:
        options = spec["options"]
        model = f"{spec['arch']}/{spec['encoder_name']}" + (f" {options}" if options else "")
        raise ArchitectureMismatch(
            f"checkpoint {ckpt} was trained with a different architecture than model {model}: "
            f"{problems}; pass model=… matching the run that wrote it, or leave model unset to "
            "use the checkpoint's own"
        )
    net.load_state_dict(weights)
    return net.eval()

"""`python -m nailseg export ckpt=CKPT [format=onnx|smp] [output=model.onnx|FOLDER]`: a checkpoint
as a model others load.

ONNX (made as predict's `engine=onnx` makes it): `image` float32 B×3×H×W normalised in, `logits`
B×1×H×W out, size, normalisation, threshold and model in its metadata; written once ONNX Runtime
matches PyTorch, journaled beside (`io.loose`): a later export replaces only its own unchanged
file. `format=smp`: the folder smp's `from_pretrained` loads, the card beside (`CARD_FILE`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig
from rich.console import Console

from nailseg.config import CONF_DIR
from nailseg.errors import UserError, require_model_group, require_values
from nailseg.inference.request import ExportError, check_overrides, file_in_the_way
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder, read_regular, refuse_foreign
from nailseg.io.loose import check_loose, write_loose
from nailseg.model.checkpoint import CARD_FILE, checkpoint_file

if TYPE_CHECKING:
    from torch import nn

    from nailseg.inference.views import InferenceSpec

FORMATS = ("onnx", "smp")
SCRATCH = ".smp"  # where smp's save_pretrained writes in the export folder, before the files move


def export_onnx(
    net: nn.Module, spec: InferenceSpec, path: Path, *, opset: int, verify: bool = True
) -> float | None:
    """Write `net` to `path` as ONNX (atomically); returns the logits difference from PyTorch's
    (`logits_difference`) when `verify`, and then writes only if it is within `TOLERANCE`."""
    from nailseg.inference.engine import checked_difference, onnx_model

    model = onnx_model(net, spec, opset=opset)
    try:
        diff = checked_difference(model, net, spec) if verify else None
    except ExportError as err:
        raise ExportError(f"{err}; {path} was not written") from err
    try:
        write_loose(path, model)
    except NotOursError as err:  # put there meanwhile
        raise ExportError(f"output={path}: {err}") from err
    return diff


def export_smp(net: nn.Module, card: dict[str, Any], out: Path) -> None:
    """Write `net` as smp's `save_pretrained` does, and `card` as `CARD_FILE`, into the folder
    `out`, claimed as an export's: a user's file there stops it before any write."""
    with OwnedFolder.claim(out, "export", key="output") as folder:
        scratch = folder.reserve(SCRATCH)
        _clear(folder)  # what a killed export left: save_pretrained keeps a README.md it finds
        net.save_pretrained(scratch)  # smp's own parameter names: fused attention keeps them
        files = {path.name: read_regular(path) for path in sorted(scratch.iterdir())}
        _clear(folder)
        files[CARD_FILE] = (json.dumps(card, indent=1, sort_keys=True) + "\n").encode()
        folder.check_free(files)
        for name, data in files.items():
            folder.write(name, data)


def _clear(folder: OwnedFolder) -> None:
    """Remove the scratch files of `export_smp` (all nailseg's: the folder is reserved)."""
    scratch = folder.file(SCRATCH)
    for name in sorted(p.name for p in scratch.iterdir()) if scratch.is_dir() else []:
        folder.remove(f"{SCRATCH}/{name}")


def run(cfg: DictConfig, console: Console | None = None) -> Path:
    """Export `cfg.ckpt`, what needs no torch checked first; returns the file (smp: folder)."""
    console = console or Console()
    if cfg.format not in FORMATS:
        raise ExportError(f"format={cfg.format}: supported formats are {', '.join(FORMATS)}")
    check_overrides(cfg, ExportError)
    ckpt = checkpoint_file(cfg.ckpt)
    smp = cfg.format == "smp"
    default = ckpt.with_name(f"{ckpt.stem}-smp") if smp else ckpt.with_suffix(".onnx")
    out = Path(cfg.output) if cfg.output else default
    try:
        if smp:
            refuse_foreign(out.absolute(), "export", "output")
        else:
            _check_output(out)
    except NotOursError as err:
        raise ExportError(str(err) if smp else f"output={out}: {err}") from err
    from nailseg.inference.engine import INPUT_NAME, OUTPUT_NAME, VERIFY_BATCH_SIZES
    from nailseg.inference.segmenter import resolve_spec
    from nailseg.model.checkpoint import card_of, load_net, read_checkpoint

    if not smp:
        lowest, highest = exporter_opsets()
        if not lowest <= cfg.opset <= highest:
            raise ExportError(
                f"opset={cfg.opset}: the exporter writes opsets {lowest} to {highest}"
            )
    spec = resolve_spec(cfg)
    net = load_net(spec.ckpt, spec.model)
    if smp:
        card = card_of(read_checkpoint(spec.ckpt), spec.ckpt) or {}
        card |= {
            "model": dict(spec.model),
            "image_size": list(spec.image_size),
            "mean": list(spec.mean),
            "std": list(spec.std),
            "threshold": spec.threshold,
        }
        export_smp(net, card, out)
        what = f"{out}/ (smp's from_pretrained loads it; nailseg's card in {CARD_FILE})"
    else:
        diff = export_onnx(net, spec, out, opset=cfg.opset, verify=cfg.verify)
        h, w = spec.image_size
        checked = (
            f"; ONNX Runtime matches PyTorch (max |logits diff| / max(1, max |logit|) {diff:.2g} "
            f"on batches {', '.join(map(str, VERIFY_BATCH_SIZES))})"
            if diff is not None
            else ""
        )
        what = (
            f"{out} (opset {cfg.opset}; {INPUT_NAME} float32 Bx3x{h}x{w} normalised → "
            f"{OUTPUT_NAME} Bx1x{h}x{w}){checked}"
        )
    console.print(f"exported {spec.ckpt} → {what}", highlight=False, soft_wrap=True)
    return out


def exporter_opsets() -> tuple[int, int]:
    """The opsets torch's TorchScript exporter writes (private constants, looked up at use, pinned
    by tests/inference/test_export.py): outside them it fails after tracing, printing the graph."""
    from torch.onnx import _constants

    return _constants.ONNX_MIN_OPSET, _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET


def _check_output(path: Path) -> None:
    """NotOursError unless the model may be written at `path`; ExportError for a file in the way."""
    if (file := file_in_the_way(path.parent)) is not None:
        raise ExportError(f"output={path}: {file} is a file, not a folder; choose another output")
    check_loose(path)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="export")
def _main(cfg: DictConfig) -> None:
    require_values(cfg, "nailseg export")
    try:
        run(cfg)
    except UserError as err:
        sys.exit(f"export failed: {err}")


def main() -> None:
    """The command: its model-key check runs before Hydra composes the config."""
    require_model_group("nailseg export", sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()

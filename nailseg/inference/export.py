"""A checkpoint as an ONNX model. `python -m nailseg export ckpt=RUN/checkpoints/last.ckpt
[format=onnx] [output=model.onnx]`

The model takes `image`, float32 B×3×H×W normalised as in training (H×W: the run's input size,
`(x/255 - mean) / std`), and returns `logits` B×1×H×W; the batch axis is dynamic. Size, mean, std,
threshold and the model config are stored in the file's metadata (`nailseg.*` keys) so a consumer
can prepare inputs without the training config.

Exported with PyTorch's TorchScript-based exporter (`dynamo=False`: it needs only `onnx`), whose
deprecation warnings are silenced: the guard is the parity check before the file is written
(atomically): ONNX Runtime (CPU) and PyTorch must agree on the logits of random batches of 1 and 3
within `TOLERANCE`, relative to the logits' size (float32 sums taken in another order differ in
proportion to the values summed). predict's `engine=onnx` runs the same in-memory model (`OnnxNet`).
"""

from __future__ import annotations

import io
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
import onnx
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig
from rich.console import Console
from torch import nn

from nailseg.config import CONF_DIR, require_model_group, require_values
from nailseg.errors import UserError
from nailseg.inference.spec import InferenceConfig, InferenceSpec, resolve_spec
from nailseg.io.atomic import write_bytes
from nailseg.model.checkpoint import load_net

FORMATS = ("onnx",)
INPUT_NAME, OUTPUT_NAME = "image", "logits"
TOLERANCE = 1e-3  # max |onnx - torch| on logits / max(1, max |logit|)
VERIFY_BATCH_SIZES = (1, 3)


@dataclass
class ExportConfig(InferenceConfig):
    """Types only: the values are in conf/export.yaml."""

    format: str = MISSING
    output: str | None = None  # None: next to the checkpoint, <checkpoint name>.onnx
    opset: int = MISSING
    verify: bool = MISSING  # check ONNX Runtime against PyTorch before writing


ConfigStore.instance().store(name="export_schema", node=ExportConfig)


class ExportError(UserError, RuntimeError):
    """An unknown format, or an export whose outputs disagree with PyTorch's."""


def onnx_model(net: nn.Module, spec: InferenceSpec, *, opset: int | None) -> bytes:
    """`net` as a checked ONNX model with nailseg's metadata, in memory; `opset` None: the
    exporter's own (a model ONNX Runtime runs here and now, never written)."""
    buffer = io.BytesIO()
    example = torch.zeros(2, 3, *spec.image_size)
    with torch.inference_mode():
        out_shape = net.eval()(example).shape
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        try:
            torch.onnx.export(
                net,
                (example,),
                buffer,
                dynamo=False,
                opset_version=opset,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            )
        except (torch.onnx.OnnxExporterError, RuntimeError) as err:  # an opset it lacks, an op
            reason = str(err).splitlines()[0]
            raise ExportError(
                f"the ONNX exporter cannot write this net at opset={opset}: {reason}"
            ) from err
    model = onnx.load_from_string(buffer.getvalue())
    _declare_output_shape(model, out_shape[1:])
    onnx.helper.set_model_props(model, _metadata(spec))
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _declare_output_shape(model: onnx.ModelProto, sizes: Sequence[int]) -> None:
    """The output's declared shape: the batch axis, then the sizes the net gives (its logits at
    the input size), where the exporter's own inference gets a UNet's wrong."""
    shape = model.graph.output[0].type.tensor_type.shape
    del shape.dim[:]
    shape.dim.add().dim_param = "batch"
    for size in sizes:
        shape.dim.add().dim_value = int(size)


def checked_difference(model: bytes, net: nn.Module, spec: InferenceSpec) -> float:
    """`logits_difference` of `model` against `net`; ExportError when beyond `TOLERANCE`."""
    diff = logits_difference(model, net, spec.image_size)
    if diff > TOLERANCE:
        raise ExportError(
            f"ONNX Runtime and PyTorch disagree on {spec.ckpt}: max |logits difference| / "
            f"max(1, max |logit|) = {diff:.3g} > {TOLERANCE}"
        )
    return diff


def export_onnx(
    net: nn.Module, spec: InferenceSpec, path: Path, *, opset: int, verify: bool = True
) -> float | None:
    """Write `net` to `path` as ONNX (atomically); returns the logits difference from PyTorch's
    (`logits_difference`) when `verify`, and then writes only if it is within `TOLERANCE`."""
    model = onnx_model(net, spec, opset=opset)
    try:
        diff = checked_difference(model, net, spec) if verify else None
    except ExportError as err:
        raise ExportError(f"{err}; {path} was not written") from err
    write_bytes(path, model)
    return diff


class OnnxNet:
    """A checkpoint's net run by ONNX Runtime on the CPU, called as the PyTorch net is (a
    normalised float32 batch in, logits out): predict's `engine=onnx`. The model is exported in
    memory and checked against PyTorch first, as `export` checks it."""

    def __init__(self, net: nn.Module, spec: InferenceSpec) -> None:
        import onnxruntime as ort

        model = onnx_model(net, spec, opset=None)
        self.difference = checked_difference(model, net, spec)
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # as many as PyTorch would use
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        (logits,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: batch.contiguous().numpy()})
        return torch.from_numpy(logits)


def _metadata(spec: InferenceSpec) -> dict[str, str]:
    return {
        "nailseg.input": f"{INPUT_NAME}: float32 Bx3x{spec.image_size[0]}x{spec.image_size[1]}, "
        "RGB (x/255 - mean) / std",
        "nailseg.output": f"{OUTPUT_NAME}: float32 Bx1xHxW, foreground logits",
        "nailseg.image_size": json.dumps(list(spec.image_size)),
        "nailseg.mean": json.dumps(list(spec.mean)),
        "nailseg.std": json.dumps(list(spec.std)),
        "nailseg.inference.threshold": json.dumps(spec.threshold),
        "nailseg.model": json.dumps(dict(spec.model)),
        "nailseg.checkpoint": spec.ckpt.name,
    }


def logits_difference(
    model: bytes,
    net: nn.Module,
    image_size: tuple[int, int],
    batch_sizes: tuple[int, ...] = VERIFY_BATCH_SIZES,
) -> float:
    """Max |ONNX Runtime - PyTorch| over the logits of random batches of each size, divided by
    max(1, max |PyTorch logit|): absolute for logits up to 1, relative beyond."""
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    diffs = []
    for n in batch_sizes:
        batch = torch.randn(n, 3, *image_size, generator=generator)
        with torch.inference_mode():
            expected = net(batch).numpy()
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch.numpy()})
        if got.shape != expected.shape:
            raise ExportError(
                f"ONNX output {got.shape} for a batch of {n}, expected {expected.shape}"
            )
        scale = max(1.0, float(np.abs(expected).max()))
        diffs.append(float(np.abs(got - expected).max()) / scale)
    return max(diffs)


def run(cfg: DictConfig, console: Console | None = None) -> Path:
    """Export `cfg.ckpt`; returns the written file."""
    console = console or Console()
    if cfg.format not in FORMATS:
        raise ExportError(f"format={cfg.format}: supported formats are {', '.join(FORMATS)}")
    lowest, highest = exporter_opsets()
    if not lowest <= cfg.opset <= highest:
        raise ExportError(f"opset={cfg.opset}: the exporter writes opsets {lowest} to {highest}")
    spec = resolve_spec(cfg)
    path = Path(cfg.output) if cfg.output else spec.ckpt.with_suffix(".onnx")
    _refuse_to_replace(path, spec.ckpt)
    net = load_net(spec.ckpt, spec.model)
    diff = export_onnx(net, spec, path, opset=cfg.opset, verify=cfg.verify)
    h, w = spec.image_size
    checked = (
        f"; ONNX Runtime matches PyTorch (max |logits diff| / max(1, max |logit|) {diff:.2g} "
        f"on batches {', '.join(map(str, VERIFY_BATCH_SIZES))})"
        if diff is not None
        else ""
    )
    console.print(
        f"exported {spec.ckpt} → {path} (opset {cfg.opset}; {INPUT_NAME} float32 Bx3x{h}x{w} "
        f"normalised → {OUTPUT_NAME} Bx1x{h}x{w}){checked}",
        highlight=False,
        soft_wrap=True,
    )
    return path


def exporter_opsets() -> tuple[int, int]:
    """The opsets torch's TorchScript-based exporter writes. Its constants are private, so they
    are looked up at use (tests/inference/test_export.py pins them): outside the range the
    exporter fails only after tracing the net, printing the traced graph."""
    from torch.onnx import _constants

    return _constants.ONNX_MIN_OPSET, _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET


def _refuse_to_replace(path: Path, ckpt: Path) -> None:
    """Raise ExportError, before any work, when `path` holds anything but a model nailseg
    exported (the checkpoint itself, a folder, a user's file, a link): only those are replaced;
    or when a file stands where its folder would be made."""
    folder = next(parent for parent in path.absolute().parents if parent.exists())
    if not folder.is_dir():
        raise ExportError(f"output={path}: {folder} is a file, not a folder; choose another output")
    if not os.path.lexists(path):
        return
    if path.is_symlink():  # replacing drops the user's link; writing through it, their file
        raise ExportError(
            f"output={path} is a symbolic link (to {os.readlink(path)}), which export never "
            "writes through nor replaces: nothing was written; choose another output"
        )
    if path.samefile(ckpt):  # the same file by any name: a link, a hard link
        raise ExportError(f"output={path} is the checkpoint being exported: choose another output")
    try:
        ours = path.is_file() and any(
            prop.key.startswith("nailseg.")
            for prop in onnx.load_model(str(path), load_external_data=False).metadata_props
        )
    except Exception:  # protobuf's DecodeError, and others, for a file that is not ONNX
        ours = False
    if not ours:
        raise ExportError(
            f"output={path} exists and is not an ONNX model nailseg exported (no nailseg.* "
            "metadata), so it is not replaced: nothing was written; choose another output"
        )


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

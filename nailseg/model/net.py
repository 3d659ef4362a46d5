"""The network: any segmentation-models-pytorch architecture through `create_model`, SegFormer's
attention through PyTorch's fused kernel (`FusedAttention`, smp's own parameters and names).
`model.encoder_weights` is null, a name smp downloads, or a local path (with a `/`, or ending in
.pth/.pt/.ckpt/.bin): the weights file or a folder holding `<encoder_name>.pth`.
"""

from __future__ import annotations

import inspect
import logging
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from nailseg.errors import UserError
from nailseg.model import PLAIN, import_smp, refusal

smp = import_smp()
Attention = smp.encoders.mix_transformer.Attention  # SegFormer's, made fused here

log = logging.getLogger(__name__)

# torch.compile's modes; reduce-overhead and max-autotune also replay CUDA graphs
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

WEIGHTS_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")
_WRAPPERS = ("state_dict", "model")  # a checkpoint dict holding the state dict under one of these
# the encoder inside a whole nailseg checkpoint, a whole smp net, a DistributedDataParallel net
_PREFIXES = ("net.encoder.", "encoder.", "module.")
# classifier heads of a backbone's own (torchvision / timm) state dict, which no encoder keeps
_HEADS = ("fc", "_fc", "head", "last_linear", "classifier", "linear")
_SHOWN_KEYS = 3
TIMM_PREFIX = "tu-"  # smp's timm universal encoders: tu-<a name timm lists>
# arguments of an architecture a model description may not set: build_net sets them, or they
# load weights
_NOT_OPTIONS = frozenset({"encoder_name", "encoder_weights", "in_channels", "classes", "kwargs"})


class ModelError(UserError, ValueError):
    """A model description nailseg does not build: the message names the key."""


class EncoderWeightsError(UserError, ValueError):
    """`model.encoder_weights` names no usable weights for the encoder."""


def plain_model(model: Any, where: str = "") -> dict[str, Any]:
    """The plain form of a model description: an smp architecture, an encoder smp or timm lists
    (`tu-` + a name as timm lists it: no hub prefix, path or URL), options only the architecture's
    own arguments as plain values, none that loads weights; anything else is ignored. A
    ModelError starts with `where`."""
    smp = import_smp()
    if isinstance(model, DictConfig):
        model = OmegaConf.to_container(model, resolve=True)
    if not isinstance(model, Mapping):
        raise ModelError(f"{where}no model description (arch, encoder_name) found")
    arch, encoder, options = model.get("arch"), model.get("encoder_name"), model.get("options")
    known = smp.MODEL_ARCHITECTURES_MAPPING
    if not isinstance(arch, str) or arch.lower() not in known:
        problem = f"not one of smp's architectures ({', '.join(sorted(known))})"
        raise ModelError(refusal(where, "model.arch", arch, problem))
    if not isinstance(encoder, str) or not _installed_encoder(encoder):
        problem = f"refused: not an encoder smp lists, nor {TIMM_PREFIX}<a model timm lists>"
        raise ModelError(refusal(where, "model.encoder_name", encoder, problem))
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise ModelError(refusal(where, "model.options", options, "must be a mapping"))
    taken = set(inspect.signature(known[arch.lower()]).parameters) - _NOT_OPTIONS
    for key, value in options.items():
        items = value if isinstance(value, list | tuple) else [value]
        if not isinstance(key, str) or key not in taken:
            problem = f"refused: not an argument {arch} takes here"
        elif not all(isinstance(item, PLAIN) for item in items):
            problem = "refused: only plain values (numbers, text, booleans, null, lists of them)"
        else:
            continue
        raise ModelError(refusal(where, f"model.options.{key}", value, problem))
    return {"arch": arch, "encoder_name": encoder, "options": dict(options)}


def _installed_encoder(name: str) -> bool:
    smp = import_smp()
    import timm  # after smp: W&B hidden

    if name.startswith(TIMM_PREFIX):
        return name.removeprefix(TIMM_PREFIX) in timm.list_models()
    return name in smp.encoders.get_encoder_names()


def build_net(
    arch: str,
    encoder_name: str,
    encoder_weights: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A binary segmentation net (3 channels in, 1 logit out), a Mix Transformer's attention
    fused (`FusedAttention`); `encoder_weights` as the module docstring says."""
    options = OmegaConf.to_container(options) if isinstance(options, DictConfig) else options
    model = {"arch": arch, "encoder_name": encoder_name, "options": dict(options or {})}
    options = plain_model(model)["options"]
    local = weights_file(encoder_weights, encoder_name) if is_path(encoder_weights) else None
    weights = None if local is not None else encoder_weights
    try:
        net = smp.create_model(
            arch, encoder_name, encoder_weights=weights, in_channels=3, classes=1, **options
        )
    except KeyError as err:
        raise ValueError(
            f"model.encoder_name={encoder_name!r}, model.encoder_weights={encoder_weights!r}: "
            f"{err.args[0] if err.args else err}"
        ) from err
    if local is not None:
        load_encoder_weights(net, local, encoder_name)
    fuse_attention(net)
    return net


def is_path(encoder_weights: str | None) -> bool:
    """Whether `model.encoder_weights` names a local file or folder rather than smp weights."""
    return isinstance(encoder_weights, str) and (
        any(c in encoder_weights for c in "/\\~")
        or encoder_weights.lower().endswith(WEIGHTS_SUFFIXES)
    )


def weights_file(encoder_weights: str, encoder_name: str) -> Path:
    """The file `model.encoder_weights` names (a path, or `<folder>/<encoder_name>.pth`)."""
    path = Path(encoder_weights).expanduser()
    if path.is_dir():
        found = path / f"{encoder_name}.pth"
        if not found.is_file():
            held = sorted(p.name for p in path.glob("*.pth"))
            raise EncoderWeightsError(
                f"model.encoder_weights={encoder_weights}: the folder holds no {found.name} for "
                f"encoder {encoder_name} ({_listing(held, '.pth files') if held else 'no .pth files'})"
            )
        return found
    if not path.is_file():
        raise EncoderWeightsError(
            f"model.encoder_weights={encoder_weights}: no such file or folder (a weights file, or "
            f"a folder holding {encoder_name}.pth)"
        )
    return path


def load_encoder_weights(net: nn.Module, path: str | Path, encoder_name: str) -> None:
    """Load the weights file `path` (`weights_only=True`) into `net.encoder`, all or nothing: the
    encoder's state dict (maybe under `state_dict` or `model`), a whole smp net or nailseg
    checkpoint's encoder, or the backbone's torchvision / timm state dict without its head."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise EncoderWeightsError(
            f"model.encoder_weights: {path} cannot be read as a torch state dict: {err}"
        ) from err
    for key in _WRAPPERS:
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise EncoderWeightsError(
            f"model.encoder_weights: {path} holds no state dict (a mapping of names to tensors)"
        )
    expected = net.encoder.state_dict()
    state = _renamed(state, expected.keys())
    state = {k: v for k, v in state.items() if k in expected or k.split(".")[0] not in _HEADS}
    problems = state_dict_mismatch(state, expected)
    if problems:
        raise EncoderWeightsError(
            f"model.encoder_weights: {path} does not fit encoder {encoder_name}: {problems}; it "
            f"must hold the state dict of a {encoder_name} encoder (net.encoder.state_dict())"
        )
    nn.Module.load_state_dict(net.encoder, state, strict=True)
    log.info("encoder %s: %d tensors loaded from %s", encoder_name, len(state), path)


def _renamed(state: Mapping[str, torch.Tensor], expected: Any) -> Mapping[str, torch.Tensor]:
    """`state` under the encoder's key names: the layout (as is, one of `_PREFIXES` stripped, or
    a timm model's keys as smp's `tu-` encoders wrap it) sharing the most keys with `expected`."""

    def timm_key(key: str) -> str:  # timm's features-only wrapper joins nested names with `_`
        for name in (f"model.{key}", f"model.{key.replace('.', '_', 1)}"):
            if name in expected:
                return name
        return key

    layouts = [state, {timm_key(k): v for k, v in state.items()}] + [
        {k.removeprefix(p): v for k, v in state.items() if k.startswith(p)} for p in _PREFIXES
    ]
    return max(layouts, key=lambda layout: len(layout.keys() & expected))


def state_dict_mismatch(
    given: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> str:
    """The keys keeping `given` from loading strictly into `expected` ("": it fits)."""
    reshaped = [
        f"{k} {tuple(given[k].shape)} vs {tuple(expected[k].shape)}"
        for k in sorted(expected.keys() & given.keys())
        if given[k].shape != expected[k].shape
    ]
    found = {
        "missing keys": sorted(expected.keys() - given.keys()),
        "unexpected keys": sorted(given.keys() - expected.keys()),
        "keys of another shape (given vs expected)": reshaped,
    }
    return "; ".join(_listing(items, what) for what, items in found.items() if items)


def _listing(items: list[str], what: str) -> str:
    shown = ", ".join(items[:_SHOWN_KEYS])
    more = f", … {len(items) - _SHOWN_KEYS} more" if len(items) > _SHOWN_KEYS else ""
    return f"{what} ({len(items)}): {shown}{more}"


def compile_net(net: nn.Module, mode: str) -> nn.Module:
    """Compile `net`'s forward in place, so its state_dict keys stay the eager net's. Only the
    net: Lightning would compile the steps too, whose metric states CUDA graphs overwrite."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    net.compile(mode=mode)
    return net


class FusedAttention(nn.Module):
    """smp's Mix Transformer `Attention` (queries from every token; keys and values from the
    tokens spatially reduced by `sr_ratio`), computed by `F.scaled_dot_product_attention`."""

    def __init__(self, attention: Attention) -> None:
        super().__init__()
        self.num_heads, self.scale, self.sr_ratio = (
            attention.num_heads,
            attention.scale,
            attention.sr_ratio,
        )
        for name, module in attention.named_children():  # q, kv, proj, sr, norm and dropouts
            self.add_module(name, module)

    def forward(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        batch, tokens, channels = x.shape
        heads = self.num_heads
        q = self.q(x).reshape(batch, tokens, heads, channels // heads).transpose(1, 2)
        if self.sr_ratio > 1:
            reduced = x.transpose(1, 2).reshape(batch, channels, height, width)
            x = self.norm(self.sr(reduced).reshape(batch, channels, -1).transpose(1, 2))
        k, v = (
            self.kv(x).reshape(batch, -1, 2, heads, channels // heads).permute(2, 0, 3, 1, 4)
        ).unbind(0)
        dropout = self.attn_drop.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=self.scale)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(batch, tokens, channels)))


def fuse_attention(net: nn.Module) -> int:
    """Each Mix Transformer attention in `net` replaced by a `FusedAttention`; returns how many."""
    found = [
        (parent, name, child)
        for parent in net.modules()
        for name, child in parent.named_children()
        if isinstance(child, Attention)
    ]
    for parent, name, child in found:
        setattr(parent, name, FusedAttention(child))
    return len(found)

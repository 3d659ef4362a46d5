"""The network: any segmentation-models-pytorch architecture through its one door, create_model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import segmentation_models_pytorch as smp
from torch import nn

# torch.compile's modes; reduce-overhead and max-autotune also replay the compiled forward and
# backward as CUDA graphs (one launch each), which is what a launch-bound model needs on a GPU
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def build_net(
    arch: str,
    encoder_name: str,
    encoder_weights: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A binary segmentation net (3 input channels, 1 logit channel).

    `encoder_weights=None` by default: pretrained weights are downloaded at run time, so they are
    opt-in (`model.encoder_weights=imagenet`).
    """
    try:
        return smp.create_model(
            arch,
            encoder_name=encoder_name,
            encoder_weights=encoder_weights,
            in_channels=3,
            classes=1,
            **dict(options or {}),
        )
    except KeyError as err:
        raise ValueError(f"model.arch={arch!r} is not an smp architecture ({err})") from err


def compile_net(net: nn.Module, mode: str) -> nn.Module:
    """Compile `net`'s forward in place (`nn.Module.compile`), so its state_dict keys, and the
    checkpoints holding them, stay those of the eager net. The mode is checked here, before
    training starts, so a typo does not surface inside the first training step.

    Only the net: Lightning, given a compiled LightningModule, also compiles its step methods,
    and under CUDA graphs the metric states updated there would be overwritten by the next replay.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    net.compile(mode=mode)
    return net

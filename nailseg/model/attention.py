"""SegFormer's attention through PyTorch's fused kernel (`scaled_dot_product_attention`): smp's
Mix Transformer forms the attention matrix, softmax and dropout as separate tensors. The very
submodules are kept, so parameters, their names and checkpoints are smp's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from segmentation_models_pytorch.encoders.mix_transformer import Attention
from torch import nn


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
    """Replace each Mix Transformer attention in `net` by a `FusedAttention` of its own modules,
    in place; returns how many were replaced (0 for a net without one)."""
    found = [
        (parent, name, child)
        for parent in net.modules()
        for name, child in parent.named_children()
        if isinstance(child, Attention)
    ]
    for parent, name, child in found:
        setattr(parent, name, FusedAttention(child))
    return len(found)

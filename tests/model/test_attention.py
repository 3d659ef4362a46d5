"""SegFormer's fused attention is smp's attention: the same parameters under the same names, the
same outputs and gradients, in training (dropout aside) and evaluation."""

from __future__ import annotations

import copy

import onnxruntime
import pytest
import segmentation_models_pytorch as smp
import torch
from segmentation_models_pytorch.encoders.mix_transformer import Attention

from nailseg.inference.engine import INPUT_NAME, onnx_model
from nailseg.inference.views import InferenceSpec
from nailseg.model.net import FusedAttention, build_net, fuse_attention


@pytest.mark.parametrize("sr_ratio", [1, 4])
def test_the_fused_attention_computes_smps_attention_and_its_gradients(sr_ratio):
    torch.manual_seed(0)
    theirs = Attention(dim=64, num_heads=2, qkv_bias=True, sr_ratio=sr_ratio)
    ours = FusedAttention(copy.deepcopy(theirs))
    x = torch.randn(2, 16 * 12, 64)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs, out_ours = theirs(x_theirs, 16, 12), ours(x_ours, 16, 12)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
    (out_theirs**2).sum().backward()
    (out_ours**2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-4, atol=1e-5)
    grads = {name: p.grad for name, p in theirs.named_parameters()}
    assert {name for name, _ in ours.named_parameters()} == grads.keys()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5)


def test_a_segformer_built_here_is_smps_net_with_every_attention_fused():
    torch.manual_seed(0)
    ours = build_net("Segformer", "mit_b0")
    theirs = smp.create_model(
        "Segformer", encoder_name="mit_b0", encoder_weights=None, in_channels=3, classes=1
    )
    theirs.load_state_dict(ours.state_dict(), strict=True)  # the same names and shapes
    assert sum(isinstance(m, FusedAttention) for m in ours.modules()) == 8  # mit_b0's 8 blocks
    assert not any(isinstance(m, Attention) for m in ours.modules())
    ours.eval(), theirs.eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)


def test_a_net_without_a_mix_transformer_is_left_as_it_is():
    net = build_net("Unet", "resnet18", options={"encoder_depth": 3, "decoder_channels": [8, 8, 8]})
    assert fuse_attention(net) == 0


@pytest.mark.slow
def test_a_fused_segformer_exports_to_onnx_and_runs_there_as_in_torch(tmp_path):
    """predict's ONNX engine and `nailseg export` take the net built here, fused attention and all."""
    torch.manual_seed(0)
    net = build_net("Segformer", "mit_b0").eval()
    spec = InferenceSpec(
        ckpt=tmp_path / "x.ckpt",
        model={"arch": "Segformer", "encoder_name": "mit_b0", "options": {}},
        image_size=(64, 96),
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
        threshold=0.5,
        data_root=None,
    )
    session = onnxruntime.InferenceSession(
        onnx_model(net, spec, opset=17), providers=["CPUExecutionProvider"]
    )
    x = torch.randn(3, 3, 64, 96)
    (logits,) = session.run(None, {INPUT_NAME: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), net(x), rtol=1e-4, atol=1e-4)

"""Losses by name, and the epoch metric: sums of pixel counts, not means of batch scores."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nailseg.model.metrics import LOSSES, BatchMean, SegmentationScores, build_loss


def _mask(b: int = 2, size: int = 16) -> torch.Tensor:
    mask = torch.zeros(b, 1, size, size)
    mask[:, :, 4:10, 3:12] = 1.0
    return mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_finite_and_vanishes_for_perfect_prediction(name: str) -> None:
    loss_fn = build_loss(name)
    target = _mask()
    signs = 2 * target - 1  # +1 on the nail, -1 elsewhere
    losses = [loss_fn(signs * scale, target).item() for scale in (-5.0, 0.0, 2.0, 30.0)]
    assert all(math.isfinite(v) for v in losses), losses
    assert all(a >= b for a, b in itertools.pairwise(losses)), losses
    assert losses[0] > 0.5 and losses[-1] < 1e-3, losses


def test_loss_has_gradient() -> None:
    logits = torch.zeros(2, 1, 16, 16, requires_grad=True)
    build_loss("dice_bce")(logits, _mask()).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_unknown_loss_lists_known_names() -> None:
    with pytest.raises(ValueError, match="dice_bce") as err:
        build_loss("dcie")
    assert "'dcie'" in str(err.value) and "lovasz" in str(err.value)


def _probs_from(pred: torch.Tensor) -> torch.Tensor:
    return pred.float() * 0.9 + 0.05  # probabilities on either side of the 0.5 threshold


def test_metric_sums_counts_over_uneven_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    metric = SegmentationScores(num_groups=2, threshold=0.5)
    tp = fp = fn = 0
    per_group = torch.zeros(2, 3, dtype=torch.float64)  # tp, fp, fn
    for b in (3, 1, 4):  # uneven batches, as the last batch of an epoch is
        truth = torch.rand(b, 1, 8, 8, generator=gen) > 0.6
        pred = torch.rand(b, 1, 8, 8, generator=gen) > 0.5
        group = torch.randint(0, 2, (b,), generator=gen)
        metric.update(_probs_from(pred), truth.float(), group)
        for i in range(b):
            counts = torch.tensor(
                [
                    (pred[i] & truth[i]).sum(),
                    (pred[i] & ~truth[i]).sum(),
                    (~pred[i] & truth[i]).sum(),
                ]
            )
            per_group[group[i]] += counts
            tp, fp, fn = tp + counts[0].item(), fp + counts[1].item(), fn + counts[2].item()
    out = metric.compute()
    assert out["dice"].item() == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert out["iou"].item() == pytest.approx(tp / (tp + fp + fn))
    assert out["samples"].item() == 8
    g_tp, g_fp, g_fn = per_group.T
    assert torch.allclose(out["dice_group"].double(), 2 * g_tp / (2 * g_tp + g_fp + g_fn))
    assert torch.allclose(out["iou_group"].double(), g_tp / (g_tp + g_fp + g_fn))
    assert out["samples_group"].sum().item() == 8


def test_metric_is_not_a_mean_of_batch_means() -> None:
    """A big nail found exactly (batch 1) and a tiny one missed (batch 2): per batch 1.0 and 0.0,
    mean 0.5; over the epoch nearly every nail pixel was found."""
    big, tiny = torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 16)
    big[..., 2:14, 2:14] = 1.0  # 144 pixels
    tiny[..., 0, 0] = 1.0  # 1 pixel
    metric = SegmentationScores(num_groups=0, threshold=0.5)
    group = torch.zeros(1, dtype=torch.long)
    metric.update(_probs_from(big > 0), big, group)
    metric.update(_probs_from(torch.zeros_like(tiny, dtype=torch.bool)), tiny, group)
    dice = metric.compute()["dice"].item()
    assert dice == pytest.approx(2 * 144 / (2 * 144 + 0 + 1))
    assert abs(dice - 0.5) > 0.4


def test_metric_groups_and_empty_case() -> None:
    metric = SegmentationScores(num_groups=3, threshold=0.5)
    empty = torch.zeros(2, 1, 4, 4)
    # group 0: nothing to find, nothing predicted -> perfect; group 1: all wrong; group 2: unseen
    metric.update(_probs_from(empty > 0), empty, torch.tensor([0, 0]))
    metric.update(_probs_from(empty == 0), empty, torch.tensor([1, 1]))
    out = metric.compute()
    assert out["dice_group"][0].item() == 1.0 and out["iou_group"][0].item() == 1.0
    assert out["dice_group"][1].item() == 0.0
    assert math.isnan(out["dice_group"][2].item()) and out["samples_group"].tolist() == [2, 2, 0]
    assert out["dice"].item() == 0.0  # overall: 32 false positives, nothing to find

    only_empty = SegmentationScores(num_groups=0, threshold=0.5)
    only_empty.update(_probs_from(empty > 0), empty, torch.tensor([0, 0]))
    assert only_empty.compute()["dice"].item() == 1.0


@pytest.mark.parametrize("group", [2, -1])
def test_metric_rejects_out_of_range_group(group: int) -> None:
    # not checked on the host (a device sync every step): index_add_ refuses it
    metric = SegmentationScores(num_groups=2, threshold=0.5)
    with pytest.raises(IndexError, match="out of range"):
        metric.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.tensor([group]))


def test_batch_mean_weights_each_batch_by_its_size() -> None:
    metric = BatchMean()
    for value, n in ((1.0, 3), (4.0, 1), (0.5, 4)):
        metric.update(torch.tensor(value), n)
    assert metric.compute().item() == pytest.approx((3 * 1.0 + 4.0 + 4 * 0.5) / 8)
    assert metric(torch.tensor(2.0), 5).item() == 2.0  # forward: this batch alone
    assert metric.count.item() == 13

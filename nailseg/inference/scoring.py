"""Dice and IoU of predicted masks against true ones: per image, per group and over all pixels.

As training's `SegmentationScores` (model/metrics.py) scores, so a score means what `val/dice`
means: totals from TP/FP/FN summed over every pixel, an image with nothing to find and nothing
predicted 1.0. The per-image mean is reported beside the pixel total: how a typical photo does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import pandas as pd


def dice_iou(tp, fp, fn) -> tuple[Any, Any]:
    """Dice and IoU from pixel counts (scalars or arrays); 1.0 where there is nothing to find and
    nothing was predicted."""
    tp, fp, fn = (np.asarray(x, dtype=np.float64) for x in (tp, fp, fn))
    empty = (tp + fp + fn) == 0
    dice = np.where(empty, 1.0, 2 * tp / np.maximum(2 * tp + fp + fn, 1))
    iou = np.where(empty, 1.0, tp / np.maximum(tp + fp + fn, 1))
    return dice if dice.ndim else float(dice), iou if iou.ndim else float(iou)


@dataclass(frozen=True)
class ImageScore:
    """One row of scores.csv."""

    key: str  # the photo's path relative to the input folder, without extension
    image: str  # the photo's path as given (or found under the input folder)
    mask: str
    group: str
    height: int
    width: int
    tp: int
    fp: int
    fn: int
    dice: float
    iou: float


SCORE_COLUMNS = [f.name for f in fields(ImageScore)]  # scores.csv's, in order


def score_image(
    pred: np.ndarray, truth: np.ndarray, *, key: str, image: str, mask: str, group: str
) -> ImageScore:
    """Scores of one predicted mask against its true mask (both HxW bool)."""
    if pred.shape != truth.shape:
        raise ValueError(f"prediction {pred.shape} and mask {truth.shape} differ in size")
    tp = int(np.count_nonzero(pred & truth))
    fp = int(np.count_nonzero(pred & ~truth))
    fn = int(np.count_nonzero(~pred & truth))
    dice, iou = dice_iou(tp, fp, fn)
    return ImageScore(key, image, mask, group, *pred.shape, tp, fp, fn, dice, iou)


def score_table(scores: Iterable[ImageScore]) -> pd.DataFrame:
    """scores.csv: one row per scored image, sorted by key."""
    rows = pd.DataFrame([asdict(s) for s in scores], columns=SCORE_COLUMNS)
    return rows.sort_values("key", ignore_index=True)


def totals(table: pd.DataFrame) -> dict[str, Any]:
    """`overall`: scores over all pixels of every image; `groups`: the same per group. Each has
    the pixel-sum Dice and IoU, the mean of the per-image ones, the image count and the counts."""
    return {
        "overall": _total(table),
        "groups": {str(group): _total(rows) for group, rows in table.groupby("group", sort=True)},
    }


def _total(rows: pd.DataFrame) -> dict[str, float]:
    tp, fp, fn = (int(rows[c].sum()) for c in ("tp", "fp", "fn"))
    dice, iou = dice_iou(tp, fp, fn)
    return {
        "images": len(rows),
        "dice": dice,
        "iou": iou,
        "mean_image_dice": float(rows["dice"].mean()) if len(rows) else float("nan"),
        "mean_image_iou": float(rows["iou"].mean()) if len(rows) else float("nan"),
        "tp": tp,
        "fp": fp,
        "fn": fn,
    }

"""auto_scale (predict's default): a photo whose nails are smaller in the one window than nearly all
the checkpoint's training nails runs again, tiled at the size that brings them to it; a photo framed
like the training photos runs once, as with auto_scale=false; summary.json says which ran again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from support.image_files import photo, save_image
from support.inference import compose_cli, own_run

import nailseg
from nailseg.inference.predict import run
from nailseg.model.checkpoint import CARD_KEY


def _with_nail_size(ckpt: Path, sizes: list[float] | None, name: str) -> Path:
    """A copy of `ckpt` beside it whose card says its training nails were `sizes` across."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    checkpoint[CARD_KEY]["nail_size"] = sizes
    out = ckpt.with_name(name)
    torch.save(checkpoint, out)
    return out


@pytest.fixture(scope="module")
def trained(trained_run, tmp_path_factory) -> Path:
    return own_run(trained_run, tmp_path_factory.mktemp("auto_run") / "run")


class _RedNails(torch.nn.Module):
    """A per-pixel net that finds red: its nails are wherever the photo is red, at any scale."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return 10 * (x[:, :1] - (x[:, 1:2] + x[:, 2:]) / 2) - 10  # normalised: red ~4, grey ~0


def _red_discs(
    side: int, diameter: int, centres: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """A grey photo with red discs, and its true mask."""
    yy, xx = np.mgrid[:side, :side]
    mask = np.zeros((side, side), np.uint8)
    for y, x in centres:
        mask[(yy - y) ** 2 + (xx - x) ** 2 <= (diameter / 2) ** 2] = 1
    image = np.full((side, side, 3), 128, np.uint8)
    image[mask == 1] = (255, 0, 0)
    return image, mask


def _dice(mask: np.ndarray, truth: np.ndarray) -> float:
    return 2 * float((mask & truth).sum()) / float(mask.sum() + truth.sum())


def _segmenters(ckpt: Path) -> tuple:
    """The checkpoint as `nailseg.load` gives it, by default and with auto_scale=false, each
    running `_RedNails` (the card's input size is 32x32)."""
    auto, once = nailseg.load(ckpt, "cpu"), nailseg.load(ckpt, "cpu", auto_scale=False)
    auto.net, once.net = _RedNails(), _RedNails()
    return auto, once


def test_a_zoomed_out_photo_runs_again_at_the_training_nail_size(trained):
    """Discs 16 px across in a 512 px photo are 1 px in the 32 px window, where the training nails
    were 12 and more: found there as specks, they are found whole at 8 times that."""
    auto, once = _segmenters(_with_nail_size(trained, [12, 13, 14, 15, 16], "trained_12.ckpt"))
    image, truth = _red_discs(512, 16, [(100, 100), (100, 400), (300, 250), (420, 120)])
    assert _dice(auto.predict(image), truth) > 0.9 > _dice(once.predict(image), truth) + 0.3
    assert auto.net.calls > 1


def test_a_photo_framed_like_the_training_photos_runs_once(trained):
    """A disc 24 px across in a 64 px photo is 12 px in the window: a training nail's size."""
    auto, once = _segmenters(_with_nail_size(trained, [12, 13, 14, 15, 16], "trained_12.ckpt"))
    image, _ = _red_discs(64, 24, [(32, 32)])
    assert (auto.predict(image) == once.predict(image)).all()
    assert auto.net.calls == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "rerun"),
    [([200.0] * 5, True), ([0.5] * 5, False), (None, None)],
    ids=["nails far smaller than training's", "nails as large", "a card without sizes"],
)
def test_summary_json_records_the_photos_run_again(trained, tmp_path, sizes, rerun):
    """With the card's nails far larger than any the tiny net finds, every photo runs again
    (at most 8 windows across); as large, none does; a card without sizes runs each once."""
    ckpt = _with_nail_size(trained, sizes, f"sizes_{rerun}.ckpt")
    for i in range(3):
        save_image(tmp_path / "in" / f"p{i}.png", photo(90, 120, seed=i))
    args = [f"ckpt={ckpt}", f"input={tmp_path / 'in'}", f"output={tmp_path / 'out'}"]
    run(compose_cli("predict", args), console=Console(quiet=True))
    recorded = json.loads((tmp_path / "out" / "summary.json").read_text())["auto_scale"]
    if rerun is None:
        assert recorded is None
    elif rerun:
        assert sorted(recorded) == ["p0", "p1", "p2"]
        assert all(32 < side <= 8 * 32 for side in recorded.values())
    else:
        assert recorded == {}

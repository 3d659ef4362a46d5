"""`make bench-zoomed` (`python -m benchmarks.zoomed`): the zoomed-out photos it makes, and the
command end to end on the CPU (tiny model, a few photos)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.cli import run_command
from support.image_files import box_mask, photo, save_image
from support.inference import compose_cli

from benchmarks.zoomed import zoomed_out
from nailseg.model.scales import nail_size


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    """Ten pairs as users' data comes, each with one square nail 12 px across."""
    for i in range(10):
        save_image(tmp_path / "raw" / "Images" / "g" / f"p{i}.png", photo(40, 48, seed=i))
        save_image(tmp_path / "raw" / "Masks" / "g" / f"p{i}.png", box_mask(40, 48, box=12))
    return tmp_path / "raw"


@pytest.mark.parametrize("background", ["synth", "border"])
def test_a_zoomed_out_photo_has_smaller_nails_on_a_larger_canvas(background: str) -> None:
    image, mask = photo(100, 80), (box_mask(100, 80, box=30) > 0).astype(np.uint8)
    cfg = compose_cli(
        "bench_zoomed",
        ["ckpt=x.ckpt", "nail_px=[8,12]", "canvas=[200,240]", f"background={background}"],
    )
    for seed in range(5):
        out, out_mask = zoomed_out((image, mask), np.random.default_rng(seed), cfg)
        assert out.dtype == np.uint8 and out.shape[:2] == out_mask.shape
        assert 200 <= max(out_mask.shape) <= 240 and min(out_mask.shape) >= 150
        assert 7 <= nail_size(out_mask) <= 13  # the nail's own size, the pixel grid rounding it
        # the photo is where its mask went: the nail's pixels are the photo's nail's colours
        nail = out[out_mask.astype(bool)].mean(axis=0)
        assert np.abs(nail - image[30:60, 30:60].mean(axis=(0, 1))).max() < 20


@pytest.mark.slow
def test_bench_zoomed_runs_and_reports(raw: Path, trained_run: Path, tmp_path: Path, capfd) -> None:
    out = tmp_path / "bench"
    args = [f"ckpt={trained_run}", f"input_dir={raw}", f"output_dir={out}", "seeds=[3,4]",
            "nail_px=[4,6]", "canvas=[64,80]", "long_sides=[64]", "+runs.tta={tta: true}",
            "device=cpu", "num_workers=1"]  # fmt: skip
    proc = run_command(["-m", "benchmarks.zoomed", *args], capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zoomed_3" in proc.stdout and "tile_64" in proc.stdout
    rows = pd.read_csv(out / "bench_zoomed.csv")
    assert rows["run"].unique().tolist() == ["default", "one_window", "tta", "tile_64"]
    assert rows["set"].unique().tolist() == ["framed", "zoomed_3", "zoomed_4"]
    assert rows["dice"].between(0, 1).all()
    report = json.loads((out / "bench_zoomed.json").read_text())
    assert report["photos"] == len(pd.read_csv(out / "prepared" / "valid.csv")) > 0
    assert report["nail_px"]["framed"] > 11 and 3 <= report["nail_px"]["zoomed_3"] <= 7
    assert (out / "bench_zoomed.png").stat().st_size > 0

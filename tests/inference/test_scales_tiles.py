"""predict's scales and tiles: each photo at several sizes, or in overlapping tiles of the input
size at a chosen long side, merged before the threshold; the same in threshold=auto and scoring;
bad values refused in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from rich.console import Console
from support.cli import run_command
from support.image_files import box_mask, photo, save_image
from support.inference import compose_cli, own_run, predict_split, reference_probabilities

from nailseg.data.datamodule import read_split
from nailseg.inference.engine import build_engine
from nailseg.inference.predict import PredictError, run
from nailseg.inference.segmenter import CACHE_FILE, resolve_spec
from nailseg.inference.views import (
    Tiling,
    Views,
    full_size_probabilities,
    image_tensors,
    input_sizes,
    photo_probabilities,
    resized_size,
    tile_layout,
    tile_starts,
)
from nailseg.model.checkpoint import load_net
from nailseg.model.scales import scaled_size

CPU = torch.device("cpu")
SIZES = [(90, 120), (20, 25), (33, 47), (90, 120), (64, 30)]  # mixed, one repeated


@pytest.fixture(scope="module")
def trained(trained_run, tmp_path_factory) -> Path:
    """The last checkpoint of a tiny UNet run at 32x32, inside its run folder."""
    return own_run(trained_run, tmp_path_factory.mktemp("scales_run") / "run")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Photos larger than the input size, of mixed sizes, with their true masks beside."""
    folder = tmp_path_factory.mktemp("scales_photos")
    for i, (h, w) in enumerate([(90, 120), (70, 50), (30, 200)]):
        save_image(folder / "photos" / f"p{i}.png", photo(h, w, seed=i))
        save_image(folder / "masks" / f"p{i}.png", box_mask(h, w, box=10))
    return folder


def predict(ckpt: Path, inputs: Path, output: Path, *extra: str):
    overrides = [f"ckpt={ckpt}", f"input={inputs}", f"output={output}", "num_workers=2", *extra]
    return run(compose_cli("predict", overrides), console=Console(quiet=True))


def _masks(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "masks").iterdir())}


def _spec_and_net(ckpt: Path):
    spec = resolve_spec(compose_cli("predict", [f"ckpt={ckpt}", "input=x", "output=y"]))
    return spec, build_engine("torch", load_net(ckpt, spec.model), spec, CPU, False)


def _images(sizes=SIZES) -> list[torch.Tensor]:
    return image_tensors([photo(h, w, seed=i) for i, (h, w) in enumerate(sizes)], CPU)


class _Pointwise(torch.nn.Module):
    """A per-pixel net (1x1 convolutions): its output at a pixel depends on that pixel alone, so
    tiles blended by windows summing to 1 must give what the whole resized photo gives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 1), torch.nn.ReLU(), torch.nn.Conv2d(8, 1, 1)
        ).eval()
        self.batches: list[int] = []  # the batch sizes it was called with

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(len(x))
        return self.net(x)


@pytest.mark.parametrize(
    ("length", "tile", "overlap"),
    [
        (100, 32, 0.25),
        (100, 32, 0.0),
        (33, 32, 0.5),
        (40, 32, 0.99),
        (500, 64, 0.75),
        (64, 64, 0.3),
    ],
)
def test_tiles_cover_the_side_evenly_overlapping_by_at_least_the_fraction(length, tile, overlap):
    starts = tile_starts(length, tile, overlap)
    assert starts[0] == 0 and starts[-1] + tile == max(length, tile)
    gaps = np.diff(starts) if len(starts) > 1 else np.array([tile])
    assert (gaps > 0).all() and gaps.max() - gaps.min() <= 1  # evenly spread, none twice
    assert (tile - gaps >= overlap * tile - 1).all() or len(starts) == length - tile + 1
    if len(starts) > 2:  # the fewest: one tile fewer would leave neighbours overlapping less
        assert (length - tile) / (len(starts) - 2) > tile * (1 - overlap)


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.6])
def test_tile_windows_sum_to_one_at_every_pixel_and_are_never_zero(overlap):
    layout = tile_layout((90, 120), (32, 24), Tiling(long_side=100, overlap=overlap))
    assert layout.size == (75, 100)  # long side 100, aspect kept
    total = torch.zeros(layout.size)
    for i, y in enumerate(layout.row_starts):
        for j, x in enumerate(layout.col_starts):
            total[y : y + 32, x : x + 24] += torch.outer(layout.rows[i], layout.cols[j])
    torch.testing.assert_close(total, torch.ones(layout.size))
    assert layout.rows.min() > 0 and layout.cols.min() > 0


def test_a_side_shorter_than_a_tile_is_stretched_to_it():
    assert resized_size((30, 200), (32, 32), 100) == (32, 100)  # 15 rows would be too few
    assert resized_size((20, 25), (32, 32), 32) == (32, 32)  # fits one tile: one window, as today
    layout = tile_layout((20, 25), (32, 32), Tiling(long_side=32, overlap=0.25))
    assert layout.corners == [(0, 0)] and (layout.rows == 1).all() and (layout.cols == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("tta", [False, True])
def test_tiled_prediction_of_a_per_pixel_net_equals_the_whole_resized_photos(trained, tta):
    """Blending is exact: for a per-pixel net, tiles give what the untiled photo gives at the
    resolution it is tiled at, for photos of mixed sizes, tiles of several photos in a batch."""
    spec, _ = _spec_and_net(trained)
    net = _Pointwise()
    images = _images()
    views = Views(tta=tta, scales=None, tile=Tiling(long_side=100, overlap=0.25))
    tiled = photo_probabilities(net, images, spec, views, batch_size=5)
    for image, got in zip(images, tiled, strict=True):
        size = resized_size(image.shape[1:], spec.image_size, 100)
        (whole,) = full_size_probabilities(net, [image], spec, tta, size)
        assert got.shape == image.shape[1:]
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_tiles_go_through_the_net_batch_size_at_a_time(trained):
    """`batch_size` counts tiles (the last batch may be smaller); the maps do not depend on it."""
    spec, unet = _spec_and_net(trained)
    net = _Pointwise()
    images = _images()
    views = Views(tta=False, scales=None, tile=Tiling(long_side=100, overlap=0.25))
    tiles = sum(
        len(tile_layout(tuple(i.shape[1:]), spec.image_size, views.tile).corners) for i in images
    )
    photo_probabilities(net, images, spec, views, batch_size=3)
    assert sum(net.batches) == tiles and max(net.batches) == 3
    assert net.batches[:-1] == [3] * (len(net.batches) - 1)
    by_one = photo_probabilities(unet, images, spec, views, batch_size=1)
    by_seven = photo_probabilities(unet, images, spec, views, batch_size=7)
    for one, seven in zip(by_one, by_seven, strict=True):
        torch.testing.assert_close(one, seven, rtol=0, atol=1e-5)


def test_scales_are_factors_of_the_input_size_rounded_to_multiples_of_32(trained):
    assert scaled_size((384, 384), 1.5) == (576, 576)
    assert scaled_size((384, 256), 1.7) == (640, 448)  # 652.8 → 640, 435.2 → 448
    assert scaled_size((100, 100), 1.0) == (100, 100)  # the trained size, as it is
    assert scaled_size((64, 64), 0.1) == (32, 32)  # at least 32
    assert scaled_size((32, 32), 1.5) == (64, 64)  # 48: halves round up
    spec, _ = _spec_and_net(trained)
    views = Views(tta=False, scales=(1.0, 1.5, 1.0), tile=None)
    assert input_sizes(views, spec) == [(32, 32), (64, 64)]
    tiled = Views(tta=False, scales=(1.0, 2.0), tile=Tiling(long_side=64, overlap=0.25))
    assert input_sizes(tiled, spec) == [(32, 32)]  # tiles are the input size at every scale


@pytest.mark.slow
@pytest.mark.parametrize("tile", [None, Tiling(long_side=64, overlap=0.25)])
def test_two_scales_are_the_mean_of_each_scale_alone(trained, tile):
    spec, unet = _spec_and_net(trained)
    images = _images()
    both = photo_probabilities(unet, images, spec, Views(True, (1.0, 1.5), tile), batch_size=4)
    alone = [
        photo_probabilities(unet, images, spec, Views(True, (s,), tile), batch_size=4)
        for s in (1.0, 1.5)
    ]
    for got, a, b in zip(both, *alone, strict=True):
        torch.testing.assert_close(got, (a + b) / 2, rtol=0, atol=1e-6)
        assert not torch.allclose(a, b)  # the scales differ: the mean is of two maps


@pytest.mark.slow
def test_scales_one_writes_the_one_windows_masks_byte_for_byte(trained, photos, tmp_path):
    predict(trained, photos / "photos", tmp_path / "plain", "auto_scale=false")
    predict(trained, photos / "photos", tmp_path / "one", "scales=[1.0]")
    assert _masks(tmp_path / "one") == _masks(tmp_path / "plain")
    report = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert report["scales"] is None and report["tile"] is None


@pytest.mark.slow
def test_written_masks_threshold_the_mean_of_the_scales(trained, photos, tmp_path):
    """The written mask is `p > threshold` of the mean of the net's maps at each scale's size
    (computed independently of predict: `reference_probabilities`)."""
    image = np.array(Image.open(photos / "photos" / "p0.png"))
    small, large = (reference_probabilities(trained, image, size) for size in [(32, 32), (64, 64)])
    prob = (small + large) / 2
    threshold = round(float(prob.median()), 2)  # a mask of both nail and not
    out = tmp_path / "out"
    extra = ("scales=[1.0,1.5]", f"threshold={threshold}")
    predict(trained, photos / "photos" / "p0.png", out, *extra)
    written = np.asarray(Image.open(out / "masks" / "p0.png")) > 0
    decided = (prob - threshold).abs().numpy() > 1e-4  # sums in another order: a hair apart
    np.testing.assert_array_equal(written[decided], (prob > threshold).numpy()[decided])
    assert written.any() and not written.all()
    report = json.loads((out / "summary.json").read_text())
    assert report["scales"] == [1.0, 1.5] and report["tile"] is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [["scales=[1.0,1.5]"], ["tile.long_side=80", "tile.overlap=0.3", "tta=true"]]
)
def test_the_command_as_users_run_it_writes_each_mask_at_its_photos_size_and_scores(
    trained, photos, tmp_path, extra, capfd
):
    out = tmp_path / "out"
    args = [f"ckpt={trained}", f"input={photos / 'photos'}", f"output={out}", "num_workers=2"]
    args += [f"masks={photos / 'masks'}", "device=cpu", "batch_size=2", *extra]
    done = run_command(["-m", "nailseg", "predict", *args], capfd)
    assert done.returncode == 0, done.stderr
    for source in sorted((photos / "photos").iterdir()):
        with Image.open(source) as image, Image.open(out / "masks" / source.name) as mask:
            assert mask.size == image.size
    scores = pd.read_csv(out / "scores.csv")
    assert sorted(scores["key"]) == ["p0", "p1", "p2"]
    assert scores[["dice", "iou"]].apply(lambda c: c.between(0, 1)).all().all()
    report = json.loads((out / "summary.json").read_text())
    if "scales=[1.0,1.5]" in extra:
        assert report["scales"] == [1.0, 1.5] and report["tile"] is None
    else:
        assert report["tile"] == {"long_side": 80, "overlap": 0.3} and report["tta"] is True


@pytest.mark.slow
def test_scores_are_of_the_merged_masks(trained, photos, tmp_path):
    """scores.csv scores what was written: the tiled, multi-scale masks."""
    out = tmp_path / "out"
    extra = ["scales=[1.0,2.0]", "tile.long_side=64", f"masks={photos / 'masks'}"]
    summary = predict(trained, photos / "photos", out, *extra)
    rows = pd.read_csv(out / "scores.csv").set_index("key")
    for key in ("p0", "p1", "p2"):
        written = np.asarray(Image.open(out / "masks" / f"{key}.png")) > 0
        truth = np.asarray(Image.open(photos / "masks" / f"{key}.png")) > 0
        tp = int((written & truth).sum())
        assert (rows.loc[key, "tp"], rows.loc[key, "fp"]) == (tp, int(written.sum()) - tp)
    assert summary.scores["overall"]["images"] == 3


@pytest.mark.slow
def test_threshold_auto_sweeps_with_the_scales_and_tiles_and_records_them(
    trained, photos, tmp_path
):
    (trained.parent / CACHE_FILE).unlink(missing_ok=True)
    image = photos / "photos" / "p0.png"
    plain = predict(trained, image, tmp_path / "plain", "threshold=auto")
    tiled = ["threshold=auto", "scales=[1.0,1.5]", "tile.long_side=48", "tile.overlap=0.5"]
    summary = predict(trained, image, tmp_path / "tiled", *tiled)
    assert plain.threshold_source == summary.threshold_source == "auto"
    entries = json.loads((trained.parent / CACHE_FILE).read_text())["entries"]
    assert len(entries) == 2  # one per setting
    assert "scales" not in entries[0]["key"] and "tile" not in entries[0]["key"]
    assert entries[1]["key"]["scales"] == [1.0, 1.5]
    assert entries[1]["key"]["tile"] == {"long_side": 48, "overlap": 0.5}
    assert summary.threshold == entries[1]["choice"]["threshold"]
    report = json.loads((tmp_path / "tiled" / "summary.json").read_text())
    assert report["scales"] == [1.0, 1.5] and report["tile"] == {"long_side": 48, "overlap": 0.5}
    assert report["threshold"] == summary.threshold

    # the sweep's Dice at its choice is that of predict's own merged masks over the valid split
    root = _spec_and_net(trained)[0].data_root
    valid = read_split(root, "valid")
    scored = predict_split(
        trained, root, valid, tmp_path / "valid", *tiled[1:], f"threshold={summary.threshold}"
    )
    assert entries[1]["choice"]["dice"] == pytest.approx(scored["dice"], abs=1e-9)


@pytest.mark.slow
def test_onnx_engine_runs_each_scale_at_its_own_size(trained, photos, tmp_path):
    masks = {}
    for engine in ("torch", "onnx"):
        out = tmp_path / engine
        predict(trained, photos / "photos", out, f"engine={engine}", "scales=[1.0,2.0]")
        masks[engine] = {p.name: np.asarray(Image.open(p)) for p in (out / "masks").iterdir()}
    assert masks["onnx"].keys() == masks["torch"].keys()
    for name, mask in masks["torch"].items():  # logits agree to float rounding
        assert (masks["onnx"][name] == mask).mean() > 0.999, name


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("scales=[]", r"^scales=\[\]: give one factor of the input size or more"),
        ("scales=[1.0,0]", r"^scales=\[1,0\]: each factor must be a number > 0$"),
        ("scales=[-1.5]", r"^scales=\[-1.5\]: each factor must be a number > 0$"),
        ("scales=[nan]", r"^scales=\[nan\]: each factor must be a number > 0$"),
        ("tile.overlap=1.0", r"^tile.overlap=1.0: must be in \[0, 1\)"),
        ("tile.overlap=-0.1", r"^tile.overlap=-0.1: must be in \[0, 1\)"),
        ("tile.long_side=31", r"^tile.long_side=31: must be at least the input size's long side, 32"),
    ],
)  # fmt: skip
def test_bad_scales_and_tiles_are_one_line_naming_the_key_before_any_write(
    trained, photos, tmp_path, override, message
):
    out = tmp_path / "out"
    with pytest.raises(PredictError, match=message) as err:
        predict(trained, photos / "photos", out, override)
    assert "\n" not in str(err.value)
    assert not out.exists()

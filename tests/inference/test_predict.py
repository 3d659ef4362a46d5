"""`python -m nailseg predict`: photos of any size and mode → full-size masks and overlays, TTA,
unreadable files skipped, scoring against true masks, threshold=auto, checkpoint loading errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from PIL import Image
from rich.console import Console
from support.image_files import box_mask, save_image
from support.inference import (
    compose_cli,
    constant_checkpoint,
    own_run,
    predict_split,
    reference_probabilities,
)
from support.train import TINY_UNET

from nailseg.data.datamodule import read_split
from nailseg.inference.engine import build_engine
from nailseg.inference.pipeline import fast_gil_handoff, to_host
from nailseg.inference.predict import PredictError, main, run
from nailseg.inference.request import worker_count
from nailseg.inference.segmenter import CACHE_FILE, ThresholdError, resolve_spec
from nailseg.inference.views import full_size_probabilities, image_tensors, probabilities
from nailseg.inference.workers import score_image
from nailseg.model.checkpoint import CARD_KEY, ArchitectureMismatch, CheckpointError, load_net
from nailseg.prep.format import write_table
from nailseg.viz import CAPTION_HEIGHT, TRUTH_COLOR


@pytest.fixture(scope="module")
def trained(trained_run, tmp_path_factory) -> Path:
    """The last checkpoint of a tiny UNet run (32x32) inside a run dir with .hydra/config.yaml."""
    return own_run(trained_run, tmp_path_factory.mktemp("predict_run") / "run")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Photos of mixed sizes, formats and modes in nested folders, one broken, one not an image."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(1)
    save_image(folder / "a" / "rgb.png", rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    save_image(folder / "a" / "grey.png", rng.integers(0, 256, (64, 20), dtype=np.uint8))
    save_image(folder / "a" / "deep" / "alpha.png", rng.integers(0, 256, (30, 31, 4), np.uint8))
    save_image(folder / "b" / "photo.JPG", rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
    save_image(folder / "b" / "wide16.tif", rng.integers(0, 65536, (16, 70), dtype=np.uint16))
    save_image(folder / "top.jpeg", rng.integers(0, 256, (45, 45, 3), dtype=np.uint8))
    (folder / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (folder / "notes.txt").write_text("not an image")
    return folder


PHOTO_SIZES = {
    "a/rgb": (37, 53),
    "a/grey": (64, 20),
    "a/deep/alpha": (30, 31),
    "b/photo": (90, 120),
    "b/wide16": (16, 70),
    "top": (45, 45),
}


def predict(ckpt: Path, inputs, output: Path, *extra: str, console: Console | None = None):
    overrides = [f"ckpt={ckpt}", f"input={inputs}", f"output={output}", "num_workers=2", *extra]
    return run(compose_cli("predict", overrides), console=console or Console(quiet=True))


@pytest.mark.slow
def test_masks_and_overlays_at_each_photos_size_broken_file_skipped(trained, photos, tmp_path):
    console = Console(record=True, width=200)
    out = tmp_path / "out"
    summary = predict(trained, photos, out, "batch_size=4", console=console)

    assert summary.images == len(PHOTO_SIZES)
    assert [(s.path.name, s.reason.split(":")[0]) for s in summary.skipped] == [
        ("notes.txt", "not an image file (extension '.txt')"),
        ("broken.png", "unreadable"),
    ]
    assert "broken.png" in console.export_text()  # reported by name
    for key, (h, w) in PHOTO_SIZES.items():
        mask = np.asarray(Image.open(out / "masks" / f"{key}.png"))
        assert mask.shape == (h, w) and set(np.unique(mask)) <= {0, 255}
        overlay = np.asarray(Image.open(out / "overlays" / f"{key}.png"))
        assert overlay.shape == (h, w, 3)
    report = json.loads((out / "summary.json").read_text())
    assert report["images"] == len(PHOTO_SIZES) and report["images_per_s"] > 0
    stages = report["stages_s"]
    assert set(stages) == {"read_wait", "device_queue", "device_wait", "write_wait"}
    assert 0 < sum(stages.values()) <= report["seconds"]
    assert report["capture_s"] == 0.0  # no CUDA graph on the CPU
    assert report["image_size"] == [32, 32] and report["threshold"] == 0.5
    assert [s["path"].rsplit("/", 1)[1] for s in report["skipped"]] == ["notes.txt", "broken.png"]
    assert not list(out.rglob("*.tmp"))  # every write was renamed into place


@pytest.mark.slow
def test_onnx_engine_writes_the_masks_pytorch_writes(trained, photos, tmp_path):
    masks = {}
    for engine in ("torch", "onnx"):
        out = tmp_path / engine
        summary = predict(trained, photos, out, f"engine={engine}", "device=cpu", "overlays=false")
        assert summary.images == len(PHOTO_SIZES)
        masks[engine] = {p.name: np.asarray(Image.open(p)) for p in (out / "masks").rglob("*.png")}
    assert masks["onnx"].keys() == masks["torch"].keys()
    for name, mask in masks["torch"].items():  # logits agree to float rounding
        assert (masks["onnx"][name] == mask).mean() > 0.999, name


def test_onnx_engine_on_a_gpu_is_refused_before_anything_is_written(trained, photos, tmp_path):
    with pytest.raises(PredictError, match="engine=onnx runs on the CPU"):
        predict(trained, photos, tmp_path / "out", "engine=onnx", "device=cuda")
    with pytest.raises(PredictError, match="engine=tensorrt: use torch or onnx"):
        predict(trained, photos, tmp_path / "out", "engine=tensorrt", "device=cpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_overlays_false_writes_only_the_masks(trained, photos, tmp_path):
    out = tmp_path / "out"
    summary = predict(trained, photos / "a", out, "overlays=false")
    assert summary.images == 3 and not (out / "overlays").exists()
    assert sorted(p.relative_to(out / "masks").as_posix() for p in out.rglob("*.png")) == [
        "deep/alpha.png", "grey.png", "rgb.png"
    ]  # fmt: skip


@pytest.mark.slow
def test_masks_threshold_the_full_size_probabilities(trained, photos, tmp_path):
    """The written mask is `p > threshold` of the net's probabilities at the input size, brought
    back to the photo's size (computed independently of predict: `reference_probabilities`);
    auto_scale's second look: test_auto_scale.py."""
    prob = reference_probabilities(trained, np.array(Image.open(photos / "top.jpeg")))
    threshold = round(float(prob.median()), 2)  # a mask of both nail and not
    out = tmp_path / "out"
    predict(trained, photos / "top.jpeg", out, f"threshold={threshold}", "auto_scale=false")
    written = np.asarray(Image.open(out / "masks" / "top.png")) > 0
    decided = (prob - threshold).abs().numpy() > 1e-4  # sums in another order: a hair apart
    np.testing.assert_array_equal(written[decided], (prob > threshold).numpy()[decided])
    assert written.any() and not written.all()


def test_photos_of_mixed_sizes_get_the_maps_each_gets_alone(trained):
    """Photos are resized in and out one size at a time, in order of size: each photo's map is
    the one it gets predicted on its own, returned in the photos' order."""
    spec = resolve_spec(compose_cli("predict", [f"ckpt={trained}", "input=x", "output=y"]))
    net = load_net(trained, spec.model)
    rng = np.random.default_rng(0)
    shapes = [(40, 30), (25, 50), (40, 30), (33, 33), (25, 50), (40, 30)]
    images = image_tensors(
        [rng.integers(0, 256, (*s, 3), np.uint8) for s in shapes], torch.device("cpu")
    )
    together = full_size_probabilities(net, images, spec)
    for image, prob in zip(images, together, strict=True):
        (alone,) = full_size_probabilities(net, [image], spec)
        assert prob.shape == image.shape[1:]
        torch.testing.assert_close(prob, alone, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_list_of_files_and_folders(trained, photos, tmp_path):
    out = tmp_path / "out"
    summary = predict(trained, f"[{photos / 'top.jpeg'},{photos / 'a'}]", out)
    assert summary.images == 4
    for key in ("top", "rgb", "grey", "deep/alpha"):
        assert (out / "masks" / f"{key}.png").is_file()


@pytest.mark.slow
def test_two_files_with_one_stem_are_both_skipped(trained, tmp_path):
    save_image(tmp_path / "in" / "x.png", np.zeros((8, 8, 3), np.uint8))
    save_image(tmp_path / "in" / "x.jpg", np.zeros((8, 8, 3), np.uint8))
    save_image(tmp_path / "in" / "y.png", np.zeros((8, 8, 3), np.uint8))
    summary = predict(trained, tmp_path / "in", tmp_path / "out")
    assert summary.images == 1
    assert sorted(s.path.name for s in summary.skipped) == ["x.jpg", "x.png"]


@pytest.mark.slow
def test_a_photo_listed_twice_is_predicted_once(trained, photos, tmp_path):
    # it was skipped, twice, as "two files with one stem"
    top = photos / "top.jpeg"
    summary = predict(trained, f"[{top},{top},{photos / 'a'},{photos / 'a'}]", tmp_path / "out")
    assert summary.images == 4 and summary.skipped == []


@pytest.mark.slow
def test_files_of_other_types_in_a_folder_are_named_as_skipped(trained, tmp_path):
    # they were passed over without a word (prepare reports them)
    save_image(tmp_path / "in" / "x.png", np.zeros((8, 8, 3), np.uint8))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "in" / "y.webp")
    (tmp_path / "in" / "notes").write_text("mine")
    summary = predict(trained, tmp_path / "in", tmp_path / "out")
    assert summary.images == 1
    assert sorted((s.path.name, s.reason) for s in summary.skipped) == [
        ("notes", "not an image file (extension '(none)')"),
        ("y.webp", "not an image file (extension '.webp')"),
    ]


def test_nothing_readable_fails(trained, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.png").write_bytes(b"junk")
    with pytest.raises(PredictError, match="could be read"):
        predict(trained, tmp_path / "in", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PredictError, match="no image files"):
        predict(trained, tmp_path / "empty", tmp_path / "out2")


@pytest.mark.slow
def test_entry_point_exit_status(trained, tmp_path, monkeypatch, capsys):
    """`python -m nailseg predict` (its Hydra main, in-process): success with one unreadable file
    among good ones, the config in summary.json; exit non-zero, naming the problem,
    when nothing could be read."""
    save_image(tmp_path / "in" / "ok.png", np.full((20, 30, 3), 128, np.uint8))
    (tmp_path / "in" / "bad.jpg").write_bytes(b"junk")
    args = ["nailseg.inference.predict", f"ckpt={trained}", "device=cpu"]
    monkeypatch.setattr(
        sys, "argv", [*args, f"input={tmp_path / 'in'}", f"output={tmp_path / 'out'}"]
    )
    main()
    printed = capsys.readouterr().out
    assert "bad.jpg" in printed and "predicted 1 images" in printed
    assert (tmp_path / "out" / "masks" / "ok.png").is_file()
    recorded = json.loads((tmp_path / "out" / "summary.json").read_text())["config"]
    assert recorded["ckpt"] == str(trained) and not (tmp_path / "out" / ".hydra").exists()
    bad = tmp_path / "in" / "bad.jpg"
    monkeypatch.setattr(sys, "argv", [*args, f"input={bad}", f"output={tmp_path / 'out2'}"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert "predict failed" in str(exit_.value.code) and "could be read" in str(exit_.value.code)


@pytest.mark.slow
def test_the_command_as_users_run_it_writes_every_mask_and_warns_of_nothing(trained, tmp_path):
    """`python -m nailseg predict` in a process of its own, as users run it (its worker processes
    then start from its main module): every mask written, and no warning printed (a worker
    importing the main module a second time made runpy warn)."""
    for i in range(4):
        save_image(tmp_path / "in" / f"p{i}.png", np.full((20, 30, 3), 60 * i, np.uint8))
    out = tmp_path / "out"
    args = [f"ckpt={trained}", f"input={tmp_path / 'in'}", f"output={out}", "num_workers=2"]
    done = subprocess.run(
        [sys.executable, "-m", "nailseg", "predict", *args, "device=cpu", "batch_size=2"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONWARNINGS": "default"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr + done.stdout, done.stderr
    assert sorted(p.name for p in (out / "masks").iterdir()) == [f"p{i}.png" for i in range(4)]
    # what it does while it loads, before the bar: it was silent for ~11 s
    said = done.stdout.splitlines()
    assert said[0] == f"predict: 4 photos; loading torch and {trained} …", done.stdout
    assert said[1].startswith("loaded Unet/resnet18 at 32x32 on cpu; threshold 0.5 (checkpoint)")
    assert said[1].endswith("starting 2 worker processes …") and "predicting" in said[2]
    # the bar's rate: its photos over its time, which lies within the summary's (it showed
    # 12,702 img/s for 13.2)
    bar_rate = float(re.search(r"4/4 +([\d.]+) img/s", done.stdout)[1])
    summary_rate = float(re.search(r"\(([\d.]+) images/s\)", done.stdout)[1])
    assert summary_rate <= bar_rate <= 1.5 * summary_rate, done.stdout


class _Pointwise(torch.nn.Module):
    """A 1x1 convolution: flipping its input flips its output, so flip TTA changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_tta_equals_plain_for_a_flip_equivariant_net_and_differs_for_a_unet(trained):
    batch = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        net = _Pointwise().eval()
        torch.testing.assert_close(probabilities(net, batch, tta=True), probabilities(net, batch))
        spec = resolve_spec(compose_cli("predict", [f"ckpt={trained}", "input=x", "output=y"]))
        unet = load_net(trained, spec.model)
        plain, tta = probabilities(unet, batch), probabilities(unet, batch, tta=True)
        assert tta.shape == plain.shape and not torch.allclose(tta, plain)
        # the mean of the three views, each flipped back
        views = [
            torch.sigmoid(unet(batch)),
            torch.sigmoid(unet(batch.flip(3))).flip(3),
            torch.sigmoid(unet(batch.flip(2))).flip(2),
        ]
        torch.testing.assert_close(tta, sum(views) / 3)


def test_tta_run_writes_full_size_masks(trained, photos, tmp_path):
    summary = predict(trained, photos / "a", tmp_path / "out", "tta=true")
    assert summary.images == 3
    report = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert report["tta"] is True
    mask = Image.open(tmp_path / "out" / "masks" / "deep" / "alpha.png")
    assert mask.size == (31, 30)


def test_scores_match_hand_computed_dice(trained, tmp_path):
    """A net that calls every pixel nail (logit +10): Dice and IoU follow from the true masks."""
    ckpt = constant_checkpoint(trained, logit=10.0)
    photos, masks = tmp_path / "photos", tmp_path / "masks"
    grey = np.full((10, 20, 3), 100, np.uint8)
    save_image(photos / "g1" / "half.jpg", grey)
    truth = np.zeros((10, 20), np.uint8)
    truth[:5, :10] = 255  # 50 of 200 pixels: TP 50, FP 150 → Dice 100/250, IoU 50/200
    save_image(masks / "g1" / "half.png", truth)
    save_image(photos / "g1" / "full.png", grey[:8, :8])
    save_image(masks / "g1" / "full.bmp", np.ones((8, 8), np.uint8))  # a 0/1 mask, all nail
    save_image(photos / "g2" / "none.png", grey[:4, :5])
    save_image(masks / "g2" / "none.PNG", np.zeros((4, 5), np.uint8))  # nothing to find: FP 20
    save_image(photos / "g2" / "unmatched.png", grey[:4, :4])

    out = tmp_path / "out"
    summary = predict(ckpt, photos, out, f"masks={masks}")

    rows = pd.read_csv(out / "scores.csv", dtype={"group": str}).set_index("key")
    assert list(rows.index) == ["g1/full", "g1/half", "g2/none"]
    assert rows.loc["g1/half", "image"] == str(photos / "g1" / "half.jpg")
    assert rows.loc["g1/full", "mask"] == str(masks / "g1" / "full.bmp")
    expected = {  # key: (tp, fp, fn, dice, iou)
        "g1/half": (50, 150, 0, 0.4, 0.25),
        "g1/full": (64, 0, 0, 1.0, 1.0),
        "g2/none": (0, 20, 0, 0.0, 0.0),
    }
    for image, (tp, fp, fn, dice, iou) in expected.items():
        row = rows.loc[image]
        assert (row.tp, row.fp, row.fn) == (tp, fp, fn)
        assert row.dice == pytest.approx(dice) and row.iou == pytest.approx(iou)
        assert row.group == image.split("/")[0]
    overall = summary.scores["overall"]
    assert (overall["tp"], overall["fp"], overall["fn"]) == (114, 170, 0)
    assert overall["dice"] == pytest.approx(228 / 398) and overall["iou"] == pytest.approx(
        114 / 284
    )
    assert overall["mean_image_dice"] == pytest.approx(1.4 / 3)
    assert summary.scores["groups"]["g1"]["dice"] == pytest.approx(228 / 378)
    assert summary.scores["groups"]["g2"]["images"] == 1
    assert [s.path.name for s in summary.unscored] == ["unmatched.png"]
    assert "no mask" in summary.unscored[0].reason
    report = json.loads((out / "summary.json").read_text())
    assert report["scores"]["overall"]["dice"] == pytest.approx(228 / 398)


def test_score_image_empty_case_is_perfect():
    empty = np.zeros((3, 3), bool)
    score = score_image(empty, empty, key="x", image="x.png", mask="y.png", group="g")
    assert (score.dice, score.iou) == (1.0, 1.0)


def test_overlays_with_true_masks_draw_their_outline_labelled(trained, tmp_path):
    """With `masks=`, each overlay shows the true mask's outline in green over the prediction (in
    red) and a strip below naming both and the photo's Dice; without, the photo as it is."""
    save_image(tmp_path / "photos" / "x.png", np.full((40, 50, 3), 128, np.uint8))
    save_image(tmp_path / "masks" / "x.png", box_mask(40, 50, box=10))  # rows, columns 10..19
    summary = predict(trained, tmp_path / "photos", tmp_path / "out", f"masks={tmp_path / 'masks'}")
    shown = np.asarray(Image.open(tmp_path / "out" / "overlays" / "x.png"))
    assert shown.shape == (40 + CAPTION_HEIGHT, 50, 3)
    green = np.all(shown[:40] == TRUTH_COLOR, axis=2)
    outline = np.zeros((40, 50), bool)
    outline[10:20, 10:20] = True
    outline[11:19, 11:19] = False
    np.testing.assert_array_equal(green, outline)
    assert shown[40:].any()  # the caption strip has its words
    assert summary.scores["overall"]["images"] == 1
    predict(trained, tmp_path / "photos", tmp_path / "plain")
    assert np.asarray(Image.open(tmp_path / "plain" / "overlays" / "x.png")).shape == (40, 50, 3)


def test_mask_of_another_size_is_not_scored(trained, tmp_path):
    save_image(tmp_path / "photos" / "x.png", np.zeros((10, 10, 3), np.uint8))
    save_image(tmp_path / "masks" / "x.png", np.zeros((12, 10), np.uint8))
    summary = predict(trained, tmp_path / "photos", tmp_path / "out", f"masks={tmp_path / 'masks'}")
    assert summary.images == 1 and summary.scores is None
    assert "(12, 10)" in summary.unscored[0].reason
    assert not (tmp_path / "out" / "scores.csv").exists()


@pytest.mark.slow
def test_threshold_auto_is_the_dice_best_on_validation_and_cached(trained, photos, tmp_path):
    (trained.parent / CACHE_FILE).unlink(missing_ok=True)
    summary = predict(trained, photos / "top.jpeg", tmp_path / "out", "threshold=auto")
    cache = json.loads((trained.parent / CACHE_FILE).read_text())
    (entry,) = cache["entries"]
    choice = entry["choice"]
    assert summary.threshold == choice["threshold"] and summary.threshold_source == "auto"
    assert entry["key"]["checkpoint"] == "last.ckpt" and entry["key"]["tta"] is False

    # the sweep's Dice at its choice is that of predict's own masks over the valid split
    root = Path(torch.load(trained, weights_only=True)[CARD_KEY]["data_root"])
    valid = read_split(root, "valid")
    scored = predict_split(
        trained, root, valid, tmp_path / "valid", f"threshold={choice['threshold']}"
    )
    assert choice["dice"] == pytest.approx(scored["dice"], abs=1e-9)
    assert choice["samples"] == scored["images"] == len(valid)
    assert choice["dice"] >= choice["dice_at_run_threshold"]

    # a second run reads the cache (a sweep would fail here)
    def no_sweep(*args, **kwargs):
        raise AssertionError("threshold.json should have been used")

    monkey = pytest.MonkeyPatch()
    monkey.setattr("nailseg.inference.segmenter.sweep", no_sweep)
    try:
        again = predict(trained, photos / "top.jpeg", tmp_path / "out2", "threshold=auto")
    finally:
        monkey.undo()
    assert again.threshold == summary.threshold

    # the same data root prepared again (one validation pair fewer) is swept again
    copy = tmp_path / "prepared"
    shutil.copytree(root, copy)
    for rows in (valid, valid.iloc[1:]):
        write_table(copy / "valid.csv", rows)
        predict(
            trained, photos / "top.jpeg", tmp_path / "out3", "threshold=auto", f"data_root={copy}"
        )
    entries = json.loads((trained.parent / CACHE_FILE).read_text())["entries"]
    swept = [e["choice"]["samples"] for e in entries if e["key"]["data_root"] == str(copy)]
    assert swept == [len(valid), len(valid) - 1]


@pytest.mark.slow
def test_threshold_auto_plateau_keeps_the_runs_threshold(trained, photos, tmp_path):
    """Every threshold scores the same for a constant net: the tie goes to the run's 0.5."""
    ckpt = constant_checkpoint(trained, logit=10.0, name="constant_auto.ckpt")
    summary = predict(ckpt, photos / "top.jpeg", tmp_path / "out", "threshold=auto")
    assert summary.threshold == 0.5
    keys = [
        e["key"]["checkpoint"]
        for e in json.loads((ckpt.parent / CACHE_FILE).read_text())["entries"]
    ]
    assert "constant_auto.ckpt" in keys


@pytest.mark.slow
def test_threshold_auto_neither_reads_nor_replaces_a_users_own_threshold_json(
    trained, photos, tmp_path
):
    """A `threshold.json` of the user's beside the checkpoint once crashed the run (KeyError),
    and one that happened to parse would have been replaced."""
    ckpt = tmp_path / "mine" / "last.ckpt"
    ckpt.parent.mkdir()
    shutil.copy2(trained, ckpt)
    for text in ('{"threshold": 0.3, "note": "mine"}', '{"entries": "mine"}', "not json"):
        (ckpt.parent / CACHE_FILE).write_text(text)
        summary = predict(ckpt, photos / "top.jpeg", tmp_path / "out", "threshold=auto")
        assert summary.threshold_source == "auto" and 0 < summary.threshold < 1
        assert (ckpt.parent / CACHE_FILE).read_text() == text


def test_bad_threshold_value(trained, photos, tmp_path):
    with pytest.raises(PredictError, match="threshold=often"):
        predict(trained, photos / "top.jpeg", tmp_path / "out", "threshold=often")
    with pytest.raises(ThresholdError, match=r"valid.csv not found.*data_root="):
        predict(
            trained,
            photos / "top.jpeg",
            tmp_path / "out",
            "threshold=auto",
            f"data_root={tmp_path}",
        )


@pytest.mark.slow
def test_wrong_architecture_is_named_not_a_key_dump(trained, photos, tmp_path):
    with pytest.raises(ArchitectureMismatch) as err:
        predict(trained, photos / "top.jpeg", tmp_path / "out", "model=segformer")
    message = str(err.value)
    assert "different architecture" in message and "Segformer/mit_b0" in message
    assert "missing keys" in message and "unexpected keys" in message and "model=" in message
    assert len(message) < 1000


def test_not_a_checkpoint(trained, tmp_path):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    model = resolve_spec(compose_cli("predict", [f"ckpt={trained}", "input=x", "output=y"])).model
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        load_net(junk, model)


def test_a_checkpoint_copied_alone_into_an_empty_folder_predicts(trained, photos, tmp_path):
    alone = tmp_path / "alone" / "model.ckpt"
    alone.parent.mkdir()
    shutil.copy(trained, alone)  # no run folder, no .hydra: the checkpoint describes itself
    summary = predict(alone, photos / "a", tmp_path / "out", "threshold=auto")
    assert summary.images == 3 and summary.threshold_source == "auto"
    with Image.open(tmp_path / "out" / "masks" / "rgb.png") as mask:
        assert mask.size == (53, 37)
    assert (alone.parent / CACHE_FILE).is_file()  # the threshold's cache sits beside it


def _without_card(ckpt: Path, out: Path) -> Path:
    """`ckpt` as checkpoints were written before they carried a card."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    del checkpoint[CARD_KEY]
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out)
    return out


def _old_run(tmp_path: Path, trained: Path, model: dict, module: dict | None = None) -> Path:
    """A run folder as earlier versions wrote it (normalisation under `aug`), holding `model`."""
    run_dir = tmp_path / "old_run"
    config = {
        "model": model,
        "dataset": {"image_size": [32, 32], "root": "data/nowhere"},
        "aug": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
        "module": {"threshold": 0.4} if module is None else module,
    }
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    return _without_card(trained, run_dir / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_a_checkpoint_older_than_cards_is_read_from_its_run_folder(trained, photos, tmp_path):
    model = {"_target_": "nailseg.model.net.build_net", "arch": "Unet", "encoder_name": "resnet18"}
    model["options"] = {"encoder_depth": 3, "decoder_channels": [16, 8, 4]}
    summary = predict(_old_run(tmp_path, trained, model), photos / "top.jpeg", tmp_path / "out")
    assert summary.images == 1 and summary.threshold == 0.4
    shutil.rmtree(tmp_path / "old_run")
    older = _old_run(tmp_path, trained, model, module={"threshold": None})  # no threshold kept
    summary = predict(older, photos / "top.jpeg", tmp_path / "out")
    assert summary.images == 1 and summary.threshold == 0.5  # the default

    lone = _without_card(trained, tmp_path / "lone" / "lone.ckpt")
    with pytest.raises(CheckpointError, match=r"model=.*image_size=.*mean="):
        predict(lone, photos / "top.jpeg", tmp_path / "out2")
    norm = ["mean=[0.485,0.456,0.406]", "std=[0.229,0.224,0.225]", "image_size=[32,32]"]
    summary = predict(lone, photos / "top.jpeg", tmp_path / "out2", *TINY_UNET, *norm)
    assert summary.images == 1 and summary.threshold == 0.5


HOSTILE = {"_target_": "pathlib.Path.touch", "self": "PWNED"}


@pytest.mark.parametrize(
    ("where", "model"),
    [
        ("run folder", HOSTILE),
        ("run folder", {"arch": "Unet", "encoder_name": "resnet18", "options": {"x": HOSTILE}}),
        ("card", {"arch": "Unet", "encoder_name": "resnet18", "options": {"x": HOSTILE}}),
        ("card", {"arch": "builtins.exec", "encoder_name": "resnet18", "options": {}}),
    ],
)
def test_a_hostile_config_off_disk_is_refused_and_never_run(
    where, model, trained, photos, tmp_path
):
    sentinel = tmp_path / "pwned"
    model = json.loads(json.dumps(model).replace("PWNED", str(sentinel)))
    if where == "run folder":
        ckpt = _old_run(tmp_path, trained, model)
    else:
        checkpoint = torch.load(trained, map_location="cpu", weights_only=True)
        checkpoint[CARD_KEY]["model"] = model
        ckpt = tmp_path / "hostile.ckpt"
        torch.save(checkpoint, ckpt)
    for app, extra in (
        ("predict", [f"input={photos / 'top.jpeg'}", f"output={tmp_path}/o"]),
        ("export", []),
    ):
        with pytest.raises(CheckpointError, match=r"refused|not one of smp's architectures"):
            resolve_spec(compose_cli(app, [f"ckpt={ckpt}", *extra]))
    assert not sentinel.exists()


@pytest.mark.real_data
def test_real_photos_of_both_groups_scored(trained, real_data, tmp_path):
    photos, masks = tmp_path / "photos", tmp_path / "masks"
    for group in ("1", "2"):
        for image in sorted((real_data / "Images" / group).iterdir())[:3]:
            (photos / group).mkdir(parents=True, exist_ok=True)
            shutil.copy(image, photos / group / image.name)
            (mask,) = (real_data / "Masks" / group).glob(f"{image.stem}.*")
            (masks / group).mkdir(parents=True, exist_ok=True)
            shutil.copy(mask, masks / group / mask.name)
    out = tmp_path / "out"
    summary = predict(trained, photos, out, f"masks={masks}")
    rows = pd.read_csv(out / "scores.csv", dtype={"group": str})
    assert len(rows) == 6 and sorted(rows["group"].unique()) == ["1", "2"]
    for row in rows.itertuples():
        with Image.open(row.image) as photo:
            assert (row.width, row.height) == photo.size
        with Image.open(
            out / "masks" / Path(row.image).relative_to(photos).with_suffix(".png")
        ) as m:
            assert m.size == photo.size
    assert rows[["dice", "iou"]].apply(lambda c: c.between(0, 1)).all().all()
    assert set(summary.scores["groups"]) == {"1", "2"}
    assert summary.scores["overall"]["images"] == 6


@pytest.mark.parametrize(
    ("cores", "device", "overrides", "workers"),
    [(16, "cpu", [], 16), (16, "cuda", [], 16), (16, "cuda", ["overlays=false"], 8),
     (32, "cuda", ["overlays=false"], 8), (6, "cuda", ["overlays=false"], 3),
     (1, "cuda", ["overlays=false"], 1), (16, "cuda", ["overlays=false", "num_workers=3"], 3)],
)  # fmt: skip
def test_default_workers_leave_the_gpu_driving_thread_room(
    monkeypatch, cores, device, overrides, workers
):
    """From predict's real config (overlays on, num_workers null by default)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    cfg = compose_cli("predict", ["ckpt=x", "input=y", "output=z", *overrides])
    assert worker_count(cfg.num_workers, cfg.overlays, device) == workers


def test_cuda_graphs_are_the_default_and_apply_on_a_gpu_only(trained):
    """From predict's real config: on the CPU the net runs eagerly, channels-last, with the
    probabilities of the net as loaded (tests/test_gpu.py checks the graphs against the eager
    net on a GPU)."""
    cfg = compose_cli("predict", [f"ckpt={trained}", "input=y", "output=z"])
    assert cfg.cuda_graphs is True
    spec = resolve_spec(cfg)
    loaded, net = load_net(spec.ckpt, spec.model), load_net(spec.ckpt, spec.model)
    assert build_engine(cfg.engine, net, spec, torch.device("cpu"), cfg.cuda_graphs) is net
    kernels = [p for p in net.parameters() if p.dim() == 4]
    assert kernels and all(p.is_contiguous(memory_format=torch.channels_last) for p in kernels)
    rng = np.random.default_rng(0)
    images = image_tensors(
        [rng.integers(0, 256, (*s, 3), np.uint8) for s in [(40, 30), (25, 50)]], torch.device("cpu")
    )
    for got, want in zip(
        full_size_probabilities(net, images, spec),
        full_size_probabilities(loaded, images, spec),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("device", "during"), [("cuda", 0.0005), ("cpu", None)])
def test_the_gil_switch_interval_is_shortened_on_a_gpu_only_while_predicting(device, during):
    before = sys.getswitchinterval()
    with fast_gil_handoff(torch.device(device)):
        assert sys.getswitchinterval() == pytest.approx(during or before)
    assert sys.getswitchinterval() == before
    with pytest.raises(KeyError), fast_gil_handoff(torch.device(device)):
        raise KeyError("a failed prediction")
    assert sys.getswitchinterval() == before


def test_tensors_of_any_shapes_come_back_whole_in_one_copy():
    rng = np.random.default_rng(0)
    images = [torch.from_numpy(rng.integers(0, 256, s, np.uint8)) for s in [(3, 5, 4), (3, 2, 7)]]
    expected = [image.numpy().copy() for image in images]
    copy = to_host(images)
    for image in images:  # work queued after the copy does not reach it
        image.add_(1)
    for got, image in zip(copy(), expected, strict=True):
        np.testing.assert_array_equal(got, image)
        np.testing.assert_array_equal(got.transpose(1, 2, 0), image.transpose(1, 2, 0))
    maps = [torch.rand(4, 6), torch.rand(3, 3)]
    for got, prob in zip(to_host(maps, lambda flat: flat > 0.5)(), maps, strict=True):
        assert got.dtype == bool and got.shape == prob.shape
        np.testing.assert_array_equal(got, (prob > 0.5).numpy())


def test_masks_that_pair_with_no_photo_are_refused_before_any_write(trained, tmp_path):
    """input=[a file] with masks=<Masks/ of groups>: every photo was 'not scored', no scores.csv,
    and predict exited 0 as if it had scored them."""
    save_image(tmp_path / "photos" / "x.png", np.zeros((10, 10, 3), np.uint8))
    save_image(tmp_path / "masks" / "g1" / "x.png", np.zeros((10, 10), np.uint8))
    out = tmp_path / "out"
    with pytest.raises(
        PredictError, match=r"no true mask for any of the 1 photos \(first: no mask x"
    ):
        predict(trained, f"[{tmp_path / 'photos' / 'x.png'}]", out, f"masks={tmp_path / 'masks'}")
    assert not out.exists()

"""`python -m nailseg bench-predict` end to end on the CPU (tiny model, a few photos), and the
photo set it makes: reused when its marker matches, a folder it did not make refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from support.cli import run_command
from support.image_files import save_image
from support.inference import compose_cli, make_run
from support.prepared import write_prepared

from nailseg.io.atomic import write_atomic
from nailseg.io.folder import MARKER as RUN_MARKER
from nailseg.tools import bench_predict
from nailseg.tools.bench_predict import MARKER, make_photos

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(30, 40), (50, 20), (24, 24)]):
        save_image(
            tmp_path / "src" / f"g{i % 2}" / f"p{i}.png", rng.integers(0, 256, (h, w, 3), np.uint8)
        )
    return tmp_path / "src"


def test_the_photo_set_mixes_sizes_and_formats_and_is_reused(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    photos = make_photos(sources, folder, [1.0, 2.0], 90)
    assert sorted(photos) == sorted(p for p in folder.iterdir() if p.name != MARKER)
    assert [p.name for p in photos[:3]] == ["00000.png", "00000_x1.jpg", "00000_x2.jpg"]
    assert len(photos) == 9
    # sources in sorted order: g0/p0 (30x40), g0/p2 (24x24), g1/p1 (50x20)
    assert np.asarray(Image.open(folder / "00002_x2.jpg")).shape == (100, 40, 3)
    stamp = (folder / "00000.png").stat().st_mtime_ns
    assert make_photos(sources, folder, [1.0, 2.0], 90) == photos  # same settings: reused
    assert (folder / "00000.png").stat().st_mtime_ns == stamp


OLDER = json.dumps({"created_by": bench_predict.CREATOR, "files": ["mine.png"], "finished": True})


@pytest.mark.parametrize(
    "marker",
    ["no marker", '{"photos": 3}', "not json", OLDER],
    ids=["none", "someone's", "broken", "unstamped (older nailseg)"],
)
def test_a_folder_it_did_not_make_is_refused(sources: Path, tmp_path: Path, marker: str) -> None:
    folder = tmp_path / "photos"
    save_image(folder / "mine.png", np.zeros((4, 4, 3), np.uint8))
    if marker != "no marker":
        (folder / MARKER).write_text(marker)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(FileExistsError, match="not this benchmark's photo set"):
        make_photos(sources, folder, [1.0], 90)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_in_its_own_set_it_replaces_only_the_files_it_listed(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    make_photos(sources, folder, [1.0, 2.0], 90)
    mine = save_image(folder / "mine.png", np.full((4, 4, 3), 7, np.uint8))
    photos = make_photos(sources, folder, [3.0], 90)  # other settings: the set is made again
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [MARKER, "mine.png", *(p.name for p in photos)]
    )
    assert mine not in photos and (np.asarray(Image.open(mine)) == 7).all()
    assert len(photos) == 6 and not (folder / "00000_x1.jpg").exists()


def test_a_user_file_in_the_way_of_a_new_set_is_refused_and_kept(
    sources: Path, tmp_path: Path
) -> None:
    """A file named as the new settings' set would name one, put there by someone else (not in
    the manifest): nothing is removed or written, the earlier set included."""
    folder = tmp_path / "photos"
    earlier = make_photos(sources, folder, [1.0], 90)
    theirs = save_image(folder / "00001_x3.jpg", np.full((4, 4, 3), 7, np.uint8))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(FileExistsError, match=r"00001_x3.jpg is in the way"):
        make_photos(sources, folder, [3.0], 90)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert all(p.is_file() for p in earlier) and theirs.is_file()


@pytest.mark.parametrize("scales", [[1.0], [3.0]], ids=["same settings", "new settings"])
def test_a_user_file_saved_under_a_listed_name_is_refused_and_kept(
    sources: Path, tmp_path: Path, scales: list[float]
) -> None:
    """The manifest lists `00001_x1.jpg`; someone saves their own photo under that name: the set
    is neither reused with it nor made again over it (nothing removed or written)."""
    folder = tmp_path / "photos"
    make_photos(sources, folder, [1.0], 90)
    theirs = save_image(folder / "00001_x1.jpg", np.full((4, 4, 3), 7, np.uint8))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(FileExistsError, match=r"00001_x1.jpg is listed in .* no longer the file"):
        make_photos(sources, folder, scales, 90)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert (np.asarray(Image.open(theirs)) == 7).all()


def test_a_missing_file_of_a_finished_set_is_made_again(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    photos = make_photos(sources, folder, [1.0], 90)
    photos[1].unlink()
    assert make_photos(sources, folder, [1.0], 90) == photos and photos[1].is_file()


@pytest.mark.parametrize("listed", ["../outside.png", "/abs/outside.png", "sub/x.png", MARKER])
def test_a_manifest_listing_files_outside_the_set_is_not_followed(
    sources: Path, tmp_path: Path, listed: str
) -> None:
    folder = tmp_path / "photos"
    make_photos(sources, folder, [1.0], 90)
    outside = save_image(tmp_path / "outside.png", np.zeros((4, 4, 3), np.uint8))
    manifest = json.loads((folder / MARKER).read_text())
    (folder / MARKER).write_text(json.dumps(manifest | {"files": [listed], "finished": False}))
    with pytest.raises(FileExistsError, match="not this benchmark's photo set"):
        make_photos(sources, folder, [1.0], 90)
    assert outside.is_file() and (folder / MARKER).is_file()


def test_an_interrupted_set_is_made_again(sources: Path, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "photos"
    calls = []

    def dies_on_the_third(path, write, mtime_ns=None):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write_atomic(path, write, mtime_ns)

    monkeypatch.setattr(bench_predict, "write_atomic", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        make_photos(sources, folder, [1.0], 90)
    monkeypatch.undo()
    photos = make_photos(sources, folder, [1.0], 90)  # its manifest says unfinished: made again
    assert len(photos) == 6 and all(p.is_file() for p in photos)


@pytest.mark.parametrize("inside", ["output in the photos", "photos in the output"])
def test_an_output_overlapping_the_photos_is_refused_before_anything_is_written(
    sources: Path, tmp_path: Path, inside: str
) -> None:
    """From bench_predict's real config, as `python -m nailseg bench-predict` composes it."""
    out = sources / "bench" if inside == "output in the photos" else sources.parent
    before = sorted(tmp_path.rglob("*"))
    cfg = compose_cli("bench_predict", ["ckpt=x.ckpt", f"input_dir={sources}", f"output_dir={out}"])
    with pytest.raises(ValueError, match=r"overlap .* nothing was written"):
        bench_predict.run(cfg)
    assert sorted(tmp_path.rglob("*")) == before


def test_every_run_of_the_real_config_composes_into_predicts_config() -> None:
    """Each run's overrides (`gpu_eager`'s `cuda_graphs=false` among them) are keys predict's
    schema has, with the values given: on a machine without a GPU the cuda runs are skipped, so
    a misspelt key would otherwise first fail on the GPU machine."""
    runs = compose_cli("bench_predict", ["ckpt=x.ckpt"]).runs
    assert "gpu_eager" in runs and runs.gpu_eager.cuda_graphs is False
    for run in runs.values():
        overrides = [f"{key}={value}" for key, value in run.items()]
        composed = compose_cli("predict", ["ckpt=x.ckpt", "input=y", "output=z", *overrides])
        assert {key: composed[key] for key in run} == dict(run)


@pytest.mark.slow
def test_bench_predict_runs_and_reports(sources: Path, tmp_path: Path, capfd) -> None:
    ckpt = make_run(write_prepared(tmp_path / "prepared"), tmp_path / "run")
    out = tmp_path / "bench"
    args = [f"ckpt={ckpt}", f"input_dir={sources}", f"output_dir={out}", "jpeg_scales=[2]",
            "runs.cpu.overlays=false", "+runs.cpu_overlays={device: cpu}", "limit.cpu=6",
            "+limit.cpu_overlays=2", "limit.cpu_onnx=3", "batch_size=2", "onnx_batch=2", "repeats=1"]  # fmt: skip
    proc = run_command(["-m", "nailseg", "bench-predict", *args], capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # piped (as into a log), the table keeps its columns whole: rich cut them to 80 characters
    assert "photos_per_s" in proc.stdout and "cpu_onnx" in proc.stdout
    if not torch.cuda.is_available():
        assert "run gpu: skipped, no CUDA device here" in proc.stdout
    rows = pd.read_csv(out / "bench_predict.csv")
    rows = rows[rows["device"] == "cpu"]
    assert rows["run"].tolist() == ["cpu", "cpu_onnx", "cpu_overlays"]
    assert rows["photos"].tolist() == [6, 3, 2] and rows["engine"].tolist()[1] == "onnx"
    # what ran: a CPU run neither decodes on a GPU nor replays a CUDA graph, whatever the defaults ask
    assert not rows["gpu_decode"].any() and not rows["cuda_graphs"].any()
    assert (rows["photos_per_s"] > 0).all() and (rows["device_queue"] > 0).all()
    report = json.loads((out / "bench_predict.json").read_text())
    assert report["photo_set"]["photos"] == 6 and report["photo_set"]["jpeg"] == 3
    assert report["onnx_cpu"]["onnx_logits_difference"] < 1e-3
    assert report["onnx_cpu"]["onnxruntime_img_s"] > 0 and report["onnx_cpu"]["torch_img_s"] > 0
    assert len(list((out / "photos").glob("*.*g"))) == 6  # the set, whole after its links went
    assert report["config"]["input_dir"] == str(sources)
    written = sorted(p.name for p in out.iterdir())  # every run's folder removed, no model file
    assert written == [
        RUN_MARKER, "bench_predict.csv", "bench_predict.json", "bench_predict.png", "photos"
    ]  # fmt: skip

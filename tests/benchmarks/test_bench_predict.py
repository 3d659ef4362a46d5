"""`make bench-predict` (`python -m benchmarks.predict`) end to end on the CPU (tiny model, a few
photos), and the photo set it makes: a folder of its own, reused when its marker matches."""

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
from support.inference import compose_cli, own_run

from benchmarks import predict
from benchmarks.predict import make_photos
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import JOURNAL, MARKER, ForeignFolderError, OwnedFolder

ROOT = Path(__file__).resolve().parents[2]
OWN = {MARKER, JOURNAL}


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(30, 40), (50, 20), (24, 24)]):
        save_image(
            tmp_path / "src" / f"g{i % 2}" / f"p{i}.png", rng.integers(0, 256, (h, w, 3), np.uint8)
        )
    return tmp_path / "src"


def _release(folder: Path) -> None:
    """The set's folder as a later run finds it: its lock dropped (this process holds it)."""
    OwnedFolder.claim(folder, predict.PHOTOS).release()


def test_the_photo_set_mixes_sizes_and_formats_and_is_reused(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    photos = make_photos(sources, folder, [1.0, 2.0], 90)
    assert sorted(photos) == sorted(p for p in folder.iterdir() if p.name not in OWN)
    assert [p.name for p in photos[:3]] == ["00000.png", "00000_x1.jpg", "00000_x2.jpg"]
    assert len(photos) == 9
    # sources in sorted order: g0/p0 (30x40), g0/p2 (24x24), g1/p1 (50x20)
    assert np.asarray(Image.open(folder / "00002_x2.jpg")).shape == (100, 40, 3)
    stamp = (folder / "00000.png").stat().st_mtime_ns
    _release(folder)
    assert make_photos(sources, folder, [1.0, 2.0], 90) == photos  # same settings: reused
    assert (folder / "00000.png").stat().st_mtime_ns == stamp


def test_a_folder_it_did_not_make_is_refused(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    save_image(folder / "mine.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ForeignFolderError, match="is not a folder nailseg made"):
        make_photos(sources, folder, [1.0], 90)
    assert [p.name for p in folder.iterdir()] == ["mine.png"]


def test_in_its_own_set_it_replaces_only_the_files_it_wrote(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    make_photos(sources, folder, [1.0, 2.0], 90)
    mine = save_image(folder / "mine.png", np.full((4, 4, 3), 7, np.uint8))
    _release(folder)
    photos = make_photos(sources, folder, [3.0], 90)  # other settings: the set is made again
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*OWN, "mine.png", *(p.name for p in photos)]
    )
    assert mine not in photos and (np.asarray(Image.open(mine)) == 7).all()
    assert len(photos) == 6 and not (folder / "00000_x1.jpg").exists()


@pytest.mark.parametrize(
    ("scales", "name"),
    [([3.0], "00001_x3.jpg"), ([1.0], "00001_x1.jpg")],
    ids=["in the way of a new set", "saved over a file of the set"],
)
def test_a_user_file_where_the_set_goes_is_refused_and_kept(
    sources: Path, tmp_path: Path, scales: list[float], name: str
) -> None:
    """Nothing is removed or written, the earlier set included; a set with the user's file in
    it is not reused either."""
    folder = tmp_path / "photos"
    earlier = make_photos(sources, folder, [1.0], 90)
    theirs = save_image(folder / name, np.full((4, 4, 3), 7, np.uint8))
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in OWN}
    _release(folder)
    with pytest.raises(NotOursError, match=rf"{name} lies where nailseg would write"):
        make_photos(sources, folder, scales, 90)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in OWN} == before
    assert all(p.is_file() for p in earlier) and (np.asarray(Image.open(theirs)) == 7).all()


def test_a_missing_file_of_a_finished_set_is_made_again(sources: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    photos = make_photos(sources, folder, [1.0], 90)
    photos[1].unlink()
    _release(folder)
    assert make_photos(sources, folder, [1.0], 90) == photos and photos[1].is_file()


def test_an_interrupted_set_is_made_again(sources: Path, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "photos"
    calls = []
    write = OwnedFolder.write

    def dies_on_the_third(self, rel, data, **kwargs):
        calls.append(rel)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write(self, rel, data, **kwargs)

    monkeypatch.setattr(OwnedFolder, "write", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        make_photos(sources, folder, [1.0], 90)
    monkeypatch.undo()
    _release(folder)
    photos = make_photos(sources, folder, [1.0], 90)  # its marker has no settings: made again
    assert len(photos) == 6 and all(p.is_file() for p in photos)


@pytest.mark.parametrize("inside", ["output in the photos", "photos in the output"])
def test_an_output_overlapping_the_photos_is_refused_before_anything_is_written(
    sources: Path, tmp_path: Path, inside: str
) -> None:
    """From bench_predict's real config, as `python -m benchmarks.predict` composes it."""
    out = sources / "bench" if inside == "output in the photos" else sources.parent
    before = sorted(tmp_path.rglob("*"))
    cfg = compose_cli("bench_predict", ["ckpt=x.ckpt", f"input_dir={sources}", f"output_dir={out}"])
    with pytest.raises(SystemExit, match=r"overlap .* nothing was written"):
        predict.run(cfg)
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
def test_bench_predict_runs_and_reports(
    trained_run: Path, sources: Path, tmp_path: Path, capfd
) -> None:
    ckpt = own_run(trained_run, tmp_path / "run")
    out = tmp_path / "bench"
    args = [f"ckpt={ckpt}", f"input_dir={sources}", f"output_dir={out}", "jpeg_scales=[2]",
            "runs.cpu.overlays=false", "+runs.cpu_overlays={device: cpu}", "limit.cpu=6",
            "+limit.cpu_overlays=2", "limit.cpu_onnx=3", "batch_size=2", "onnx_batch=2", "repeats=1"]  # fmt: skip
    proc = run_command(["-m", "benchmarks.predict", *args], capfd)
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
    assert len(list((out / "photos").glob("0*.*g"))) == 6  # the set, whole after its links went
    assert report["config"]["input_dir"] == str(sources)
    written = sorted(p.name for p in out.iterdir())  # every run's folder removed, no model file
    assert written == sorted(
        [*OWN, "bench_predict.csv", "bench_predict.json", "bench_predict.png", "photos"]
    )

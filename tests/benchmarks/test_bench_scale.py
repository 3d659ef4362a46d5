"""`make bench-scale` (`python -m benchmarks.scale`): generate, prepare, a loader epoch and a train.py epoch per count,
each stage in a process of its own, its scratch data removed, a count the disk cannot hold refused
in one line."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from support.cli import run_command
from support.train import TINY_UNET

from benchmarks.scale import OUTPUTS, STAGES, ratios
from nailseg.io.folder import JOURNAL, MARKER, OwnedFolder

# a count no disk holds: refused from the bytes per photo of the count before it
HUGE = 10**12
TRAIN = ["loader=torch", "loader.num_workers=0", "trainer=cpu", *TINY_UNET]  # train.py's, quick


@pytest.mark.slow
def test_each_count_is_measured_its_data_removed_and_a_count_too_big_refused(tmp_path, capfd):
    out = tmp_path / "scale"
    argv = [
        "-m", "benchmarks.scale", f"output_dir={out}", f"counts=[16,{HUGE}]",
        "image_size=[32,32]", "num_workers=1", "loader=torch", "loader.num_workers=0",
        "loader.batch_size=4",
        "train=[{}]".format(",".join(f"'{o}'" for o in TRAIN)),
    ]  # fmt: skip
    proc = run_command(argv, capfd)
    # the refusal: one line naming the count and the free space, after the counts before it
    assert proc.returncode == 1
    refusal = proc.stderr.strip().splitlines()[-1]
    assert refusal.startswith(f"benchmarks.scale: {HUGE} photos would take about ")
    assert f"{out} has " in refusal and " GiB free: not measured" in refusal
    for stage in STAGES:  # a line of progress before and after each stage
        assert f"16 photos: {stage} ..." in proc.stdout
        assert re.search(rf"^16 photos: {stage} [\d.]+ s, .* MiB", proc.stdout, re.M)

    rows = pd.read_csv(out / "bench_scale.csv")
    assert rows["count"].tolist() == [16]
    rates = ["generate_photos_s", "prepare_photos_s", "loader_img_s", "train_img_s"]
    peaks = [f"{stage}_peak_mib" for stage in STAGES]
    assert (rows[[*rates, *peaks, "bytes_per_photo"]] > 0).all().all()
    assert (rows[[f"{stage}_s" for stage in STAGES]] > 0).all().all()
    assert rows["loader_images"].gt(0).all() and rows["loader_images"].lt(rows["count"]).all()
    # train.py's epoch saw the train split the loader's epoch saw, at the bench's batch size
    assert rows["train_images"].tolist() == rows["loader_images"].tolist()
    assert rows["train_data_wait_frac"].between(0, 1).all()
    assert (rows["loader"] == "TorchLoader").all()
    assert (out / "bench_scale.png").stat().st_size > 0
    assert json.loads((out / "bench_scale.json").read_text())["config"]["counts"] == [16, HUGE]
    # the scratch data is gone: only the outputs, the marker and the journal stay
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUTS, MARKER, JOURNAL])


def test_a_users_output_dir_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    proc = run_command(["-m", "benchmarks.scale", f"output_dir={mine}"], capsys)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"benchmarks.scale: output_dir={mine} is not a folder nailseg made"
    )
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_file_in_a_kept_data_folder_is_left_and_the_run_refused_in_one_line(tmp_path, capsys):
    """keep_data=true writes into `data-<count>` of the bench's own folder; a folder there already
    (an earlier run's, or with a user's file in it) is refused before any stage runs."""
    out = tmp_path / "scale"
    OwnedFolder.claim(out, "bench").release()
    mine = out / "data-16" / "raw" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's")
    argv = ["-m", "benchmarks.scale", f"output_dir={out}", "counts=[16]", "keep_data=true"]
    proc = run_command(argv, capsys)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"benchmarks.scale: {out / 'data-16'} holds data kept by an earlier run, which would "
        "be reused, not measured: remove it or choose another output_dir"
    )
    assert mine.read_text() == "the user's"
    assert sorted(p.name for p in (out / "data-16").rglob("*")) == ["notes.txt", "raw"]


def test_each_count_is_set_against_the_one_before_per_photo_and_in_peak_memory():
    """1.0 is linear cost and flat memory: twice the photos in twice the time, the same peak."""
    rates = {"generate_photos_s": 10.0, "prepare_photos_s": 20.0, "loader_img_s": 400.0}
    peaks = {f"{stage}_peak_mib": 100.0 for stage in STAGES}
    frame = pd.DataFrame(
        [
            {"count": 1000, **rates, "train_img_s": 300.0, **peaks},
            {"count": 10000, **rates, "train_img_s": 150.0, **peaks, "train_peak_mib": 300.0},
        ]
    )
    row = ratios(frame).iloc[0]
    assert row["counts"] == "10000 / 1000"
    assert row[["generate s/photo", "prepare s/photo", "loader s/photo"]].tolist() == [1, 1, 1]
    assert row["train s/photo"] == 2.0 and row["train peak"] == 3.0
    assert row[["generate peak", "prepare peak", "loader peak"]].tolist() == [1, 1, 1]

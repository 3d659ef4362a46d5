"""`python -m nailseg bench-scale`: generate, prepare and a loader epoch per count, each stage in a
process of its own, its scratch data removed, a count the disk cannot hold refused in one line."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from support.cli import run_command

from nailseg.io.run_folder import RUN_MARKER
from nailseg.tools.bench_scale import OUTPUTS, STAGES
from nailseg.tools.output import claim_output

# a count no disk holds: refused from the bytes per photo of the count before it
HUGE = 10**12


@pytest.mark.slow
def test_each_count_is_measured_its_data_removed_and_a_count_too_big_refused(tmp_path, capfd):
    out = tmp_path / "scale"
    argv = [
        "-m", "nailseg", "bench-scale", f"output_dir={out}", f"counts=[16,32,{HUGE}]",
        "image_size=[32,32]", "num_workers=1", "loader=torch", "loader.num_workers=0",
        "loader.batch_size=4",
    ]  # fmt: skip
    proc = run_command(argv, capfd)
    # the refusal: one line naming the count and the free space, after the counts before it
    assert proc.returncode == 1
    refusal = proc.stderr.strip().splitlines()[-1]
    assert refusal.startswith(f"nailseg bench-scale: {HUGE} photos would take about ")
    assert f"{out} has " in refusal and " GiB free: not measured" in refusal
    for count in (16, 32):  # a line of progress before and after each stage
        for stage in STAGES:
            assert f"{count} photos: {stage} ..." in proc.stdout
            assert re.search(rf"^{count} photos: {stage} [\d.]+ s, .* MiB", proc.stdout, re.M)
    assert "each count ÷ the one before" in proc.stdout

    rows = pd.read_csv(out / "bench_scale.csv")
    assert rows["count"].tolist() == [16, 32]
    rates = ["generate_photos_s", "prepare_photos_s", "loader_img_s"]
    peaks = [f"{stage}_peak_mib" for stage in STAGES]
    assert (rows[[*rates, *peaks, "bytes_per_photo"]] > 0).all().all()
    assert (rows[[f"{stage}_s" for stage in STAGES]] > 0).all().all()
    assert rows["loader_images"].gt(0).all() and rows["loader_images"].lt(rows["count"]).all()
    assert (rows["loader"] == "TorchLoader").all()
    assert (out / "bench_scale.png").stat().st_size > 0
    assert json.loads((out / "bench_scale.json").read_text())["config"]["counts"][:2] == [16, 32]
    # the scratch data is gone: only the outputs and the marker stay
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUTS, RUN_MARKER])


def test_a_users_output_dir_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    proc = run_command(["-m", "nailseg", "bench-scale", f"output_dir={mine}"], capsys)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"nailseg bench-scale: {mine} is not empty and has no {RUN_MARKER}"
    )
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_file_in_a_kept_data_folder_is_left_and_the_run_refused_in_one_line(tmp_path, capsys):
    """keep_data=true writes into `data-<count>` of the bench's own folder; a folder there already
    (an earlier run's, or with a user's file in it) is refused before any stage runs."""
    out = tmp_path / "scale"
    claim_output(out, OUTPUTS)
    mine = out / "data-16" / "raw" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's")
    argv = ["-m", "nailseg", "bench-scale", f"output_dir={out}", "counts=[16]", "keep_data=true"]
    proc = run_command(argv, capsys)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"nailseg bench-scale: {out / 'data-16'} holds data kept by an earlier run, which would "
        "be reused, not measured: remove it or choose another output_dir"
    )
    assert mine.read_text() == "the user's"
    assert sorted(p.name for p in (out / "data-16").rglob("*")) == ["notes.txt", "raw"]

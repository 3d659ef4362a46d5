"""`python -m nailseg.compare` on a real sweep of train.py with a failing job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

from nailseg.tools.compare import summarise

ROOT = Path(__file__).resolve().parents[2]


def test_a_sweep_is_summarised_by_what_it_varied_failed_jobs_included(failing_sweep):
    rows = summarise(failing_sweep)
    assert list(rows["job"]) == ["0", "1", "2"]
    assert list(rows.columns[:2]) == ["job", "scheduler.total_steps"]  # only what varied
    assert list(rows["scheduler.total_steps"]) == ["null", "1", "null"]
    assert list(rows["status"].str[:6]) == ["ok", "failed", "ok"]
    assert "Tried to step" in rows["status"][1]
    assert rows.loc[[0, 2], "best"].notna().all() and rows.loc[[0, 2], "epochs"].tolist() == [1, 1]
    table = (failing_sweep / "compare.md").read_text()
    assert table.count("\n") == 2 + 3 and table.count("| failed: ") == 1
    assert pd.read_csv(failing_sweep / "compare.csv", keep_default_na=False).shape == rows.shape
    assert (failing_sweep / "compare.png").is_file()


def test_the_command_takes_a_bare_folder_and_has_its_own_help(failing_sweep):
    proc = subprocess.run(
        [sys.executable, "-m", "nailseg.compare", str(failing_sweep)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "scheduler.total_steps" in proc.stdout, proc.stderr[-2000:]
    help_text = subprocess.run(
        [sys.executable, "-m", "nailseg.compare", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert "sweep_dir=DIR" in help_text and "dataset" not in help_text

"""A real multirun sweep of train.py: one folder per job, a failing job recorded, the summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.train import small_overrides

from nailseg.tools.compare import summarise

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_survives_a_failing_job_and_is_summarised(prepared, tmp_path):
    sweep = tmp_path / "sweep"
    overrides = small_overrides(prepared, "debug=fast", "logger=csv")
    overrides = [o for o in overrides if not o.startswith("model")] + [
        "model.arch=Unet,NoSuchNet",
        "aug=none,light",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", *overrides], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 4 and len({p.name for p in jobs}) == 4  # one folder per job
    rows = summarise(sweep)
    assert (sweep / "compare.csv").is_file()
    ok, failed = rows[rows["status"] == "ok"], rows[rows["status"] != "ok"]
    assert len(ok) == 2 and len(failed) == 2
    assert failed["status"].str.contains("NoSuchNet").all()
    assert sorted(ok["aug"]) == ["light", "none"] and "loader" not in rows  # only what varied
    assert (sweep / "compare.png").is_file()
    table = (sweep / "compare.md").read_text()
    assert table.count("\n") == 2 + 4 and table.count("| failed: ") == 2

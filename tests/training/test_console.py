"""What `python train.py` prints: the config without nulls (also kept in the run folder), no
library chatter, and a summary at the end naming the run folder, the best value and checkpoint,
and how to reach the logger's record."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.ddp import ROOT, TIMEOUT_S
from support.train import TINY_UNET, train

from nailseg.training.console import CONFIG_TREE

# what libraries printed on every run before: Lightning's tips and FLOPs, torch's LeafSpec
# deprecation raised from Lightning, W&B's banner and history (its lines start "wandb:")
CHATTER = re.compile(r"Tip:|FLOPs|is deprecated|Trainer already configured|to estimate|^wandb:")


@pytest.mark.slow
def test_a_default_run_prints_its_config_without_nulls_no_chatter_and_ends_with_a_summary(
    prepared, tmp_path, monkeypatch
):
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # as a user's shell has it: unset
    run_dir = tmp_path / "run"
    tiny = ["dataset.image_size=[32,32]", "loader.batch_size=4", *TINY_UNET, "trainer.max_epochs=1"]
    args = [f"dataset.root={prepared}", *tiny, "trainer.limit_train_batches=2"]
    done = subprocess.run(  # the defaults, progress bar and model summary included, only tiny
        [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # as a terminal shows them: one stream
        text=True,
        timeout=TIMEOUT_S,
    )
    stdout = done.stdout
    assert done.returncode == 0, stdout[-3000:]
    printed = stdout.splitlines()
    assert "config" in printed and not [line for line in printed if re.search(r": null$", line)]
    assert not [line for line in printed if CHATTER.search(line)], stdout
    assert "│ 0 │ net " in stdout  # the parameter table is kept

    saved = (run_dir / CONFIG_TREE).read_text()
    assert "image_size: [32, 32]" in saved and "image_size: [32, 32]" in stdout
    assert "null" not in saved and "├── model (unet)" in saved

    best = json.loads((run_dir / "metrics.json").read_text())["best"]
    (sync_dir,) = (run_dir / "wandb").glob("offline-run-*")
    start = printed.index(next(line for line in printed if line.endswith("run summary")))
    assert [line.strip() for line in printed[start + 1 :]] == [
        f"run folder: {run_dir}",
        f"best val/dice: {best['value']:.4g} (epoch 0)",
        f"best checkpoint: {best['checkpoint']}",
        *[line.strip() for line in printed[start + 4 : start + 5]],  # the final evaluation's
        f"metrics: {run_dir / 'metrics.json'}",
        f"W&B (offline): wandb sync {sync_dir}",
    ]
    assert printed[start + 4].strip().startswith("final evaluation (valid): val_best/dice ")
    assert Path(best["checkpoint"]).parent == run_dir / "checkpoints" and best["epoch"] == 0


def test_the_summary_names_the_csv_log(prepared, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="nailseg.training.run"):
        train(prepared, run_dir, "logger=csv", "trainer.max_epochs=1", "test=false")
    (summary,) = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary")
    ]
    assert summary.splitlines()[-1].strip() == f"CSV log: {run_dir / 'csv' / 'metrics.csv'}"
    assert (run_dir / "csv" / "metrics.csv").is_file()

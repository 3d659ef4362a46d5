"""What `python train.py` prints: the config without nulls (also kept in the run folder), no
library chatter, and a summary at the end naming the run folder, the best value and checkpoint,
and how to reach the logger's record. Its W&B logger writes only into the run dir: not its
caches, service logs or staged tables into the home folder, and it warns nothing."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.ddp import ROOT, TIMEOUT_S
from support.prepared import write_prepared
from support.train import TINY_UNET, train
from wandb import env as wandb_env

from nailseg.training.loggers import WANDB_DIRS
from nailseg.training.run import CONFIG_TREE

# what libraries printed on every run before: Lightning's tips and FLOPs, torch's LeafSpec
# deprecation raised from Lightning, W&B's banner and history (its lines start "wandb:")
CHATTER = re.compile(r"Tip:|FLOPs|is deprecated|Trainer already configured|to estimate|^wandb:")


@dataclass(frozen=True)
class DefaultRun:
    run_dir: Path
    home: Path  # the run's home folder, empty before it
    stdout: str  # stdout and stderr, as a terminal shows them: one stream


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> DefaultRun:
    """`python train.py` with the defaults (W&B, progress bar, model summary, final evaluation,
    whose per-group table is staged as a W&B artifact), only tiny, in a process of its own
    started as from a user's shell: WANDB_SILENT unset, W&B's and the XDG folders at the home
    folder's defaults, train.py's own W&B service (not one this test process may have started,
    which would write the logs of its own)."""
    tmp = tmp_path_factory.mktemp("default_run")
    prepared, home, run_dir = write_prepared(tmp / "prepared"), tmp / "home", tmp / "run"
    home.mkdir()
    tiny = ["dataset.image_size=[32,32]", "loader.batch_size=4", *TINY_UNET, "trainer.max_epochs=1"]
    args = [f"dataset.root={prepared}", *tiny, "trainer.limit_train_batches=2"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOME", str(home))
        for var in ("WANDB_SILENT", *WANDB_DIRS, "XDG_CACHE_HOME", "XDG_DATA_HOME",
                    "XDG_CONFIG_HOME", wandb_env.SERVICE):  # fmt: skip
            env.delenv(var, raising=False)
        # matplotlib (imported by torchmetrics when train.py starts) keeps its font cache in the
        # home folder too: not the logger's doing, so it is pointed elsewhere here
        env.setenv("MPLCONFIGDIR", str(tmp / "matplotlib"))
        done = subprocess.run(
            [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
    assert done.returncode == 0, done.stdout[-3000:]
    return DefaultRun(run_dir, home, done.stdout)


@pytest.mark.slow
def test_a_default_run_prints_its_config_without_nulls_no_chatter_and_ends_with_a_summary(
    default_run,
):
    run_dir, stdout = default_run.run_dir, default_run.stdout
    printed = stdout.splitlines()
    assert "config" in printed and not [line for line in printed if re.search(r": null$", line)]
    assert not [line for line in printed if CHATTER.search(line)], stdout
    assert any(
        line.endswith("parameters: 11.2 M trainable, 0 frozen (44.9 MB)") for line in printed
    )

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


@pytest.mark.slow
def test_a_wandb_run_writes_nothing_into_home_and_warns_nothing(default_run):
    # W&B warned on every run that "The anonymous setting has no effect": Lightning passed it
    assert "wandb: WARNING" not in default_run.stdout
    assert sorted(default_run.home.rglob("*")) == []
    assert list(default_run.run_dir.glob("wandb/cache/wandb/logs/core-debug-*.log"))


def test_the_summary_names_the_csv_log(prepared, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="nailseg.training.run"):
        train(prepared, run_dir, "logger=csv", "trainer.max_epochs=1", "test=false")
    (summary,) = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary")
    ]
    assert summary.splitlines()[-1].strip() == f"CSV log: {run_dir / 'csv' / 'metrics.csv'}"
    assert (run_dir / "csv" / "metrics.csv").is_file()

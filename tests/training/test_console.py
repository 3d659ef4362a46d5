"""What `python train.py` prints (issue #47): in a pipe a line per epoch, no config tree unless
asked for (it is kept in the run folder, without nulls), no library chatter and no table of the
final evaluation, and a summary naming the run folder, the best value and checkpoint, the curves
and the loggers' records; a sweep prints its folder, then its jobs compared. Its W&B logger writes
only into the run dir, and warns nothing."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from support.cli import run_command
from support.ddp import ROOT, TIMEOUT_S
from support.prepared import write_prepared
from support.train import TINY_UNET, train
from wandb import env as wandb_env

from nailseg.training.loggers import WANDB_DIRS
from nailseg.training.run import CONFIG_TREE

# what libraries printed on every run before: Lightning's tips, FLOPs, seed, TPU, checkpoint and
# logging-interval notes, its evaluation table and bars, torch's LeafSpec deprecation, W&B's banner
CHATTER = re.compile(
    r"Tip:|FLOPs|is deprecated|Trainer already configured|to estimate|^wandb:|Seed set|TPU avail"
    r"|Restoring states|Loaded model weights|logging interval|Test metric|DataLoader 0|━|fit` stopped"
)
EPOCH = re.compile(
    r"epoch (\d+)/1: \d+\.\d s, train/loss [\d.]+, val/loss [\d.]+, val/dice [\d.]+$"
)


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
    tiny = ["dataset.image_size=[32,32]", "loader.batch_size=4", *TINY_UNET, "trainer.max_epochs=2"]
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
def test_a_default_run_in_a_pipe_prints_a_line_per_epoch_and_a_summary_and_draws_its_curves(
    default_run,
):
    run_dir, stdout = default_run.run_dir, default_run.stdout
    printed = stdout.splitlines()
    assert not [line for line in printed if CHATTER.search(line)], stdout
    assert "config" not in printed and "├── model (unet)" not in stdout  # asked for only
    epochs = [m for line in printed if (m := EPOCH.search(line))]
    assert [m[1] for m in epochs] == ["0", "1"], stdout
    assert any(
        line.endswith("parameters: 11.2 M trainable, 0 frozen (44.9 MB)") for line in printed
    )

    saved = (run_dir / CONFIG_TREE).read_text()
    assert "image_size: [32, 32]" in saved and "null" not in saved and "├── model (unet)" in saved

    report = json.loads((run_dir / "metrics.json").read_text())
    best, history = report["best"], pd.read_csv(run_dir / report["history"])
    assert history.dropna(subset=["val/dice"])["epoch"].tolist() == [0, 1]
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    (sync_dir,) = (run_dir / "wandb").glob("offline-run-*")
    start = printed.index(next(line for line in printed if line.endswith("run summary")))
    assert [line.strip() for line in printed[start + 1 :]] == [
        f"run folder: {run_dir}",
        f"best val/dice: {best['value']:.4g} (epoch {best['epoch']})",
        f"best checkpoint: {best['checkpoint']}",
        *[line.strip() for line in printed[start + 4 : start + 5]],  # the final evaluation's
        f"metrics: {run_dir / 'metrics.json'}",
        f"curves: {run_dir / 'curves.png'}",
        f"W&B (offline): wandb sync {sync_dir}",
        f"CSV log: {run_dir / 'csv' / 'metrics.csv'}",
    ]
    assert printed[start + 4].strip().startswith("final evaluation (valid): val_best/dice ")
    assert Path(best["checkpoint"]).parent == run_dir / "checkpoints"
    assert len(printed) <= 20, stdout  # one screen


@pytest.mark.slow
def test_a_wandb_run_writes_nothing_into_home_and_warns_nothing(default_run):
    # W&B warned on every run that "The anonymous setting has no effect": Lightning passed it
    assert "wandb: WARNING" not in default_run.stdout
    assert sorted(default_run.home.rglob("*")) == []
    assert list(default_run.run_dir.glob("wandb/cache/wandb/logs/core-debug-*.log"))


@pytest.mark.slow
def test_the_summary_names_the_csv_log_which_every_logger_has_beside_it(prepared, tmp_path, caplog):
    for logger in ("csv", "none"):
        run_dir = tmp_path / logger
        with caplog.at_level(logging.INFO, logger="nailseg.training.run"):
            train(prepared, run_dir, f"logger={logger}", "trainer.max_epochs=1", "test=false")
        summary = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary")
        ]
        assert summary[-1].splitlines()[-1].strip() == f"CSV log: {run_dir / 'csv' / 'metrics.csv'}"
        assert json.loads((run_dir / "metrics.json").read_text())["history"] == "csv/metrics.csv"


def _user_run(capsys, prepared: Path, run_dir: Path, *args: str) -> list[str]:
    """`python train.py debug=fast ...` on the fixture's data, as a user types it; its stdout."""
    size = ["dataset.image_size=[32,32]", "loader.batch_size=4", *TINY_UNET]
    argv = ["train.py", *args, f"dataset.root={prepared}", *size, f"hydra.run.dir={run_dir}"]
    done = run_command(argv, capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_debug_fast_prints_its_config_tree_only_when_asked(prepared, tmp_path, capsys):
    quiet = _user_run(capsys, prepared, tmp_path / "quiet", "debug=fast")
    assert not [line for line in quiet if "├──" in line] and len(quiet) <= 15, quiet
    assert "├── model (unet)" in (tmp_path / "quiet" / CONFIG_TREE).read_text()
    asked = _user_run(
        capsys, prepared, tmp_path / "asked", "debug=fast", "extras.print_config=true"
    )
    assert "├── model (unet)" in asked and "config" in asked
    assert not [line for line in asked if CHATTER.search(line)], asked


@pytest.mark.slow
def test_a_sweep_prints_its_folder_and_its_jobs_compared_in_one_screen_each(
    prepared, tmp_path, capsys
):
    sweep, size = tmp_path / "sweep", ["dataset.image_size=[32,32]", "loader.batch_size=4"]
    argv = ["train.py", "-m", "loader=torch,kornia,dali", f"dataset.root={prepared}", *size,
            *TINY_UNET, "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = run_command(argv, capsys)
    printed = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0 and len(printed) <= 120, printed
    assert printed[0].endswith(f"sweep folder: {sweep}") and not done.stderr, printed
    jobs = [i for i, line in enumerate(printed) if re.search(r"\t#\d : loader=", line)]
    ends = [
        *jobs[1:],
        next(i for i, line in enumerate(printed) if f"sweep folder: {sweep};" in line),
    ]
    assert len(jobs) == 3 and all(end - start <= 25 for start, end in zip(jobs, ends, strict=True))
    table = printed[ends[-1] + 1 :]
    assert table[:2] == [
        "| job | loader | train_img_s | data_wait_frac | best | final_dice |",
        "|---|---|---|---|---|---|",
    ]
    assert [row.split(" | ")[1] for row in table[2:5]] == ["torch", "kornia", "dali"]
    assert table[-1] == f"written: {sweep / 'compare.md'}, compare.csv, compare.png"
    assert (sweep / "compare.md").read_text().startswith(table[0])
    assert (sweep / "compare.png").read_bytes().startswith(b"\x89PNG")

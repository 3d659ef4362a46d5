"""The W&B logger writes only into its run dir: not its caches, service logs or staged tables
into the home folder; and a plain offline run draws no W&B warning."""

from __future__ import annotations

import pytest
from support.ddp import run_train
from support.train import small_overrides
from wandb import env as wandb_env

from nailseg.training.loggers import WANDB_DIRS


@pytest.mark.slow
def test_a_wandb_run_writes_nothing_into_home_and_warns_nothing(prepared, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    # the home folder's defaults, as a user has them, and train.py's own W&B service (not one
    # this test process may have started, which would write the logs of its own)
    for var in (
        *WANDB_DIRS,
        "XDG_CACHE_HOME",
        "XDG_DATA_HOME",
        "XDG_CONFIG_HOME",
        wandb_env.SERVICE,
    ):
        monkeypatch.delenv(var, raising=False)
    # matplotlib (imported by torchmetrics when train.py starts) keeps its font cache there too:
    # not the logger's doing, so it is pointed elsewhere here
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))
    run_dir = tmp_path / "run"
    # a final evaluation: its per-group table is staged as a W&B artifact
    overrides = small_overrides(prepared, "logger=wandb", "trainer.max_epochs=1")
    stderr = run_train(*overrides, f"hydra.run.dir={run_dir}")
    # W&B warned on every run that "The anonymous setting has no effect": Lightning passed it
    assert "wandb: WARNING" not in stderr
    assert sorted(home.rglob("*")) == []
    assert list(run_dir.glob("wandb/cache/wandb/logs/core-debug-*.log"))

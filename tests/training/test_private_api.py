"""Each private name of Hydra and Lightning that training uses (nailseg/training/private_api.py),
pinned: these fail when the library renames, removes or changes one."""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import hydra
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from nailseg.config import CONF_DIR
from nailseg.training import private_api
from nailseg.training.jobs import hydra_child_command


def _hydra_config():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", return_hydra_config=True).hydra


def test_the_basic_sweeper_and_launcher_are_hydras_defaults_by_these_targets():
    hydra = _hydra_config()
    assert hydra.sweeper._target_ == private_api.basic_sweeper_target()
    assert hydra.launcher._target_ == private_api.basic_launcher_target()


def test_a_basic_sweep_expands_as_the_basic_sweeper_runs_it():
    parsed = OverridesParser.create().parse_overrides(["a=1,2", "b=x", "c=range(2)"])
    assert private_api.basic_sweep_jobs(parsed) == [
        ["a=1", "b=x", "c=0"],
        ["a=1", "b=x", "c=1"],
        ["a=2", "b=x", "c=0"],
        ["a=2", "b=x", "c=1"],
    ]


def test_hydras_parser_reads_the_config_flags_a_ddp_rank_is_given():
    args = private_api.hydra_args_parser().parse_args(
        ["--config-path=p", "--config-name=n", "--config-dir=d", "k=v"]
    )
    assert (args.config_path, args.config_name, args.config_dir) == ("p", "n", "d")
    assert args.overrides == ["k=v"]


def test_lightnings_ddp_child_command_is_swapped_by_name_and_signature():
    name = private_api.DDP_CHILD_COMMAND
    original = getattr(subprocess_script, name)
    assert list(inspect.signature(original).parameters) == list(
        inspect.signature(hydra_child_command).parameters
    )
    launched = _SubprocessScriptLauncher._call_children_scripts.__globals__
    with private_api.ddp_child_command(hydra_child_command):
        assert launched[name] is hydra_child_command
    assert launched[name] is original


def test_a_gone_ddp_child_command_is_named(monkeypatch):
    monkeypatch.delattr(subprocess_script, private_api.DDP_CHILD_COMMAND)
    with (
        pytest.raises(private_api.PrivateApiError, match="_hydra_subprocess_cmd is gone"),
        private_api.ddp_child_command(hydra_child_command),
    ):
        pass


def test_wandbs_unset_anonymous_is_left_out_of_its_init_arguments(tmp_path):
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    assert "anonymous" in logger._wandb_init and logger._wandb_init["anonymous"] is None
    private_api.drop_unset_wandb_anonymous(logger)
    assert "anonymous" not in logger._wandb_init
    with pytest.raises(private_api.PrivateApiError, match="_wandb_init"):
        private_api.drop_unset_wandb_anonymous(SimpleNamespace())


def test_the_computed_bar_values_are_the_ones_the_trainer_shows():
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert trainer.progress_bar_metrics is trainer._logger_connector._progress_bar_metrics
    trainer._logger_connector._progress_bar_metrics["val/dice"] = 0.5
    assert private_api.computed_bar_values(trainer) == {"val/dice": 0.5}
    with pytest.raises(private_api.PrivateApiError, match="_progress_bar_metrics"):
        private_api.computed_bar_values(SimpleNamespace())


def test_an_error_hydra_reports_is_given_in_the_line_asked_for(tmp_path, monkeypatch, capsys):
    """hydra_errors swaps hydra._internal.utils.run_and_report, which hydra.main calls."""
    from hydra._internal import utils

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
    def app(cfg) -> None:
        raise AssertionError("composed")

    monkeypatch.setattr(sys, "argv", ["app", "trainer.max_epoch=3", f"hydra.run.dir={tmp_path}"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    original = utils.run_and_report
    with pytest.raises(SystemExit) as done, private_api.hydra_errors(lambda err: "one line"):
        app()
    assert done.value.code == "one line" and utils.run_and_report is original
    with pytest.raises(SystemExit) as done, private_api.hydra_errors(lambda err: None):
        app()  # Hydra's own report
    assert done.value.code == 1 and "max_epoch" in capsys.readouterr().err

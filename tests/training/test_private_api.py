"""Each private name of Hydra, Lightning and torch that training uses, pinned: these fail when the
library renames, removes or changes one (checks.py, jobs.py, callbacks.py, loggers.py,
data/loaders/torch_workers.py)."""

from __future__ import annotations

import inspect
import sys

import hydra
import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

from nailseg.config import CONF_DIR
from nailseg.training.checks import BASIC_LAUNCHER, BASIC_SWEEPER, command_line
from nailseg.training.jobs import DDP_CHILD_COMMAND, hydra_child_command, isolated_job
from nailseg.training.loggers import BestModelWandbLogger


def test_the_basic_sweeper_and_launcher_are_hydras_defaults_by_these_targets():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hydra_cfg = compose("train", return_hydra_config=True).hydra
    assert (hydra_cfg.sweeper._target_, hydra_cfg.launcher._target_) == (
        BASIC_SWEEPER,
        BASIC_LAUNCHER,
    )


def test_a_basic_sweep_expands_as_the_basic_sweeper_runs_it():
    parsed = OverridesParser.create().parse_overrides(["a=1,2", "b=x", "c=range(2)"])
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    assert jobs == [["a=1", "b=x", "c=0"], ["a=1", "b=x", "c=1"], ["a=2", "b=x", "c=0"],
                    ["a=2", "b=x", "c=1"]]  # fmt: skip


def test_hydras_parser_reads_the_config_flags_a_ddp_rank_is_given():
    args = get_args_parser().parse_args(
        ["--config-path=p", "--config-name=n", "--config-dir=d", "k=v"]
    )
    assert (args.config_path, args.config_name, args.config_dir) == ("p", "n", "d")
    assert args.overrides == ["k=v"]


def test_lightnings_ddp_child_command_is_swapped_by_name_and_signature():
    original = getattr(subprocess_script, DDP_CHILD_COMMAND)
    assert list(inspect.signature(original).parameters) == list(
        inspect.signature(hydra_child_command).parameters
    )
    launched = _SubprocessScriptLauncher._call_children_scripts.__globals__
    with isolated_job():
        assert launched[DDP_CHILD_COMMAND] is hydra_child_command
    assert launched[DDP_CHILD_COMMAND] is original


def test_wandbs_unset_anonymous_is_left_out_of_its_init_arguments(tmp_path):
    logger = BestModelWandbLogger(save_dir=str(tmp_path), offline=True)
    assert (
        "anonymous" not in logger._wandb_init and logger._wandb_init["project"] == "lightning_logs"
    )


def test_the_computed_bar_values_are_the_ones_the_trainer_shows():
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert trainer.progress_bar_metrics is trainer._logger_connector._progress_bar_metrics
    # EpochLines reads the epoch's values as computed, never computing one
    assert trainer.callback_metrics is trainer._logger_connector._callback_metrics


@pytest.mark.slow
def test_an_error_hydra_reports_is_given_in_one_line(tmp_path, monkeypatch, capsys):
    """command_line swaps hydra._internal.utils.run_and_report, which hydra.main calls."""
    from hydra._internal import utils

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
    def app(cfg) -> None:
        raise AssertionError("composed")

    monkeypatch.setattr(sys, "argv", ["app", "trainer.max_epoch=3", f"hydra.run.dir={tmp_path}"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    original = utils.run_and_report
    with pytest.raises(SystemExit) as done, command_line("app"):
        app()
    assert done.value.code.startswith("app: ConfigError: trainer.max_epoch=3: no such key")
    assert utils.run_and_report is original
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Exception, match="max_epoch"), command_line("app"):
        app()  # Hydra's own report, with the trace


def test_hydras_help_lists_the_groups_through_the_method_a_help_without_them_shadows():
    from hydra._internal.hydra import Hydra

    assert list(inspect.signature(Hydra.get_help).parameters)[:2] == ["self", "help_cfg"]
    assert "self.format_config_groups(" in inspect.getsource(Hydra.get_help)


def test_a_dataloader_with_workers_stops_them_on_its_iterators_shutdown_workers():
    """TorchLoader.close stops its workers through `_shutdown_workers` (`_iterator`: the
    persistent one), not waiting for the iterator to be collected."""
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(loader)
    next(it)
    assert it is loader._iterator
    workers = list(it._workers)
    it._shutdown_workers()
    assert not any(w.is_alive() for w in workers)

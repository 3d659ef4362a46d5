"""The private Lightning function jobs.py replaces: pinned, and the one Lightning's launcher calls
whenever it starts a job's ranks as subprocesses, whatever made it choose to."""

from __future__ import annotations

import inspect

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from nailseg.training.jobs import DDP_CHILD_COMMAND as PATCHED
from nailseg.training.jobs import hydra_child_command, isolated_job


def test_the_replaced_function_has_the_signature_of_its_replacement():
    original = getattr(subprocess_script, PATCHED)
    assert list(inspect.signature(original).parameters) == list(
        inspect.signature(hydra_child_command).parameters
    )


def launched_command() -> object:
    """The function Lightning's launcher calls for a rank's command when it starts the ranks."""
    return _SubprocessScriptLauncher._call_children_scripts.__globals__[PATCHED]


@pytest.mark.parametrize(
    ("trainer", "subprocesses"),
    [
        ({"devices": 2}, True),  # no strategy: Lightning's "auto" picks DDP with scripts
        ({"devices": 2, "strategy": "auto"}, True),
        ({"devices": 1, "num_nodes": 2}, True),
        ({"devices": 2, "strategy": "ddp"}, True),
        ({"devices": 2, "strategy": "ddp_find_unused_parameters_true"}, True),
        ({"devices": 2, "strategy": DDPStrategy(static_graph=True)}, True),
        ({"devices": 2, "strategy": "ddp_spawn"}, False),
        ({"devices": 2, "strategy": DDPStrategy(start_method="spawn")}, False),
        ({"devices": 1}, False),
        ({"devices": 1, "strategy": "ddp"}, True),
    ],
)
def test_every_subprocess_launch_lightning_chooses_runs_this_jobs_command(trainer, subprocesses):
    original = getattr(subprocess_script, PATCHED)
    with isolated_job():
        built = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **trainer)
        launcher = built.strategy.launcher
        assert isinstance(launcher, _SubprocessScriptLauncher) is subprocesses
        # the name Lightning's launcher looks up when it starts the ranks
        assert launched_command() is hydra_child_command
    assert launched_command() is original

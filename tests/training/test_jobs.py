"""The private Lightning function jobs.py replaces: pinned, and replaced only when DDP needs it."""

from __future__ import annotations

import inspect

import pytest
from lightning.pytorch.strategies.launchers import subprocess_script

from nailseg.training.checks import ConfigError
from nailseg.training.jobs import PATCHED, hydra_child_command, isolated_job, launches_subprocesses


def test_the_replaced_function_has_the_signature_of_its_replacement():
    original = getattr(subprocess_script, PATCHED)
    assert list(inspect.signature(original).parameters) == list(
        inspect.signature(hydra_child_command).parameters
    )


@pytest.mark.parametrize(
    ("strategy", "swapped"),
    [
        (None, False),
        ("auto", False),
        ("ddp", True),
        ("ddp_find_unused_parameters_true", True),
        ("ddp_spawn", False),
        ("ddp_fork", False),
        ("ddp_notebook", False),
        ({"_target_": "lightning.pytorch.strategies.DDPStrategy", "static_graph": True}, True),
        ({"_target_": "lightning.pytorch.strategies.DDPStrategy", "start_method": "spawn"}, False),
        ({"_target_": "lightning.pytorch.strategies.SingleDeviceStrategy"}, False),
    ],
)
def test_the_child_command_is_swapped_only_for_subprocess_ddp(strategy, swapped):
    original = getattr(subprocess_script, PATCHED)
    assert launches_subprocesses(strategy) is swapped
    with isolated_job(strategy):
        inside = getattr(subprocess_script, PATCHED)
    assert (inside is hydra_child_command) is swapped
    assert getattr(subprocess_script, PATCHED) is original


def test_a_strategy_node_of_no_class_is_named_before_the_job_starts():
    # run_job asks this before build's checks run: the same message as the check gives
    with pytest.raises(ConfigError, match=r"trainer.strategy._target_=lightning.NoSuch"):
        launches_subprocesses({"_target_": "lightning.NoSuch"})

"""The private names of Hydra and Lightning that training uses, one function each, so a library
update that changes one fails here, naming it (tests/training/test_private_api.py pins each).

DALI's `backend.ReleaseUnusedMemory` is looked up in nailseg/data/loaders/dali.py, where the
loader is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

WRITTEN_FOR = "lightning 2.6 and hydra-core 1.3"
DDP_CHILD_COMMAND = "_hydra_subprocess_cmd"  # Lightning's: the command of a DDP rank under Hydra


class PrivateApiError(RuntimeError):
    """A private name nailseg relies on is gone from the installed library."""


def _gone(what: str) -> PrivateApiError:
    return PrivateApiError(
        f"{what} is gone from the installed library; nailseg was written for {WRITTEN_FOR}: "
        "install the pinned versions"
    )


def basic_sweeper_target() -> str:
    """The `_target_` of Hydra's basic sweeper, whose jobs can be composed before they run."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return f"{BasicSweeper.__module__}.{BasicSweeper.__name__}"


def basic_launcher_target() -> str:
    """The `_target_` of Hydra's basic launcher, which runs the jobs in this process."""
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return f"{BasicLauncher.__module__}.{BasicLauncher.__name__}"


def basic_sweep_jobs(overrides: list[Any]) -> list[list[str]]:
    """Each job's overrides as the basic sweeper expands parsed `overrides`, in its order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


@contextmanager
def hydra_errors(one_line: Callable[[Exception], str | None]) -> Iterator[None]:
    """Within the block, an error Hydra reports itself (composing the config) exits with
    `one_line(err)` when that gives a line, unless HYDRA_FULL_ERROR asks for the trace."""
    from hydra._internal import utils

    original = getattr(utils, "run_and_report", None)
    if original is None:
        raise _gone("hydra._internal.utils.run_and_report")

    def run_and_report(func: Callable[[], Any]) -> Any:
        def reported() -> Any:
            try:
                return func()
            except Exception as err:
                line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else one_line(err)
                if line is None:
                    raise
                sys.exit(line)

        return original(reported)

    utils.run_and_report = run_and_report
    try:
        yield
    finally:
        utils.run_and_report = original


@contextmanager
def help_without_group_walk() -> Iterator[None]:
    """Within the block, `--help` lists Hydra's config groups only for a help template that
    prints them: listing them walks every group twice, deep-copying the config repository at
    each step (a second), also for nailseg's templates, which name their groups themselves."""
    from hydra._internal.hydra import Hydra

    original = getattr(Hydra, "get_help", None)
    if original is None or not hasattr(Hydra, "format_config_groups"):
        raise _gone("hydra._internal.hydra.Hydra.get_help")

    def get_help(self: Any, help_cfg: Any, *args: Any, **kwargs: Any) -> str:
        if "CONFIG_GROUPS" not in help_cfg.template:  # shadows the method for this call
            self.format_config_groups = lambda *_, **__: ""
        try:
            return original(self, help_cfg, *args, **kwargs)
        finally:
            vars(self).pop("format_config_groups", None)

    Hydra.get_help = get_help
    try:
        yield
    finally:
        Hydra.get_help = original


def hydra_args_parser() -> argparse.ArgumentParser:
    """Hydra's own command-line parser (`--config-path`, `--config-name`, ...)."""
    try:
        from hydra._internal.utils import get_args_parser
    except ImportError as err:
        raise _gone("hydra._internal.utils.get_args_parser") from err
    return get_args_parser()


@contextmanager
def ddp_child_command(command: Callable[[int], tuple[Sequence[str], str]]) -> Iterator[None]:
    """Lightning's launcher takes `command` for the command of each DDP rank it starts under
    Hydra, within the block."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    original = getattr(subprocess_script, DDP_CHILD_COMMAND, None)
    if original is None:
        raise _gone(f"{subprocess_script.__name__}.{DDP_CHILD_COMMAND}")
    setattr(subprocess_script, DDP_CHILD_COMMAND, command)
    try:
        yield
    finally:
        setattr(subprocess_script, DDP_CHILD_COMMAND, original)


def drop_unset_wandb_anonymous(logger: Any) -> None:
    """Leave `anonymous` out of a WandbLogger's `wandb.init` arguments when it is unset: Lightning
    passes None, which W&B warns about on every run."""
    init = getattr(logger, "_wandb_init", None)
    if not isinstance(init, dict):
        raise _gone("WandbLogger._wandb_init")
    if init.get("anonymous") is None:
        init.pop("anonymous", None)


def computed_bar_values(trainer: Any) -> dict[str, Any]:
    """The progress-bar values the loop has computed already, read without computing a pending
    one (a collective under DDP)."""
    values = getattr(getattr(trainer, "_logger_connector", None), "_progress_bar_metrics", None)
    if values is None:
        raise _gone("Trainer._logger_connector._progress_bar_metrics")
    return dict(values)

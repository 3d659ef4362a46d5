"""A Hydra callback checking a composed config before Hydra writes the run folder (train.py,
prepare.py): the single run's config, or every job of a basic sweep composed as it will run (a
sampling sweeper: its base config; each job checks its own as it starts).

A refusal exits with its message alone: Hydra turns an exception raised in a callback into a
warning and runs on. HYDRA_FULL_ERROR=1 re-raises it instead, for the trace.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from rich.progress import track

from nailseg.errors import refusal
from nailseg.training.private_api import (
    basic_launcher_target,
    basic_sweep_jobs,
    basic_sweeper_target,
)


class PreCheck(Callback):
    """Runs `check` (raising on a value that cannot work) on every config a run or sweep will
    run; `elsewhere` (default: `check`) on jobs a launcher runs on other machines, whose devices
    are not this machine's. `early`, a check of a light module, runs first on each: its refusal
    comes before `check`'s module (torch, Lightning) is imported."""

    def __init__(self, check: str, elsewhere: str | None = None, early: str | None = None) -> None:
        self.check, self.elsewhere, self.early = check, elsewhere or check, early

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._run_checks(self.check, [("", config)])

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **_) -> None:
        here = config.hydra.launcher._target_ == basic_launcher_target()
        check = self.check if here else self.elsewhere
        if config.hydra.sweeper._target_ != basic_sweeper_target():
            self._run_checks(check, [("the sweep's base config: ", config)])
            return
        self._run_checks(check, list(composed_jobs(config, config_name)))

    def _run_checks(self, check: str, configs: list[tuple[str, DictConfig]]) -> None:
        for name in (self.early, check):
            if name is None:
                continue
            method: Callable[[DictConfig], Any] = get_method(name)
            for where, config in configs:
                try:
                    method(config)
                except Exception as err:
                    leave(where, err)


def composed_jobs(config: DictConfig, config_name: str | None) -> Iterator[tuple[str, DictConfig]]:
    """Each job of a basic-sweeper sweep composed as it will run, with where it is in the sweep
    (`job 1 of 4 (overrides): `, to start a message); a job that does not compose (a choice or
    key that exists in no config) leaves with its error (`leave`)."""
    jobs = sweep_jobs(config)
    hydra_overrides = list(config.hydra.overrides.hydra)  # hydra.searchpath: a user's own configs
    for number, overrides in enumerate(
        track(jobs, description="checking the sweep's jobs", transient=True)
    ):
        where = f"job {number} of {len(jobs)} ({' '.join(overrides)}): "
        try:  # with the command line's hydra overrides, as the launcher composes it
            job = compose(config_name, overrides=[*hydra_overrides, *overrides])
        except Exception as err:
            leave(where, err)
        yield where, job


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The overrides of each job the basic sweeper will launch, in its order: its `params`, then
    the command line's overrides, expanded as it expands them."""
    params = config.hydra.sweeper.params or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(OmegaConf.to_container(config.hydra.overrides.task))
    return basic_sweep_jobs(OverridesParser.create().parse_overrides(arguments))


def leave(where: str, err: Exception) -> NoReturn:
    """Stop before Hydra writes; with HYDRA_FULL_ERROR set, re-raise for a warning with the
    trace and let the job's own check fail in full."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    sys.exit(refusal(os.path.basename(sys.argv[0]) or "nailseg", err, where))

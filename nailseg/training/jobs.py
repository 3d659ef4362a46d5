"""Keep the jobs of a sweep apart: DDP's extra ranks re-run only their job, and a job leaves no
DDP rendezvous or open W&B run behind for the next job in the same process.

Why this exists:

* Lightning's `ddp` strategy starts ranks 1..devices-1 by re-running the entry point. Under Hydra
  it re-runs `sys.argv` plus `hydra.run.dir=<this run's dir>`: right for a single run, wrong for a
  job of a sweep (`-m`). There the child re-runs the *whole sweep* in a sweep dir of its own (a
  second timestamp), and rank 1 of job k is job k of that other sweep, a different config as soon
  as a sweeper samples (Lightning-AI/pytorch-lightning#15689). `hydra_child_command` re-runs
  exactly this job instead, as a single run: the job's own overrides (`hydra.overrides.task`), in
  the job's output dir, `hydra.mode=RUN`, no `.hydra/` of its own. One run dir per job, any mode.
* Lightning leaves its rendezvous in the process: MASTER_PORT, LOCAL_RANK, ... in `os.environ`
  and the process group. The next job of a sweep in the same process would then believe its ranks
  already exist (`LOCAL_RANK` set: "processes are created externally") and wait for them forever.
* A job that fails after W&B started leaves `wandb.run` open, and Lightning's WandbLogger reuses an
  open run: the next job would log into the failed job's W&B run.

Under SLURM (`hydra/launcher=slurm`) no child is started: SLURM runs one task per device and
Lightning reads the ranks from SLURM's variables; only the clean-up applies. `SlurmSweepCheck`
refuses, before submitting, a sweep whose jobs would need other resources than SLURM's one request.

The child command replaces a private function of Lightning (`_hydra_subprocess_cmd`) and reads
Hydra's private argument parser, so both are contained here. It is swapped in for every job:
Lightning calls it only when its own launcher starts ranks as subprocesses under Hydra (whatever
strategy, devices, nodes and accelerator made it choose that: "auto" on 2 devices does), so the
choice is Lightning's and cannot drift from it. A missing name fails naming the versions this was
written for, and tests/training/test_jobs.py pins the replaced function's signature.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.utils import get_original_cwd, to_absolute_path
from lightning.pytorch.strategies.launchers import subprocess_script
from omegaconf import DictConfig, OmegaConf

from nailseg.precheck import BASIC_SWEEPER, composed_jobs, leave, refusal
from nailseg.training.checks import ConfigError
from nailseg.training.signals import ends_on_signal

# what the child command replaces, and the versions it was written against
PATCHED = "_hydra_subprocess_cmd"
WRITTEN_FOR = "lightning 2.6 and hydra-core 1.3"
# the trainer keys SLURM's request follows (conf/hydra/launcher/slurm.yaml)
SLURM_TRAINER_KEYS = ("trainer", "trainer.devices", "trainer.num_nodes")

# what Lightning's DDP launch writes into os.environ: the rendezvous and the per-process threads
_RENDEZVOUS_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "OMP_NUM_THREADS",
)
# Hydra overrides of the parent that must not reach a child: the child is one run in this job's
# dir, not a sweep (its mode, dirs, sweeper and launcher are set below or irrelevant)
_PARENT_ONLY = (
    "hydra.mode",
    "hydra.run",
    "hydra.sweep",
    "hydra.output_subdir",
    "hydra.job.name",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
)


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _parent_only(override: str) -> bool:
    key = _override_key(override)
    return any(key == k or key.startswith(f"{k}.") for k in _PARENT_ONLY)


def hydra_child_command(local_rank: int) -> tuple[Sequence[str], str]:
    """The command and cwd that start DDP rank `local_rank` of this Hydra job (replaces
    Lightning's `_hydra_subprocess_cmd`, which has the same signature)."""
    import __main__

    hydra_cfg = HydraConfig.get()
    args = _hydra_args_parser().parse_args(sys.argv[1:])
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    for flag, value in (
        ("--config-path", args.config_path),
        ("--config-name", args.config_name),
        ("--config-dir", args.config_dir),
    ):
        if value is not None:
            command.append(f"{flag}={value}")
    command += [
        *hydra_cfg.overrides.task,
        *(o for o in hydra_cfg.overrides.hydra if not _parent_only(o)),
        "hydra.mode=RUN",
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        "hydra.output_subdir=null",  # rank 0 wrote .hydra/; the child must not rewrite it
        f"hydra.job.name={hydra_cfg.job.name}_ddp_process_{local_rank}",  # its own log file
    ]
    return command, get_original_cwd()


def _hydra_args_parser():
    try:
        from hydra._internal.utils import get_args_parser
    except ImportError as err:
        raise RuntimeError(
            f"hydra no longer has hydra._internal.utils.get_args_parser; nailseg's DDP launch "
            f"was written for {WRITTEN_FOR}: install the pinned versions"
        ) from err
    return get_args_parser()


@contextmanager
def _child_command_swapped() -> Iterator[None]:
    original = getattr(subprocess_script, PATCHED, None)
    if original is None:
        raise RuntimeError(
            f"lightning no longer has {subprocess_script.__name__}.{PATCHED}; nailseg's DDP "
            f"launch under Hydra was written for {WRITTEN_FOR}: install the pinned versions"
        )
    setattr(subprocess_script, PATCHED, hydra_child_command)
    try:
        yield
    finally:
        setattr(subprocess_script, PATCHED, original)


def _finish_open_wandb_run() -> None:
    if "wandb" not in sys.modules:  # never imported: no run can be open
        return
    import wandb

    if wandb.run is not None:
        wandb.run.finish(exit_code=1)


def _reset_wandb() -> None:
    """Forget W&B's process-wide setup: it reads its environment (the cache and data folders
    `keep_wandb_inside` points into the job's folder) once, at the first run of a process, and
    warns that later changes are ignored: every later job of a sweep cached into the first's."""
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


@contextmanager
def isolated_job() -> Iterator[None]:
    """Run one job: the DDP ranks Lightning starts as subprocesses re-run this job only, and
    SIGTERM or Ctrl-C ends the job and its ranks within seconds (signals.py); on exit, the
    process group, the rendezvous variables and torch's thread count are as before, and no W&B
    run is left open."""
    env = {key: os.environ.get(key) for key in _RENDEZVOUS_ENV}
    threads = torch.get_num_threads()
    try:
        with ends_on_signal(), _child_command_swapped():
            yield
    except BaseException:
        _finish_open_wandb_run()
        raise
    finally:
        _reset_wandb()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads)


class SlurmSweepCheck(Callback):
    """Refuses a sweep under hydra/launcher=slurm whose jobs need other resources than the
    sweep's config: submitit submits a sweep as one job array with one request (nodes, tasks and
    GPUs per node), resolved once from that config, so every job would get its request.

    On construction, a sweep that varies the trainer keys SLURM's request follows is refused
    (Hydra builds its callbacks before the launcher: nothing is submitted yet). Then, for the
    basic sweeper, every job is composed as it will run and must ask for the same nodes and
    devices: a choice such as `experiment=` can set them without naming them. A job that asked
    for more would run on too few GPUs; one that asked for fewer would run once per SLURM task,
    all in one folder. (A refusal from a hook exits: an exception there is only a warning.)"""

    def __init__(self, overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None) -> None:
        try:
            check_slurm_sweep(overrides, sweeper_params)
        except ConfigError as err:
            leave("", err)

    def on_multirun_start(
        self, config: DictConfig, config_name: str | None = None, **_: Any
    ) -> None:
        if config.hydra.sweeper._target_ != BASIC_SWEEPER:
            return  # a sampling sweeper's jobs exist only as they run: the keys check stands
        request = slurm_request(config)
        for where, job in composed_jobs(config, config_name):
            if (needed := slurm_request(job)) != request:
                sys.exit(
                    refusal(
                        where,
                        ConfigError(
                            f"hydra/launcher=slurm: this job's trainer needs {needed}, but SLURM "
                            f"gets the sweep's one request for every job, {request}: run the "
                            "jobs that differ as a sweep of their own"
                        ),
                    )
                )


def check_slurm_sweep(overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None) -> None:
    """Raises ConfigError where SLURM cannot take this sweep: no `srun` here to submit with, or a
    sweep that varies the trainer keys SLURM's one request follows."""
    if shutil.which("srun") is None:  # submitit's SLURM executor submits through it
        raise ConfigError(
            "hydra/launcher=slurm: SLURM's srun is not on PATH here: submit from a SLURM login "
            "node (hydra/launcher=submitit_local runs the same jobs on this machine)"
        )
    swept = swept_keys(overrides, sweeper_params)
    varied = [key for key in SLURM_TRAINER_KEYS if key in swept]
    if varied:
        raise ConfigError(
            f"hydra/launcher=slurm: this sweep varies {', '.join(varied)}, but SLURM gets one "
            f"request (nodes, tasks and GPUs per node) for every job of a sweep, resolved "
            f"from the base config: run one sweep per setting of "
            f"{', '.join(SLURM_TRAINER_KEYS)}"
        )


def slurm_request(config: DictConfig) -> str:
    """The trainer values SLURM's request follows (conf/hydra/launcher/slurm.yaml), as text."""
    keys = ("trainer.num_nodes", "trainer.devices")
    return ", ".join(f"{key}={OmegaConf.select(config, key)}" for key in keys)


def swept_keys(overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None) -> set[str]:
    """The keys a sweep varies: its sweep overrides (`key=a,b`, `key=range(...)`, ...) and the
    sweeper's `params` (hydra.sweeper.params, where the Optuna preset names its search space)."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.key_or_group for o in parsed if o.is_sweep_override()} | set(sweeper_params or {})

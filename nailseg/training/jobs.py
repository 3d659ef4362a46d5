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
Lightning reads the ranks from SLURM's variables; only the clean-up applies.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path
from lightning.pytorch.strategies.launchers import subprocess_script

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
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    args = get_args_parser().parse_args(sys.argv[1:])
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


def _finish_open_wandb_run() -> None:
    if "wandb" not in sys.modules:  # never imported: no run can be open
        return
    import wandb

    if wandb.run is not None:
        wandb.run.finish(exit_code=1)


@contextmanager
def isolated_job() -> Iterator[None]:
    """Run one job: DDP children re-run this job only; on exit, the process group, the
    rendezvous variables and torch's thread count are as before, and no W&B run is left open."""
    original_command = subprocess_script._hydra_subprocess_cmd
    env = {key: os.environ.get(key) for key in _RENDEZVOUS_ENV}
    threads = torch.get_num_threads()
    subprocess_script._hydra_subprocess_cmd = hydra_child_command
    try:
        yield
    except BaseException:
        _finish_open_wandb_run()
        raise
    finally:
        subprocess_script._hydra_subprocess_cmd = original_command
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads)

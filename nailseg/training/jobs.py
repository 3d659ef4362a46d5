"""Keep the jobs of a sweep apart, and end each on SIGTERM or Ctrl-C. Lightning starts DDP ranks
by re-running `sys.argv` (in a sweep, the whole sweep: Lightning-AI/pytorch-lightning#15689):
`hydra_child_command` re-runs this job alone. SIGTERM raises `Terminated` (a KeyboardInterrupt:
Lightning ends the fit as on Ctrl-C); a watcher thread, woken by the signal wake-up fd even while
the main thread waits in a collective, exits a job still running `GRACE_S` later. Under SLURM
(a task per device) `SlurmSweepCheck` refuses jobs that need other resources than its request.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any
from unittest import mock

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import get_original_cwd, to_absolute_path
from omegaconf import DictConfig, OmegaConf

from nailseg.errors import ConfigError, refusal
from nailseg.lifetime import die_with_parent
from nailseg.training.checks import BASIC_SWEEPER, composed_jobs, leave

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
# the trainer keys SLURM's request follows (conf/hydra/launcher/slurm.yaml)
SLURM_TRAINER_KEYS = ("trainer", "trainer.devices", "trainer.num_nodes")

# Hydra overrides of the parent that must not reach a child, one run in this job's folder
_PARENT_ONLY = ("hydra.mode", "hydra.run", "hydra.sweep", "hydra.output_subdir", "hydra.job.name")
_PARENT_ONLY += ("hydra.sweeper", "hydra/sweeper", "hydra.launcher", "hydra/launcher")


DDP_CHILD_COMMAND = "_hydra_subprocess_cmd"  # Lightning's: the command of a DDP rank under Hydra
GRACE_S = 10.0  # how long an interrupted job may take to end by itself (a graceful end included)
# the job's process, as its DDP ranks inherit it: a rank that finds another pid here was launched
LAUNCHER_ENV = "NAILSEG_JOB_PID"
_ENDING = (signal.SIGINT, signal.SIGTERM)
_STOP = b"\0"  # no signal has number 0: the watcher's own wake-up at the job's end


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so it is handled alike."""


def _watch(wakeups: socket.socket, ended: threading.Event) -> None:
    """Wait for an ending signal's byte; then give the job `GRACE_S` to end by itself."""
    while (byte := wakeups.recv(1)) != _STOP:
        if byte and byte[0] in _ENDING:
            if ended.wait(GRACE_S):
                return
            name = signal.Signals(byte[0]).name
            os.write(2, f"still running {GRACE_S:g} s after {name}: ending it now\n".encode())
            os._exit(128 + byte[0])


@contextmanager
def ends_on_signal() -> Iterator[None]:
    """Run a job that SIGTERM and Ctrl-C end within `GRACE_S` (see the module docstring). Signal
    handlers belong to the main thread: elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is not None and int(launcher) != os.getpid():  # a DDP rank the job launched
        die_with_parent()
        if os.getppid() != int(launcher):  # it exited before the kernel was told
            os._exit(1)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # until the job's end (isolated_job)
    raised = []

    def terminate(signum: int, frame: FrameType | None) -> None:
        if not raised:  # once: a repeat would break off the shutdown
            raised.append(signum)
            raise Terminated(f"received {signal.Signals(signum).name}")

    wakeups, wakeup_fd = socket.socketpair()
    wakeup_fd.setblocking(False)  # the C-level handler must never block
    previous_fd = signal.set_wakeup_fd(wakeup_fd.fileno(), warn_on_full_buffer=False)
    previous_term = signal.signal(signal.SIGTERM, terminate)
    ended = threading.Event()
    watcher = threading.Thread(target=_watch, args=(wakeups, ended), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.set_wakeup_fd(previous_fd)
        ended.set()
        wakeup_fd.send(_STOP)
        watcher.join()
        wakeups.close()
        wakeup_fd.close()


def sweep_job() -> bool:
    """Whether this run is one job of a `-m` sweep."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _parent_only(override: str) -> bool:
    key = override.split("=", 1)[0].lstrip("+~")
    return any(key == k or key.startswith(f"{k}.") for k in _PARENT_ONLY)


def hydra_child_command(local_rank: int) -> tuple[Sequence[str], str]:
    """The command and cwd that start DDP rank `local_rank` of this Hydra job: this job alone, as
    a single run in its folder (in place of Lightning's `_hydra_subprocess_cmd`)."""
    from hydra._internal.utils import get_args_parser

    import __main__

    hydra_cfg = HydraConfig.get()
    args = get_args_parser().parse_args(sys.argv[1:])
    if __main__.__spec__ is None and os.path.isfile(sys.argv[0]):  # python train.py
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:  # nailseg train, python -m nailseg train
        command = [sys.executable, "-m", "nailseg", "train"]
    for flag in ("config_path", "config_name", "config_dir"):
        if (value := getattr(args, flag)) is not None:
            command.append(f"--{flag.replace('_', '-')}={value}")
    command += [
        *hydra_cfg.overrides.task,
        *(o for o in hydra_cfg.overrides.hydra if not _parent_only(o)),
        "hydra.mode=RUN",
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        "hydra.output_subdir=null",  # rank 0 wrote .hydra/; the child must not rewrite it
        f"hydra.job.name={hydra_cfg.job.name}_ddp_process_{local_rank}",  # its own log file
    ]
    return command, get_original_cwd()


@contextmanager
def isolated_job() -> Iterator[None]:
    """Run one job: its DDP ranks re-run this job only, SIGTERM or Ctrl-C ends it within seconds;
    after it the process group, environment, thread count are as before, no W&B run open."""
    import torch  # here: SlurmSweepCheck, a Hydra callback of every run, keeps this module light
    from lightning.pytorch.strategies.launchers import subprocess_script

    threads = torch.get_num_threads()
    try:
        with (
            mock.patch.dict(os.environ),  # Lightning's rendezvous (MASTER_PORT, ...) ends here
            ends_on_signal(),
            mock.patch.object(subprocess_script, DDP_CHILD_COMMAND, hydra_child_command),
        ):
            yield
    except BaseException:
        if (wandb := sys.modules.get("wandb")) is not None and wandb.run is not None:
            wandb.run.finish(exit_code=1)
        raise
    finally:
        if (wandb := sys.modules.get("wandb")) is not None:
            wandb.teardown()  # its setup reads the environment once: the next job's cache moves
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)


class SlurmSweepCheck(Callback):
    """Refuses a sweep under hydra/launcher=slurm whose jobs need other resources than its config:
    submitit sends every job with one request (nodes, tasks, GPUs). Built before the launcher, it
    refuses a sweep over the keys that request follows, then composes every job of a basic sweep
    (an `experiment=` can set devices unnamed)."""

    def __init__(
        self, launcher: str, overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None
    ) -> None:
        self.slurm = launcher == SLURM_LAUNCHER
        if not self.slurm:
            return
        varied = [k for k in SLURM_TRAINER_KEYS if k in swept_keys(overrides, sweeper_params)]
        if shutil.which("srun") is None:  # submitit's SLURM executor submits so
            leave("", ConfigError(
                "hydra/launcher=slurm: SLURM's srun is not on PATH here: submit from a SLURM login "
                "node (hydra/launcher=submitit_local runs the same jobs on this machine)"
            ))  # fmt: skip
        if varied:
            leave("", ConfigError(
                f"hydra/launcher=slurm: this sweep varies {', '.join(varied)}, but SLURM gets one "
                "request (nodes, tasks and GPUs per node) for every job of a sweep, resolved "
                f"from the base config: run one sweep per setting of {', '.join(SLURM_TRAINER_KEYS)}"
            ))  # fmt: skip

    def on_multirun_start(
        self, config: DictConfig, config_name: str | None = None, **_: Any
    ) -> None:
        if not self.slurm or config.hydra.sweeper._target_ != BASIC_SWEEPER:
            return  # a sampling sweeper's jobs exist only as they run: the keys check stands
        request = _slurm_request(config)
        for where, job in composed_jobs(config, config_name):
            if (needed := _slurm_request(job)) != request:
                refused = ConfigError(  # exits even with HYDRA_FULL_ERROR: no job checks it again
                    f"hydra/launcher=slurm: this job's trainer needs {needed}, but SLURM gets "
                    f"the sweep's one request for every job, {request}: run the jobs that differ "
                    "as a sweep of their own"
                )
                sys.exit(refusal(os.path.basename(sys.argv[0]), refused, where))


def _slurm_request(config: DictConfig) -> str:
    """The trainer values SLURM's request follows (conf/hydra/launcher/slurm.yaml), as text."""
    keys = ("trainer.num_nodes", "trainer.devices")
    return ", ".join(f"{key}={OmegaConf.select(config, key)}" for key in keys)


def swept_keys(overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None) -> set[str]:
    """The keys a sweep varies: its sweep overrides (`key=a,b`, `key=range(...)`, ...) and the
    sweeper's `params` (hydra.sweeper.params, where the Optuna preset names its search space)."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.key_or_group for o in parsed if o.is_sweep_override()} | set(sweeper_params or {})

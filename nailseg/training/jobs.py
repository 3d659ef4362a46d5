"""Keep the jobs of a sweep apart: DDP's extra ranks re-run only their job, and a job leaves no
DDP rendezvous or open W&B run behind for the next job in the same process.

* Lightning starts DDP ranks 1.. by re-running `sys.argv` plus `hydra.run.dir`: in a sweep that
  re-runs the whole sweep, so rank 1 of job k could be another config
  (Lightning-AI/pytorch-lightning#15689). `hydra_child_command` re-runs exactly this job, as a
  single run in its folder, wherever Lightning's launcher starts ranks as subprocesses.
* Lightning leaves its rendezvous (MASTER_PORT, LOCAL_RANK, ...) in `os.environ`: the next job
  would take its ranks as started already and wait for them for ever.
* A job that fails after W&B started leaves `wandb.run` open, which the next job's logger reuses.

A job ends within seconds of SIGTERM or Ctrl-C, its DDP ranks included, also while a rank waits
in a collective that never completes (`ends_on_signal`): SIGTERM raises `Terminated`, a
KeyboardInterrupt, so Lightning ends the fit as on Ctrl-C (its own handler only sets a flag read at
the epoch's end); a watcher thread, woken by Python's signal wake-up fd (written by the C-level
handler even while the main thread is blocked), exits a job still running `GRACE_S` later with
128 + signal; the kernel kills a DDP rank this job's process launched when that process exits.

Under SLURM no child is started (SLURM runs a task per device); `SlurmSweepCheck` refuses a sweep
whose jobs need other resources than SLURM's one request.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import get_original_cwd, to_absolute_path
from omegaconf import DictConfig, OmegaConf

from nailseg.errors import ConfigError, refusal
from nailseg.lifetime import die_with_parent
from nailseg.training.checks import composed_jobs, leave
from nailseg.training.private_api import basic_sweeper_target, ddp_child_command, hydra_args_parser

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
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
# Hydra overrides of the parent that must not reach a child, one run in this job's folder
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


GRACE_S = 10.0  # how long an interrupted job may take to end by itself (a graceful end included)
# the job's process, as its DDP ranks inherit it: a rank that finds another pid here was launched
LAUNCHER_ENV = "NAILSEG_JOB_PID"
_ENDING = (signal.SIGINT, signal.SIGTERM)
_STOP = b"\0"  # no signal has number 0: the watcher's own wake-up at the job's end


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so it is handled alike."""


def _terminate_once() -> Callable[[int, FrameType | None], None]:
    """A SIGTERM handler raising `Terminated` once: a repeat would break off the shutdown."""
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated(f"received {signal.Signals(signum).name}")

    return handler


def _watch(wakeups: socket.socket, ended: threading.Event) -> None:
    """Wait for an ending signal's byte; then give the job `GRACE_S` to end by itself."""
    while (byte := wakeups.recv(1)) != _STOP:
        if byte and byte[0] in _ENDING:
            if ended.wait(GRACE_S):
                return
            name = signal.Signals(byte[0]).name
            os.write(2, f"still running {GRACE_S:g} s after {name}: ending it now\n".encode())
            os._exit(128 + byte[0])


def _tie_to_launcher() -> None:
    """In a DDP rank launched by a job's process: die when that process exits."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or int(launcher) == os.getpid():
        return
    die_with_parent()
    if os.getppid() != int(launcher):  # it exited before the kernel was told
        os._exit(1)


@contextmanager
def ends_on_signal() -> Iterator[None]:
    """Run a job that SIGTERM and Ctrl-C end within `GRACE_S` (see the module docstring). Signal
    handlers belong to the main thread: elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _tie_to_launcher()
    launcher = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    wakeups, wakeup_fd = socket.socketpair()
    wakeup_fd.setblocking(False)  # the C-level handler must never block
    previous_fd = signal.set_wakeup_fd(wakeup_fd.fileno(), warn_on_full_buffer=False)
    previous_term = signal.signal(signal.SIGTERM, _terminate_once())
    ended = threading.Event()
    watcher = threading.Thread(target=_watch, args=(wakeups, ended), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.set_wakeup_fd(previous_fd)
        if launcher is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = launcher
        ended.set()
        wakeup_fd.send(_STOP)
        watcher.join()
        wakeups.close()
        wakeup_fd.close()


def sweep_job() -> bool:
    """Whether this run is one job of a `-m` sweep."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _parent_only(override: str) -> bool:
    key = _override_key(override)
    return any(key == k or key.startswith(f"{k}.") for k in _PARENT_ONLY)


def hydra_child_command(local_rank: int) -> tuple[Sequence[str], str]:
    """The command and cwd that start DDP rank `local_rank` of this Hydra job, in place of
    Lightning's (`private_api.ddp_child_command`)."""
    import __main__

    hydra_cfg = HydraConfig.get()
    args = hydra_args_parser().parse_args(sys.argv[1:])
    if __main__.__spec__ is None and os.path.isfile(sys.argv[0]):  # python train.py
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:  # nailseg train, python -m nailseg train
        command = [sys.executable, "-m", "nailseg", "train"]
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


def _reset_wandb() -> None:
    """Forget W&B's process-wide setup, which reads its environment once a process: the next job
    then keeps its cache in its own folder."""
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


@contextmanager
def isolated_job() -> Iterator[None]:
    """Run one job: the DDP ranks Lightning starts as subprocesses re-run this job only, and
    SIGTERM or Ctrl-C ends the job and its ranks within seconds (`ends_on_signal`); on exit, the
    process group, the rendezvous variables and torch's thread count are as before, and no W&B
    run is left open."""
    import torch  # here: SlurmSweepCheck, a Hydra callback of every run, keeps this module light

    env = {key: os.environ.get(key) for key in _RENDEZVOUS_ENV}
    threads = torch.get_num_threads()
    try:
        with ends_on_signal(), ddp_child_command(hydra_child_command):
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
    """Refuses a sweep under hydra/launcher=slurm (`launcher`: the launcher's target) whose jobs
    need other resources than the sweep's config: submitit sends every job of a sweep with one
    request (nodes, tasks, GPUs).

    Built before the launcher, it refuses a sweep over the keys that request follows; for the
    basic sweeper it then composes every job (an `experiment=` can set devices unnamed), before
    the sweep's folder is claimed (conf/train.yaml's order). A hook's refusal exits: Hydra takes
    an exception there for a warning."""

    def __init__(
        self, launcher: str, overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None
    ) -> None:
        self.slurm = launcher == SLURM_LAUNCHER
        try:
            if self.slurm:
                check_slurm_sweep(overrides, sweeper_params)
        except ConfigError as err:
            leave("", err)

    def on_multirun_start(
        self, config: DictConfig, config_name: str | None = None, **_: Any
    ) -> None:
        if not self.slurm or config.hydra.sweeper._target_ != basic_sweeper_target():
            return  # a sampling sweeper's jobs exist only as they run: the keys check stands
        request = slurm_request(config)
        for where, job in composed_jobs(config, config_name):
            if (needed := slurm_request(job)) != request:
                refused = ConfigError(
                    f"hydra/launcher=slurm: this job's trainer needs {needed}, but SLURM gets "
                    f"the sweep's one request for every job, {request}: run the jobs that differ "
                    "as a sweep of their own"
                )
                sys.exit(refusal(os.path.basename(sys.argv[0]), refused, where))


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

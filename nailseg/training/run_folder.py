"""The folders a training job writes, each claimed through `nailseg.io.folder` before the first
byte lands there. Hydra writes nothing itself (conf/train.yaml: `hydra.output_subdir: null`, a
console-only log): `RunFolders` claims the run's or sweep's folder, then each job's, and writes
`.hydra/*.yaml` and the job's log through it. A job's first rank claims; its other DDP ranks
attach. A job folder of an earlier sweep is refused unless the job resumes it; a failed job's
error is kept in its folder's marker (`nailseg.train.SweepReport` names it at the sweep's end).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from nailseg.errors import UserError
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import ForeignFolderError, OwnedFolder, read_marker
from nailseg.training.checks import leave

log = logging.getLogger(__name__)
RUN, SWEEP = "run", "sweep"  # the folders' kinds
SWEEPER_FILES = ("multirun.yaml", "optimization_results.yaml")  # Hydra's and Optuna's
# where a DDP rank launched by Lightning, torchrun or SLURM finds its rank
_RANK_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
ATTACH_WAIT_S = 120.0  # how long a later rank waits for the first to claim the folder
PEER_WAIT_S = 10.0  # how long the first rank waits for a failed rank's error
_held: dict[Path, OwnedFolder] = {}  # the folders this process writes, claimed or attached


def first_rank() -> bool:
    """Whether this process is its job's first (or only) rank: the one that claims."""
    return all(os.environ.get(key, "0") == "0" for key in _RANK_ENV)


def hold(path: str | os.PathLike[str], key: str = "hydra.run.dir") -> OwnedFolder:
    """The run folder at `path`, claimed by the first rank (until `release`), attached by the
    others; NotOursError (naming `key`) for a folder nailseg did not make or another holds."""
    path = Path(os.path.abspath(path))
    if path not in _held:
        _held[path] = OwnedFolder.claim(path, RUN, key=key) if first_rank() else _attach(path)
    return _held[path]


def _attach(path: Path) -> OwnedFolder:
    deadline = time.monotonic() + ATTACH_WAIT_S
    while True:
        try:
            return OwnedFolder.attach(path)
        except ForeignFolderError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def release(path: str | os.PathLike[str]) -> None:
    folder = _held.pop(Path(os.path.abspath(path)), None)
    if folder is not None:
        folder.release()


def _within(path: str | os.PathLike[str]) -> tuple[OwnedFolder, str] | None:
    """The held folder `path` lies in (the innermost), and `path` relative to it."""
    path = Path(os.path.abspath(path))
    for root in sorted(_held, key=lambda p: len(p.parts), reverse=True):
        if root in path.parents:
            return _held[root], path.relative_to(root).as_posix()
    return None


def _holder(path: str | os.PathLike[str]) -> tuple[OwnedFolder, str]:
    """`_within`; outside every held folder, the path's own folder, claimed (a `dirpath` set
    elsewhere)."""
    path = Path(os.path.abspath(path))
    return _within(path) or (hold(path.parent, "its dirpath"), path.name)


def inside(path: str | os.PathLike[str]) -> None:
    """Raise NotOursError where a link lies between the held folder of `path` and it."""
    if (found := _within(path)) is not None:
        found[0].file(found[1])


def write_file(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], object]) -> bool:
    """Write `data` at `path` in its run folder, atomically; False, writing nothing, where a file
    there is not nailseg's: it stays, named in `kept`."""
    folder, rel = _holder(path)
    if os.path.islink(path):
        folder.kept.append(Path(path))
        return False
    return folder.write(rel, data, strict=False) is not None


def remove_file(path: str | os.PathLike[str]) -> bool:
    """Remove the file at `path` if it is nailseg's in a held folder (else False)."""
    found = _within(path)
    return found is not None and found[0].remove(found[1])


def is_ours(path: str | os.PathLike[str]) -> bool:
    found = _within(path)
    return found is not None and found[0].owns(found[1])


def kept() -> list[Path]:
    """The files left in the way, as not nailseg's, in every held folder."""
    return [path for folder in _held.values() for path in folder.kept]


def reserve(path: str | os.PathLike[str], lasting: bool = False) -> None:
    """Make `path` (where a library is about to write) the run's (`OwnedFolder.reserve`); a
    hard-linked file there gets a copy of its own first, so the snapshot never changes."""
    folder, rel = _holder(path)
    folder.reserve(rel, lasting)
    top = folder.path / rel
    for file in [top] if top.is_file() else sorted(top.rglob("*")):
        if file.is_file() and not file.is_symlink() and file.stat().st_nlink > 1:
            folder.write(file.relative_to(folder.path).as_posix(), file.read_bytes())


@contextmanager
def job_log(path: Path) -> Iterator[None]:
    """The root logger's records also appended to `path` in its run folder, as the console shows
    them."""
    folder, rel = _holder(path)
    handler = logging.StreamHandler(os.fdopen(folder.open_append(rel), "a", encoding="utf-8"))
    root = logging.getLogger()
    shown = [h.formatter for h in root.handlers if h.formatter is not None]
    handler.setFormatter(shown[0] if shown else logging.Formatter())
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def record_failure(run_dir: Path, err: BaseException) -> None:
    """Keep a sweep job's error in its folder's marker, for the sweep's exit and compare."""
    try:
        hold(run_dir, "hydra.sweep.dir").update_marker(failed=f"{type(err).__name__}: {err}")
    except NotOursError as refused:
        log.warning("the failure is not recorded: %s", refused)


class RankFailed(UserError):
    """A DDP rank of the job failed; the message names the rank and its error."""


# how the first rank's collective ends when a later rank's process is gone (gloo's words)
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe")


def rank_error(job_dir: Path, err: Exception) -> Exception:
    """The error a job's process ends with: a later DDP rank's own, kept in the job's marker; the
    first rank's collective then fails with its peer gone, and it ends with that rank's error."""
    if not first_rank():
        rank = next((os.environ[k] for k in _RANK_ENV if os.environ.get(k, "0") != "0"), "?")
        line = f"DDP rank {rank}: {type(err).__name__}: {str(err).strip().splitlines()[0]}"
        with contextlib.suppress(NotOursError, OSError):
            hold(job_dir).update_marker(rank_failed=line)
        return RankFailed(line)
    import torch.distributed  # loaded by now: imported here, a Hydra callback's import stays light

    ranks = torch.distributed.is_initialized()  # until the job's end (jobs.isolated_job)
    if not ranks or not any(words in str(err) for words in _PEER_GONE):
        return err
    deadline = time.monotonic() + PEER_WAIT_S
    while (line := (read_marker(job_dir) or {}).get("rank_failed")) is None:
        if time.monotonic() > deadline:
            return RankFailed(f"another DDP rank ended: {str(err).strip().splitlines()[0]}")
        time.sleep(0.2)
    return RankFailed(line)


def read_failure(job: Path) -> str | None:
    """The error a job folder's marker keeps; None for a job that did not fail."""
    return (read_marker(job) or {}).get("failed")


def job_folders(sweep_dir: Path) -> list[Path]:
    """A sweep's job folders (those with a `.hydra/`), by job number; none if it does not exist."""
    if not sweep_dir.is_dir():
        return []
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()]
    return sorted(
        jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    )


class RunFolders(Callback):
    """Claims the folders of a run, a sweep and each job before anything is written there, and
    writes Hydra's files through them; a refusal exits in one line naming the folder."""

    def __init__(self) -> None:
        self._job = ExitStack()  # the job's log, closed at its end
        self._sweep: OwnedFolder | None = None  # held from the sweep's start to its end

    def on_run_start(self, config: DictConfig, **_: Any) -> None:
        _or_leave(lambda: hold(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **_: Any) -> None:
        def claim() -> None:
            sweep = OwnedFolder.claim(config.hydra.sweep.dir, SWEEP, key="hydra.sweep.dir")
            self._sweep = sweep
            sweep.update_marker(session=secrets.token_hex(8))
            for name in SWEEPER_FILES:  # the sweepers write them in place: a new file each time
                sweep.remove(name)
                sweep.reserve(name)
            log.info("sweep folder: %s", sweep.path)

        _or_leave(claim)

    def on_job_start(self, config: DictConfig, **_: Any) -> None:
        _or_leave(lambda: self._start_job(config))

    def _start_job(self, config: DictConfig) -> None:
        hydra = config.hydra
        sweep = HydraConfig.get().mode == RunMode.MULTIRUN
        folder = hold(hydra.runtime.output_dir, "hydra.sweep.dir" if sweep else "hydra.run.dir")
        if first_rank():
            if sweep:
                session = (read_marker(Path(hydra.sweep.dir)) or {}).get("session")
                earlier = folder.marker.get("session")
                if earlier not in (None, session) and OmegaConf.select(config, "ckpt_path") is None:
                    raise NotOursError(
                        f"hydra.sweep.dir={hydra.sweep.dir}: {folder.path} holds a job of an "
                        "earlier sweep: nothing was written; choose another hydra.sweep.dir (or "
                        "hydra.sweep.subdir), or resume its jobs with ckpt_path=last"
                    )
                folder.update_marker(session=session)
            folder.update_marker(failed=None, rank_failed=None)
            task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            files = {"config": task, "hydra": HydraConfig.instance().cfg}
            for name, content in (files | {"overrides": hydra.overrides.task}).items():
                folder.write(f".hydra/{name}.yaml", OmegaConf.to_yaml(content).encode())
        self._job.enter_context(job_log(folder.path / f"{hydra.job.name}.log"))

    def on_job_end(self, config: DictConfig, **_: Any) -> None:
        self._job.close()
        release(config.hydra.runtime.output_dir)

    def on_multirun_end(self, config: DictConfig, **_: Any) -> None:
        if self._sweep is not None:  # compare writes into it next (nailseg.train.SweepReport)
            self._sweep.release()


def _or_leave(claim: Callable[[], object]) -> None:
    try:
        claim()
    except NotOursError as err:
        leave("", err)

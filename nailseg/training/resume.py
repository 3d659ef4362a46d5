"""Which checkpoint `ckpt_path` means, and which run folder a resumed fit continues in.

* `ckpt_path=last` in a run folder that holds a `last.ckpt` (a rerun with a fixed
  `hydra.run.dir`): that one. Otherwise, in a single run, the newest `last.ckpt` among the runs
  beside this one that can be resumed: one that cannot be read (say truncated by a crash), whose
  card is refused, or that another config trained is skipped, and said so; when none can, each is
  named with why. In a sweep (`-m`): this job's own `last.ckpt` only, never a sibling job's
  (rerun the sweep with the same `hydra.sweep.dir`); a job without one starts afresh.
* A fit resumes in the run folder its checkpoint lives in (`<run>/checkpoints/x.ckpt`) when that
  folder is the checkpoint's own run, by identity: the id of the folder's marker (`.nailseg.json`,
  nailseg/io/run_folder.py) is the run id the checkpoint's card carries. The checkpoint callback
  then finds its own folder and keeps the best score and best checkpoint from before the resume
  (also after the folder was moved or copied: checkpoint_io.py), and the loggers continue their
  files. Any other checkpoint is only read: the fit writes into the new run folder.
* One training writes a run folder at a time: rank 0 holds its lock (`hold_run_folder`) for the
  whole run, and a second train.py into it fails at once, naming it.
* The checkpoint must describe the model and input size the config composes, and a fit must
  resume on the data it trained on (`dataset.root` and its split files): resuming another
  architecture would fail deep inside Lightning, or silently mix two experiments.
* A resumed fit restores the checkpoint's LR schedule, whose length is the checkpoint's fit: a fit
  of another length (a larger `trainer.max_epochs`, ...) would run it past its end (cosine climbs
  back up, one-cycle fails), so it is refused before anything is written.
* A resumed fit also restores the optimizer's settings (lr, betas, weight decay, ...) and the
  schedule's, whatever the config says: a config whose `optimizer` or `scheduler` differs from
  the checkpoint's is refused too, naming each key, rather than trained with the checkpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nailseg.io.lock import locked
from nailseg.io.ownership import ForeignFolderError, new_marker, read_marker, write_marker
from nailseg.io.run_folder import RUN_MARKER
from nailseg.model.checkpoint import (
    CheckpointError,
    card_of,
    data_identity,
    new_run_id,
    plain_model,
    read_checkpoint,
)
from nailseg.model.schedules import schedule_length
from nailseg.training.checks import ConfigError

LAST = "last"
CHECKPOINTS = "checkpoints"  # the checkpoint callback's folder in a run (conf/callbacks)
RUN_LOCK = ".train.lock"  # held by the one train.py writing the folder
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    checkpoint: Path
    run_dir: Path  # where the resumed fit writes: the checkpoint's own run folder, else the new one
    card: Mapping[str, Any]  # validated; empty for a checkpoint older than cards
    schedule_steps: int | None = None  # the length of its LR schedule; None without one
    global_step: int = 0  # optimizer steps done: what the loggers keep of the earlier sessions
    run_id: str | None = None  # the run continued in its own folder; None: a new run


def resolve(
    ckpt_path: str | None, run_dir: Path, sweep_job: bool, cfg: DictConfig | None = None
) -> Resume | None:
    """The checkpoint `ckpt_path` names (see the module docstring), or None to start afresh; with
    `cfg`, one that can resume (or evaluate) the fit `cfg` composes (`check_resumable`)."""
    if ckpt_path is None:
        return None
    if ckpt_path != LAST:
        found = _resume(Path(ckpt_path), run_dir, cfg)
        log.info("resuming from %s", found.checkpoint)
        return found
    candidates = _last_candidates(run_dir, sweep_job)
    if not candidates and sweep_job:
        log.info("ckpt_path=last: no checkpoint of this job in %s; starting afresh", run_dir)
        return None
    rejected = []
    for path in candidates:
        try:
            found = _resume(path, run_dir, cfg)
        except CheckpointError as err:
            log.warning("ckpt_path=last: skipping %s: %s", path, err)
            rejected.append(str(err))
            continue
        log.info("resuming from %s", path)
        return found
    raise CheckpointError(
        f"ckpt_path=last: no run under {run_dir.parent} can be resumed"
        + (f": {'; '.join(rejected)}" if rejected else f" (no */{CHECKPOINTS}/last.ckpt)")
    )


def _resume(path: Path, run_dir: Path, cfg: DictConfig | None) -> Resume:
    checkpoint = read_checkpoint(path)
    card = card_of(checkpoint, path) or {}
    step = checkpoint.get("global_step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: global_step={step!r} is not a step count")
    own = _run_folder(path, card.get("run_id"))
    found = Resume(
        path,
        own or run_dir,
        card,
        _schedule_steps(checkpoint),
        step,
        card.get("run_id") if own else None,
    )
    if cfg is not None:
        check_resumable(found, cfg)
    return found


def check_resumable(resume: Resume, cfg: DictConfig) -> None:
    """The checkpoint fits `cfg`: its model and input size; to resume a fit (`train=true`) also
    its data and its optimizer and schedule settings."""
    check_matches(resume, cfg)
    if cfg.train:
        check_restored(resume, cfg)


def _last_candidates(run_dir: Path, sweep_job: bool) -> list[Path]:
    """What `ckpt_path=last` chooses from: the run folder's own `last.ckpt` when it has one (a
    rerun in a fixed folder continues itself, never a sibling); in a sweep only that one; else
    every run's beside it."""
    own = run_dir / CHECKPOINTS / "last.ckpt"
    if own.is_file() or sweep_job:
        return [own] if own.is_file() else []
    found = [(p.stat().st_mtime_ns, p) for p in run_dir.parent.glob(f"*/{CHECKPOINTS}/last.ckpt")]
    return [path for _, path in sorted(found, reverse=True)]  # the newest first


def _schedule_steps(checkpoint: Mapping[str, Any]) -> int | None:
    """The length (`T_max`, `total_steps`) of the checkpoint's LR schedule, from its state."""
    states = checkpoint.get("lr_schedulers")
    if not isinstance(states, list) or not states or not isinstance(states[0], Mapping):
        return None
    return schedule_length(states[0])


def _run_folder(checkpoint: Path, run_id: str | None) -> Path | None:
    """`<run>` for a checkpoint of the run that folder holds (`<run>/checkpoints/<name>.ckpt`,
    its card's `run_id` the one `<run>`'s marker names); None for any other."""
    folder = checkpoint.absolute().parent
    if folder.name != CHECKPOINTS or run_id is None:
        return None
    return folder.parent if read_run_id(folder.parent) == run_id else None


def read_run_id(run_dir: Path) -> str | None:
    """The id of the run folder `run_dir`, from its marker; None without a marker nailseg wrote."""
    try:
        marker = read_marker(run_dir, RUN_MARKER, "run")
    except ForeignFolderError:
        return None
    return marker["id"] if marker else None


def folder_run_id(run_dir: Path) -> str:
    """The run id of a fit writing into `run_dir`, which its checkpoints' cards carry: the
    folder's (Hydra's callback marks each job's folder as it starts; a resumed run's folder has
    its own), else a new one, which `hold_run_folder` writes."""
    return read_run_id(run_dir) or new_run_id()


@contextmanager
def hold_run_folder(
    run_dir: Path, run_id: str, resumed: Resume | None, hold: bool = True
) -> Iterator[None]:
    """Hold `run_dir` for this run: its lock, so a second train.py into it fails at once, and its
    marker, made with `run_id` (`folder_run_id`) when it has none. `hold=False` (the job's other
    DDP ranks, which write into rank 0's folder): nothing."""
    if not hold:
        yield
        return
    key = "ckpt_path" if resumed is not None and resumed.run_id is not None else "hydra.run.dir"
    with locked(run_dir, RUN_LOCK, "train.py", key, ConfigError):
        try:
            if read_marker(run_dir, RUN_MARKER, "run") is None:
                write_marker(run_dir, RUN_MARKER, new_marker("run", id=run_id))
        except ForeignFolderError as err:
            raise ConfigError(f"{err} (or another {key})") from None
        yield


def check_matches(resume: Resume, cfg: DictConfig) -> None:
    """The checkpoint was trained with the model and input size `cfg` describes, and, to resume
    its fit (`train=true`), on its data: the same resolved `dataset.root` and split files (an
    evaluation may score it on any data)."""
    card = resume.card
    if not card:
        return
    ours = {
        "model": plain_model(cfg.model, "model"),
        "dataset.image_size": [int(v) for v in cfg.dataset.image_size],
    }
    theirs = {"model": card.get("model"), "dataset.image_size": card.get("image_size")}
    if cfg.train and card.get("data") is not None:
        ours["dataset"] = _shown_data(data_identity(cfg.dataset.root))
        theirs["dataset"] = _shown_data(card["data"])
    differ = [key for key in ours if theirs[key] is not None and theirs[key] != ours[key]]
    if differ:
        detail = "; ".join(f"{k}: checkpoint {theirs[k]}, config {ours[k]}" for k in differ)
        raise CheckpointError(
            f"{resume.checkpoint} was trained with another {' and '.join(differ)} ({detail}); "
            "pass the checkpoint's values"
        )


def _shown_data(identity: Mapping[str, Any]) -> str:
    """`root (split files: train abc123…, valid …)`: what a data mismatch names."""
    splits = ", ".join(
        f"{split} {digest[:12]}" for split, digest in identity["splits"].items() if digest
    )
    return f"{identity['root']} (split files: {splits or 'none'})"


# what Lightning restores on a resume, whatever the config says: the optimizer's param groups
# (lr, betas, weight decay, ...) and the LR schedule's state
_RESTORED = ("optimizer", "scheduler")
# how the optimizer computes, not what: a checkpoint of either kind resumes under the other
# (and keeps its own)
_IMPLEMENTATION_KEYS = frozenset({"fused"})


def check_restored(resume: Resume, cfg: DictConfig) -> None:
    """The config's optimizer and LR schedule are the checkpoint's. Lightning restores both from
    it, so `optimizer.lr=0.05` on a resume trained on with the checkpoint's lr, silently."""
    theirs = resume.card.get("config")
    if not theirs:  # a checkpoint older than cards' configs
        return
    ours = {
        group: None if cfg[group] is None else OmegaConf.to_container(cfg[group], resolve=True)
        for group in _RESTORED
    }
    differ = [line for group in _RESTORED for line in _differences(group, theirs, ours)]
    if differ:
        raise CheckpointError(
            f"{resume.checkpoint} was trained with other optimizer or schedule settings "
            f"({'; '.join(differ)}): a resumed fit restores the checkpoint's, so this config's "
            "would not take effect. Resume with the checkpoint's values, or start a new run "
            f"from its weights: model.encoder_weights={resume.checkpoint} (the encoder; the "
            "decoder starts afresh)"
        )


def _differences(group: str, theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """`group.key: checkpoint a, config b` for each value that differs; another optimizer or
    schedule altogether (or none) as one line naming both, `none` for a group set to null."""
    before, now = theirs.get(group), ours.get(group)
    if not (isinstance(before, Mapping) and isinstance(now, Mapping)) or (
        before.get("_target_") != now.get("_target_")
    ):
        named = [g.get("_target_") if isinstance(g, Mapping) else "none" for g in (before, now)]
        return [] if before == now else [f"{group}: checkpoint {named[0]}, config {named[1]}"]
    keys = sorted((before.keys() | now.keys()) - _IMPLEMENTATION_KEYS)
    return [
        f"{group}.{key}: checkpoint {before.get(key, 'unset')}, config {now.get(key, 'unset')}"
        for key in keys
        if before.get(key, "unset") != now.get(key, "unset")
    ]


# the trainer keys that size a fit (with the batch size, the devices and the train split)
_FIT_LENGTH_KEYS = ("max_epochs", "max_steps")


def check_schedule(resume: Resume, steps: float | None, cfg: DictConfig) -> None:
    """The resumed fit's LR schedule spans as many steps as the checkpoint's (`steps`: this fit's
    length; None without a sized schedule, so `scheduler=none` may extend a fit)."""
    theirs = resume.schedule_steps
    if theirs is None or steps is None or steps == theirs:
        return
    before = _fit_settings((resume.card.get("config") or {}).get("trainer") or {})
    raise CheckpointError(
        f"{resume.checkpoint}: its LR schedule spans {theirs} optimizer steps"
        + (f" ({before})" if before else "")
        + f", this fit's would span {steps} ({_fit_settings(cfg.trainer)}): resuming would run "
        "the restored schedule past its end or stop it early. Resume with the checkpoint's "
        "length (its trainer.max_epochs, trainer.max_steps, loader.batch_size, devices and train "
        "data), or start a new run from its weights: "
        f"model.encoder_weights={resume.checkpoint} (the encoder; the decoder starts afresh)"
    )


def _fit_settings(trainer: Mapping[str, Any]) -> str:
    return " ".join(
        f"trainer.{key}={trainer[key]}" for key in _FIT_LENGTH_KEYS if trainer.get(key) is not None
    )

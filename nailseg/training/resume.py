"""Which checkpoint `ckpt_path` means, and which run folder a resumed fit continues in.

* `ckpt_path=last` in a run folder that holds a `last.ckpt` (a rerun with a fixed
  `hydra.run.dir`): that one. Otherwise, in a single run, the newest *valid* `last.ckpt` among
  the runs beside this one (a checkpoint that cannot be read, say truncated by a crash, is
  skipped, and said so). In a sweep (`-m`): this job's own `last.ckpt` only, never a sibling
  job's (rerun the sweep with the same `hydra.sweep.dir`); a job without one starts afresh.
* A fit resumes in the run folder its checkpoint lives in (`<run>/checkpoints/x.ckpt`): the
  checkpoint callback then finds its own folder and keeps the best score and best checkpoint from
  before the resume, and the loggers continue their files. Only a checkpoint kept elsewhere
  resumes into the new run folder.
* The checkpoint must describe the model and input size the config composes: resuming another
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nailseg.model.checkpoint import (
    CheckpointError,
    card_of,
    plain_model,
    read_checkpoint,
)
from nailseg.model.schedules import schedule_length

LAST = "last"
CHECKPOINTS = "checkpoints"  # the checkpoint callback's folder in a run (conf/callbacks)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    checkpoint: Path
    run_dir: Path  # where the resumed fit writes: the checkpoint's own run folder
    card: Mapping[str, Any]  # empty for a checkpoint older than cards
    schedule_steps: int | None = None  # the length of its LR schedule; None without one
    global_step: int = 0  # optimizer steps done: what the loggers keep of the earlier sessions


def _valid(path: Path) -> Mapping[str, Any] | None:
    try:
        return read_checkpoint(path)
    except CheckpointError as err:
        log.warning("skipping %s: %s", path, err)
        return None


def _newest_valid(candidates: list[Path]) -> tuple[Path, Mapping[str, Any]] | None:
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime_ns, reverse=True):
        checkpoint = _valid(path)
        if checkpoint is not None:
            return path, checkpoint
    return None


def resolve(ckpt_path: str | None, run_dir: Path, sweep_job: bool) -> Resume | None:
    """The checkpoint `ckpt_path` names (see the module docstring), or None to start afresh."""
    if ckpt_path is None:
        return None
    if ckpt_path == LAST:
        candidates = _last_candidates(run_dir, sweep_job)
        found = _newest_valid(candidates)
        if found is None and sweep_job:
            log.info("ckpt_path=last: no checkpoint of this job in %s; starting afresh", run_dir)
            return None
        if found is None:
            unreadable = f" ({len(candidates)} found, none readable)" if candidates else ""
            if len(candidates) == 1:  # this run's own, or the only one beside it
                unreadable = f" ({candidates[0]} is not readable)"
            raise CheckpointError(
                f"ckpt_path=last: no valid */checkpoints/last.ckpt under {run_dir.parent}"
                + unreadable
            )
        path, checkpoint = found
    else:
        path = Path(ckpt_path)
        checkpoint = read_checkpoint(path)
    log.info("resuming from %s", path)
    return Resume(
        path,
        _run_folder(path) or run_dir,
        card_of(checkpoint) or {},
        _schedule_steps(checkpoint),
        int(checkpoint.get("global_step", 0)),
    )


def _last_candidates(run_dir: Path, sweep_job: bool) -> list[Path]:
    """What `ckpt_path=last` chooses from: the run folder's own `last.ckpt` when it has one (a
    rerun in a fixed folder continues itself, never a sibling); in a sweep only that one; else
    every run's beside it."""
    own = run_dir / CHECKPOINTS / "last.ckpt"
    if own.is_file() or sweep_job:
        return [own] if own.is_file() else []
    return list(run_dir.parent.glob(f"*/{CHECKPOINTS}/last.ckpt"))


def _schedule_steps(checkpoint: Mapping[str, Any]) -> int | None:
    """The length (`T_max`, `total_steps`) of the checkpoint's LR schedule, from its state."""
    states = checkpoint.get("lr_schedulers") or []
    return schedule_length(states[0]) if states else None


def _run_folder(checkpoint: Path) -> Path | None:
    """`<run>` for a checkpoint the checkpoint callback wrote (`<run>/checkpoints/<name>.ckpt`)."""
    folder = checkpoint.absolute().parent
    return folder.parent if folder.name == CHECKPOINTS else None


def check_matches(resume: Resume, cfg: DictConfig) -> None:
    """The checkpoint was trained with the model and input size `cfg` describes."""
    card = resume.card
    if not card:
        return
    ours = {
        "model": plain_model(cfg.model, "model"),
        "dataset.image_size": [int(v) for v in cfg.dataset.image_size],
    }
    theirs = {"model": card.get("model"), "dataset.image_size": card.get("image_size")}
    differ = [key for key in ours if theirs[key] is not None and theirs[key] != ours[key]]
    if differ:
        detail = "; ".join(f"{k}: checkpoint {theirs[k]}, config {ours[k]}" for k in differ)
        raise CheckpointError(
            f"{resume.checkpoint} was trained with another {' and '.join(differ)} ({detail}); "
            "pass the checkpoint's values"
        )


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

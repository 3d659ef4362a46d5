"""Which checkpoint `ckpt_path` means, and which run folder a resumed fit continues in.

* `ckpt_path=last` in a single run: the newest *valid* `last.ckpt` among the runs beside this one
  (a checkpoint that cannot be read, say truncated by a crash, is skipped, and said so). In a
  sweep (`-m`): this job's own `last.ckpt` only, never a sibling job's (rerun the sweep with the
  same `hydra.sweep.dir`); a job without one starts afresh.
* A fit resumes in the run folder its checkpoint lives in (`<run>/checkpoints/x.ckpt`): the
  checkpoint callback then finds its own folder and keeps the best score and best checkpoint from
  before the resume, and the loggers continue their files. Only a checkpoint kept elsewhere
  resumes into the new run folder.
* The checkpoint must describe the model and input size the config composes: resuming another
  architecture would fail deep inside Lightning, or silently mix two experiments.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from nailseg.model.checkpoint import (
    CheckpointError,
    card_of,
    plain_model,
    read_checkpoint,
)

LAST = "last"
CHECKPOINTS = "checkpoints"  # the checkpoint callback's folder in a run (conf/callbacks)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    checkpoint: Path
    run_dir: Path  # where the resumed fit writes: the checkpoint's own run folder
    card: Mapping[str, Any]  # empty for a checkpoint older than cards


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
        if sweep_job:
            candidates = [p for p in [run_dir / CHECKPOINTS / "last.ckpt"] if p.is_file()]
        else:
            candidates = [
                p
                for p in run_dir.parent.glob(f"*/{CHECKPOINTS}/last.ckpt")
                if run_dir.absolute() not in p.absolute().parents
            ]
        found = _newest_valid(candidates)
        if found is None and sweep_job:
            log.info("ckpt_path=last: no checkpoint of this job in %s; starting afresh", run_dir)
            return None
        if found is None:
            raise CheckpointError(
                f"ckpt_path=last: no valid */checkpoints/last.ckpt under {run_dir.parent}"
                + (f" ({len(candidates)} found, none readable)" if candidates else "")
            )
        path, checkpoint = found
    else:
        path = Path(ckpt_path)
        checkpoint = read_checkpoint(path)
    log.info("resuming from %s", path)
    return Resume(path, _run_folder(path) or run_dir, card_of(checkpoint) or {})


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

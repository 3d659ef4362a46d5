"""Which checkpoint `ckpt_path` means, and which run folder a resumed fit continues in.

* `ckpt_path=last`: the run folder's own `last.ckpt`, else the newest among the runs beside it
  that can be resumed (each one skipped is named, with why); in a sweep, the job's own only.
* A fit continues in its checkpoint's run folder (`<run>/checkpoints/x.ckpt`) when the folder's
  marker id is the run id the checkpoint's card carries and the folder is that marker's own, not
  a copy of it (`cp -a`, a restored backup); any other checkpoint is only read.
* The checkpoint must fit the config: its model and input size, and for a fit its data, its
  optimizer and schedule settings and its schedule's length, all of which Lightning restores
  whatever the config says. Anything else is refused before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nailseg.io.folder import is_copy, read_marker
from nailseg.model.checkpoint import (
    CheckpointError,
    card_of,
    data_identity,
    plain_model,
    read_checkpoint,
)
from nailseg.model.schedules import schedule_length
from nailseg.training.checks import take_card

LAST = "last"
CHECKPOINTS = "checkpoints"  # the checkpoint callback's folder in a run (conf/callbacks)
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
    """The checkpoint `ckpt_path` names, or None to start afresh; with `cfg`, one that can
    resume (or evaluate) the fit `cfg` composes."""
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


def resolve_for(cfg: DictConfig, sweep_job: bool) -> Resume | None:
    """What `cfg.ckpt_path` resumes, the fit then writing into the checkpoint's own run folder
    (`cfg.run_dir` set to it), or evaluates (`cfg` takes the checkpoint's model and input size)."""
    resumed = resolve(cfg.ckpt_path, Path(cfg.run_dir), sweep_job, cfg if cfg.train else None)
    if resumed is not None and cfg.train:
        cfg.run_dir = str(resumed.run_dir)
    elif resumed is not None:
        take_card(cfg, resumed.card, str(resumed.checkpoint))
        check_matches(resumed, cfg)
    return resumed


def _resume(path: Path, run_dir: Path, cfg: DictConfig | None) -> Resume:
    checkpoint = read_checkpoint(path)
    card = card_of(checkpoint, path) or {}
    step = checkpoint.get("global_step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: global_step={step!r} is not a step count")
    if cfg is not None and cfg.train:
        _check_restorable(path, checkpoint)
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


# what Lightning restores for a fit, with its kind (missing in a weights-only checkpoint)
_FIT_STATE = {
    "optimizer_states": list,
    "lr_schedulers": list,
    "loops": Mapping,
    "callbacks": Mapping,
}


def _check_restorable(path: Path, checkpoint: Mapping[str, Any]) -> None:
    """The fit state Lightning restores is whole (else it fails deep inside with a trace)."""
    for key, kind in _FIT_STATE.items():
        if not isinstance(checkpoint.get(key), kind):
            raise CheckpointError(
                f"{path}: its {key} is missing or damaged, so a fit cannot resume from it; "
                f"start a new run from its weights: model.encoder_weights={path}"
            )


def check_resumable(resume: Resume, cfg: DictConfig) -> None:
    """The checkpoint fits `cfg`: its model and input size; to resume a fit (`train=true`) also
    its data and its optimizer and schedule settings."""
    check_matches(resume, cfg)
    if cfg.train:
        check_restored(resume, cfg)


def _last_candidates(run_dir: Path, sweep_job: bool) -> list[Path]:
    """What `ckpt_path=last` chooses from, the newest first (see the module docstring)."""
    own = run_dir / CHECKPOINTS / "last.ckpt"
    if own.is_file() or sweep_job:
        return [own] if own.is_file() else []
    found = [
        (p.stat().st_mtime_ns, p)
        for p in run_dir.parent.glob(f"*/{CHECKPOINTS}/last.ckpt")
        if not _copied(p.parent.parent)
    ]
    return [path for _, path in sorted(found, reverse=True)]  # the newest first


def _copied(run: Path) -> bool:
    """Whether `run` is a copy of a run folder: the original is the one resumed, never it."""
    marker = read_marker(run)
    if marker is not None and is_copy(run, marker):
        log.info("ckpt_path=last: %s is a copy of a run folder: never resumed into", run)
        return True
    return False


def _schedule_steps(checkpoint: Mapping[str, Any]) -> int | None:
    """The length (`T_max`, `total_steps`) of the checkpoint's LR schedule, from its state."""
    states = checkpoint.get("lr_schedulers")
    if not isinstance(states, list) or not states or not isinstance(states[0], Mapping):
        return None
    return schedule_length(states[0])


def _run_folder(checkpoint: Path, run_id: str | None) -> Path | None:
    """`<run>` for a checkpoint of the run that folder holds (`<run>/checkpoints/<name>.ckpt`,
    its card's `run_id` the one `<run>`'s marker names, `<run>` not a copy); None for any other."""
    folder = checkpoint.absolute().parent
    if folder.name != CHECKPOINTS or run_id is None:
        return None
    marker = read_marker(folder.parent)
    own = marker is not None and marker["kind"] == "run" and marker["id"] == run_id
    return folder.parent if own and not is_copy(folder.parent, marker) else None


def check_matches(resume: Resume, cfg: DictConfig) -> None:
    """The checkpoint was trained with `cfg`'s model and input size and, to resume its fit, on
    its data (`dataset.root` and its split files; an evaluation may score any data)."""
    card = resume.card
    if not card:
        return
    ours = {
        "model": plain_model(cfg.model, "model"),
        "dataset.image_size": [int(v) for v in cfg.dataset.image_size],
    }
    theirs = {"model": card.get("model"), "dataset.image_size": card.get("image_size")}
    if cfg.train and card.get("data") is not None:
        ours["dataset"] = _shown_data(data_identity(cfg.dataset.root, cfg.dataset.mix))
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
    mixed = "".join(
        f"; mixed in: {m['name']} {m['root']} weight {m['weight']:g} (train {str(m['train'])[:12]})"
        for m in identity.get("mix", [])
    )
    return f"{identity['root']} (split files: {splits or 'none'}){mixed}"


# what Lightning restores on a resume, whatever the config says
_RESTORED = ("optimizer", "scheduler")
# how the optimizer computes, not what: either resumes the other
_IMPLEMENTATION_KEYS = frozenset({"fused"})


def check_restored(resume: Resume, cfg: DictConfig) -> None:
    """The config's optimizer and LR schedule are the checkpoint's, which Lightning restores."""
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
    schedule altogether (or none) as one line naming both."""
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
    """The resumed fit's LR schedule spans as many steps as the checkpoint's (`steps`: this fit's;
    None without a sized schedule: `scheduler=none` may extend a fit)."""
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

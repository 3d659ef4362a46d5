"""Which checkpoint `ckpt_path` means, and which run folder a resumed fit continues in.

`ckpt_path=last`: the run folder's own `last.ckpt`, else the newest resumable one beside it (each
skipped is named); in a sweep, the job's own. A fit continues in its checkpoint's run folder when
that folder's marker names the card's run id and is not a copy. The checkpoint must fit the
config: model, input size and, for a fit, the data, optimizer and schedule Lightning restores.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
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

LAST = "last"
CHECKPOINTS = "checkpoints"  # the checkpoint callback's folder in a run (conf/callbacks)
log = logging.getLogger(__name__)
# what Lightning restores for a fit, with its kind (missing in a weights-only checkpoint)
_FIT_STATE = {
    "optimizer_states": list,
    "lr_schedulers": list,
    "loops": Mapping,
    "callbacks": Mapping,
}
_RESTORED = ("optimizer", "scheduler")  # restored on a resume, whatever the config says
_IMPLEMENTATION_KEYS = frozenset({"fused"})  # how the optimizer computes, not what
_FIT_LENGTH_KEYS = ("max_epochs", "max_steps")
FROM_WEIGHTS = "start a new run from its weights: init_from={} (a fine-tune of the whole net)"


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
    resume the fit `cfg` composes."""
    if ckpt_path is None:
        return None
    doing = "evaluating" if cfg is None else "resuming from"
    if ckpt_path != LAST:
        found = _resume(Path(ckpt_path), run_dir, cfg)
        log.info("%s %s", doing, found.checkpoint)
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
        log.info("%s %s", doing, path)
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
    return resumed


def _resume(path: Path, run_dir: Path, cfg: DictConfig | None) -> Resume:
    checkpoint = read_checkpoint(path)
    card = card_of(checkpoint, path) or {}
    step = checkpoint.get("global_step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: global_step={step!r} is not a step count")
    if cfg is not None:  # the fit state Lightning restores is whole (else a deep trace)
        for key, kind in _FIT_STATE.items():
            if not isinstance(checkpoint.get(key), kind):
                raise CheckpointError(
                    f"{path}: its {key} is missing or damaged, so a fit cannot resume from it; "
                    + FROM_WEIGHTS.format(path)
                )
    states = checkpoint.get("lr_schedulers")
    steps = schedule_length(states[0]) if states and isinstance(states[0], Mapping) else None
    own = _run_folder(path, card.get("run_id"))
    found = Resume(path, own or run_dir, card, steps, step, card.get("run_id") if own else None)
    if cfg is not None:
        check_matches(found, cfg)
        check_restored(found, cfg)
    return found


def _last_candidates(run_dir: Path, sweep_job: bool) -> list[Path]:
    """What `ckpt_path=last` chooses from, newest first; never a copy, nor a run with none (named)."""
    own = run_dir / CHECKPOINTS / "last.ckpt"
    if own.is_file() or sweep_job:
        return [own] if own.is_file() else []
    found = []
    beside = run_dir.parent.iterdir() if run_dir.parent.is_dir() else ()
    for run in sorted(p for p in beside if p.is_dir() and p != run_dir):
        path, marker = run / CHECKPOINTS / "last.ckpt", read_marker(run)
        if marker is not None and is_copy(run, marker):
            log.info("ckpt_path=last: %s is a copy of a run folder: never resumed into", run)
        elif path.is_file():
            found.append((path.stat().st_mtime_ns, path))
        elif marker is not None and marker["kind"] == "run":
            log.info("ckpt_path=last: skipping %s: it saved no checkpoint", run)
    return [path for _, path in sorted(found, reverse=True)]


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
    """The checkpoint was trained with `cfg`'s model, input size and data (`dataset.root` and its
    split files)."""
    card = resume.card
    if not card:
        return
    ours = {
        "model": plain_model(cfg.model, "model"),
        "dataset.image_size": [int(v) for v in cfg.dataset.image_size],
    }
    theirs = {"model": card.get("model"), "dataset.image_size": card.get("image_size")}
    if card.get("data") is not None:
        ours["dataset"] = _shown_data(data_identity(cfg.dataset.root, cfg.dataset.mix))
        theirs["dataset"] = _shown_data(card["data"])
    differ = [key for key in ours if theirs[key] is not None and theirs[key] != ours[key]]
    if differ:
        detail = "; ".join(f"{k}: checkpoint {theirs[k]}, config {ours[k]}" for k in differ)
        raise CheckpointError(
            f"{resume.checkpoint} was trained with another {' and '.join(differ)} ({detail}); "
            "pass the checkpoint's values"
        )


def take_card(cfg: DictConfig, card: Mapping[str, Any], ckpt: str) -> None:
    """An evaluation (`train=false`) takes the model and input size from the checkpoint's card, as
    predict does; a value the command line gives that differs raises, naming the key."""
    given = None  # not started by Hydra (a script's config): every key counts as given
    if HydraConfig.initialized():
        given = [a.lstrip("+~").partition("=")[0] for a in HydraConfig.get().overrides.task]
    pairs = {"model": card.get("model"), "dataset.image_size": card.get("image_size")}
    for key, theirs in pairs.items():
        node = OmegaConf.select(cfg, key)
        ours = plain_model(node, key) if key == "model" else list(node)
        if theirs is None or ours == theirs:  # None: a checkpoint older than cards
            continue
        if given is None or any(k == key or k.startswith(f"{key}.") for k in given):
            raise CheckpointError(
                f"{key}: {ckpt} was trained with {theirs}, not {ours}: leave {key} out to "
                "evaluate the checkpoint with its own"
            )
        if key == "model":  # arch, encoder_name and options, each replaced whole
            for name, value in theirs.items():
                cfg.model[name] = value
        else:
            OmegaConf.update(cfg, key, list(theirs), merge=False)


def _shown_data(identity: Mapping[str, Any]) -> str:
    """`root (split files: train abc123…, valid …)`: what a data mismatch names."""
    splits = ", ".join(f"{s} {digest[:12]}" for s, digest in identity["splits"].items() if digest)
    mixed = "".join(
        f"; mixed in: {m['name']} {m['root']} weight {m['weight']:g} (train {str(m['train'])[:12]})"
        for m in identity.get("mix", [])
    )
    return f"{identity['root']} (split files: {splits or 'none'}){mixed}"


def check_restored(resume: Resume, cfg: DictConfig) -> None:
    """The config's optimizer and LR schedule are the checkpoint's, which Lightning restores."""
    theirs = resume.card.get("config")
    if not theirs:  # a checkpoint older than cards' configs
        return
    differ = []
    for group in _RESTORED:
        before = theirs.get(group)
        now = None if cfg[group] is None else OmegaConf.to_container(cfg[group], resolve=True)
        named = [g.get("_target_") if isinstance(g, Mapping) else "none" for g in (before, now)]
        if "none" in named or named[0] != named[1]:  # another optimizer or schedule, or none
            differ += (
                [f"{group}: checkpoint {named[0]}, config {named[1]}"] if before != now else []
            )
            continue
        for key in sorted((before.keys() | now.keys()) - _IMPLEMENTATION_KEYS):
            if (old := before.get(key, "unset")) != (new := now.get(key, "unset")):
                differ.append(f"{group}.{key}: checkpoint {old}, config {new}")
    if differ:
        raise CheckpointError(
            f"{resume.checkpoint} was trained with other optimizer or schedule settings "
            f"({'; '.join(differ)}): a resumed fit restores the checkpoint's, so this config's "
            "would not take effect. Resume with the checkpoint's values, or "
            + FROM_WEIGHTS.format(resume.checkpoint)
        )


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
        "data), or " + FROM_WEIGHTS.format(resume.checkpoint)
    )


def _fit_settings(trainer: Mapping[str, Any]) -> str:
    return " ".join(
        f"trainer.{key}={trainer[key]}" for key in _FIT_LENGTH_KEYS if trainer.get(key) is not None
    )

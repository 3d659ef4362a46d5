"""prepare's settings and request checks: everything that can refuse a request does so before the
first write."""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from omegaconf import DictConfig, OmegaConf

from nailseg.config import CONF_DIR
from nailseg.errors import UserError
from nailseg.io.folder import OWN_NAMES, is_copy, read_marker
from nailseg.io.overlap import overlap
from nailseg.io.permissions import may_write
from nailseg.prep.format import KIND, output_paths
from nailseg.prep.imageio import check_mask_threshold
from nailseg.prep.layout import OUTPUT_CLASH, Exclusion, Pair, find_pairs
from nailseg.prep.splits import SplitSettings, check_split_settings


class PrepareError(UserError, RuntimeError):
    """A request refused or a run with nothing usable: the message says which and why."""


@dataclass(frozen=True)
class PrepareSettings:
    """How prepare converts, checks and splits (conf/prepare.yaml's keys of the same names)."""

    mask_threshold: int  # a mask value above it is nail; {0, 1} masks are taken as they are
    strict: bool  # any excluded file fails the run
    prune: bool  # delete the outputs of pairs gone from the input (else kept, unlisted)
    num_workers: int | None  # processes; None: one per CPU core
    split: SplitSettings

    @classmethod
    def from_config(cls, cfg: DictConfig) -> PrepareSettings:
        """The settings of a composed conf/prepare.yaml."""
        split = OmegaConf.to_container(cfg.split, resolve=True)
        split["holdout_groups"] = tuple(split["holdout_groups"])
        return cls(
            cfg.mask_threshold, cfg.strict, cfg.prune, cfg.num_workers, SplitSettings(**split)
        )


def compose_prepare(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/prepare.yaml with Hydra `overrides`, composed inside a Hydra app or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose("prepare", overrides=list(overrides))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("prepare", overrides=list(overrides))


def _checked_split(split: SplitSettings, groups: list[str] | None = None) -> None:
    try:
        check_split_settings(split, groups)
    except ValueError as err:
        raise PrepareError(str(err)) from err


def check_request(input_dir: Path, out_root: Path, settings: PrepareSettings) -> None:
    """Refuse a request that cannot end well. Needs nothing of the input but its path, so `run`
    checks it before it generates the input; `usable_pairs` checks the input's files."""
    _checked_split(settings.split)
    if settings.split.folds == 1 and settings.split.valid_fraction == 0:
        raise PrepareError(
            "split.valid_fraction=0 leaves no validation split, and training needs one (it "
            "validates every epoch and keeps the best checkpoint by val/dice): set e.g. 0.2"
        )
    try:
        check_mask_threshold(settings.mask_threshold)
    except ValueError as err:
        raise PrepareError(str(err)) from err
    if overlap(input_dir, out_root):
        raise PrepareError(
            f"input_dir={input_dir} and output_dir={out_root} overlap (one is, or is inside, the "
            "other, comparing names without case): choose an output_dir outside the input"
        )
    _check_creatable(out_root)
    refuse_foreign(out_root, KIND, "output_dir")


def refuse_foreign(folder: Path, kind: str, key: str) -> None:
    """Refuse, before anything is written, a folder that `OwnedFolder.claim(folder, kind)` would
    refuse: one holding files but no nailseg marker of `kind`, or a copy of nailseg's folder."""
    being_written = tuple(f".{name}." for name in OWN_NAMES)  # by a claim in another process
    try:
        names = sorted(n for n in os.listdir(folder) if not n.startswith(being_written))
    except (FileNotFoundError, NotADirectoryError):
        return
    names = [n for n in names if n not in OWN_NAMES]
    marker = read_marker(folder)
    if marker is None and names:
        why = f"it holds {folder / names[0]}" + (f" and {len(names) - 1} more" if names[1:] else "")
    elif marker is not None and marker["kind"] != kind:
        why = f"it is nailseg's {marker['kind']} folder"
    elif marker is not None and is_copy(folder, marker):
        why = "it is a copy of nailseg's folder (a backup, or a folder copied with its files)"
    else:
        return
    raise PrepareError(
        f"{key}={folder} is not a folder nailseg made ({why}): nothing was written; choose a new "
        "or empty folder"
    )


def _check_creatable(out_root: Path) -> None:
    """Refuse an output_dir that is, or lies below, a link to nothing or a file, or whose nearest
    existing folder this user may not write in. One stat a path: another process may make the
    folder meanwhile, and a path seen missing, then present, is no file."""
    for path in (out_root, *out_root.parents):
        try:
            if stat.S_ISDIR(os.stat(path).st_mode):
                if not may_write(path):
                    raise PrepareError(
                        f"output_dir={out_root}: {path} is not writable by this user: change its "
                        "permissions, or choose another output_dir"
                    )
                return
        except (FileNotFoundError, NotADirectoryError):  # missing, or below a file
            if os.path.islink(path):
                raise PrepareError(
                    f"output_dir={out_root}: {path} is a symlink to {os.readlink(path)}, which "
                    "does not exist: create that folder, or choose another output_dir"
                ) from None
            continue
        raise PrepareError(f"output_dir={out_root}: {path} is a file, not a folder")


def _require_input(input_dir: Path) -> None:
    if not input_dir.is_dir():
        raise PrepareError(f"input_dir={input_dir} does not exist")


def usable_pairs(input_dir: Path, split: SplitSettings) -> tuple[list[Pair], list[Exclusion]]:
    """The input's pairs and every file left out; refuses an input without a pair or without a
    held-out group."""
    _require_input(input_dir)
    try:
        pairs, excluded = find_pairs(input_dir)
    except FileNotFoundError as err:
        raise PrepareError(str(err)) from err
    pairs, clashing = _output_clashes(pairs, input_dir)
    excluded += clashing
    if not pairs:
        raise PrepareError(nothing_usable(input_dir, pairs, excluded))
    _checked_split(split, [p.group for p in pairs])
    return pairs, excluded


def _output_clashes(pairs: list[Pair], input_dir: Path) -> tuple[list[Pair], list[Exclusion]]:
    """Pairs whose output would be a folder of another pair's output (`g/x.png` and
    `g/x.npy/y.png`, names compared without case) are both excluded, each naming the other."""
    outputs = {output_paths(pair.key)[0].casefold(): pair for pair in pairs}
    clashes: dict[str, str] = {}  # pair key -> detail
    for pair in pairs:
        for parent in PurePosixPath(output_paths(pair.key)[0]).parents:
            other = outputs.get(parent.as_posix().casefold())
            if other is not None:
                names = " and ".join(
                    p.image.relative_to(input_dir).as_posix() for p in (other, pair)
                )
                detail = f"{names} would write {parent}, as a file and as a folder"
                clashes[pair.key] = clashes[other.key] = detail
    excluded = [
        Exclusion(path, OUTPUT_CLASH, clashes[pair.key])
        for pair in pairs
        if pair.key in clashes
        for path in (pair.image, pair.mask)
    ]
    return [pair for pair in pairs if pair.key not in clashes], excluded


def nothing_usable(
    input_dir: Path, pairs: list[Pair], excluded: list[Exclusion], made: str | None = None
) -> str:
    """The error of a run without a usable pair; `made`: what it created, if anything."""
    if not pairs and not excluded:
        return f"no image files found under {input_dir}/Images and {input_dir}/Masks"
    reasons = Counter(e.kind for e in excluded)
    listed = ", ".join(f"{n} {kind}" for kind, n in reasons.most_common())
    outcome = f"Nothing was converted: {made}" if made else "Nothing was changed"
    return f"no usable image/mask pair in {input_dir}: {listed}; first: {excluded[0]}. {outcome}"


def generates(cfg: DictConfig) -> bool:
    """Whether `run` makes its input: a synthetic dataset read from its own raw_dir."""
    dataset = cfg.dataset
    return (
        dataset.synthetic is not None
        and bool(dataset.raw_dir)
        and Path(cfg.input_dir) == Path(dataset.raw_dir)
    )


def check_config(cfg: DictConfig) -> None:
    """Everything `run` can check before its first write, on a composed conf/prepare.yaml: the
    request; the input exists, or for a synthetic set it will generate, the set's size and the
    held-out groups against the groups it will have."""
    settings = PrepareSettings.from_config(cfg)
    check_request(Path(cfg.input_dir), Path(cfg.output_dir), settings)
    if not generates(cfg):
        _require_input(Path(cfg.input_dir))
        return
    from nailseg.synth.scene import KIND as SYNTHETIC
    from nailseg.synth.scene import groups_of

    synthetic = cfg.dataset.synthetic
    if synthetic.n < 1:
        raise PrepareError(f"dataset.synthetic.n={synthetic.n}: must be at least 1")
    refuse_foreign(Path(cfg.input_dir), SYNTHETIC, "dataset.raw_dir")
    _checked_split(settings.split, groups_of(synthetic.n))

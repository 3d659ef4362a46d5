"""The built-in synthetic dataset as `train.py` gets it: generated and prepared on first use, and
again when its options (n, seed) change, in its own folders only (conf/dataset/synthetic.yaml's
raw_dir and root). A folder the user names is never filled: `missing_data` names the
`prepare.py` command that makes it. Every process calls `prepare_builtin`; one prepares while the
others wait for it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from nailseg.config import CONF_DIR, ConfigError
from nailseg.io.lock import locked
from nailseg.prep.format import BUILTIN_LOCK_FILE, SOURCE_FILE, split_file
from nailseg.prep.prepare import run
from nailseg.prep.request import PrepareError, check_config
from nailseg.prep.settings import compose_prepare

BUILTIN_WAIT_S = 3600.0  # how long a process waits for another preparing the built-in dataset
BUILTIN_CONFIG = Path(CONF_DIR) / "dataset" / "synthetic.yaml"  # the built-in set and its folders

log = logging.getLogger(__name__)


def _builtin_current(dataset: DictConfig) -> bool:
    """Whether the dataset's root is ready: prepared from the synthetic set its options ask for
    (its raw photos are not needed), or prepared without recording a synthetic source."""
    from nailseg.prep.synthetic import is_current

    n, seed, root = dataset.synthetic.n, dataset.synthetic.seed, Path(dataset.root)
    if not (root / split_file("train")).is_file():
        return False
    return not os.path.lexists(root / SOURCE_FILE) or is_current(root, n, seed, SOURCE_FILE)


def _builtin(dataset: DictConfig) -> DictConfig:
    """conf/dataset/synthetic.yaml's folders and options, resolved in `dataset`'s config (its
    `paths.data_dir`, wherever the run puts it)."""
    own = OmegaConf.to_container(OmegaConf.load(BUILTIN_CONFIG), resolve=False)
    return OmegaConf.create({k: own[k] for k in ("raw_dir", "root", "synthetic")}, parent=dataset)


def _same(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def makes(dataset: DictConfig) -> bool:
    """Whether train.py makes `dataset` itself: a synthetic set in the built-in set's own raw_dir
    and root. Elsewhere the user asks for one by name: `python prepare.py dataset=synthetic`."""
    if dataset.synthetic is None:
        return False
    own = _builtin(dataset)
    return _same(dataset.raw_dir, own.raw_dir) and _same(dataset.root, own.root)


def check_data(cfg: DictConfig) -> None:
    """A training config's dataset root is prepared, or is the built-in set's own, which train.py
    makes; needs no torch, so train.py answers a root not prepared at once (`PreCheck`'s `early`)."""
    problem = missing_data(cfg.dataset)
    if problem is not None:
        raise ConfigError(problem)


def missing_data(dataset: DictConfig) -> str | None:
    """Why train.py cannot train on `dataset` as its folders stand, with the `prepare.py`
    command that makes it; None when its root is ready or train.py makes it (`makes`)."""
    root, train_csv = Path(dataset.root), split_file("train")
    if dataset.synthetic is None:
        if (root / train_csv).is_file():
            return None
        return (
            f"dataset.root={root} is not prepared (no {train_csv}): prepare your photos "
            f"(input_dir: Images/<group>/, Masks/<group>/) first: `python prepare.py "
            f"dataset={dataset.name} input_dir={dataset.raw_dir or 'RAW'} output_dir={root}`"
        )
    if makes(dataset) or _builtin_current(dataset):
        return None
    own, synthetic = _builtin(dataset), dataset.synthetic
    state = (
        f"holds another synthetic set than n={synthetic.n}, seed={synthetic.seed}"
        if (root / train_csv).is_file()
        else f"is not prepared (no {train_csv})"
    )
    asked = [
        f"dataset.{key}={value}"
        for key, value, default in (
            ("synthetic.n", synthetic.n, own.synthetic.n),
            ("synthetic.seed", synthetic.seed, own.synthetic.seed),
            ("raw_dir", dataset.raw_dir, own.raw_dir),
        )
        if value != default
    ]
    return (
        f"dataset.root={root} {state}, and train.py makes the synthetic set only in its own "
        f"folders ({own.raw_dir}, {own.root}); to make it here: `python prepare.py "
        f"dataset={dataset.name} {' '.join([*asked, f'dataset.root={root}'])}`"
    )


def _compose_prepare(dataset: DictConfig) -> DictConfig:
    """conf/prepare.yaml for `dataset`: its paths are the caller's, resolved where it was made."""
    cfg = compose_prepare()
    cfg.dataset = OmegaConf.merge(cfg.dataset, OmegaConf.to_container(dataset, resolve=True))
    return cfg


def prepare_builtin(dataset: DictConfig, wait_s: float = BUILTIN_WAIT_S) -> bool:
    """Generate and prepare the built-in dataset in its own folders (`makes`) with the settings
    of conf/prepare.yaml, unless its root already holds the set its options ask for; returns
    whether it did. prune=true: the root is nailseg's alone, and a smaller set must not fail as
    pairs gone missing. One process works holding BUILTIN_LOCK_FILE; the others wait for it, up
    to `wait_s`, and use what it made.
    """
    if not makes(dataset) or _builtin_current(dataset):
        return False
    cfg = _compose_prepare(dataset)
    cfg.prune = True
    check_config(cfg)  # before the lock file: the first write
    with locked(
        Path(cfg.output_dir), BUILTIN_LOCK_FILE, "prepare", "output_dir", PrepareError, wait_s
    ):
        if _builtin_current(dataset):  # made by another process while this one waited
            return False
        log.info(
            "dataset=%s (n=%d, seed=%d) is not prepared yet: generating and preparing it in %s",
            dataset.name,
            dataset.synthetic.n,
            dataset.synthetic.seed,
            dataset.root,
        )
        run(cfg)
    return True

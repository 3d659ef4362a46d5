"""The built-in synthetic dataset as `train.py` gets it: made on first use and when its options
change, in its own folders only (conf/dataset/synthetic.yaml's); a folder the user names is never
filled (`missing_data` names the command that fills it). Of processes asking at once, one makes
it, holding the root, while the others wait until the root is current."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from nailseg.config import CONF_DIR
from nailseg.io.folder import BusyError, read_marker
from nailseg.prep.format import split_file
from nailseg.prep.prepare import PrepareError, check_config, claim_root, compose_prepare, run

BUILTIN_WAIT_S = 3600.0  # how long a process waits for another preparing the built-in dataset
BUILTIN_CONFIG = Path(CONF_DIR) / "dataset" / "synthetic.yaml"  # the built-in set and its folders
OPTIONS = ("n", "seed", "framing")  # dataset.synthetic's, which name the set

log = logging.getLogger(__name__)


def _builtin_current(dataset: DictConfig) -> bool:
    """Whether the root is prepared from the set asked for (its photos may be gone), or by hand."""
    from nailseg.synth.scene import manifest

    root = Path(dataset.root)
    if not (root / split_file("train")).is_file():
        return False
    marker = read_marker(root) or {}
    if marker.get("synthetic") is None:
        return True
    current = manifest(*(dataset.synthetic[key] for key in OPTIONS))
    return marker.get("complete") is True and marker["synthetic"] == current


def _builtin(dataset: DictConfig) -> DictConfig:
    """conf/dataset/synthetic.yaml's folders and options, resolved in `dataset`'s config."""
    own = OmegaConf.to_container(OmegaConf.load(BUILTIN_CONFIG), resolve=False)
    return OmegaConf.create({k: own[k] for k in ("raw_dir", "root", "synthetic")}, parent=dataset)


def makes(dataset: DictConfig) -> bool:
    """Whether train.py makes `dataset` itself: a synthetic set in the built-in set's own raw_dir
    and root. Elsewhere the user asks for one by name: `python prepare.py dataset=synthetic`."""
    if dataset.synthetic is None or dataset.raw_dir is None:
        return False
    own = _builtin(dataset)
    return all(Path(dataset[k]).resolve() == Path(own[k]).resolve() for k in ("raw_dir", "root"))


def missing_data(dataset: DictConfig) -> str | None:
    """Why train.py cannot train on `dataset` as its folders stand, with the `prepare.py`
    command that makes it; None when its root is ready or train.py makes it (`makes`). Needs no
    torch: train.py answers a root not prepared at once (`PreCheck`'s `early`)."""
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
        f"dataset.synthetic.{key}={synthetic[key]}"
        for key in OPTIONS
        if synthetic[key] != own.synthetic[key]
    ]
    if dataset.raw_dir != own.raw_dir:
        asked.append(f"dataset.raw_dir={dataset.raw_dir}")
    return (
        f"dataset.root={root} {state}, and train.py makes the synthetic set only in its own "
        f"folders ({own.raw_dir}, {own.root}); to make it here: `python prepare.py "
        f"dataset={dataset.name} {' '.join([*asked, f'dataset.root={root}'])}`"
    )


def prepare_builtin(dataset: DictConfig, wait_s: float = BUILTIN_WAIT_S) -> bool:
    """Generate and prepare the built-in dataset in its own folders (`makes`), unless its root holds
    the set asked for; returns whether it did (prune=true: a smaller set is no mass vanishing).
    The others wait up to `wait_s` until the root is current, not for its lock: a rank that has
    begun to train holds that too."""
    if not makes(dataset) or _builtin_current(dataset):
        return False
    cfg = compose_prepare()  # its paths are the caller's, resolved where `dataset` was made
    cfg.dataset = OmegaConf.merge(cfg.dataset, OmegaConf.to_container(dataset, resolve=True))
    cfg.prune = True
    check_config(cfg)  # before the first write
    options = ", ".join(f"{key}={dataset.synthetic[key]}" for key in OPTIONS)
    log.info("dataset=%s (%s) is not prepared yet: making it", dataset.name, options)
    root, deadline = Path(cfg.output_dir), time.monotonic() + wait_s
    while not _builtin_current(dataset):
        try:
            with claim_root(root):  # held from before the photos are generated
                if not _builtin_current(dataset):
                    run(cfg)
                    return True
        except PrepareError as err:
            if not isinstance(err.__cause__, BusyError):
                raise
            if time.monotonic() > deadline:
                raise PrepareError(
                    f"{root} is held by another process (preparing it, or training on it) and "
                    f"has not finished after {wait_s:g} s: if it is stuck, stop it, then rerun"
                ) from err
        time.sleep(0.5)
    return False

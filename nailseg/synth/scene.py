"""The synthetic photos: procedural hands with nail masks in the users' layout (`Images/<group>/`
RGB, `Masks/<group>/` 0/255), one kind of scene a group. A sample draws from its own RNG seeded by
(seed, index): the same set gives byte-identical files, whatever the workers."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cv2
import hydra
import numpy as np
from omegaconf import DictConfig

from nailseg.config import CONF_DIR
from nailseg.errors import require_values
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import Journal, OwnedFolder, read_marker
from nailseg.lifetime import die_with_parent
from nailseg.progress import progress
from nailseg.synth.hand import SCENES, draw_finger, fill, finger_outline, layout
from nailseg.synth.look import BACKGROUNDS, Rng, camera, light, nail_look, shadow, skin_tone

VERSION = 3  # bump whenever the pictures change, so that old sets are regenerated
GROUPS = ("studio", "desk", "fabric", "clutter")
MIN_FG, MAX_FG = 0.002, 0.45  # nail fraction of every mask; scenes outside are redrawn
KIND = "synthetic"  # the kind of the set's folder
log = logging.getLogger(__name__)
_PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, 1]  # speed over size; noise barely compresses anyway
_worker_folder: OwnedFolder | None = None  # a pool worker's view of the folder being filled


@dataclass(frozen=True)
class Style:
    """How a group looks; ranges are closed intervals sampled per image."""

    size: tuple[int, int]  # (height, width)
    scenes: tuple[str, ...]  # drawn from hand.SCENES
    nail_area: tuple[float, float]  # one nail's fraction of the photo, drawn log-uniform
    backgrounds: tuple[str, ...]  # drawn from look.BACKGROUNDS; a repeat, more often
    light: float  # strength of the illumination gradient and colour cast
    drop_shadow: float  # probability of the hand's shadow on the background
    cast_shadow: float  # probability of a blurred shadow across the whole scene
    noise: tuple[float, float]  # sensor noise sigma at mid grey
    blur: tuple[float, float]  # defocus sigma (below 0.3: none)


STYLES: dict[str, Style] = {
    "studio": Style(
        (240, 192), ("tip",), (0.04, 0.36), ("plain", "gradient"), 0.25, 0.5, 0.2,
        (1.0, 4.0), (0.0, 1.5),
    ),
    "desk": Style(
        (240, 320), ("hand",), (0.003, 0.03), ("desk", "wood", "tiles", "plain"), 0.35, 0.7, 0.3,
        (2.0, 8.0), (0.0, 1.2),
    ),
    "fabric": Style(
        (272, 224), ("fingers", "tip"), (0.005, 0.10),
        ("cloth", "cloth", "weave", "noise", "fractal"), 0.35, 0.6, 0.4, (3.0, 8.0), (0.0, 1.2),
    ),
    "clutter": Style(
        (288, 288), SCENES, (0.003, 0.20), ("clutter",), 0.45, 0.5, 0.5, (2.0, 10.0), (0.0, 1.5),
    ),
}  # fmt: skip
# framing=close (the built-in set, for a CPU): seen from near, no nail tiny, less nail-like clutter
_CLOSE = {
    "desk": {"scenes": ("fingers",), "nail_area": (0.01, 0.06)},
    "fabric": {"nail_area": (0.02, 0.15)},
    "clutter": {
        "scenes": ("fingers", "tip"),
        "nail_area": (0.01, 0.2),
        "backgrounds": ("clutter", "desk", "tiles", "wood"),
    },
}
FRAMINGS = {
    "wild": STYLES,
    "close": {group: replace(style, **_CLOSE.get(group, {})) for group, style in STYLES.items()},
}


def _scene(rng: Rng, style: Style, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(image, mask) of one drawn scene, before the light and the camera."""
    kind = style.backgrounds[int(rng.integers(len(style.backgrounds)))]
    img = np.ascontiguousarray(BACKGROUNDS[kind](rng, h, w), np.float32)
    scene = style.scenes[int(rng.integers(len(style.scenes)))]
    area = math.exp(rng.uniform(*np.log(style.nail_area)))
    fingers = layout(rng, scene, area, h, w)
    if rng.uniform() < style.drop_shadow:
        hand = sum(fill((h, w), finger_outline(f)) for f in fingers)
        offset = rng.uniform(-0.3, 0.3, 2) * fingers[-1].width
        moved = cv2.warpAffine(hand, np.float32([[1, 0, offset[0]], [0, 1, offset[1]]]), (w, h))
        img *= shadow(rng, np.clip(moved, 0, 1), rng.uniform(0.3, 0.6))[..., None]
    skin = skin_tone(rng)
    look = nail_look(rng, skin)
    tilt = rng.uniform(-1, 1)
    mask = np.zeros((h, w), np.uint8)
    for f in fingers:
        if rng.uniform() < 0.15:  # not every finger wears the same polish
            look = nail_look(rng, skin)
        draw_finger(rng, img, mask, f, skin, look, tilt)
    return img, mask


def render(index: int, seed: int, framing: str = "wild") -> tuple[str, np.ndarray, np.ndarray]:
    """(group, RGB uint8 HxWx3 image, uint8 HxW mask in {0, 255}) of sample `index`.

    The mask is final before the light and the camera touch the image."""
    rng = np.random.default_rng([seed, index])
    group = GROUPS[index % len(GROUPS)]
    style = FRAMINGS[framing][group]
    h, w = style.size
    for _ in range(50):  # redraw the rare scene whose nails are hidden, out of view or too big
        img, mask = _scene(rng, style, h, w)
        if MIN_FG <= np.count_nonzero(mask) / mask.size <= MAX_FG:
            break
    else:
        raise RuntimeError(f"sample {index} (seed {seed}): no scene with a usable nail fraction")
    img = light(rng, img, style.light)
    if rng.uniform() < style.cast_shadow:
        corners = rng.uniform(-0.3, 1.3, (4, 2)) * (w, h)
        hull = cv2.convexHull(corners.astype(np.float32))[:, 0]
        img *= shadow(rng, fill((h, w), hull), rng.uniform(0.25, 0.5))[..., None]
    return group, camera(rng, img, style.noise, style.blur), mask


def _write_sample(folder: OwnedFolder, index: int, seed: int, framing: str) -> None:
    group, img, mask = render(index, seed, framing)
    for kind, array in (("Images", np.ascontiguousarray(img[..., ::-1])), ("Masks", mask)):
        ok, buf = cv2.imencode(".png", array, _PNG_PARAMS)
        if not ok:
            raise OSError(f"cannot encode sample {index}")
        folder.write(f"{kind}/{group}/s{index:04d}.png", buf.tobytes())


def _init_worker(parent: int, path: str) -> None:
    global _worker_folder
    die_with_parent(parent)  # a prepare killed outright leaves no generator behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer
    cv2.setNumThreads(0)  # OpenCV's own thread pool in a worker process can hang
    _worker_folder = OwnedFolder.attach(path)


def _write_in_worker(job: tuple[int, int, str]) -> None:
    _write_sample(_worker_folder, *job)


def manifest(n: int, seed: int, framing: str = "wild") -> dict[str, Any]:
    """What names a complete set; a prepared root's marker keeps it as its source."""
    return {
        "n": n,
        "seed": seed,
        "framing": framing,
        "generator": VERSION,
    }  # "version": the format's


def is_current(out_dir: Path, n: int, seed: int, framing: str = "wild") -> bool:
    """Whether `out_dir` holds the complete set (n, seed, framing) of this generator version."""
    marker: dict[str, Any] = read_marker(Path(out_dir)) or {}
    wanted = manifest(n, seed, framing)
    complete = marker.get("kind") == KIND and marker.get("complete") is True
    return complete and {key: marker.get(key) for key in wanted} == wanted


def _samples(n: int) -> list[str]:
    return [
        f"{k}/{GROUPS[i % len(GROUPS)]}/s{i:04d}.png" for i in range(n) for k in ("Images", "Masks")
    ]


def groups_of(n: int) -> list[str]:
    """The groups a set of `n` photos has (sample i is in group i mod 4)."""
    return list(GROUPS[: min(n, len(GROUPS))])


def generate(
    out_dir: Path,
    n: int,
    seed: int,
    num_workers: int = 0,
    key: str = "out",
    wait_s: float = 0.0,
    framing: str = "wild",
) -> Path:
    """Write n samples to `out_dir` unless it already holds them; returns `out_dir`. Raises
    NotOursError, before writing, when `out_dir` is not nailseg's synthetic folder, another process
    fills it, or a sample's path holds a file nailseg did not write. An earlier set's samples are
    removed while they are as written; the marker says complete last."""
    out_dir = Path(out_dir)
    if n < 1 or num_workers < 0:
        raise ValueError(f"need n >= 1 and num_workers >= 0, got n={n}, num_workers={num_workers}")
    if framing not in FRAMINGS:
        raise ValueError(f"framing={framing!r}: one of {sorted(FRAMINGS)}")
    if is_current(out_dir, n, seed, framing):
        return out_dir
    with OwnedFolder.claim(out_dir, KIND, key=key, wait_s=wait_s) as folder:
        if is_current(out_dir, n, seed, framing):  # made by the process this one waited for
            return out_dir
        samples, earlier = _samples(n), _samples(folder.marker.get("n", 0))
        folder.check_free(samples)
        folder.update_marker(complete=False, **manifest(n, seed, framing))
        jobs = [(i, seed, framing) for i in range(n)]
        with progress("generating synthetic photos", n) as advance:
            if num_workers:
                # spawn, not fork: the caller may hold threads (torch, OpenCV) a fork would break
                ctx = multiprocessing.get_context("spawn")
                init = (os.getpid(), str(folder.path))
                with ctx.Pool(num_workers, initializer=_init_worker, initargs=init) as pool:
                    chunk = max(1, n // (4 * num_workers))
                    for _ in pool.imap_unordered(_write_in_worker, jobs, chunksize=chunk):
                        advance(1)
                folder.journal = Journal(folder.path)  # with what the workers journaled
            else:
                for job in jobs:
                    _write_sample(folder, *job)
                    advance(1)
        for rel in sorted(set(earlier) - set(samples)):  # the earlier set's, while as written
            folder.remove(rel)
        folder.prune(samples)
        for path in folder.kept:
            log.warning("kept %s: an earlier set's picture, changed since nailseg wrote it", path)
        folder.update_marker(complete=True)
    return out_dir


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="synthetic")
def main(cfg: DictConfig) -> None:
    """A set made into `out` on its own, with a one-line report; a current set is left as it is."""
    require_values(cfg, "nailseg.synth")
    if is_current(Path(cfg.out), cfg.n, cfg.seed, cfg.framing):
        print(f"{cfg.out}: already holds n={cfg.n} seed={cfg.seed}; nothing written")
        return
    start = time.perf_counter()
    try:
        generate(Path(cfg.out), cfg.n, cfg.seed, cfg.num_workers, framing=cfg.framing)
    except (NotOursError, ValueError) as err:
        sys.exit(f"synthetic failed: {err}")
    except KeyboardInterrupt:
        sys.exit(f"synthetic interrupted: {cfg.out} is left incomplete; run it again to finish it")
    seconds = time.perf_counter() - start
    print(f"wrote {cfg.n} images to {cfg.out} in {seconds:.2f} s ({cfg.n / seconds:.1f} images/s)")

"""Built-in synthetic dataset: procedural hand photos and nail masks, the default on a fresh clone.

Written in the users' layout (`Images/<group>/<name>.png` RGB, `Masks/<group>/<name>.png` 0/255)
with something real to learn: whole hands, fingers from an edge and close-up tips at every scale,
every skin tone, bare, polished, French and glitter nails, backgrounds from plain cloth to
clutter with skin- and nail-coloured distractors, light from any side, and a phone camera's blur,
noise, white balance and JPEG (`synthetic_hand`, `synthetic_look`); each group is one kind of
scene. Each sample draws from its own RNG seeded by (seed, index): the same (n, seed) gives
byte-identical files, whatever the workers. The generator writes only into a folder that is new,
empty or marked by `MANIFEST`, and deletes only its own samples there.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from nailseg.config import CONF_DIR, require_values
from nailseg.io.atomic import write_bytes
from nailseg.io.ownership import (
    ForeignFolderError,
    is_marker,
    make_folder,
    marker_proofs,
    new_marker,
    records_of,
    remove_file,
    remove_temp_files,
    replaceable,
    require_owned,
    write_marker,
)
from nailseg.lifetime import die_with_parent
from nailseg.prep.synthetic_hand import SCENES, draw_finger, fill, finger_outline, layout
from nailseg.prep.synthetic_look import background, camera, light, nail_look, shadow, skin_tone

VERSION = 3  # bump whenever the pictures change, so that old sets are regenerated
MANIFEST = "synthetic.json"
GROUPS = ("studio", "desk", "fabric", "clutter")
MIN_FG, MAX_FG = 0.002, 0.45  # nail fraction of every mask; scenes outside are redrawn
MARKER_KIND = "synthetic"
log = logging.getLogger(__name__)
_OURS_IN_NEW_FOLDER = re.compile(rf"\.{re.escape(MANIFEST)}\.\d+\.tmp")
_PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, 1]  # speed over size; noise barely compresses anyway


@dataclass(frozen=True)
class Style:
    """How a group looks; ranges are closed intervals sampled per image."""

    size: tuple[int, int]  # (height, width)
    scenes: tuple[str, ...]  # drawn from synthetic_hand.SCENES
    nail_area: tuple[float, float]  # one nail's fraction of the photo, drawn log-uniform
    backgrounds: tuple[str, ...]  # drawn from synthetic_look.BACKGROUNDS; a repeat, more often
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


def _scene(
    rng: np.random.Generator, style: Style, h: int, w: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """(image, mask, light side) of one drawn scene, before the light and the camera."""
    img = background(rng, style.backgrounds[int(rng.integers(len(style.backgrounds)))], h, w)
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
    return img, mask, tilt


def render(index: int, seed: int) -> tuple[str, np.ndarray, np.ndarray]:
    """(group, RGB uint8 HxWx3 image, uint8 HxW mask in {0, 255}) of sample `index`.

    The mask is final before the light and the camera touch the image."""
    rng = np.random.default_rng([seed, index])
    group = GROUPS[index % len(GROUPS)]
    style = STYLES[group]
    h, w = style.size
    for _ in range(50):  # redraw the rare scene whose nails are hidden, out of view or too big
        img, mask, _ = _scene(rng, style, h, w)
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


def _write_png(path: Path, array: np.ndarray) -> None:
    """Write atomically: a dotted temp name in the same folder (the layout scan skips dotfiles)."""
    ok, buf = cv2.imencode(".png", array, _PNG_PARAMS)
    if not ok:
        raise OSError(f"cannot encode {path}")
    write_bytes(path, buf.tobytes())


def _write_sample(job: tuple[Path, int, int]) -> None:
    out_dir, index, seed = job
    group, img, mask = render(index, seed)
    name = f"s{index:04d}.png"
    _write_png(out_dir / "Images" / group / name, np.ascontiguousarray(img[..., ::-1]))
    _write_png(out_dir / "Masks" / group / name, mask)


def _init_worker(parent: int) -> None:
    die_with_parent(parent)  # a prepare killed outright leaves no generator behind
    cv2.setNumThreads(0)  # OpenCV's own thread pool in a worker process can hang


def _manifest(n: int, seed: int) -> dict[str, int]:
    return {"n": n, "seed": seed, "version": VERSION}


def manifest_text(n: int, seed: int) -> str:
    """The manifest of the complete set for (n, seed); a prepared root keeps a copy as its source."""
    return json.dumps(_manifest(n, seed)) + "\n"


def is_current(out_dir: Path, n: int, seed: int, name: str = MANIFEST) -> bool:
    """Whether `out_dir/name` is the manifest of the complete set for (n, seed) of this generator
    version: `out_dir` holds that set (its marker, complete) or, for a prepared root's copy of
    the manifest, was prepared from it."""
    try:
        content = json.loads((Path(out_dir) / name).read_text())
    except (OSError, ValueError):
        return False
    if name != MANIFEST:
        return content == _manifest(n, seed)
    complete = is_marker(content, MARKER_KIND) and content.get("complete") is True
    return complete and {key: content.get(key) for key in ("n", "seed", "version")} == _manifest(
        n, seed
    )


def groups_of(n: int) -> list[str]:
    """The groups a set of `n` photos has (sample i is in group i mod 4)."""
    return list(GROUPS[: min(n, len(GROUPS))])


def generate(out_dir: Path, n: int, seed: int, num_workers: int = 0) -> Path:
    """Write n samples to `out_dir` unless it already holds them; returns `out_dir`.

    Raises ForeignFolderError, before writing, when `out_dir` holds files but not our marker, or
    a sample's path holds a file the marker does not show as the generator's. The marker claims
    the paths first and is written complete last, so an interrupted run is redone; an earlier
    set's samples are removed while they are as written. One process per folder at a time.
    """
    out_dir = Path(out_dir)
    if n < 1 or num_workers < 0:
        raise ValueError(f"need n >= 1 and num_workers >= 0, got n={n}, num_workers={num_workers}")
    if is_current(out_dir, n, seed):
        return out_dir
    marker = require_owned(out_dir, MANIFEST, MARKER_KIND, _OURS_IN_NEW_FOLDER)
    proofs = marker_proofs(marker)
    samples = [
        f"{kind}/{GROUPS[i % len(GROUPS)]}/s{i:04d}.png"
        for i in range(n)
        for kind in ("Images", "Masks")
    ]
    taken = [rel for rel in samples if not replaceable(out_dir / rel, proofs.get(rel))]
    if taken:
        raise ForeignFolderError(
            f"{out_dir / taken[0]} is not a picture the generator wrote there (changed or put "
            "there since), so it is not replaced: nothing was written; move it away, or choose "
            "another folder"
        )
    marker = (marker or new_marker(MARKER_KIND)) | _manifest(n, seed)
    write_marker(
        out_dir, MANIFEST, marker | {"complete": False, "claimed": sorted({*samples, *proofs})}
    )
    folders = [out_dir / kind / group for kind in ("Images", "Masks") for group in GROUPS]
    for folder in folders:
        make_folder(folder)

    jobs = [(out_dir, i, seed) for i in range(n)]
    if num_workers:
        # spawn, not fork: the caller may hold threads (torch, OpenCV) that a fork would break
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(num_workers, initializer=_init_worker, initargs=(os.getpid(),)) as pool:
            chunk = max(1, n // (4 * num_workers))
            for _ in pool.imap_unordered(_write_sample, jobs, chunksize=chunk):
                pass
    else:
        for job in jobs:
            _write_sample(job)

    remove_temp_files(out_dir, {*samples, *proofs})
    kept = [out_dir / rel for rel in sorted(proofs.keys() - set(samples))]
    kept = [
        path for path in kept if not remove_file(path, proofs[path.relative_to(out_dir).as_posix()])
    ]
    for path in kept:
        log.warning("kept %s: an earlier set's picture, changed since the generator wrote it", path)
    marker = marker | {"complete": True, "files": records_of(out_dir, samples)}
    write_marker(out_dir, MANIFEST, {k: v for k, v in marker.items() if k != "claimed"})
    return out_dir


@dataclass
class SyntheticCliConfig:
    """`python -m nailseg.prep.synthetic`; values in conf/synthetic.yaml."""

    out: str = MISSING
    n: int = MISSING
    seed: int = MISSING
    num_workers: int = MISSING


ConfigStore.instance().store(name="synthetic_schema", node=SyntheticCliConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="synthetic")
def main(cfg: DictConfig) -> None:
    """Generate a set into `out`, with a one-line report; a current set is left as it is."""
    require_values(cfg, "nailseg.prep.synthetic")
    out = Path(cfg.out)
    if is_current(out, cfg.n, cfg.seed):
        print(f"{out}: already holds n={cfg.n} seed={cfg.seed}; nothing written")
        return
    start = time.perf_counter()
    try:
        generate(out, cfg.n, cfg.seed, cfg.num_workers)
    except ForeignFolderError as err:
        sys.exit(f"synthetic failed: {err}")
    seconds = time.perf_counter() - start
    print(
        f"wrote {cfg.n} images to {out} in {seconds:.2f} s "
        f"({cfg.n / seconds:.1f} images/s, {cfg.num_workers} workers)"
    )


if __name__ == "__main__":
    main()

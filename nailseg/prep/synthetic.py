"""Built-in synthetic dataset: procedural hand photos and nail masks, the default on a fresh clone.

Written in the users' layout (`Images/<group>/<name>.png` RGB, `Masks/<group>/<name>.png` 0/255)
with something real to learn: skin-coloured fingers around every nail, varied skin tones and
nail colours, and per group its own backgrounds, scale, finger count, nail shape, lighting and
size; skin- and nail-coloured clutter keeps "find the pink blob" from being the answer. Each
sample draws from its own RNG seeded by (seed, index): the same (n, seed) gives byte-identical
files, whatever the workers. The generator writes only into a folder that is new, empty or marked
by `MANIFEST`, and deletes only its own samples there.
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

VERSION = 1  # bump whenever the pictures change, so that old sets are regenerated
MANIFEST = "synthetic.json"
GROUPS = ("studio", "desk", "fabric", "clutter")
MIN_FG, MAX_FG = 0.01, 0.40  # nail fraction of every mask; scenes outside are redrawn
MARKER_KIND = "synthetic"
log = logging.getLogger(__name__)
_OURS_IN_NEW_FOLDER = re.compile(rf"\.{re.escape(MANIFEST)}\.\d+\.tmp")
_PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, 1]  # speed over size; noise barely compresses anyway
_SUBPIXEL = 4  # fillPoly fractional bits: smooth outlines from float points


@dataclass(frozen=True)
class Style:
    """How a group looks; ranges are closed intervals sampled per image."""

    size: tuple[int, int]  # (height, width)
    background: str  # flat | gradient | texture | clutter
    fingers: tuple[int, int]  # how many fingers (and nails)
    width: tuple[float, float]  # finger width / shorter image side: the scale
    palm: bool  # a hand (palm, fanned fingers, thumb) vs fingers entering from the edge
    nails: tuple[str, ...]  # nail shapes drawn from: rounded | ellipse | tapered
    turn: float  # max |rotation| of the hand away from pointing up, degrees
    light: float  # strength of the illumination gradient and colour cast
    drop_shadow: float  # probability of the hand's shadow on the background
    cast_shadow: float  # probability of a blurred shadow across the whole scene
    noise: tuple[float, float]  # pixel noise sigma
    blur: tuple[float, float]  # Gaussian blur sigma (below 0.3: none)


STYLES: dict[str, Style] = {
    "studio": Style(
        (240, 192), "flat", (1, 2), (0.32, 0.42), False, ("rounded",), 25, 0.12, 0.0, 0.0,
        (1.0, 4.0), (0.0, 1.2),
    ),
    "desk": Style(
        (176, 256), "gradient", (3, 5), (0.13, 0.17), True, ("ellipse", "rounded"), 50, 0.3, 0.8,
        0.2, (2.0, 6.0), (0.0, 0.8),
    ),
    "fabric": Style(
        (272, 224), "texture", (2, 4), (0.16, 0.24), False, ("tapered", "ellipse"), 180, 0.35,
        0.6, 0.4, (3.0, 8.0), (0.0, 1.0),
    ),
    "clutter": Style(
        (288, 320), "clutter", (1, 5), (0.12, 0.24), True, ("rounded", "ellipse", "tapered"),
        180, 0.45, 0.5, 0.6, (2.0, 10.0), (0.0, 1.5),
    ),
}  # fmt: skip

_SKIN_LIGHT = np.array([250, 214, 190], np.float32)
_SKIN_DARK = np.array([88, 56, 40], np.float32)
_NAIL_PINK = np.array([236, 168, 168], np.float32)
_FREE_EDGE = np.array([246, 240, 228], np.float32)
_BACKDROPS = np.array(
    [[236, 236, 232], [205, 208, 212], [45, 65, 150], [28, 28, 32], [60, 120, 85], [222, 205, 175]],
    np.float32,
)


@dataclass(frozen=True)
class Finger:
    """A finger in pixels: tip point, unit direction towards the tip, width, length, nail."""

    tip: np.ndarray
    d: np.ndarray
    width: float
    length: float
    nail: str | None  # shape, or None for the palm


def _hsv(rng: np.random.Generator, s: tuple[float, float], v: tuple[float, float]) -> np.ndarray:
    """A random RGB colour with any hue and saturation/value in the given ranges."""
    hsv = np.array([[[rng.integers(0, 180), rng.uniform(*s) * 255, rng.uniform(*v) * 255]]])
    hsv = hsv.astype(np.uint8)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0].astype(np.float32)


def _skin(rng: np.random.Generator) -> np.ndarray:
    tone = rng.uniform(0, 1) ** 1.3
    skin = _SKIN_LIGHT + (_SKIN_DARK - _SKIN_LIGHT) * tone + rng.normal(0, 8, 3)
    return np.clip(skin, 0, 255).astype(np.float32)


def _nail_colour(rng: np.random.Generator, skin: np.ndarray) -> tuple[np.ndarray, bool]:
    """(colour, natural): natural nails are pink-white tinted by the skin, else any polish."""
    if rng.uniform() < 0.55:
        pink = skin + (_NAIL_PINK - skin) * rng.uniform(0.45, 0.85) + rng.normal(0, 6, 3)
        return np.clip(pink, 0, 255).astype(np.float32), True
    return _hsv(rng, (0.3, 1.0), (0.15, 0.95)), False


def _smooth_noise(rng: np.random.Generator, h: int, w: int, cell: int) -> np.ndarray:
    """Noise in [0, 1] with features about `cell` pixels wide (bicubic upsampled grid)."""
    grid = rng.random((h // cell + 2, w // cell + 2), np.float32)
    return np.clip(cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC), 0, 1)


def _ramp(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A linear ramp in [-1, 1] along a random direction."""
    a = rng.uniform(0, 2 * math.pi)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = (x - w / 2) * math.cos(a) + (y - h / 2) * math.sin(a)
    return r / max(float(np.abs(r).max()), 1.0)


def _background(rng: np.random.Generator, kind: str, h: int, w: int) -> np.ndarray:
    """Float32 HxWx3 background in 0..255."""
    if kind == "flat":
        base = (_BACKDROPS[rng.integers(len(_BACKDROPS))] + rng.normal(0, 10, 3)).astype(np.float32)
        return base * (1 + 0.04 * _ramp(rng, h, w))[..., None]
    if kind == "gradient":
        c0, c1 = _hsv(rng, (0.0, 0.6), (0.3, 1.0)), _hsv(rng, (0.0, 0.6), (0.3, 1.0))
        t = (_ramp(rng, h, w)[..., None] + 1) / 2
        return c0 + (c1 - c0) * t
    if kind == "texture":
        c0, c1 = _hsv(rng, (0.1, 0.7), (0.2, 0.9)), _hsv(rng, (0.1, 0.7), (0.2, 0.9))
        n = 0.6 * _smooth_noise(rng, h, w, 24) + 0.4 * _smooth_noise(rng, h, w, 4)
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        f = rng.uniform(0.3, 1.2)
        if rng.uniform() < 0.5:  # wood grain: wavy stripes
            a = rng.uniform(0, math.pi)
            pattern = np.sin((x * math.cos(a) + y * math.sin(a)) * f * 0.3 + 6 * n)
        else:  # woven fabric
            pattern = np.sin(x * f) * np.sin(y * f)
        t = np.clip(0.5 * n + 0.25 * pattern + 0.25, 0, 1)[..., None]
        return c0 + (c1 - c0) * t
    # clutter: a gradient or texture, then objects, some skin- and nail-coloured as distractors
    img = _background(rng, "gradient" if rng.uniform() < 0.5 else "texture", h, w)
    for _ in range(rng.integers(6, 16)):
        r = rng.uniform()
        if r < 0.25:
            colour = _skin(rng)
        elif r < 0.4:
            colour = _nail_colour(rng, _skin(rng))[0]
        else:
            colour = _hsv(rng, (0.0, 1.0), (0.1, 1.0))
        centre = (float(rng.uniform(0, w)), float(rng.uniform(0, h)))
        size = (float(rng.uniform(8, w / 2.5)), float(rng.uniform(6, h / 4)))
        angle = float(rng.uniform(0, 180))
        if rng.uniform() < 0.5:
            pts = cv2.boxPoints((centre, size, angle))
            cv2.fillPoly(img, [np.round(pts).astype(np.int32)], colour.tolist(), cv2.LINE_8)
        else:
            axes = (int(size[0] / 2), int(size[1] / 2))
            c = (int(centre[0]), int(centre[1]))
            cv2.ellipse(img, c, axes, angle, 0, 360, colour.tolist(), -1, cv2.LINE_8)
    return cv2.GaussianBlur(img, (0, 0), rng.uniform(0.5, 2.0))


def _layout(rng: np.random.Generator, style: Style, h: int, w: int) -> list[Finger]:
    """Place the palm (if any) and the fingers, scaled and shifted so every tip is in view."""
    n = int(rng.integers(style.fingers[0], style.fingers[1] + 1))
    theta = math.radians(-90 + rng.uniform(-style.turn, style.turn))
    d0 = np.array([math.cos(theta), math.sin(theta)])
    n0 = np.array([-d0[1], d0[0]])
    side = 1 if rng.uniform() < 0.5 else -1  # left or right hand

    def turned(deg: float) -> np.ndarray:
        a = theta + math.radians(deg)
        return np.array([math.cos(a), math.sin(a)])

    # geometry in finger widths, hand at the origin: (tip, direction, width, length)
    parts: list[tuple[np.ndarray, np.ndarray, float, float]] = []
    thumb = style.palm and n == 5
    m = n - 1 if thumb else n
    spacing = 1.05 if style.palm else rng.uniform(1.1, 1.6)
    spread = rng.uniform(3, 12) if style.palm else 0.0
    for k in range(m):
        off = (k - (m - 1) / 2) * side
        d = turned(spread * off + rng.uniform(-6, 6))
        knuckle = n0 * off * spacing - d0 * 0.15 * off**2
        if style.palm:
            length = (2.7 - 0.25 * abs(off)) * rng.uniform(0.92, 1.08)
            parts.append((knuckle + d * length, d, rng.uniform(0.92, 1.05), length))
        else:
            parts.append((knuckle + d * rng.uniform(-0.6, 0.6), d, rng.uniform(0.92, 1.05), 0.0))
    if thumb:
        d = turned(-side * rng.uniform(35, 55))
        base = -n0 * side * (m * spacing / 2) - d0 * 1.6
        parts.append((base + d * 2.0, d, 1.2, 2.0))

    scale = rng.uniform(*style.width) * min(h, w)
    tips = np.array([p[0] for p in parts]) * scale
    margin = 0.7 * scale
    extent = np.maximum(tips.max(0) - tips.min(0), 1e-6)
    shrink = min(1.0, (w - 2 * margin) / extent[0], (h - 2 * margin) / extent[1])
    scale, tips, margin = scale * shrink, tips * shrink, margin * shrink
    lo = np.array([margin, margin]) - tips.min(0)
    hi = np.array([w - margin, h - margin]) - tips.max(0)
    shift = rng.uniform(np.minimum(lo, hi), np.maximum(lo, hi))

    beyond = math.hypot(h, w) + scale  # length that takes a finger's base out of view
    fingers = []
    if style.palm:
        palm_w = (m * spacing + 0.5) * scale
        fingers.append(Finger(d0 * 0.2 * scale + shift, d0, palm_w, beyond + palm_w, None))
    for tip, d, width, length in parts:
        shape = style.nails[int(rng.integers(len(style.nails)))]
        full = length * scale if style.palm else beyond
        fingers.append(Finger(tip * scale + shift, d, width * scale, full, shape))
    return fingers


def _to_image(f: Finger, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Finger-local (u along the finger, 0 at the tip; v across) to image points."""
    n = np.array([-f.d[1], f.d[0]])
    return f.tip + u[:, None] * f.d + v[:, None] * n


def _finger_outline(f: Finger) -> np.ndarray:
    """A tapered capsule; the palm gets a flatter front so it does not swallow the fingers."""
    cap = (0.15 if f.nail is None else 0.55) * f.width
    t = np.linspace(-math.pi / 2, math.pi / 2, 17)
    u = np.concatenate([[-f.length], -cap + cap * np.cos(t), [-f.length]])
    v = np.concatenate([[-0.58 * f.width], 0.5 * f.width * np.sin(t), [0.58 * f.width]])
    return _to_image(f, u, v)


def _nail_outline(rng: np.random.Generator, f: Finger) -> tuple[np.ndarray, float, float, float]:
    """(outline, centre u, half length, half width) of the nail near the finger tip."""
    half_len = f.width * rng.uniform(0.36, 0.52)
    half_w = f.width * rng.uniform(0.29, 0.36)
    centre = -half_len - f.width * rng.uniform(0.05, 0.12)
    power, taper = {"rounded": (4.0, 0.0), "ellipse": (2.0, 0.0), "tapered": (2.5, -0.35)}[f.nail]
    t = np.linspace(0, 2 * math.pi, 40, endpoint=False)
    along = np.sign(np.sin(t)) * np.abs(np.sin(t)) ** (2 / power)
    across = np.sign(np.cos(t)) * np.abs(np.cos(t)) ** (2 / power) * (1 + taper * along)
    return _to_image(f, centre + half_len * along, half_w * across), centre, half_len, half_w


def _fill(shape: tuple[int, int], pts: np.ndarray) -> np.ndarray:
    """Anti-aliased polygon coverage, float32 in [0, 1]."""
    canvas = np.zeros(shape, np.uint8)
    fixed = np.round(pts * (1 << _SUBPIXEL)).astype(np.int32)
    cv2.fillPoly(canvas, [fixed], 255, cv2.LINE_AA, shift=_SUBPIXEL)
    return canvas.astype(np.float32) / 255


def _box(pts: np.ndarray, h: int, w: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1): the pixels around `pts`, clipped to the image; may be empty."""
    x0, y0 = np.clip(np.floor(pts.min(0)).astype(int), 0, (w, h))
    x1, y1 = np.clip(np.ceil(pts.max(0)).astype(int) + 1, 0, (w, h))
    return int(x0), int(y0), int(x1), int(y1)


def _local(f: Finger, box: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Finger-local (u, v) of every pixel in `box`."""
    x0, y0, x1, y1 = box
    y, x = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    x, y = x - np.float32(f.tip[0]), y - np.float32(f.tip[1])
    dx, dy = np.float32(f.d[0]), np.float32(f.d[1])
    return x * dx + y * dy, y * dx - x * dy


def _draw_finger(
    rng: np.random.Generator,
    img: np.ndarray,
    mask: np.ndarray,
    f: Finger,
    skin: np.ndarray,
    nail: tuple[np.ndarray, bool],
) -> None:
    """Composite one finger (round shading, knuckle creases) and its nail; update the mask.

    The work is confined to the finger's bounding box (and the nail's), which keeps it fast.
    """
    outline = _finger_outline(f)
    box = x0, y0, x1, y1 = _box(outline, *mask.shape)
    if x0 >= x1 or y0 >= y1:  # out of view: only a palm can be
        return
    origin = np.array([x0, y0])
    alpha = _fill((y1 - y0, x1 - x0), outline - origin)
    u, v = _local(f, box)
    across = np.clip((2 * v / f.width) ** 2, 0, 1)
    layer = skin * (1 - 0.35 * across)[..., None]
    if f.nail is not None:
        for at in rng.uniform(1.35, 1.7, rng.integers(1, 3)) * f.width:
            crease = _to_image(f, np.array([-at, -at]), np.array([-0.3, 0.3]) * f.width) - origin
            a, b = np.round(crease).astype(int)
            cv2.line(layer, (int(a[0]), int(a[1])), (int(b[0]), int(b[1])), (skin * 0.72).tolist())
    view, mask_view = img[y0:y1, x0:x1], mask[y0:y1, x0:x1]
    view += alpha[..., None] * (layer - view)
    mask_view[alpha >= 0.5] = 0  # this finger hides nails drawn before it
    if f.nail is None:
        return

    outline, centre, half_len, half_w = _nail_outline(rng, f)
    nx0, ny0, nx1, ny1 = _box(outline - origin, y1 - y0, x1 - x0)
    sub = slice(ny0, ny1), slice(nx0, nx1)
    nail_alpha = np.minimum(
        _fill((ny1 - ny0, nx1 - nx0), outline - origin - (nx0, ny0)), alpha[sub]
    )
    colour, natural = nail
    un, vn = (u[sub] - centre) / half_len, v[sub] / half_w  # nail-local, +un to the free edge
    shade = 1 - 0.18 * np.clip(vn**2, 0, 1) - 0.25 * np.exp(-(((un + 1) / 0.18) ** 2))
    layer = colour * shade[..., None]
    if natural:  # white free edge
        edge = np.clip((un - rng.uniform(0.45, 0.75)) / 0.15, 0, 1)[..., None]
        layer += edge * (_FREE_EDGE - layer)
    spot_u, spot_v = rng.uniform(-0.4, 0.3), rng.uniform(-0.5, 0.5)
    spec = np.exp(-(((un - spot_u) / 0.45) ** 2) - ((vn - spot_v) / rng.uniform(0.1, 0.25)) ** 2)
    strength = rng.uniform(0.15, 0.45) if natural else rng.uniform(0.4, 0.9)
    layer += (strength * spec)[..., None] * (255 - layer)
    view[sub] += nail_alpha[..., None] * (layer - view[sub])
    mask_view[sub][nail_alpha >= 0.5] = 255


def _shadow(rng: np.random.Generator, coverage: np.ndarray, strength: float) -> np.ndarray:
    """Multiplicative darkening from a coverage map, softened by a wide blur."""
    soft = cv2.GaussianBlur(coverage, (0, 0), rng.uniform(3, 9))
    return 1 - strength * soft


def render(index: int, seed: int) -> tuple[str, np.ndarray, np.ndarray]:
    """(group, RGB uint8 HxWx3 image, uint8 HxW mask in {0, 255}) of sample `index`."""
    rng = np.random.default_rng([seed, index])
    group = GROUPS[index % len(GROUPS)]
    style = STYLES[group]
    h, w = style.size
    for _ in range(50):  # redraw the rare scene whose nails are hidden, cut off or too big
        img = _background(rng, style.background, h, w)
        fingers = _layout(rng, style, h, w)
        if rng.uniform() < style.drop_shadow:
            hand = sum(_fill((h, w), _finger_outline(f)) for f in fingers)
            offset = rng.uniform(-0.25, 0.25, 2) * fingers[-1].width
            moved = cv2.warpAffine(hand, np.float32([[1, 0, offset[0]], [0, 1, offset[1]]]), (w, h))
            img *= _shadow(rng, np.clip(moved, 0, 1), rng.uniform(0.3, 0.6))[..., None]
        skin = _skin(rng)
        nail = _nail_colour(rng, skin)
        mask = np.zeros((h, w), np.uint8)
        for f in fingers:
            if rng.uniform() < 0.3:  # not every finger wears the same polish
                nail = _nail_colour(rng, skin)
            _draw_finger(rng, img, mask, f, skin, nail)
        if MIN_FG <= np.count_nonzero(mask) / mask.size <= MAX_FG:
            break
    else:
        raise RuntimeError(f"sample {index} (seed {seed}): no scene with a usable nail fraction")

    light = 1 + style.light * rng.uniform(0.3, 1) * _ramp(rng, h, w)
    cast = 1 + rng.uniform(-style.light, style.light, 3) * 0.3
    img *= light[..., None] * cast.astype(np.float32)
    if rng.uniform() < style.cast_shadow:
        corners = rng.uniform(-0.3, 1.3, (4, 2)) * (w, h)
        hull = cv2.convexHull(corners.astype(np.float32))[:, 0]
        img *= _shadow(rng, _fill((h, w), hull), rng.uniform(0.25, 0.5))[..., None]
    img += rng.standard_normal((h, w, 3), np.float32) * np.float32(rng.uniform(*style.noise))
    sigma = rng.uniform(*style.blur)
    if sigma >= 0.3:
        img = cv2.GaussianBlur(img, (0, 0), sigma)
    return group, np.clip(img + 0.5, 0, 255).astype(np.uint8), mask


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

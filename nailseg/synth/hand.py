"""The hands of a synthetic photo: a whole hand, fingers from an edge (mostly a row of whole
fingers) or close-up tips, at any rotation and scale, partly out of frame; nail plates narrower
than their finger, as seen from the back. The image gets anti-aliased outlines, the mask the exact
fill of each visible plate."""

from __future__ import annotations

import math
from typing import NamedTuple

import cv2
import numpy as np

from nailseg.synth.look import FREE_EDGE, NailLook, Rng, smooth_noise

SCENES = ("hand", "fingers", "tip")
NAIL_AREA = 0.36  # a nail's area over its finger's width squared, for the nail outline below
_SUBPIXEL = 4  # fillPoly fractional bits: smooth outlines from float points
_NAIL_SHAPES = {
    "square": (7.0, 0.0),
    "rounded": (4.0, 0.0),
    "ellipse": (2.0, 0.0),
    "tapered": (2.5, -0.3),
}
_FINGER_WIDTHS = (1.0, 1.05, 0.97, 0.84)  # index to little finger
_FINGER_LENGTHS = (3.9, 4.3, 4.0, 3.2)
_ROW_SHARE = 0.65  # "fingers" scenes that are a row of whole fingers across the frame
_ROW_BEHIND = ((0.4, 1.5), (0.0, 0.0), (0.2, 1.0), (2.0, 4.0))  # tips behind the middle's


class Finger(NamedTuple):
    """A finger (or the palm, the wrist): tip point, unit direction towards the tip, width and
    length; in finger widths while a scene is laid out, in pixels once placed."""

    tip: np.ndarray
    d: np.ndarray
    width: float
    length: float  # math.inf: it runs out of the frame
    nail: str | None = "any"  # its shape ("any" until placed); None: the palm, the wrist
    cap: float = 0.55  # the tip's roundness in widths: a palm is flatter


def _unit(angle: float) -> np.ndarray:
    return np.array([math.cos(angle), math.sin(angle)])


def _hand(rng: Rng, theta: float, side: int) -> list[Finger]:
    """A whole hand, knuckles at the origin: arm, palm, thumb (mostly) and four fingers."""
    d0, n0 = _unit(theta), _unit(theta + math.pi / 2)
    spread = rng.uniform(2, 14)
    palm_w = 4.4
    parts = [
        Finger(-d0 * 4.6, d0, 0.75 * palm_w, math.inf, None, 0.1),
        Finger(d0 * 0.3, d0, palm_w, 4.8, None, 0.25),
    ]
    thumb = side * rng.uniform(30, 75)
    if rng.uniform() < 0.85:
        d = _unit(theta - math.radians(thumb))
        base = -n0 * side * 1.9 - d0 * 3.2
        parts.append(Finger(base + d * 3.6, d, 1.2, 3.6))
    for k in range(4):
        off = (k - 1.5) * side
        d = _unit(theta + math.radians(spread * off + rng.uniform(-4, 4)))
        knuckle = n0 * off * 1.08 - d0 * 0.12 * off**2
        length = _FINGER_LENGTHS[k] * rng.uniform(0.92, 1.06)
        parts.append(Finger(knuckle + d * length, d, _FINGER_WIDTHS[k], length))
    return parts


def _fingers(rng: Rng, theta: float, side: int, n: int, close: bool) -> list[Finger]:
    """`n` fingers entering from beyond the edge, side by side (further apart when `close`),
    tips staggered as a hand's are."""
    d0, n0 = _unit(theta), _unit(theta + math.pi / 2)
    spacing = rng.uniform(1.1, 1.8) if close else rng.uniform(1.02, 1.25)
    first = int(rng.integers(0, 5 - n)) if n < 4 else 0
    parts = []
    for k in range(n):
        off = (k - (n - 1) / 2) * side
        finger = first + k
        d = _unit(theta + math.radians(rng.uniform(-5, 5)))
        stagger = _FINGER_LENGTHS[finger] - max(_FINGER_LENGTHS) + rng.uniform(-0.2, 0.2)
        tip = n0 * off * spacing + d0 * stagger
        parts.append(Finger(tip, d, _FINGER_WIDTHS[finger], math.inf))
    return parts


def _row(rng: Rng, side: int, h: int, w: int) -> tuple[list[Finger], float, np.ndarray]:
    """(parts, finger width, shift) of three to five whole fingers of a hand laid flat, side by
    side with small gaps, near parallel, tips staggered as a hand's are, mostly rising from the
    bottom edge; fingers a fifth of the frame across, tips in its far part."""
    if rng.uniform() < 0.1:
        theta = rng.uniform(0, 2 * math.pi)
    else:
        edge = 0 if rng.uniform() < 0.7 else int(rng.integers(1, 4))
        theta = -math.pi / 2 + edge * math.pi / 2 + rng.uniform(-0.25, 0.25)
    count = int(rng.integers(3, 6))
    first = int(rng.integers(0, 2)) if count == 3 else 0
    d0, n0 = _unit(theta), _unit(theta + math.pi / 2)
    fan = rng.uniform(0, 3)
    across, parts = 0.0, []
    for k in range(first, first + min(count, 4)):
        if parts:
            across += (_FINGER_WIDTHS[k - 1] + _FINGER_WIDTHS[k]) / 2 * rng.uniform(1.02, 1.25)
        d = _unit(theta + math.radians(side * fan * (k - 1.5) + rng.uniform(-2, 2)))
        tip = n0 * side * across - d0 * rng.uniform(*_ROW_BEHIND[k])
        parts.append(Finger(tip, d, _FINGER_WIDTHS[k], math.inf))
    if count == 5:  # the thumb, beside the index finger and turned out from it
        d = _unit(theta - side * math.radians(rng.uniform(15, 45)))
        parts.append(Finger(-n0 * side * 1.3 - d0 * rng.uniform(2.0, 3.5), d, 1.2, math.inf))
    parts = [p._replace(tip=p.tip - n0 * side * across / 2) for p in parts]  # centred across
    frame_across = abs(w * n0[0]) + abs(h * n0[1])
    along = abs(w * d0[0]) + abs(h * d0[1])
    at = d0 * along * rng.uniform(0.2, 0.42) + n0 * frame_across * rng.uniform(-0.1, 0.1)
    return parts, frame_across * rng.uniform(0.14, 0.24), np.array([w / 2, h / 2]) + at


def layout(rng: Rng, scene: str, nail_area: float, h: int, w: int) -> list[Finger]:
    """The fingers of a scene, drawn in order; `nail_area` is a nail's fraction of the photo (a
    row of whole fingers takes its scale from the frame instead). Tips are kept in view when they
    fit; larger hands are shifted so some tips leave the frame."""
    side = 1 if rng.uniform() < 0.5 else -1  # left or right hand
    if scene == "fingers" and rng.uniform() < _ROW_SHARE:
        return _placed(rng, *_row(rng, side, h, w), h, w)
    theta = rng.uniform(0, 2 * math.pi)
    if scene == "hand":
        parts = _hand(rng, theta, side)
    elif scene == "fingers":
        parts = _fingers(rng, theta, side, int(rng.integers(2, 5)), close=False)
    else:
        parts = _fingers(rng, theta, side, 1 if rng.uniform() < 0.75 else 2, close=True)
    scale = math.sqrt(nail_area * h * w / NAIL_AREA)
    tips = np.array([p.tip for p in parts if p.nail]) * scale
    margin = (rng.uniform(0.05, 0.6) if rng.uniform() < 0.8 else -0.2) * scale
    lo = np.array([margin, margin]) - tips.min(0)
    hi = np.array([w - margin, h - margin]) - tips.max(0)
    return _placed(rng, parts, scale, rng.uniform(np.minimum(lo, hi), np.maximum(lo, hi)), h, w)


def _placed(
    rng: Rng, parts: list[Finger], scale: float, shift: np.ndarray, h: int, w: int
) -> list[Finger]:
    """The parts scaled to pixels and shifted, each nail in a shape of its own."""
    beyond = math.hypot(h, w) + scale  # a length that takes a finger's base out of view
    fingers = []
    for p in parts:
        shape = tuple(_NAIL_SHAPES)[int(rng.integers(len(_NAIL_SHAPES)))] if p.nail else None
        length = min(p.length * scale, beyond)
        fingers.append(Finger(p.tip * scale + shift, p.d, p.width * scale, length, shape, p.cap))
    return fingers


def _to_image(f: Finger, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Finger-local (u along the finger, 0 at the tip; v across) to image points."""
    n = np.array([-f.d[1], f.d[0]])
    return f.tip + u[:, None] * f.d + v[:, None] * n


def finger_outline(f: Finger) -> np.ndarray:
    """A slightly tapered capsule with a round (finger) or flat (palm) front."""
    cap = f.cap * f.width
    t = np.linspace(-math.pi / 2, math.pi / 2, 21)
    u = np.concatenate([[-f.length], -cap + cap * np.cos(t), [-f.length]])
    v = np.concatenate([[-0.56 * f.width], 0.5 * f.width * np.sin(t), [0.56 * f.width]])
    return _to_image(f, u, v)


class Plate(NamedTuple):
    """A nail plate: its outline in image points and its size in pixels along the finger."""

    outline: np.ndarray
    centre: float  # finger-local u of the plate's middle (0 at the tip, negative towards the base)
    half_len: float
    half_w: float


def nail_plate(rng: Rng, f: Finger) -> Plate:
    """The plate near the tip, as on a real finger seen from the back: narrower than the finger,
    lateral folds of skin on both sides, mostly about as long as wide (some longer), a little
    fingertip showing beyond its free edge."""
    half_w = f.width * rng.uniform(0.26, 0.36)
    half_len = half_w * (rng.uniform(0.9, 1.4) if rng.uniform() < 0.85 else rng.uniform(1.4, 1.9))
    centre = -half_len - f.width * rng.uniform(0.03, 0.2)
    power, taper = _NAIL_SHAPES[f.nail]
    t = np.linspace(0, 2 * math.pi, 48, endpoint=False)
    along = np.sign(np.sin(t)) * np.abs(np.sin(t)) ** (2 / power)
    across = np.sign(np.cos(t)) * np.abs(np.cos(t)) ** (2 / power) * (1 + taper * along)
    across /= np.abs(across).max()  # a tapered plate is as wide as drawn at its widest
    return Plate(_to_image(f, centre + half_len * along, half_w * across), centre, half_len, half_w)


def fill(shape: tuple[int, int], pts: np.ndarray, exact: bool = False) -> np.ndarray:
    """Polygon coverage: anti-aliased float32 in [0, 1], or with `exact` the binary fill (bool)."""
    canvas = np.zeros(shape, np.uint8)
    fixed = np.round(pts * (1 << _SUBPIXEL)).astype(np.int32)
    cv2.fillPoly(canvas, [fixed], 255, cv2.LINE_8 if exact else cv2.LINE_AA, shift=_SUBPIXEL)
    return canvas > 0 if exact else canvas.astype(np.float32) / 255


def _box(pts: np.ndarray, h: int, w: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1): the pixels around `pts`, clipped to the image; may be empty."""
    x0, y0 = np.clip(np.floor(pts.min(0)).astype(int), 0, (w, h))
    x1, y1 = np.clip(np.ceil(pts.max(0)).astype(int) + 1, 0, (w, h))
    return int(x0), int(y0), int(x1), int(y1)


def draw_finger(
    rng: Rng,
    img: np.ndarray,
    mask: np.ndarray,
    f: Finger,
    skin: np.ndarray,
    look: NailLook,
    tilt: float,
) -> None:
    """Composite one finger (round shading lit from `tilt`, skin texture, knuckle creases) and its
    nail; the finger hides the mask of nails drawn before it. Work stays in the finger's box."""
    outline = finger_outline(f)
    x0, y0, x1, y1 = _box(outline, *mask.shape)
    if x0 >= x1 or y0 >= y1:
        return
    origin = np.array([x0, y0])
    size = (y1 - y0, x1 - x0)
    alpha = fill(size, outline - origin)
    x = np.arange(x0, x1, dtype=np.float32)[None] - np.float32(f.tip[0])
    y = np.arange(y0, y1, dtype=np.float32)[:, None] - np.float32(f.tip[1])
    dx, dy = np.float32(f.d[0]), np.float32(f.d[1])
    u, v = x * dx + y * dy, y * dx - x * dy  # finger-local: along (0 at the tip), across
    across = np.clip(2 * v / f.width, -1, 1)
    shade = 1 - 0.32 * across**2 + 0.12 * tilt * across
    shade *= 0.94 + 0.12 * smooth_noise(rng, *size, max(2.0, f.width / 6))
    layer = skin * shade[..., None]
    if f.nail is not None:  # the finger tip is flushed: redder than the rest of the finger
        flush = rng.uniform(0, 0.12) * np.exp(-((u / f.width) ** 2))
        layer *= 1 - flush[..., None] * np.array([-0.3, 0.6, 0.6], np.float32)
        # the knuckles: a few creases at the last joint; at the middle one a darker, wrinkled
        # patch of several slightly bent creases
        for at, lines, patch in ((rng.uniform(1.3, 1.7), 3, 0.0), (rng.uniform(2.6, 3.2), 8, 0.12)):
            centre = -at * f.width
            if patch:
                dark = rng.uniform(0, patch) * np.exp(
                    -(((u - centre) / (0.35 * f.width)) ** 2) - (v / (0.4 * f.width)) ** 2
                )
                layer *= (1 - dark)[..., None]
            for _ in range(int(rng.integers(1, lines))):
                span = np.linspace(-1, 1, 5) * rng.uniform(0.12, 0.35)
                bend = rng.uniform(-0.05, 0.05) * span + rng.uniform(-0.1, 0.1) * span**2
                along = centre + (rng.uniform(-0.15, 0.15) + bend) * f.width
                pts = (_to_image(f, along, span * f.width) - origin) * (1 << _SUBPIXEL)
                crease = (skin * rng.uniform(0.65, 0.9)).tolist()
                line = [np.round(pts).astype(np.int32)]
                cv2.polylines(layer, line, False, crease, 1, cv2.LINE_AA, _SUBPIXEL)
    view, mask_view = img[y0:y1, x0:x1], mask[y0:y1, x0:x1]
    view += alpha[..., None] * (layer - view)
    inside = fill(size, outline - origin, exact=True)
    mask_view[inside] = 0
    if f.nail is not None:
        _draw_nail(rng, view, mask_view, f, (u, v), origin, inside, skin, look, tilt)


def _draw_nail(
    rng: Rng,
    view: np.ndarray,
    mask_view: np.ndarray,
    f: Finger,
    uv: tuple[np.ndarray, np.ndarray],
    origin: np.ndarray,
    inside: np.ndarray,
    skin: np.ndarray,
    look: NailLook,
    tilt: float,
) -> None:
    """The nail fold, then the plate in its finish; the mask is the plate's exact fill."""
    outline, centre, half_len, half_w = nail_plate(rng, f)
    ctr = f.tip + centre * f.d
    fold = ctr + (outline - ctr) * rng.uniform(1.06, 1.14) - f.d * 0.08 * f.width
    nx0, ny0, nx1, ny1 = _box(fold - origin, *mask_view.shape)
    if nx0 >= nx1 or ny0 >= ny1:
        return
    sub = slice(ny0, ny1), slice(nx0, nx1)
    size, at = (ny1 - ny0, nx1 - nx0), origin + np.array([nx0, ny0])
    fold_alpha = cv2.GaussianBlur(fill(size, fold - at), (0, 0), max(0.5, f.width / 40))
    dark = skin * rng.uniform(0.72, 0.92) * np.array([1.0, 0.95, 0.95], np.float32)
    view[sub] += (0.7 * fold_alpha)[..., None] * (dark - view[sub])

    plate = fill(size, outline - at)
    u, v = uv[0][sub], uv[1][sub]
    un, vn = (u - centre) / half_len, v / half_w  # nail-local, +un towards the free edge
    shade = 1 - 0.2 * np.clip(vn**2, 0, 1) + 0.08 * tilt * np.clip(vn, -1, 1)
    shade -= 0.22 * np.exp(-(((un + 1) / 0.15) ** 2))  # the cuticle's shadow
    layer = look.colour * shade[..., None]
    if look.finish in ("bare", "french"):
        if rng.uniform() < 0.5:  # the lunula, lighter at the base
            lunula = np.clip(1 - ((un + 1) ** 2 + (0.7 * vn) ** 2) / 0.25, 0, 1) ** 0.5
            layer += (rng.uniform(0.15, 0.35) * lunula)[..., None] * (FREE_EDGE - layer)
        layer *= (1 + 0.03 * np.sin(vn * rng.uniform(8, 16)))[..., None]  # faint ridges
        edge = look.free_edge + rng.uniform(-0.05, 0.05)
        if look.finish == "french":
            edge -= 0.3 * vn**2  # the smile line
        free = np.clip((un - edge) / 0.08, 0, 1)[..., None]
        layer += free * (look.tip * shade[..., None] - layer)
    elif look.finish == "metallic":
        phase = rng.uniform(0, 2 * math.pi)
        layer *= (0.65 + 0.6 * (0.5 + 0.5 * np.sin(2.5 * un + 1.5 * vn + phase)))[..., None]
    elif look.finish == "glitter":
        sparks = rng.random(size, np.float32)
        density = rng.uniform(0.03, 0.2)
        bright = np.clip((sparks - (1 - density)) / density, 0, 1)
        layer += bright[..., None] * (look.sparkle * rng.uniform(0.7, 1.1) - layer)
    spot = rng.uniform(-0.5, 0.3), rng.uniform(-0.5, 0.5), rng.uniform(0.08, 0.25)
    spec = np.exp(-(((un - spot[0]) / 0.45) ** 2) - ((vn - spot[1]) / spot[2]) ** 2)
    layer += (look.gloss * rng.uniform(0.8, 1.2) * spec)[..., None] * (255 - layer)
    alpha = np.minimum(plate, inside[sub])
    view[sub] += alpha[..., None] * (np.clip(layer, 0, 255) - view[sub])
    nail = fill(size, outline - at, exact=True) & inside[sub]
    mask_view[sub][nail] = 255

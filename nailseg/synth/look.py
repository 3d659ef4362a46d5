"""The look of a synthetic photo: skin and nail colours, backgrounds, light and the camera. Every
function draws only from the sample's RNG, on float32 RGB in 0..255: a sample is a pure function
of (seed, index)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

Rng = np.random.Generator

# very light to very dark skin, in order: a tone is drawn anywhere along this line
_SKIN_TONES = np.array([
    [255, 226, 208], [243, 200, 172], [226, 176, 138], [202, 140, 100],
    [168, 108, 72], [128, 80, 54], [92, 58, 40], [60, 38, 28],
], np.float32)  # fmt: skip
_NAIL_PINK = np.array([238, 170, 172], np.float32)
_PINKER = np.array([0.5, -0.5, -0.1], np.float32)  # a relative tint: more red, less green
FREE_EDGE = np.array([248, 242, 230], np.float32)
FINISHES = ("bare", "polish", "metallic", "french", "glitter")
_FINISH_ODDS = (0.4, 0.25, 0.08, 0.12, 0.15)
_SUBTLE_BARE = 0.55  # bare nails that are low-contrast, as most real bare nails are
NO_FREE_EDGE = 1.0  # a free edge that begins at the plate's tip: none
_BACKDROPS = np.array(
    [[236, 236, 232], [205, 208, 212], [45, 65, 150], [28, 28, 32], [60, 120, 85], [222, 205, 175]],
    np.float32,
)


def hsv_colour(
    rng: Rng, s: tuple[float, float], v: tuple[float, float], hue: tuple[int, int] = (0, 180)
) -> np.ndarray:
    """A random RGB colour with hue (OpenCV's 0..180, may wrap past 180), saturation and value
    drawn from the given ranges."""
    h = rng.integers(*hue) % 180
    hsv = np.array([[[h, rng.uniform(*s) * 255, rng.uniform(*v) * 255]]]).astype(np.uint8)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0].astype(np.float32)


def skin_tone(rng: Rng) -> np.ndarray:
    """A skin colour anywhere from very light to very dark, with a red or yellow undertone."""
    t = rng.uniform(0, len(_SKIN_TONES) - 1)
    k = min(int(t), len(_SKIN_TONES) - 2)
    skin = _SKIN_TONES[k] + (_SKIN_TONES[k + 1] - _SKIN_TONES[k]) * (t - k)
    skin = skin * (1 + rng.normal(0, (0.03, 0.03, 0.05))) + rng.normal(0, 4, 3)
    return np.clip(skin, 0, 255).astype(np.float32)


@dataclass(frozen=True)
class NailLook:
    """How a nail plate is painted: its finish, the colours the finish uses, its shine."""

    finish: str  # one of FINISHES
    colour: np.ndarray  # the bed (bare, French) or the polish
    tip: np.ndarray  # the free edge, or the French tip
    sparkle: np.ndarray  # glitter
    gloss: float  # the highlight's strength
    free_edge: float  # where the free edge begins, from the plate's base (-1) to its tip (1)


def _nail_bed(rng: Rng, skin: np.ndarray) -> np.ndarray:
    """A contrasty bare nail's colour: pink over the skin's own tone, lighter than the skin."""
    bed = skin + (_NAIL_PINK - skin) * rng.uniform(0.35, 0.8) + rng.normal(0, 6, 3)
    return np.clip(bed * rng.uniform(1.0, 1.12), 0, 255).astype(np.float32)


def _bare(rng: Rng, skin: np.ndarray, white: np.ndarray) -> NailLook:
    """A bare nail. Most are subtle, as trimmed nails are: on any skin a plate barely pinker and
    lighter than the skin, a short free edge or none, little shine, so the fold's outline is the
    main cue; the rest are contrasty, pink with a white free edge."""
    if rng.uniform() < _SUBTLE_BARE:
        bed = (skin + (_NAIL_PINK - skin) * rng.uniform(0.0, 0.15)) * rng.uniform(1.03, 1.14)
        bed = np.clip(bed * (1 + rng.uniform(0.05, 0.2) * _PINKER) + rng.normal(0, 3, 3), 0, 255)
        tip = (bed + (white - bed) * rng.uniform(0.3, 0.8)).astype(np.float32)
        edge = rng.uniform(0.7, 0.92) if rng.uniform() < 0.75 else NO_FREE_EDGE
        return NailLook("bare", bed.astype(np.float32), tip, tip, rng.uniform(0.0, 0.12), edge)
    bed = _nail_bed(rng, skin)
    return NailLook("bare", bed, white, white, rng.uniform(0.1, 0.4), rng.uniform(0.45, 0.8))


def _polish(rng: Rng, skin: np.ndarray) -> np.ndarray:
    """Any polish: nudes close to the skin, reds, near-blacks, whites and pastels, any hue."""
    r = rng.uniform()
    if r < 0.15:  # nude: the skin's own colour, lighter and pinker, so colour alone cannot tell
        nude = skin + (np.array([235, 190, 175]) - skin) * rng.uniform(0.2, 0.7)
        return np.clip(nude + rng.normal(0, 8, 3), 0, 255).astype(np.float32)
    if r < 0.35:
        return hsv_colour(rng, (0.5, 1.0), (0.25, 0.95), hue=(165, 190))
    if r < 0.45:
        return hsv_colour(rng, (0.0, 1.0), (0.03, 0.18))
    if r < 0.55:
        return hsv_colour(rng, (0.0, 0.25), (0.85, 1.0))
    return hsv_colour(rng, (0.3, 1.0), (0.15, 0.95))


def nail_look(rng: Rng, skin: np.ndarray) -> NailLook:
    """A finish and its colours: bare (subtle or contrasty), polish, metallic, French or glitter."""
    finish = FINISHES[int(rng.choice(len(FINISHES), p=_FINISH_ODDS))]
    white = np.clip(FREE_EDGE + rng.normal(0, 6, 3), 0, 255).astype(np.float32)
    if finish == "bare":
        return _bare(rng, skin, white)
    if finish == "french":
        bed = _nail_bed(rng, skin)
        base = (bed + (FREE_EDGE - bed) * rng.uniform(0.1, 0.45)).astype(np.float32)
        tip = _polish(rng, skin) if rng.uniform() < 0.15 else white
        return NailLook(finish, base, tip, tip, rng.uniform(0.1, 0.4), rng.uniform(0.45, 0.8))
    sparkle = hsv_colour(rng, (0.0, 0.6), (0.8, 1.0))
    return NailLook(finish, _polish(rng, skin), white, sparkle, rng.uniform(0.4, 0.9), NO_FREE_EDGE)


def smooth_noise(rng: Rng, h: int, w: int, cell: float) -> np.ndarray:
    """Noise in [0, 1] with features about `cell` pixels wide (bicubic upsampled grid)."""
    grid = rng.random((int(h / cell) + 2, int(w / cell) + 2), np.float32)
    return np.clip(cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC), 0, 1)


def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates as a column of y and a row of x, to broadcast."""
    return np.arange(h, dtype=np.float32)[:, None], np.arange(w, dtype=np.float32)[None]


def _ramp(rng: Rng, h: int, w: int) -> np.ndarray:
    """A linear ramp in [-1, 1] along a random direction."""
    a = rng.uniform(0, 2 * math.pi)
    y, x = _grid(h, w)
    r = (x - w / 2) * np.float32(math.cos(a)) + (y - h / 2) * np.float32(math.sin(a))
    return r / np.float32(max(float(np.abs(r).max()), 1.0))


def _rotated(rng: Rng, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates along and across a random direction."""
    a = rng.uniform(0, math.pi)
    y, x = _grid(h, w)
    c, s = np.float32(math.cos(a)), np.float32(math.sin(a))
    return x * c + y * s, y * c - x * s


def _blend(c0: np.ndarray, c1: np.ndarray, t: np.ndarray) -> np.ndarray:
    return c0 + (c1 - c0) * t[..., None]


def _two_colours(rng: Rng, s: float = 0.7) -> tuple[np.ndarray, np.ndarray]:
    return hsv_colour(rng, (0.0, s), (0.15, 0.95)), hsv_colour(rng, (0.0, s), (0.15, 0.95))


def _plain_colour(rng: Rng) -> np.ndarray:
    """A backdrop's colour: a common one (white, grey, blue, black, green, beige) or any."""
    if rng.uniform() < 0.5:
        return hsv_colour(rng, (0.0, 0.9), (0.1, 0.98))
    return (_BACKDROPS[rng.integers(len(_BACKDROPS))] + rng.normal(0, 12, 3)).astype(np.float32)


def _evenly_lit(rng: Rng, colour: np.ndarray, h: int, w: int) -> np.ndarray:
    return colour * (1 + 0.05 * _ramp(rng, h, w))[..., None]


def _plain(rng: Rng, h: int, w: int) -> np.ndarray:
    return _evenly_lit(rng, _plain_colour(rng), h, w)


def _cloth(rng: Rng, h: int, w: int) -> np.ndarray:
    """Plain cloth, often strongly saturated in any hue: soft folds, thin dark creases, a faint
    weave."""
    saturated = rng.uniform() < 0.5
    colour = hsv_colour(rng, (0.6, 1.0), (0.3, 0.9)) if saturated else _plain_colour(rng)
    base = _evenly_lit(rng, colour, h, w)
    folds = smooth_noise(rng, h, w, rng.uniform(30, 80))
    creases = np.exp(-(((smooth_noise(rng, h, w, rng.uniform(20, 60)) - 0.5) / 0.015) ** 2))
    creases *= np.clip(4 * smooth_noise(rng, h, w, rng.uniform(15, 40)) - 1.5, 0, 1)  # in pieces
    shade = 0.85 + 0.3 * folds - rng.uniform(0.1, 0.5) * creases
    shade += 0.04 * (smooth_noise(rng, h, w, 1.5) - 0.5)
    return base * shade[..., None]


def _gradient(rng: Rng, h: int, w: int) -> np.ndarray:
    c0, c1 = _two_colours(rng, 0.6)
    return _blend(c0, c1, (_ramp(rng, h, w) + 1) / 2)


def _wood(rng: Rng, h: int, w: int) -> np.ndarray:
    """Wood grain: wavy stripes along the planks, fine streaks, dark seams between planks."""
    dark = hsv_colour(rng, (0.35, 0.8), (0.2, 0.5), hue=(5, 22))
    light = hsv_colour(rng, (0.25, 0.7), (0.5, 0.9), hue=(8, 25))
    _, across = _rotated(rng, h, w)
    wave = smooth_noise(rng, h, w, rng.uniform(20, 60))
    grain = 0.5 + 0.5 * np.sin(across * rng.uniform(0.2, 0.6) + 8 * wave)
    streaks = smooth_noise(rng, h, w, 2.0)
    t = np.clip(0.6 * grain + 0.4 * streaks, 0, 1)
    plank = rng.uniform(40, 120)
    seam = np.abs((across + rng.uniform(0, plank)) % plank - plank / 2) > plank / 2 - 1.2
    return _blend(dark, light, t) * (1 - 0.4 * seam)[..., None]


def _weave(rng: Rng, h: int, w: int) -> np.ndarray:
    """Woven fabric: crossing threads at a random angle and pitch."""
    c0, c1 = _two_colours(rng)
    along, across = _rotated(rng, h, w)
    f = rng.uniform(0.6, 2.0)
    pattern = 0.5 + 0.25 * (np.sin(along * f) + np.sin(across * f))
    folds = smooth_noise(rng, h, w, rng.uniform(20, 60))
    return _blend(c0, c1, np.clip(0.6 * pattern + 0.4 * folds, 0, 1))


def _tiles(rng: Rng, h: int, w: int) -> np.ndarray:
    """Tiles or a grid: cells with their own shade, grout lines between them."""
    tile, grout = _two_colours(rng, 0.5)
    along, across = _rotated(rng, h, w)
    pitch = rng.uniform(18, 70)
    width = rng.uniform(1.0, 3.5)
    line = (np.abs(along % pitch - pitch / 2) > pitch / 2 - width) | (
        np.abs(across % pitch - pitch / 2) > pitch / 2 - width
    )
    cells = (np.floor(along / pitch) * 7 + np.floor(across / pitch) * 13) % 5
    img = tile * (0.9 + 0.05 * cells)[..., None]
    img[line] = grout
    return img * (0.93 + 0.14 * smooth_noise(rng, h, w, 40))[..., None]


def _noise(rng: Rng, h: int, w: int) -> np.ndarray:
    c0, c1 = _two_colours(rng, 0.9)
    return _blend(c0, c1, smooth_noise(rng, h, w, rng.uniform(2, 12)))


def _fractal(rng: Rng, h: int, w: int) -> np.ndarray:
    """Fractal noise through three colours (stone, marble, foliage, carpet): octaves each half
    the size of the one before, `persistence` of its weight."""
    c0, c1 = _two_colours(rng, 0.9)
    c2 = hsv_colour(rng, (0.0, 0.9), (0.1, 1.0))
    cell, persistence = rng.uniform(24, 96), rng.uniform(0.4, 0.7)
    t, weight = np.zeros((h, w), np.float32), 1.0
    while cell >= 1.5:
        t += np.float32(weight) * smooth_noise(rng, h, w, cell)
        cell, weight = cell / 2, weight * persistence
    t = (t - t.min()) / max(float(np.ptp(t)), 1e-6)
    img = _blend(c0, c1, np.clip(2 * t, 0, 1))
    return img + (c2 - img) * np.clip(2 * t - 1, 0, 1)[..., None]


def _desk(rng: Rng, h: int, w: int) -> np.ndarray:
    """A desk top (plain, wood or gradient) with a few office things on it."""
    surface = (_plain, _wood, _gradient)[int(rng.integers(3))]
    img = surface(rng, h, w)
    colours = [hsv_colour(rng, (0.0, 0.3), (0.05, 1.0)) for _ in range(int(rng.integers(1, 5)))]
    _objects(rng, img, colours, (0.15, 0.6))
    return img


def _clutter(rng: Rng, h: int, w: int) -> np.ndarray:
    """Any texture under many objects, some skin- and nail-coloured and nail-sized."""
    kind = ("gradient", "noise", "fractal", "weave", "wood")[int(rng.integers(5))]
    img = BACKGROUNDS[kind](rng, h, w)
    colours = []
    for _ in range(int(rng.integers(6, 16))):
        r = rng.uniform()
        if r < 0.25:
            colours.append(skin_tone(rng))
        elif r < 0.45:
            colours.append(nail_look(rng, skin_tone(rng)).colour)
        else:
            colours.append(hsv_colour(rng, (0.0, 1.0), (0.1, 1.0)))
    _objects(rng, img, colours, (0.03, 0.4))
    return cv2.GaussianBlur(img, (0, 0), rng.uniform(0.3, 1.5))


def _objects(
    rng: Rng, img: np.ndarray, colours: list[np.ndarray], size: tuple[float, float]
) -> None:
    """Boxes, ellipses and capsules in the given colours, each `size` of the image side."""
    h, w = img.shape[:2]
    side = min(h, w)
    for colour in colours:
        centre = (float(rng.uniform(0, w)), float(rng.uniform(0, h)))
        dims = rng.uniform(*size, 2) * side
        angle = float(rng.uniform(0, 180))
        shade = colour * rng.uniform(0.85, 1.15)
        r = rng.uniform()
        if r < 0.4:
            pts = cv2.boxPoints((centre, (float(dims[0]), float(dims[1])), angle))
            cv2.fillPoly(img, [np.round(pts).astype(np.int32)], shade.tolist(), cv2.LINE_AA)
        elif r < 0.75:
            axes = (int(dims[0] / 2), int(dims[1] / 2))
            c = (int(centre[0]), int(centre[1]))
            cv2.ellipse(img, c, axes, angle, 0, 360, shade.tolist(), -1, cv2.LINE_AA)
        else:  # a capsule: a pen, or a finger-like shape without a nail
            a = math.radians(angle)
            half = np.array([math.cos(a), math.sin(a)]) * dims[0]
            ends = np.round(np.array(centre) + np.outer((-1, 1), half)).astype(int).tolist()
            thick = max(2, int(dims[1] / 2))
            cv2.line(img, tuple(ends[0]), tuple(ends[1]), shade.tolist(), thick, cv2.LINE_AA)


BACKGROUNDS: dict[str, Callable[[Rng, int, int], np.ndarray]] = {
    f.__name__[1:]: f
    for f in (_plain, _cloth, _gradient, _wood, _weave, _tiles, _noise, _fractal, _desk, _clutter)
}


def shadow(rng: Rng, coverage: np.ndarray, strength: float) -> np.ndarray:
    """Multiplicative darkening from a coverage map, softened by a wide blur."""
    soft = cv2.GaussianBlur(coverage, (0, 0), rng.uniform(2, 9))
    return 1 - strength * soft


def light(rng: Rng, img: np.ndarray, strength: float) -> np.ndarray:
    """Light from any side (a ramp) and a colour cast of the light source."""
    h, w = img.shape[:2]
    gain = 1 + strength * rng.uniform(0.3, 1) * _ramp(rng, h, w)
    cast = 1 + rng.uniform(-strength, strength, 3) * 0.4
    return img * gain[..., None] * cast.astype(np.float32)


def camera(
    rng: Rng, img: np.ndarray, noise: tuple[float, float], blur: tuple[float, float]
) -> np.ndarray:
    """What a phone camera does to the scene: white balance, vignetting, defocus or motion blur,
    lost resolution, sensor noise, exposure and JPEG compression; returns RGB uint8. The mask is
    not touched."""
    h, w = img.shape[:2]
    img = img * rng.normal(1, 0.06, 3).astype(np.float32)
    if rng.uniform() < 0.4:
        y, x = np.ogrid[0:h, 0:w]
        r2 = ((x - w / 2) / (w / 2)) ** 2 + ((y - h / 2) / (h / 2)) ** 2
        img = img * (1 - rng.uniform(0.1, 0.35) * r2 / 2).astype(np.float32)[..., None]
    if rng.uniform() < 0.2:
        length = int(rng.integers(3, 10))
        kernel = np.zeros((length, length), np.float32)
        a = rng.uniform(0, math.pi)
        c, dx, dy = (length - 1) / 2, math.cos(a) * (length - 1) / 2, math.sin(a) * (length - 1) / 2
        p0, p1 = (round(c - dx), round(c - dy)), (round(c + dx), round(c + dy))
        cv2.line(kernel, p0, p1, 1.0)
        img = cv2.filter2D(img, -1, kernel / kernel.sum())
    else:
        sigma = rng.uniform(*blur)
        if sigma >= 0.3:
            img = cv2.GaussianBlur(img, (0, 0), sigma)
    if rng.uniform() < 0.25:  # a small photo shown larger: detail lost, edges soft
        f = rng.uniform(1.5, 3.0)
        small = cv2.resize(img, (round(w / f), round(h / f)), interpolation=cv2.INTER_AREA)
        img = cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)
    sigma = np.float32(rng.uniform(*noise))
    level = np.sqrt(np.clip(img.mean(2), 0, 255) * np.float32(1 / 128) + np.float32(0.1))
    # shot noise, brighter pixels noisier: fine in brightness, coarser and weaker in colour
    chroma = rng.standard_normal(((h + 1) // 2, (w + 1) // 2, 3), np.float32)
    grain = cv2.resize(chroma, (w, h), interpolation=cv2.INTER_NEAREST) * np.float32(0.5)
    grain += rng.standard_normal((h, w), np.float32)[..., None]
    img += grain * (sigma * level)[..., None]
    out = np.clip(img + 0.5, 0, 255).astype(np.uint8)
    levels = np.linspace(0, 1, 256) ** rng.uniform(0.75, 1.3) * 255 * rng.uniform(0.9, 1.15)
    out = cv2.LUT(out, np.clip(levels + 0.5, 0, 255).astype(np.uint8))  # exposure and gamma
    if rng.uniform() < 0.75:
        quality = int(rng.integers(30, 96))
        ok, buf = cv2.imencode(".jpg", out[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        out = np.ascontiguousarray(cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1])
    return out

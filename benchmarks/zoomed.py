"""Benchmark of predict's scale: Dice on zoomed-out real photos, and on the photos as they are.

    make bench-zoomed CKPT=...   (python -m benchmarks.zoomed ckpt=CKPT input_dir=RAW output_dir=DIR)

A proxy for whole-hand photos, made from the real pairs alone: `input_dir` is prepared (as
`prepare.py dataset=nails` does, the same split) into `DIR/prepared`, and each validation photo
and its mask, for each of `seeds`, is shrunk so its median nail is `nail_px` across (drawn
log-uniform; never enlarged) and placed at a random spot of a larger canvas (its long side drawn
from `canvas`) whose background is one of the generator's (`background=synth`) or the photo's
own edge, extended (`border`). The photos as they are, framed like the training photos, are the
other set. Every run of `runs` (name: `nailseg.load` options, predict's keys) and one per
`tile.long_side` of `long_sides` predicts both sets through the Python API, as predict does;
the score is Dice over all pixels of a set. Writes `DIR/bench_zoomed.csv`, `.json` (the config,
the checkpoint's training nail sizes, the sets' sizes) and `.png` and prints a table. DIR is a
folder of its own (`benchmarks.output`) and may not overlap `input_dir`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import cv2
import hydra
import matplotlib
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

import nailseg
from benchmarks.output import claim_output
from nailseg.config import CONF_DIR
from nailseg.errors import require_values
from nailseg.model.checkpoint import card_of, read_checkpoint
from nailseg.model.scales import nail_size
from nailseg.prep.format import read_table, split_file
from nailseg.prep.prepare import PrepareSettings, compose_prepare, prepare
from nailseg.synth.look import BACKGROUNDS
from nailseg.tables import print_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COMMAND = "benchmarks.zoomed"
OUTPUTS = ["bench_zoomed.csv", "bench_zoomed.json", "bench_zoomed.png"]
Pair = tuple[np.ndarray, np.ndarray]  # RGB uint8 H×W×3, its mask 0/1 H×W


def validation_pairs(cfg: DictConfig, root: Path) -> list[Pair]:
    """`cfg.input_dir` prepared into `root` as `prepare.py dataset=nails` splits it; its
    validation pairs (the first `cfg.limit`, all where null)."""
    settings = PrepareSettings.from_config(compose_prepare(["dataset=nails"]))
    prepare(cfg.input_dir, root, replace(settings, num_workers=cfg.num_workers))
    rows = read_table(root / split_file("valid"), ["images", "masks"])[: cfg.limit]
    load = lambda rel: np.load(root / rel, allow_pickle=False)  # noqa: E731
    return [(load(r.images), load(r.masks)[..., 0]) for r in rows.itertuples()]


def zoomed_out(pair: Pair, rng: np.random.Generator, cfg: DictConfig) -> Pair:
    """The pair shrunk (its median nail `cfg.nail_px` across, drawn log-uniform) onto a canvas
    (module docstring)."""
    image, mask = pair
    h, w = mask.shape
    long = int(rng.integers(cfg.canvas[0], cfg.canvas[1] + 1))
    short = round(long * rng.uniform(0.75, 1.0))
    height, width = (long, short) if rng.uniform() < 0.5 else (short, long)
    target = math.exp(rng.uniform(*np.log(list(cfg.nail_px))))
    scale = min(1.0, target / (nail_size(mask) or target), height / h, width / w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    small = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    small_mask = cv2.resize(mask.astype(np.float32), size, interpolation=cv2.INTER_AREA) > 0.5
    y, x = int(rng.integers(height - size[1] + 1)), int(rng.integers(width - size[0] + 1))
    around = ((y, height - size[1] - y), (x, width - size[0] - x))
    out_mask = np.pad(small_mask, around).astype(np.uint8)
    if cfg.background == "border":
        return np.pad(small, (*around, (0, 0)), mode="edge"), out_mask
    kind = list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS)))]
    canvas = np.clip(BACKGROUNDS[kind](rng, height, width), 0, 255).astype(np.uint8)
    canvas[y : y + size[1], x : x + size[0]] = small
    return canvas, out_mask


def dice(segmenter, pairs: list[Pair], chunk: int = 16) -> float:
    """Dice over all pixels of `pairs`, predicted `chunk` photos at a time."""
    both = found = true = 0
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        for mask, (_, truth) in zip(segmenter.predict([p[0] for p in part]), part, strict=True):
            both += int(np.count_nonzero(mask & truth))
            found, true = found + int(mask.sum()), true + int(truth.sum())
    return 2 * both / max(1, found + true)


def runs(cfg: DictConfig) -> Iterator[tuple[str, dict]]:
    """Each run's name and its `nailseg.load` options."""
    yield from ((n, OmegaConf.to_container(o, resolve=True)) for n, o in cfg.runs.items())
    yield from ((f"tile_{n}", {"tile": {"long_side": n}}) for n in cfg.long_sides)


def _plot(rows: pd.DataFrame, folder) -> None:
    table = rows.pivot_table(index="run", columns="set", values="dice", sort=False)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(table)), 4))
    table.plot.bar(ax=ax, rot=30)
    ax.set_ylabel("Dice over all pixels")
    fig.tight_layout()
    folder.write("bench_zoomed.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def run(cfg: DictConfig) -> pd.DataFrame:
    if cfg.background not in ("synth", "border"):
        raise SystemExit(f"{COMMAND}: background={cfg.background}: use synth or border")
    out = claim_output(cfg, OUTPUTS, COMMAND)
    framed = validation_pairs(cfg, out.path / "prepared")
    sets = {"framed": framed}
    for seed in cfg.seeds:
        sets[f"zoomed_{seed}"] = [
            zoomed_out(pair, np.random.default_rng([seed, i]), cfg) for i, pair in enumerate(framed)
        ]
    rows = []
    for name, options in runs(cfg):
        segmenter = nailseg.load(cfg.ckpt, cfg.device, batch_size=cfg.batch_size, **options)
        for set_name, pairs in sets.items():
            rows.append({"run": name, "set": set_name, "dice": dice(segmenter, pairs)})
    rows = pd.DataFrame(rows)
    extra = {
        "photos": len(framed),
        "nail_size": (card_of(read_checkpoint(cfg.ckpt), cfg.ckpt) or {}).get("nail_size"),
        "nail_px": {  # the median nail of each set's photos, as made
            name: float(np.median([nail_size(m) or 0 for _, m in pairs]))
            for name, pairs in sets.items()
        },
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    out.write("bench_zoomed.csv", rows.to_csv(index=False, float_format="%.4f").encode())
    out.write("bench_zoomed.json", json.dumps(extra, indent=2).encode())
    _plot(rows, out)
    table = Table(title=f"Dice over all pixels, {len(framed)} validation photos ({cfg.ckpt})")
    wide = rows.pivot_table(index="run", columns="set", values="dice", sort=False)
    for column in ("run", *wide.columns):
        table.add_column(column, justify="right")
    for name, values in wide.iterrows():
        table.add_row(name, *(f"{v:.4f}" for v in values))
    print_table(table, Console())
    return rows


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_zoomed")
def main(cfg: DictConfig) -> None:
    require_values(cfg, COMMAND)
    run(cfg)


if __name__ == "__main__":
    main()

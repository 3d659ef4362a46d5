"""Prepared data written the way `prepare.py` writes it, with every sample tagged by its CSV row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from nailseg.prep.format import CSV_COLUMNS, write_table


def write_prepared(
    root: Path, n_train: int = 12, n_valid: int = 5, size: tuple[int, int] = (40, 48)
) -> Path:
    """Write a prepared root (npy + CSVs) whose every sample carries its CSV row index.

    Image pixel (0, 0) channel 0 and the mask's top-left 4x4 block encode the row index, so a test
    can check that image and mask stayed paired: image[0,0,0] == row % 256 and the mask's block
    is 1 exactly when row is odd.
    """
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("valid", n_valid)):
        images, masks = [], []
        for i in range(n):
            h, w = size[0] + (i % 3) * 4, size[1] + (i % 2) * 6  # mixed sizes, as real data has
            image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            image[0, 0, 0] = i % 256
            mask = np.zeros((h, w, 1), np.uint8)
            mask[h // 4 : h // 2, w // 4 : w // 2] = 1
            mask[:4, :4] = i % 2
            images.append(image)
            masks.append(mask)
        write_split(root, split, images, masks, prefix=f"{split}_")
    return root


def write_split(
    root: Path, split: str, images: list[np.ndarray], masks: list[np.ndarray], prefix: str = ""
) -> None:
    """npy files (`<prefix><row>.npy`) and `split`.csv as prepare.py writes them; groups 'a' / 'b'
    alternate."""
    rows = []
    for i, (image, mask) in enumerate(zip(images, masks, strict=True)):
        group = "ab"[i % 2]
        name = f"{prefix}{i}.npy"
        rel_image, rel_mask = Path("images", group, name), Path("masks", group, name)
        for rel, array in ((rel_image, image), (rel_mask, mask)):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            np.save(root / rel, array, allow_pickle=False)
        h, w = image.shape[:2]
        rows.append([str(rel_image), str(rel_mask), group, h, w, float(mask.mean())])
    write_table(root / f"{split}.csv", pd.DataFrame(rows, columns=CSV_COLUMNS))

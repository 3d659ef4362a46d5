"""COCO instance JSON beside (or instead of) mask PNGs: prepare turns it into the npy masks the
PNGs give, RLE exactly and polygons up to the pixels on the outline, and names every entry and
annotation it cannot use in excluded.csv."""

from __future__ import annotations

import json
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image
from support.image_files import box_mask, photo, save_image
from support.prep_settings import prepare

import nailseg.prep.prepare
from nailseg.prep.format import read_table
from nailseg.prep.layout import COCO_UNUSABLE, NO_IMAGE

pycocotools_mask = pytest.importorskip("pycocotools.mask")


def _rle(mask: np.ndarray) -> dict:
    rle = pycocotools_mask.encode(np.asfortranarray(mask > 0, dtype=np.uint8))
    return {"size": rle["size"], "counts": rle["counts"].decode()}


def _polygons(mask: np.ndarray) -> list[list[float]]:
    """The outlines of the mask's regions through its boundary pixels' centres."""
    contours, _ = cv2.findContours(
        (mask > 0).astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE
    )
    return [c.reshape(-1).astype(float).tolist() for c in contours if len(c) >= 3]


def _coco(masks: dict[str, np.ndarray], polygons: dict[str, list], extra: list[dict] = ()) -> dict:
    """A COCO file of `masks` (file name → mask), as RLE but those given in `polygons`."""
    images, annotations = [], list(extra)
    for n, (name, mask) in enumerate(masks.items()):
        images.append({"id": n, "file_name": name, "height": mask.shape[0], "width": mask.shape[1]})
        seg = polygons.get(name) or _rle(mask)
        annotations.append({"id": 100 + n, "image_id": n, "category_id": 1, "segmentation": seg})
    return {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "nail"}]}


def _npy_masks(root: Path) -> dict[str, np.ndarray]:
    return {
        p.relative_to(root).as_posix(): np.load(p) for p in sorted((root / "masks").rglob("*.npy"))
    }


def _link_photos(raw: Path, photos: list[Path], top: Path) -> None:
    for path in photos:
        target = raw / "Images" / path.relative_to(top)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, target)


def test_coco_prepares_as_the_png_masks_and_names_what_it_cannot_use(tmp_path):
    png_raw, coco_raw = tmp_path / "png", tmp_path / "coco"
    masks = {}
    for n in range(6):
        mask = box_mask(box=3 + n)
        masks[f"p{n}.jpg"] = mask
        for raw in (png_raw, coco_raw):
            save_image(raw / "Images" / "g" / f"p{n}.png", photo(seed=n))
        save_image(png_raw / "Masks" / "g" / f"p{n}.png", mask)
    bad = [  # each named in excluded.csv; none stops the run
        {"id": 1, "image_id": 77, "segmentation": [[1, 1, 5, 1, 5, 5]]},
        {"id": 2, "image_id": 0, "segmentation": [[1, 1, 5, 1]]},
        {"id": 3, "image_id": 0, "segmentation": [[1, 1, 5, float("nan"), 5, 5]]},
        {"id": 4, "image_id": 0, "segmentation": {"size": [2, 2], "counts": [4]}},
        {"id": 5, "image_id": 0, "segmentation": {"size": [24, 32], "counts": [5, 3]}},
    ]
    # a box's polygon along its pixels' outer edges covers exactly its pixels
    boxes = {
        f"p{n}.jpg": [[b, b, 2 * b, b, 2 * b, 2 * b, b, 2 * b]] for n in (1, 3, 5) for b in [3 + n]
    }
    coco = _coco({**masks, "ghost.jpg": box_mask()}, boxes, bad)
    (coco_raw / "Masks").mkdir()
    (coco_raw / "Masks" / "annotations.json").write_text(json.dumps(coco))

    prepare(png_raw, tmp_path / "png_out", num_workers=1)
    summary = prepare(coco_raw, tmp_path / "coco_out", num_workers=1)

    assert _npy_masks(tmp_path / "coco_out").keys() == _npy_masks(tmp_path / "png_out").keys()
    for (name, got), want in zip(
        _npy_masks(tmp_path / "coco_out").items(),
        _npy_masks(tmp_path / "png_out").values(),
        strict=False,
    ):
        assert np.array_equal(got, want), name
    excluded = read_table(tmp_path / "coco_out" / "excluded.csv")
    reasons = sorted(
        f"{r}: {d}" for r, d in zip(excluded["reason"], excluded["detail"], strict=False)
    )
    assert len(summary.excluded) == len(bad) + 1, reasons
    assert excluded["reason"].tolist().count(COCO_UNUSABLE) == len(bad), reasons
    assert any(
        p.endswith("annotations.json[ghost.jpg]")
        for p in excluded[excluded["reason"] == NO_IMAGE]["path"]
    )
    assert any("annotation 3: a polygon needs 3 or more finite" in d for d in excluded["detail"])


def test_a_coco_export_of_the_real_masks_prepares_to_the_png_masks(real_data, tmp_path):
    """A handful of real pairs: their PNG masks, and the same masks exported as COCO, RLE for
    some and polygons for others, prepare to the same npy masks: RLE exactly, polygons but for
    pixels on the mask's outline (polygons through the outline's pixel centres are rasterised
    by area, so part of that one-pixel band may fall either way)."""
    photos = sorted((real_data / "Images").rglob("*.png"))[::150][:5]
    png_raw, coco_raw = tmp_path / "png", tmp_path / "coco"
    by_group: dict[str, dict[str, np.ndarray]] = {}
    for path in photos:
        rel = path.relative_to(real_data / "Images")
        mask = np.asarray(Image.open(real_data / "Masks" / rel).convert("L"))
        by_group.setdefault(rel.parts[0], {})[rel.name] = mask
        for raw in (png_raw, coco_raw):
            _link_photos(raw, [path], real_data / "Images")
        (png_raw / "Masks" / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(real_data / "Masks" / rel, png_raw / "Masks" / rel)
    polygon_names = {p.name for p in photos[1::2]}
    for group, masks in by_group.items():  # one COCO file per group, as a labelling tool's task
        (coco_raw / "Masks" / group).mkdir(parents=True)
        coco = _coco(masks, {name: _polygons(masks[name]) for name in polygon_names & set(masks)})
        (coco_raw / "Masks" / group / "instances.json").write_text(json.dumps(coco))

    prepare(png_raw, tmp_path / "png_out", num_workers=1, valid_fraction=0.4)
    summary = prepare(coco_raw, tmp_path / "coco_out", num_workers=1, valid_fraction=0.4)

    assert not summary.excluded, summary.excluded
    want, got = _npy_masks(tmp_path / "png_out"), _npy_masks(tmp_path / "coco_out")
    assert want.keys() == got.keys() and len(want) == len(photos)
    for name, mask in want.items():
        if Path(name).with_suffix(".png").name not in polygon_names:
            assert np.array_equal(got[name], mask), name
            continue
        kernel = np.ones((3, 3), np.uint8)
        outline = cv2.dilate(mask[..., 0], kernel) != cv2.erode(mask[..., 0], kernel)
        differ = (got[name] != mask)[..., 0]
        assert not (differ & ~outline).any(), f"{name}: differs off the outline"


def test_a_coco_file_edited_during_a_run_is_reconverted_on_the_next(tmp_path, monkeypatch):
    """prepare reads a COCO file when it scans the input and converts later: a labelling tool
    saving the file in between left masks of the old file recorded as the new one's, never
    converted again. Each entry is recorded as scanned, so the next run converts the entries the
    edit changed, and only those."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    masks = {f"p{n}.jpg": box_mask(box=3 + n) for n in range(4)}
    for n in range(4):
        save_image(raw / "Images" / "g" / f"p{n}.png", photo(seed=n))
    (raw / "Masks").mkdir()
    annotations = raw / "Masks" / "annotations.json"
    annotations.write_text(json.dumps(_coco(masks, {})))
    edited = {**masks, "p1.jpg": box_mask(box=9)}  # one nail redrawn
    convert = nailseg.prep.prepare.convert

    def save_then_convert(*args):
        annotations.write_text(json.dumps(_coco(edited, {})))
        return convert(*args)

    monkeypatch.setattr(nailseg.prep.prepare, "convert", save_then_convert)
    prepare(raw, out, num_workers=1)
    monkeypatch.undo()
    assert np.array_equal(_npy_masks(out)["masks/g/p1.npy"][..., 0], masks["p1.jpg"] > 0)

    summary = prepare(raw, out, num_workers=1)
    assert (summary.written, summary.up_to_date) == (1, 3)
    got = _npy_masks(out)
    assert all(
        np.array_equal(got[f"masks/g/p{n}.npy"][..., 0], edited[f"p{n}.jpg"] > 0) for n in range(4)
    )
    assert prepare(raw, out, num_workers=1).written == 0

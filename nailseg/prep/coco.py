"""COCO instance JSON, as CVAT, Label Studio and Roboflow export it, as masks: an image entry's
nail annotations (of a category named "nail" when there are several), polygons and RLE alike,
joined by pycocotools. Every entry or annotation that cannot be used is named, never raised.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

PIXELS_MAX = 2 * Image.MAX_IMAGE_PIXELS  # larger than any photo PIL decodes


@dataclass(frozen=True)
class CocoMask:
    """One image entry's mask as compressed COCO RLE; `counts` None: no usable annotation."""

    json: Path
    file_name: str
    height: int
    width: int
    counts: bytes | None

    @property
    def source(self) -> str:
        """What the mask was made from, as prepare's manifest records it: the entry's content
        as read, so an edit of the file, even during a run, reconverts the entries it changed."""
        content = f"{self.height} {self.width} ".encode() + (self.counts or b"-")
        return f"coco {hashlib.blake2b(content, digest_size=16).hexdigest()}"

    @property
    def label(self) -> Path:
        """The entry as excluded.csv names it: `annotations.json[x.jpg]`."""
        return Path(f"{self.json}[{self.file_name}]")

    def decode(self, shape: tuple[int, ...]) -> np.ndarray:
        """The mask in {0, 1} HxW; one of no memory when empty or not of the photo's `shape`,
        whose size check then names both sizes."""
        if self.counts is None or (self.height, self.width) != tuple(shape[:2]):
            return np.broadcast_to(np.uint8(0), (self.height, self.width))
        from pycocotools import mask

        return mask.decode({"size": [self.height, self.width], "counts": self.counts})


def _runs(counts: bytes) -> int:
    """The pixels compressed RLE `counts` cover (-1: a negative run), read as pycocotools does."""
    runs: list[int] = []
    digits = iter(counts)
    for first in digits:
        value, shift, more = 0, 0, True
        while more:
            c = (first if shift == 0 else next(digits, 48)) - 48
            value |= (c & 0x1F) << shift
            shift, more = shift + 5, bool(c & 0x20)
            if not more and c & 0x10:
                value -= 1 << shift
        runs.append(value + (runs[-2] if len(runs) > 2 else 0))
    return sum(runs) if min(runs, default=0) >= 0 else -1


def _rles(segmentation: object, height: int, width: int) -> list[dict]:
    """The annotation's regions as COCO RLE; ValueError saying why it cannot be used."""
    from pycocotools import mask

    if isinstance(segmentation, dict):
        if segmentation.get("size") != [height, width]:
            raise ValueError(f"RLE of size {segmentation.get('size')}, image {[height, width]}")
        counts = segmentation.get("counts")
        if isinstance(counts, str):  # compressed, as pycocotools writes it
            rle = {"size": [height, width], "counts": counts.encode()}
        else:
            rle = mask.frPyObjects(segmentation, height, width)
        if _runs(rle["counts"]) != height * width:  # else decode and merge read past its end
            raise ValueError("RLE whose runs do not cover the image exactly")
        return [rle]
    if not isinstance(segmentation, list) or not segmentation:
        raise ValueError("segmentation is neither polygons nor RLE")
    size = np.array([width, height], float)
    for polygon in segmentation:
        points = np.asarray(polygon if isinstance(polygon, list) else [], float)
        if len(points) < 6 or len(points) % 2 or not np.isfinite(points).all():
            raise ValueError("a polygon needs 3 or more finite (x, y) points")
        # pycocotools' cost grows with the outline's length: far-off points are refused
        if (abs(points.reshape(-1, 2) - size / 2) > 1.5 * size).any():
            raise ValueError("a polygon point lies further outside the image than its size")
    return mask.frPyObjects(segmentation, height, width)


def read_coco(path: Path) -> tuple[list[CocoMask], list[tuple[Path, str]]]:
    """The file's image entries as masks, and (where, why) for each entry and annotation left
    out; ValueError when the file is no COCO instance JSON."""
    from pycocotools import mask

    try:
        data = json.loads(path.read_bytes())
        images, annotations = list(data["images"]), list(data["annotations"])
        names = {repr(c["id"]): str(c.get("name", "")) for c in data.get("categories", [])}
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as err:
        raise ValueError(f"not COCO instance JSON (images, annotations): {err!r}") from err
    nails = {i for i, name in names.items() if "nail" in name.lower()}
    if len(names) > 1 and not nails:
        raise ValueError(f"no category named nail among {sorted(names.values())}")
    entries, left_out = {}, []
    for n, image in enumerate(images):
        image = image if isinstance(image, dict) else {}
        fields = image.get("file_name"), image.get("height"), image.get("width")
        sizes = [v for v in fields[1:] if isinstance(v, int) and v > 0]
        if isinstance(fields[0], str) and len(sizes) == 2 and math.prod(sizes) <= PIXELS_MAX:
            entries[repr(image.get("id"))] = (CocoMask(path, *fields, None), [])
        else:
            left_out.append((path, f"image entry {n}: needs file_name, height and width"))
    for n, ann in enumerate(annotations):
        ann = ann if isinstance(ann, dict) else {}
        name, image_id = f"annotation {ann.get('id', f'#{n}')}", repr(ann.get("image_id"))
        if len(names) > 1 and repr(ann.get("category_id")) not in nails:
            continue  # not a nail
        if image_id not in entries:
            left_out.append((path, f"{name}: image_id {image_id} is no image entry"))
            continue
        entry, rles = entries[image_id]
        try:
            rles += _rles(ann.get("segmentation"), entry.height, entry.width)
        except (ValueError, TypeError, OverflowError) as err:
            left_out.append((entry.label, f"{name}: {err}"))
    merged = [
        replace(e, counts=mask.merge(rles)["counts"] if rles else None)
        for e, rles in entries.values()
    ]
    return merged, left_out

"""predict never writes over what it reads: one test per way the output could meet the photos or
the true masks, and the order of reads and writes. docs/FAULTS.md lists the cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from support.image_files import save_image
from support.inference import compose_cli, make_run
from support.prepared import write_prepared

import nailseg.inference.photos
import nailseg.inference.predict
from nailseg.inference.predict import PredictError, run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("faults_predict")
    return make_run(write_prepared(base / "prepared"), base / "run")


@pytest.fixture
def data(tmp_path) -> Path:
    """photos/x.png, its true mask DATA/masks/x.png, and a link to DATA/masks."""
    save_image(tmp_path / "photos" / "x.png", np.full((20, 24, 3), 90, np.uint8))
    mask = np.zeros((20, 24), np.uint8)
    mask[5:10, 5:10] = 255
    save_image(tmp_path / "DATA" / "masks" / "x.png", mask)
    (tmp_path / "link").symlink_to(tmp_path / "DATA" / "masks")
    return tmp_path


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _predict(ckpt: Path, inputs: Path, output: Path, masks: Path | None = None):
    overrides = [f"ckpt={ckpt}", f"input={inputs}", f"output={output}", "num_workers=2"]
    overrides += [f"masks={masks}"] if masks else []
    return run(compose_cli("predict", overrides), console=Console(quiet=True))


def _cases(data: Path) -> dict[str, tuple[Path, Path, Path | None]]:
    """(input, output, masks) that overlap, by name."""
    photos, masks = data / "photos", data / "DATA" / "masks"
    return {
        # the output's masks/ folder is the true masks' folder: Dice 1.0 against itself
        "masks inside output": (photos, data / "DATA", masks),
        "output inside masks": (photos, masks / "pred", masks),
        "output inside input": (photos, photos / "pred", None),
        "input inside output": (photos, data, None),
        # the photo is where its own prediction would be written
        "file input inside output": (masks / "x.png", data / "DATA", None),
        "masks in another case": (photos, data / "data", masks),
        "output a link to the masks": (photos, data / "link", masks),
    }


@pytest.mark.parametrize(
    "case",
    [
        "masks inside output",
        "output inside masks",
        "output inside input",
        "input inside output",
        "file input inside output",
        "masks in another case",
        "output a link to the masks",
    ],
)
def test_output_overlapping_photos_or_masks_is_refused_before_any_write(case, ckpt, data):
    before = _files(data)
    inputs, output, masks = _cases(data)[case]
    with pytest.raises(PredictError, match=r"overlap \(one is, or is inside, the other\)"):
        _predict(ckpt, inputs, output, masks)
    assert _files(data) == before  # not a byte changed, nothing added


def test_every_true_mask_is_read_before_the_first_write(ckpt, data, tmp_path, monkeypatch):
    for i in range(5):
        save_image(data / "photos" / f"p{i}.png", np.full((20, 24, 3), 30 * i, np.uint8))
        save_image(
            data / "DATA" / "masks" / f"p{i}.png", np.full((20, 24), 255 * (i % 2), np.uint8)
        )
    events = []
    read, write = nailseg.inference.photos.TrueMask.read, nailseg.inference.predict.save_png_atomic
    monkeypatch.setattr(
        nailseg.inference.photos.TrueMask,
        "read",
        classmethod(lambda cls, *a: events.append("read") or read(*a)),
    )
    monkeypatch.setattr(
        nailseg.inference.predict,
        "save_png_atomic",
        lambda *a, **k: events.append("write") or write(*a, **k),
    )
    summary = _predict(ckpt, data / "photos", tmp_path / "out", data / "DATA" / "masks")
    assert summary.scores["overall"]["images"] == 6
    assert events[:6] == ["read"] * 6 and events.count("read") == 6  # then only writes

"""Photos to tensors: JPEG bytes decoded in a batch (nvJPEG on a GPU; torchvision's CPU decoder
here, the same code path), EXIF orientation applied as PIL applies it, and a broken or refused
file decoded or named by the CPU decoder."""

from __future__ import annotations

from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from support.image_files import save_image

from nailseg.inference.pipeline import orient, to_device
from nailseg.inference.request import Photo
from nailseg.inference.views import image_tensors
from nailseg.inference.workers import EncodedJpeg, load
from nailseg.prep.imageio import UnreadableImage, read_rgb

CPU = torch.device("cpu")


def _jpeg(path: Path, array: np.ndarray, orientation: int = 1) -> Path:
    exif = Image.Exif()
    exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format="JPEG", quality=95, exif=exif.tobytes())
    return path


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_matches_pils_exif_transpose(orientation: int) -> None:
    image = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", exif=exif.tobytes())
    expected = np.asarray(ImageOps.exif_transpose(Image.open(buffer)))
    got = orient(torch.from_numpy(image).permute(2, 0, 1), orientation).permute(1, 2, 0)
    np.testing.assert_array_equal(got.numpy(), expected)


def test_jpegs_decode_in_a_batch_upright_and_others_on_the_cpu(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    files = {
        "turned": _jpeg(tmp_path / "turned.jpg", rng.integers(0, 256, (24, 40, 3), np.uint8), 6),
        "plain": _jpeg(tmp_path / "plain.JPEG", rng.integers(0, 256, (16, 16, 3), np.uint8)),
        "png": save_image(tmp_path / "p.png", rng.integers(0, 256, (9, 11, 3), np.uint8)),
    }
    photos = [Photo(path, key) for key, path in files.items()]
    loaded = [load(photo, gpu_jpeg=True) for photo in photos]
    assert [type(item).__name__ for item in loaded] == ["EncodedJpeg", "EncodedJpeg", "ndarray"]
    assert loaded[0].orientation == 6
    for photo, image in zip(photos, to_device(photos, loaded, CPU), strict=True):
        expected = read_rgb(photo.path)  # PIL: EXIF applied; libjpeg, as torchvision's decoder
        assert image.shape == (3, *expected.shape[:2]) and image.dtype == torch.uint8
        diff = np.abs(image.permute(1, 2, 0).numpy().astype(int) - expected.astype(int))
        assert diff.mean() < 1.0, photo.path.name


def test_a_broken_jpeg_is_named_and_its_batch_still_decodes(tmp_path: Path) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)
    good = _jpeg(tmp_path / "good.jpg", noise[:8, :8])
    broken = _jpeg(tmp_path / "broken.jpg", noise)
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) // 2])  # the header survives, half the data does not
    photos = [Photo(good, "good"), Photo(broken, "broken")]
    loaded = [load(photo, gpu_jpeg=True) for photo in photos]
    assert all(isinstance(item, EncodedJpeg) for item in loaded)
    image, failed = to_device(photos, loaded, CPU)
    assert isinstance(image, torch.Tensor) and image.shape == (3, 8, 8)
    assert isinstance(failed, UnreadableImage) and failed.path == broken


def test_a_file_that_is_no_jpeg_is_named(tmp_path: Path) -> None:
    fake = tmp_path / "fake.jpg"
    fake.write_bytes(b"not an image at all")
    with pytest.raises(UnreadableImage, match=r"fake\.jpg"):
        load(Photo(fake, "fake"), gpu_jpeg=True)


def test_photos_of_mixed_sizes_travel_in_one_buffer_and_come_out_whole() -> None:
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in [(3, 5), (7, 2), (1, 1)]]
    images[1].flags.writeable = False  # PIL hands out read-only arrays
    tensors = image_tensors(images, CPU)
    for tensor, image in zip(tensors, images, strict=True):
        assert tensor.shape == (3, *image.shape[:2]) and tensor.dtype == torch.uint8
        np.testing.assert_array_equal(tensor.permute(1, 2, 0).numpy(), image)
    assert image_tensors([], CPU) == []


def _jpeg_with_a_malformed_tag(path: Path, array: np.ndarray, orientation: int) -> Path:
    """A JPEG whose EXIF holds text under a number tag (YPosition, 0x011F: the Make tag 0x010F
    with one byte changed) beside its orientation: PIL decodes it, and its exif_transpose, which
    rewrites the whole EXIF, raised TypeError on it."""
    exif = Image.Exif()
    exif[0x0112], exif[0x010F] = orientation, "Camera"
    buffer = BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95, exif=exif)
    data = bytearray(buffer.getvalue())
    at = data.index(b"\x01\x0f\x00\x02")  # the Make tag's entry (big-endian: tag, ASCII type)
    data[at + 1] = 0x1F
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(data))
    return path


def test_a_malformed_exif_tag_beside_the_orientation_is_read_upright(tmp_path: Path) -> None:
    image = np.random.default_rng(3).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    bad = _jpeg_with_a_malformed_tag(tmp_path / "bad.jpg", image, 6)
    clean = _jpeg(tmp_path / "clean.jpg", image, 6)
    with pytest.raises(TypeError):  # what the code before called
        ImageOps.exif_transpose(Image.open(bad))
    got = read_rgb(bad)
    assert got.shape == (30, 20, 3)  # turned upright
    np.testing.assert_array_equal(got, read_rgb(clean))
    loaded = load(Photo(bad, "bad"), gpu_jpeg=True)  # the GPU path reads the same orientation
    assert isinstance(loaded, EncodedJpeg) and loaded.orientation == 6


def test_a_jpeg_declaring_a_decompression_bomb_is_named_on_the_gpu_path(
    tmp_path: Path, monkeypatch
) -> None:
    big = _jpeg(tmp_path / "big.jpg", np.zeros((64, 64, 3), np.uint8))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4,096 pixels: over twice the limit
    with pytest.raises(UnreadableImage, match=r"big\.jpg.*exceeds limit"):
        load(Photo(big, "big"), gpu_jpeg=True)
    with pytest.raises(UnreadableImage, match=r"big\.jpg"):
        read_rgb(big)

"""The epoch plan (sampling.py) and the DALI backend on CPU: pairing, augmentation, Lightning safety."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.loaders import loader_settings, spec, spec_from
from support.prepared import write_split

from nailseg.data.augment import AugSpec
from nailseg.data.datamodule import read_split
from nailseg.data.loaders.base import read_npy, read_records
from nailseg.data.loaders.dali import DaliLoader
from nailseg.data.sampling import epoch_batches, num_batches

GROUPS = {"a": 0, "b": 1}
HEAVY = [
    {"op": "hflip", "p": 0.5},
    {"op": "vflip", "p": 0.5},
    {"op": "rotate", "p": 0.3, "degrees": [-30, 30]},
    {"op": "random_resized_crop", "p": 0.3, "scale": [0.5, 1.0], "ratio": [0.75, 1.33]},
    {"op": "gaussian_noise", "p": 0.15, "sigma": [0, 0.33]},
    {"op": "gaussian_blur", "p": 0.15, "sigma": [0.5, 1.5]},
    {"op": "brightness", "p": 0.15, "factor": [0.7, 1.3]},
    {"op": "contrast", "p": 0.13, "factor": [0.9, 1.1]},
]


# --- sampling ------------------------------------------------------------------------------------


def _rows(batches: list[np.ndarray]) -> list[int]:
    return [int(i) for batch in batches for i in batch]


@pytest.mark.parametrize("n,world", [(37, 1), (37, 2), (37, 3), (40, 4), (5, 8)])
def test_train_plan_equal_shares_no_duplicates(n: int, world: int) -> None:
    shards = [
        _rows(epoch_batches(n, 1, train=True, seed=3, epoch=2, rank=r, world_size=world))
        for r in range(world)
    ]
    assert {len(s) for s in shards} == {n // world}
    union = [i for shard in shards for i in shard]
    assert len(set(union)) == len(union) == (n // world) * world
    assert set(union) <= set(range(n))


def test_train_plan_shuffles_per_epoch_and_is_deterministic() -> None:
    def rows(seed: int, epoch: int) -> list[int]:
        return _rows(epoch_batches(50, 4, train=True, seed=seed, epoch=epoch))

    assert rows(0, 0) == rows(0, 0)
    assert rows(0, 0) != rows(0, 1)
    assert rows(0, 0) != rows(1, 0)

    def left_over(epoch: int) -> frozenset[int]:
        kept = {
            i
            for rank in range(3)
            for i in _rows(epoch_batches(10, 1, train=True, epoch=epoch, rank=rank, world_size=3))
        }
        return frozenset(range(10)) - kept

    assert len({left_over(e) for e in range(5)}) > 1  # not always the same row left out


def test_train_plan_drop_last() -> None:
    assert [len(b) for b in epoch_batches(10, 4, train=True)] == [4, 4]
    assert [len(b) for b in epoch_batches(10, 4, train=True, drop_last=False)] == [4, 4, 2]


@pytest.mark.parametrize("n,batch,world", [(10, 3, 1), (10, 3, 3), (7, 2, 2), (2, 4, 3), (0, 2, 2)])
def test_eval_plan_covers_every_row_once(n: int, batch: int, world: int) -> None:
    seen = []
    for rank in range(world):
        batches = epoch_batches(n, batch, train=False, rank=rank, world_size=world)
        assert all(0 < len(b) <= batch for b in batches)
        assert len(batches) == num_batches(n, batch, train=False, rank=rank, world_size=world)
        seen += _rows(batches)
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("drop_last", [True, False])
def test_num_batches_matches_train_plan(drop_last: bool) -> None:
    for n, batch, world in [(10, 3, 1), (11, 2, 3), (3, 4, 2)]:
        for rank in range(world):
            plan = epoch_batches(
                n, batch, train=True, rank=rank, world_size=world, drop_last=drop_last
            )
            assert len(plan) == num_batches(
                n, batch, train=True, rank=rank, world_size=world, drop_last=drop_last
            )


# --- DALI loader helpers ---------------------------------------------------------------------------


def _loader(root: Path, split: str, spec: AugSpec, **kwargs) -> DaliLoader:
    records = read_records(read_split(root, split), root, GROUPS)
    kwargs = {"train": split == "train", "batch_size": 4, "image_size": (32, 32), **kwargs}
    return DaliLoader(records, spec, **loader_settings(DaliLoader, **kwargs))


def _unnormalise(image: torch.Tensor, spec: AugSpec) -> np.ndarray:
    """B×3×H×W normalised -> uint8-scale float, to read back the written pixels."""
    mean = np.array(spec.mean, dtype=np.float32)[None, :, None, None]
    std = np.array(spec.std, dtype=np.float32)[None, :, None, None]
    return (image.numpy() * std + mean) * 255


def _write(root: Path, images: list[np.ndarray], masks: list[np.ndarray]) -> Path:
    """A prepared root (group 'a' / 'b' alternating) from the given arrays."""
    write_split(root, "train", images, masks)
    return root


@pytest.fixture
def tagged(tmp_path: Path) -> Path:
    """Samples whose tags survive flips and crops: image channel 0 is the constant row index, the
    mask is all 1 for odd rows and all 0 for even ones; mixed sizes."""
    rng = np.random.default_rng(1)
    images, masks = [], []
    for i in range(16):
        h, w = 36 + 4 * (i % 3), 40 + 6 * (i % 2)
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        image[..., 0] = i
        images.append(image)
        masks.append(np.full((h, w, 1), i % 2, np.uint8))
    return _write(tmp_path / "tagged", images, masks)


@pytest.fixture
def ramps(tmp_path: Path) -> Path:
    """32x32 samples: channel 0 = 8*row, channel 1 = 8*column, channel 2 = 255*mask, where the mask
    is a random (so asymmetric) pattern: flips are readable and image/mask must move together."""
    rng = np.random.default_rng(2)
    y, x = np.mgrid[0:32, 0:32]
    images, masks = [], []
    for _ in range(40):
        mask = rng.integers(0, 2, (32, 32, 1), dtype=np.uint8)
        images.append(np.stack([8 * y, 8 * x, 255 * mask[..., 0]], axis=-1).astype(np.uint8))
        masks.append(mask)
    return _write(tmp_path / "ramps", images, masks)


# --- DALI loader ---------------------------------------------------------------------------------


def test_batches_follow_contract_and_auto_is_cpu(prepared: Path) -> None:
    loader = _loader(prepared, "train", spec_from(HEAVY), device="auto")
    assert loader.device.type == "cpu"
    batch = next(iter(loader))
    assert batch["image"].shape == (4, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert batch["mask"].shape == (4, 1, 32, 32) and batch["mask"].dtype == torch.float32
    assert batch["group"].shape == batch["index"].shape == (4,)
    assert batch["group"].dtype == batch["index"].dtype == torch.int64
    assert all(t.device.type == "cpu" for t in batch.values())
    loader.close()


def test_pairing_over_shuffled_epochs(tagged: Path) -> None:
    spec = spec_from(
        [
            {"op": "hflip", "p": 0.5},
            {"op": "vflip", "p": 0.5},
            {"op": "random_resized_crop", "p": 0.5, "scale": [0.3, 1.0], "ratio": [0.5, 2.0]},
        ]
    )
    records = read_split(tagged, "train")
    loader = _loader(tagged, "train", spec)
    orders = []
    for _ in range(3):
        order = []
        for batch in loader:
            rows = batch["index"].numpy()
            channel0 = _unnormalise(batch["image"], spec)[:, 0]
            assert np.abs(channel0 - rows[:, None, None]).max() < 0.01
            assert (batch["mask"].flatten(1) == torch.from_numpy(rows % 2)[:, None]).all()
            want_groups = records["group"].map(GROUPS).to_numpy()[rows]
            assert batch["group"].tolist() == want_groups.tolist()
            order += rows.tolist()
        assert sorted(order) == list(range(16))
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]


def test_a_pass_started_ahead_follows_the_plan_or_is_discarded(tagged: Path) -> None:
    # a finished pass starts the next one at once (its plan: the next epoch); a set_epoch to
    # another epoch, or a pass abandoned half way, must not leave its batches in the next pass
    def rows(loader: DaliLoader, stop_after: int | None = None) -> list[int]:
        seen = []
        for k, batch in enumerate(loader):
            if k == stop_after:
                break
            seen += batch["index"].tolist()
        return seen

    spec = spec_from([{"op": "hflip", "p": 0.5}])
    loader = _loader(tagged, "train", spec)
    planned = {e: [int(r) for b in loader.plan(epoch=e) for r in b] for e in (0, 1, 5, 6)}
    assert rows(loader) == planned[0]
    assert rows(loader) == planned[1]  # started when epoch 0 ended
    loader.set_epoch(5)  # the started epoch 2 is discarded
    assert rows(loader) == planned[5]
    assert rows(loader, stop_after=1) == planned[6][:4]  # abandoned after one batch
    loader.set_epoch(0)
    assert rows(loader) == planned[0]
    loader.close()


def test_heavy_masks_stay_binary(prepared: Path) -> None:
    loader = _loader(prepared, "train", spec_from(HEAVY), batch_size=6)
    for _ in range(3):
        for batch in loader:
            assert set(batch["mask"].unique().tolist()) <= {0.0, 1.0}
            assert torch.isfinite(batch["image"]).all()


def test_geometry_moves_image_and_mask_together(ramps: Path) -> None:
    spec = spec_from(
        [
            {"op": "hflip", "p": 0.5},
            {"op": "vflip", "p": 0.5},
            {"op": "rotate", "p": 0.5, "degrees": [90, 90]},  # exact on a square: no blending
        ]
    )
    loader = _loader(ramps, "train", spec, batch_size=8)
    for batch in loader:
        channel2 = _unnormalise(batch["image"], spec)[:, 2] / 255
        assert np.abs(channel2 - batch["mask"][:, 0].numpy()).max() < 1e-3


def test_random_resized_crop_is_a_window_shared_by_mask(ramps: Path) -> None:
    crop = {"op": "random_resized_crop", "p": 1.0, "scale": [0.25, 0.25], "ratio": [1.0, 1.0]}
    spec = spec_from([crop])
    loader = _loader(ramps, "train", spec, batch_size=8, image_size=(16, 16))
    for batch in loader:
        image = _unnormalise(batch["image"], spec)
        rows, cols = image[:, 0, :, 0] / 8, image[:, 1, 0, :] / 8
        assert np.abs(np.diff(rows, axis=1) - 1).max() < 0.01  # 16 consecutive rows of 32
        assert np.abs(np.diff(cols, axis=1) - 1).max() < 0.01
        assert np.abs(image[:, 2] / 255 - batch["mask"][:, 0].numpy()).max() < 1e-3


def test_decode_is_exact_at_native_size(ramps: Path) -> None:
    loader = _loader(ramps, "train", spec(), train=False, batch_size=5)
    batch = next(iter(loader))
    for image, row in zip(_unnormalise(batch["image"], spec()), batch["index"], strict=True):
        raw = np.load(ramps / "images" / "ab"[int(row) % 2] / f"{int(row)}.npy")
        assert np.abs(image - raw.transpose(2, 0, 1)).max() < 1e-3


def test_close_releases_pipeline_threads(prepared: Path) -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    for _ in range(5):
        loader = _loader(prepared, "train", spec(), num_workers=2)
        next(iter(loader))  # a suspended pass must not keep the pipeline alive
        loader.close()
    assert threads() <= before + 1
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(loader))


def test_bad_npy_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"bad\.npy"):
        read_npy(str(path), 3)


def test_missing_dali_names_the_backend(prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    with pytest.raises(ImportError, match="loader=dali"):
        _loader(prepared, "train", spec())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pipeline(prepared: Path) -> None:
    loader = _loader(prepared, "train", spec_from(HEAVY), device="gpu")
    rows = []
    for batch in loader:
        assert all(t.device.type == "cuda" for t in batch.values())
        assert set(batch["mask"].unique().tolist()) <= {0.0, 1.0}
        rows += batch["index"].tolist()
    assert sorted(rows) == list(range(12))
    next(iter(loader))
    assert sum(1 for _ in loader) == len(loader)

"""The built-in synthetic dataset: layout, mask contents, determinism, idempotence, variety."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from nailseg.io.folder import OWN_NAMES, read_marker
from nailseg.synth import scene as synthetic
from nailseg.synth.hand import SCENES, Finger, layout, nail_plate
from nailseg.synth.look import FINISHES, NailLook
from nailseg.synth.scene import GROUPS, MAX_FG, MIN_FG, generate, is_current, main, render

N = 16
VARIETY = 64  # rendered in memory for the variety checks


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("synthetic") / "set", n=N, seed=0)


def _files(root: Path) -> dict[str, bytes]:
    """Every file but the marker and journal, which hold the folder's own id and inodes."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name not in OWN_NAMES
    }


def _pairs(root: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(group, image, mask) of every sample, as PIL decodes them."""
    out = []
    for image_path in sorted((root / "Images").glob("*/*.png")):
        mask_path = root / "Masks" / image_path.parent.name / image_path.name
        image, mask = Image.open(image_path), Image.open(mask_path)
        assert (image.mode, mask.mode) == ("RGB", "L"), image_path.name
        out.append((image_path.parent.name, np.asarray(image), np.asarray(mask)))
    return out


@pytest.mark.slow
def test_layout_pairs_every_image_with_a_same_sized_mask(dataset: Path) -> None:
    for kind in ("Images", "Masks"):
        assert sorted(p.name for p in (dataset / kind).iterdir()) == sorted(GROUPS)
    images = sorted(p.relative_to(dataset / "Images") for p in (dataset / "Images").rglob("*.png"))
    masks = sorted(p.relative_to(dataset / "Masks") for p in (dataset / "Masks").rglob("*.png"))
    assert images == masks
    assert sorted(p.name for p in images) == [f"s{i:04d}.png" for i in range(N)]
    assert {p.parent.name for p in images} == set(GROUPS)
    for _, image, mask in _pairs(dataset):
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        assert mask.shape == image.shape[:2]
    assert is_current(dataset, N, 0)


def test_masks_are_binary_with_a_modest_foreground(dataset: Path) -> None:
    assert MIN_FG <= 0.003 and MAX_FG >= 0.30  # room for one small nail and for one close-up
    for _, _, mask in _pairs(dataset):
        assert set(np.unique(mask)) <= {0, 255}
        assert MIN_FG <= np.mean(mask == 255) <= MAX_FG


def test_version_3_pictures_stay_as_they_were() -> None:
    """The pixels of generator version 3: a change to them must bump `VERSION`."""
    digest = hashlib.sha256()
    for i in range(8):
        group, image, mask = render(i, 0)
        digest.update(group.encode() + image.tobytes() + mask.tobytes())
    assert synthetic.VERSION == 3
    assert digest.hexdigest() == "cbdf6f15036917424ff245e1a1eee90b789ea995bbc4a60333363972404fe64d"


@pytest.mark.slow
def test_same_seed_gives_identical_bytes_and_another_seed_differs(
    dataset: Path, tmp_path: Path
) -> None:
    first = _files(dataset)
    assert _files(generate(tmp_path / "again", n=N, seed=0)) == first
    other = _files(generate(tmp_path / "other", n=N, seed=1))
    assert other.keys() == first.keys()
    assert all(other[k] != first[k] for k in other if k.endswith(".png"))


@pytest.mark.slow
def test_worker_pool_writes_the_same_bytes_as_serial(dataset: Path, tmp_path: Path) -> None:
    pooled = _files(generate(tmp_path / "pooled", n=6, seed=0, num_workers=2))
    serial = _files(dataset)  # per-sample RNG: a sample does not depend on n either
    pictures = [k for k in pooled if k.endswith(".png")]
    assert len(pictures) == 2 * 6
    assert all(pooled[k] == serial[k] for k in pictures)


def test_rerun_with_the_same_request_writes_nothing(dataset: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in dataset.rglob("*")}
    assert generate(dataset, n=N, seed=0) == dataset
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*")} == before


def test_new_request_regenerates_and_removes_only_stale_samples(tmp_path: Path) -> None:
    root = generate(tmp_path / "set", n=8, seed=0)
    user_file = root / "Images" / GROUPS[0] / "mine.png"
    user_file.write_bytes(b"not ours")
    generate(root, n=4, seed=3)
    names = sorted(p.name for p in root.rglob("s*.png"))
    assert names == sorted([f"s{i:04d}.png" for i in range(4)] * 2)
    assert user_file.read_bytes() == b"not ours"
    assert read_marker(root)["seed"] == 3
    assert all(p.name in OWN_NAMES for p in root.rglob(".*"))  # no temp files left


def test_interrupted_set_is_redone_and_an_empty_folder_is_taken(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    generate(root, n=4, seed=0)
    first = _files(root)
    with synthetic.OwnedFolder.claim(root, "synthetic") as folder:
        folder.update_marker(complete=False)  # as if killed
        folder.remove(f"Images/{GROUPS[1]}/s0001.png")
    generate(root, n=4, seed=0)
    assert _files(root) == first


def test_groups_differ_in_size_finger_count_and_texture(dataset: Path) -> None:
    sizes: dict[str, set[tuple[int, ...]]] = {g: set() for g in GROUPS}
    nails: dict[str, list[int]] = {g: [] for g in GROUPS}
    texture: dict[str, list[float]] = {g: [] for g in GROUPS}
    for group, image, mask in _pairs(dataset):
        sizes[group].add(image.shape[:2])
        nails[group].append(cv2.connectedComponents(mask)[0] - 1)
        grey = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(np.float32)
        texture[group].append(float(np.abs(cv2.Laplacian(grey, cv2.CV_32F))[mask == 0].mean()))
    assert len({s for group in sizes.values() for s in group}) == len(GROUPS)
    assert any(h != w for group in sizes.values() for h, w in group)
    assert max(nails["studio"]) <= 2 < np.mean(nails["desk"])
    assert np.mean(texture["studio"]) < np.mean(texture["fabric"])


def test_nails_vary_in_colour(dataset: Path) -> None:
    means = np.array([image[mask == 255].mean(0) for _, image, mask in _pairs(dataset)])
    assert means.std(0).min() > 10  # each RGB channel varies from image to image


def test_cli_prints_a_summary_then_skips_a_current_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["nailseg.synth", f"out={tmp_path / 'cli'}", "n=4", "seed=2"]
    monkeypatch.setattr(sys, "argv", args)
    main()
    assert "wrote 4 images" in capsys.readouterr().out
    assert read_marker(tmp_path / "cli")["framing"] == "close"  # the built-in set's
    main()
    assert "nothing written" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*args, "framing=far"])
    with pytest.raises(SystemExit, match=r"framing='far': one of \['close', 'wild'\]"):
        main()


@pytest.mark.parametrize(("n", "workers"), [(0, 0), (4, -1)])
def test_rejects_bad_arguments(tmp_path: Path, n: int, workers: int) -> None:
    with pytest.raises(ValueError, match="need n >= 1"):
        generate(tmp_path, n=n, seed=0, num_workers=workers)


def test_close_framing_shows_the_groups_from_near() -> None:
    """framing=close (the built-in set, for a CPU): no tiny nails of whole hands seen from afar."""
    areas: dict[str, list[float]] = {"wild": [], "close": []}
    for framing, found in areas.items():
        for i in range(24):
            _, _, mask = render(i, 0, framing)
            _, _, stats, _ = cv2.connectedComponentsWithStats((mask == 255).astype(np.uint8))
            found += list(stats[1:, cv2.CC_STAT_AREA] / mask.size)
    assert min(areas["close"]) > 0.005 > min(areas["wild"])
    assert np.percentile(areas["close"], 10) > 2 * np.percentile(areas["wild"], 10)


@dataclass
class Drawn:
    """What `VARIETY` rendered samples drew: their pictures and the choices made on the way."""

    samples: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    scenes: list[str] = field(default_factory=list)
    skins: list[np.ndarray] = field(default_factory=list)
    looks: list[NailLook] = field(default_factory=list)


@pytest.fixture(scope="module")
def drawn() -> Drawn:
    """Renders with the generator's own choices recorded on the way; recording calls the real
    function with the same RNG, so the pictures are the ones `generate` writes."""
    out = Drawn()
    layout, skin_tone, nail_look = synthetic.layout, synthetic.skin_tone, synthetic.nail_look

    def record_layout(rng, scene, *args):
        out.scenes.append(scene)
        return layout(rng, scene, *args)

    def record_skin(rng):
        out.skins.append(skin_tone(rng))
        return out.skins[-1]

    def record_look(rng, skin):
        out.looks.append(nail_look(rng, skin))
        return out.looks[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(synthetic, "layout", record_layout)
        patch.setattr(synthetic, "skin_tone", record_skin)
        patch.setattr(synthetic, "nail_look", record_look)
        out.samples = [render(i, 0) for i in range(VARIETY)]
    return out


@pytest.mark.slow
def test_rendering_with_choices_recorded_draws_the_same_pictures(
    drawn: Drawn, dataset: Path
) -> None:
    for i, (group, image, mask) in enumerate(drawn.samples[:N]):
        name = f"{group}/s{i:04d}.png"
        np.testing.assert_array_equal(image, np.asarray(Image.open(dataset / "Images" / name)))
        np.testing.assert_array_equal(mask, np.asarray(Image.open(dataset / "Masks" / name)))


def test_every_scene_finish_and_skin_tone_is_drawn(drawn: Drawn) -> None:
    assert set(drawn.scenes) == set(SCENES)  # whole hands, fingers from an edge, close-up tips
    assert {look.finish for look in drawn.looks} == set(FINISHES)
    luminance = [float(skin @ np.array([0.299, 0.587, 0.114])) for skin in drawn.skins]
    assert min(luminance) < 70 and max(luminance) > 200  # very dark to very light skin


def test_a_nail_covers_from_a_tiny_to_a_large_part_of_a_photo(drawn: Drawn) -> None:
    areas = []
    for _, _, mask in drawn.samples:
        _, _, stats, _ = cv2.connectedComponentsWithStats((mask == 255).astype(np.uint8))
        areas += list(stats[1:, cv2.CC_STAT_AREA] / mask.size)
    assert min(areas) < 0.005 and max(areas) > 0.2
    assert np.mean(np.array(areas) < 0.02) > 0.2  # the small nails of hands are not rare


def test_masks_are_solid_nails_whatever_the_finish(drawn: Drawn) -> None:
    """Glitter, French tips and highlights are painted on the image, never cut into the mask."""
    for _, _, mask in drawn.samples:
        assert set(np.unique(mask)) <= {0, 255}
        nails = (mask == 255).astype(np.uint8)
        _, labels = cv2.connectedComponents(1 - nails)
        border = set(np.unique(labels[[0, -1]])) | set(np.unique(labels[:, [0, -1]]))
        assert set(np.unique(labels[nails == 0])) <= border  # no holes inside a nail


def test_light_and_camera_change_the_image_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask is final before the light, noise, blur and JPEG are applied."""
    before = [render(i, 0) for i in range(8)]
    monkeypatch.setattr(synthetic, "camera", lambda rng, img, noise, blur: np.clip(img, 0, 255))
    monkeypatch.setattr(synthetic, "light", lambda rng, img, strength: img)
    for i, (group, image, mask) in enumerate(before):
        plain_group, plain, plain_mask = render(i, 0)
        assert plain_group == group
        np.testing.assert_array_equal(plain_mask, mask)
        assert np.abs(plain.astype(np.float32) - image).mean() > 1


def test_each_group_is_its_own_kind_of_scene(drawn: Drawn) -> None:
    nails: dict[str, list[int]] = {g: [] for g in GROUPS}
    for group, _, mask in drawn.samples:
        nails[group].append(cv2.connectedComponents(mask)[0] - 1)
    assert max(nails["studio"]) <= 2 and np.mean(nails["desk"]) > 3  # close-ups, whole hands


def test_nail_plates_are_narrower_than_their_finger_with_skin_beyond_the_tip() -> None:
    """As on a finger seen from the back: lateral folds on both sides, mostly about as long as
    wide, the fingertip's skin beyond the free edge."""
    rng = np.random.default_rng(0)
    widths, ratios = [], []
    for shape in ("square", "rounded", "ellipse", "tapered"):
        for angle in rng.uniform(0, 2 * np.pi, 50):
            d = np.array([np.cos(angle), np.sin(angle)])
            finger = Finger(rng.uniform(0, 100, 2), d, 40.0, 200.0, shape, 0.55)
            plate = nail_plate(rng, finger)
            rel = plate.outline - finger.tip
            along, across = rel @ d, rel @ np.array([-d[1], d[0]])
            assert along.max() < 0  # the tip's skin shows beyond the plate
            widths.append(np.ptp(across) / finger.width)
            ratios.append(np.ptp(along) / np.ptp(across))
    assert min(widths) >= 0.5 and max(widths) <= 0.75
    assert np.mean((np.array(ratios) >= 0.85) & (np.array(ratios) <= 1.45)) > 0.7
    assert max(ratios) > 1.5  # some longer nails too


def test_bare_nails_are_mostly_subtle_on_every_skin_some_contrasty() -> None:
    """Most real bare nails are barely pinker and lighter than the skin, with little shine."""
    rng = np.random.default_rng(0)
    subtle = {True: 0, False: 0}  # by dark skin
    contrasty, gloss = 0, {True: [], False: []}
    for _ in range(600):
        skin = synthetic.skin_tone(rng)
        look = synthetic.nail_look(rng, skin)
        if look.finish != "bare":
            continue
        contrast = float(np.linalg.norm(look.colour - skin) / np.linalg.norm(skin))
        dark = float(skin @ np.array([0.299, 0.587, 0.114])) < 120
        subtle[dark] += contrast < 0.2
        contrasty += contrast > 0.35
        gloss[contrast < 0.2].append(look.gloss)
    assert subtle[True] > 8 and subtle[False] > 40
    assert contrasty > 20
    assert np.mean(gloss[True]) < np.mean(gloss[False])


def test_fingers_scenes_are_often_rows_of_whole_fingers_from_an_edge() -> None:
    """Three to five near-parallel fingers rising from beyond an edge, mostly the bottom, each
    a large part of the frame across, their tips in view."""
    rng = np.random.default_rng(0)
    h, w = 272, 224
    rows, from_bottom, in_view = 0, 0, 0
    for _ in range(200):
        fingers = [f for f in layout(rng, "fingers", 0.002, h, w) if f.nail is not None]
        mean = np.mean([f.d for f in fingers], 0)
        parallel = [f for f in fingers if f.d @ mean / np.linalg.norm(mean) > np.cos(0.2)]
        across = abs(w * mean[1]) + abs(h * mean[0])
        if len(parallel) < 3 or not all(0.12 < f.width / across * 1.05 < 0.3 for f in parallel):
            continue
        for f in parallel:
            base = f.tip - f.d * f.length
            assert not (0 <= base[0] <= w and 0 <= base[1] <= h)  # the whole finger length
        in_view += sum(0 <= f.tip[0] <= w and 0 <= f.tip[1] <= h for f in parallel) >= 3
        rows += 1
        from_bottom += mean[1] / np.linalg.norm(mean) < -0.85
    assert rows > 80 and in_view > 0.8 * rows
    assert rows / 2 < from_bottom < rows  # mostly from the bottom, not only

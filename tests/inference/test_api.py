"""`nailseg.load`: the README's Python example run as written, its masks those predict writes;
photos as paths, arrays, PIL images or lists, each at its own size; an smp export folder loads as
its checkpoint; `import nailseg` leaves torch unloaded."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console
from support.image_files import save_image
from support.inference import compose_cli, own_run

import nailseg
from nailseg.inference.export import run as export_run
from nailseg.inference.predict import run
from nailseg.inference.request import PredictError
from nailseg.model.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
SIZES = [(37, 53), (64, 20), (45, 45), (30, 31), (90, 120), (16, 70), (33, 33), (50, 40), (21, 60)]


@pytest.fixture(scope="module")
def trained(trained_run, tmp_path_factory) -> Path:
    return own_run(trained_run, tmp_path_factory.mktemp("api_run") / "run")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Nine photos of mixed sizes, more than one batch of predict's default 8."""
    folder = tmp_path_factory.mktemp("api_photos")
    rng = np.random.default_rng(2)
    for i, size in enumerate(SIZES):
        save_image(folder / f"p{i}.png", rng.integers(0, 256, (*size, 3), dtype=np.uint8))
    return folder


def predicted(ckpt: Path, photos: Path, out: Path, *extra: str) -> dict[str, np.ndarray]:
    """`nailseg predict`'s masks, 0/1, by file name."""
    overrides = [f"ckpt={ckpt}", f"input={photos}", f"output={out}", "num_workers=1", *extra]
    run(compose_cli("predict", ["overlays=false", *overrides]), console=Console(quiet=True))
    return {p.name: np.asarray(Image.open(p)) // 255 for p in sorted((out / "masks").iterdir())}


def readme_example() -> str:
    """The indented block under README.md's `## In Python`, as a script."""
    section = (ROOT / "README.md").read_text().split("## In Python\n", 1)[1]
    block = re.match(r"\n*((?:    .*\n|\n)+)", section).group(1)
    return textwrap.dedent(block)


@pytest.mark.slow
def test_the_readme_example_runs_as_written_and_gives_predicts_masks(
    trained, photos, tmp_path, monkeypatch, capsys
):
    code = readme_example().replace("RUN", str(trained.parents[1]))
    code = code.replace("PHOTOS", str(photos))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)

    assert capsys.readouterr().out.startswith(nailseg.__version__)
    written = predicted(trained, photos, tmp_path / "out")
    assert list(written) == [p.name for p in scope["photos"]]
    for mask, truth in zip(scope["masks"], written.values(), strict=True):
        assert mask.dtype == np.uint8
        np.testing.assert_array_equal(mask, truth)
    assert scope["prob"].dtype == np.float32 and scope["prob"].shape == SIZES[0]
    assert 0.0 <= scope["prob"].min() <= scope["prob"].max() <= 1.0


@pytest.mark.slow
def test_tta_and_tiles_give_predicts_masks(trained, photos, tmp_path):
    model = nailseg.load(trained, device="cpu", tta=True, tile={"long_side": 64}, threshold=0.45)
    masks = model.predict(sorted(photos.iterdir()))
    extra = ("tta=true", "tile.long_side=64", "threshold=0.45")
    written = predicted(trained, photos, tmp_path / "out", *extra)
    for mask, truth in zip(masks, written.values(), strict=True):
        np.testing.assert_array_equal(mask, truth)


def test_a_path_an_array_a_pil_image_and_lists_give_one_mask_at_the_photos_size(trained, photos):
    model = nailseg.load(str(trained), device="cpu")
    path = photos / "p4.png"
    image = Image.open(path)
    array = np.asarray(image)
    prob = model.probabilities(path)
    assert prob.shape == SIZES[4] and prob.dtype == np.float32
    for photo in (str(path), path, array, image, np.asarray(image.convert("L"))):
        assert model.predict(photo).shape == SIZES[4]
    for photo in (array, image):
        np.testing.assert_array_equal(model.probabilities(photo), prob)
    np.testing.assert_array_equal(model.predict(path), (prob > model.threshold).astype(np.uint8))
    many = model.predict((path, array, image))
    assert isinstance(many, list) and len(many) == 3
    assert model.predict(path, threshold=0.0).all() and not model.predict(path, threshold=1.0).any()


@pytest.mark.slow
def test_bad_photos_and_options_are_one_line(trained):
    model = nailseg.load(trained, device="cpu")
    with pytest.raises(TypeError, match=r"must be uint8 \(RGB, grey or RGBA\), not float32$"):
        model.predict(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(TypeError, match="Cannot handle this data type"):
        model.predict(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(TypeError, match="a photo is a path, a uint8 array or a PIL image, not int"):
        model.predict(3)
    with pytest.raises(PredictError, match=r"^nailseg\.load: Key 'colour' not in 'PredictConfig'$"):
        nailseg.load(trained, colour="red")
    with pytest.raises(PredictError, match=r"tile\.overlap=1\.5: must be in"):
        nailseg.load(trained, tile={"overlap": 1.5})


def test_import_nailseg_leaves_torch_unloaded_and_has_a_version():
    code = "import sys, nailseg; print(nailseg.__version__, 'torch' in sys.modules)"
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert shown.stdout.split() == [nailseg.__version__, "False"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", nailseg.__version__)


@pytest.mark.slow
def test_an_smp_export_folder_loads_and_gives_the_checkpoints_masks(trained, photos, tmp_path):
    folder = tmp_path / "exported"
    export_cfg = compose_cli("export", [f"ckpt={trained}", "format=smp", f"output={folder}"])
    export_run(export_cfg, console=Console(quiet=True))
    files = sorted(photos.iterdir())
    exported = nailseg.load(folder, device="cpu", tta=True)
    checkpoint = nailseg.load(trained, device="cpu", tta=True)
    assert exported.spec.image_size == checkpoint.spec.image_size
    for got, expected in zip(exported.predict(files), checkpoint.predict(files), strict=True):
        np.testing.assert_array_equal(got, expected)
    (folder / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be loaded"):
        nailseg.load(folder, device="cpu")
    with pytest.raises(CheckpointError, match="or a folder `nailseg export format=smp` wrote"):
        nailseg.load(tmp_path, device="cpu")

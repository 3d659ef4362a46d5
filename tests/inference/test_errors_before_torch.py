"""Every user error of `python -m nailseg predict|export|compare` is one line raised before torch,
Lightning, smp, timm or DALI is imported: each command runs in a process of its own, which reports,
at the moment the error ends the command, which of those modules it holds (none may)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from support.cli import quick_first
from support.image_files import save_image

from nailseg.device import gpu_count

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "lightning", "segmentation_models_pytorch", "timm", "nvidia.dali")
# the command run as `python -m nailseg`; at its exit, the heavy modules it holds, on stdout
RUN = f"""
import json, runpy, sys
sys.argv = ["nailseg", *sys.argv[1:]]
try:
    runpy.run_module("nailseg", run_name="__main__", alter_sys=True)
finally:
    print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A photo, a user's folder, a file, zip archives that are no checkpoint, a truncated one."""
    root = tmp_path_factory.mktemp("errors")
    save_image(root / "photos" / "x.png", np.zeros((8, 8, 3), np.uint8))
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my own")
    (root / "file").write_text("a file")
    with zipfile.ZipFile(root / "arrays.ckpt", "w") as archive:
        archive.writestr("a.npy", b"")
    with zipfile.ZipFile(root / "unread.ckpt", "w") as archive:  # passes for one until read
        archive.writestr("unread/data.pkl", b"")
    (root / "cut.ckpt").write_bytes(b"PK\x03\x04 the start of a zip archive only")
    (root / "sweep").mkdir()
    return root


def refused(files: Path, *args: str) -> str:
    """The one line the command exits with, after checking it held none of `HEAVY`."""
    done = subprocess.run(
        [sys.executable, "-c", RUN, *[arg.replace("FILES", str(files)) for arg in args]],
        capture_output=True,
        text=True,
        cwd=files,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


PHOTOS = ["input=FILES/photos", "output=FILES/out"]
CKPT = "ckpt=FILES/unread.ckpt"  # a checkpoint until torch reads it: the checks after pass it


@pytest.mark.parametrize(
    ("args", "message"),
    quick_first(
        [
            (["predict", "ckpt=FILES/nope.ckpt", *PHOTOS], "ckpt=.*nope.ckpt: no such checkpoint"),
            (["predict", "ckpt=FILES/cut.ckpt", *PHOTOS], "cut.ckpt is not a checkpoint"),
            (["predict", "ckpt=FILES/arrays.ckpt", *PHOTOS], "cannot be loaded as a checkpoint"),
            (
                ["predict", CKPT, "input=FILES/none", "output=FILES/out"],
                "input .*none does not exist",
            ),
            (
                ["predict", CKPT, "input=FILES/photos", "output=FILES/mine"],
                "not a folder nailseg made",
            ),
            (["predict", CKPT, "input=FILES/photos", "output=FILES/file/out"], "output="),
            (["predict", CKPT, "input=FILES/photos", "output=FILES/photos/out"], "overlap"),
            (["predict", CKPT, *PHOTOS, "masks=FILES/none"], "masks=.*none is not a folder"),
            (["predict", CKPT, *PHOTOS, "batch_size=0"], "batch_size=0: must be at least 1"),
            (["predict", CKPT, *PHOTOS, "threshold=often"], "threshold=often: use a number"),
            (["predict", CKPT, *PHOTOS, "std=[1,0,1]"], "every value must be above 0"),
            (["predict", CKPT, *PHOTOS, "batch_size=many"], "batch_size=many"),
            (["export", "ckpt=FILES/nope.ckpt"], "no such checkpoint"),
            (["export", CKPT, "format=tflite"], "format=tflite: supported formats are onnx, smp"),
            (["export", CKPT, "image_size=[0,32]"], r"image_size must be \[height, width\]"),
            (["export", CKPT, "output=FILES/file/x.onnx"], "file is a file, not a folder"),
            (["export", CKPT, "format=smp", "output=FILES/mine"], "not a folder nailseg made"),
            (["compare", "sweep_dir=FILES/nowhere"], "no such folder"),
            (["compare", "sweep_dir=FILES/sweep"], "sweep"),
        ]
    ),
)
def test_a_user_error_is_one_line_before_the_heavy_imports(files, args, message):
    line = refused(files, *args)
    assert line.startswith(("predict failed", "export failed", "nailseg", "python")), line
    assert re.search(message, line), line


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
@pytest.mark.parametrize("device", quick_first([("cuda",), ("cuda:1",), ("gpu",)], kind=len))
def test_a_gpu_asked_for_where_none_is_is_one_line_before_torch(files, device):
    line = refused(files, "predict", CKPT, *PHOTOS, f"device={device}")
    assert f"device='{device}': this machine has no CUDA device; use auto or cpu" in line

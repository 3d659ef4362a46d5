"""The loader benchmark on this CPU (loaders only: training is measured on CUDA by default)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from nailseg import bench
from nailseg.bench import TrainStep, measured_peak_tflops, run, training_flops_per_image
from nailseg.config import CONF_DIR
from nailseg.model.metrics import build_loss

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cfg(prepared, out, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("bench", overrides=[
            f"dataset.root={prepared}", "image_size=[32,32]", "warmup_batches=1", "measure_batches=2",
            "repeats=1", f"output_dir={out}", "~augs.heavy", *overrides,
        ])  # fmt: skip


@pytest.mark.slow
def test_loader_rows_and_a_table_that_names_the_model(prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per title, as in a wide terminal
    cfg = _cfg(
        prepared, tmp_path / "bench", "~loaders.kornia", "loaders.torch.batch_size=4",
        "loaders.torch.num_workers=0", "loaders.dali.batch_size=4", "model.encoder_name=resnet34",
    )  # fmt: skip
    rows = run(cfg)
    assert sorted(rows["loader"]) == ["dali", "torch"] and (rows["loader_img_s"] > 0).all()
    assert rows["train_img_s"].isna().all()  # the CPU measures loaders only
    assert rows["ceiling_batch_size"].isna().all()
    csv = pd.read_csv(tmp_path / "bench" / "bench.csv")
    assert csv["model"].eq("Unet-resnet34").all()
    assert (csv["gflop_per_image"] > 0).all() and csv["gflop_per_image"].nunique() == 1
    # no peak is measured on the CPU: no MFU, rather than a made-up one, and the table says why
    assert csv[["peak_tflops", "ceiling_mfu", "train_mfu"]].isna().all().all()
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["config"]["repeats"] == 1
    printed = capsys.readouterr().out
    # a ceiling is comparable only for one model: the table says which it measured
    assert "Unet-resnet34, 32x32, cpu" in printed
    assert "gflop_per_image" in printed and "ceiling_mfu" not in printed
    assert "no MFU: the bf16 matrix-multiply peak is measured on CUDA only" in printed


@pytest.mark.slow
def test_each_row_divides_by_the_ceiling_at_its_own_batch_size(prepared, tmp_path, monkeypatch):
    measured = []  # batch size of each resident batch a ceiling ran on
    ceiling = bench._ceiling
    monkeypatch.setattr(
        bench,
        "_ceiling",
        lambda batch, *a: measured.append(len(batch["image"])) or ceiling(batch, *a),
    )
    cfg = _cfg(
        prepared, tmp_path / "bench", "measure_train=true", "loaders.torch.batch_size=2",
        "loaders.kornia.batch_size=4", "loaders.dali.batch_size=2", "peak_tflops=0.001",
        *(f"loaders.{name}.num_workers=0" for name in ("torch", "kornia")),
        *(f"loaders.{name}.persistent_workers=false" for name in ("torch", "kornia")),
    )  # fmt: skip
    frame = run(cfg).set_index("loader")  # unrounded, as the MFU was computed
    rows = pd.read_csv(tmp_path / "bench" / "bench.csv").set_index("loader")
    assert measured == [2, 4]  # once per distinct batch size: dali reuses torch's
    assert rows["ceiling_batch_size"].to_dict() == rows["batch_size"].to_dict()
    assert rows.loc["torch", "ceiling_img_s"] == rows.loc["dali", "ceiling_img_s"]
    ratio = rows["train_img_s"] / rows["ceiling_img_s"]
    pd.testing.assert_series_equal(ratio, rows["train_vs_ceiling"], check_names=False, atol=1e-3)
    # a given peak is used as is, on the CPU too: MFU = images/s x FLOPs per image / peak
    flop_s = frame["gflop_per_image"] * 1e9 * frame[["ceiling_img_s", "train_img_s"]].T
    mfu = (flop_s / (frame["peak_tflops"] * 1e12)).T
    assert frame["peak_tflops"].eq(0.001).all() and frame["gflop_per_image"].gt(0).all()
    pd.testing.assert_frame_equal(
        mfu, frame[["ceiling_mfu", "train_mfu"]].set_axis(mfu.columns, axis=1)
    )


@pytest.mark.slow
def test_the_built_in_data_is_made_on_first_use_as_train_py_makes_it(tmp_path):
    """`make bench` on a fresh clone failed: data/synthetic/prepared/train.csv not found."""
    root = tmp_path / "synthetic" / "prepared"  # the built-in set's own, under paths.data_dir
    cfg = _cfg(
        root, tmp_path / "bench", f"paths.data_dir={tmp_path}", "dataset.synthetic.n=16",
        "~loaders.kornia", "~loaders.dali", "loaders.torch.batch_size=2",
        "loaders.torch.num_workers=0",
    )  # fmt: skip
    rows = run(cfg)
    assert (root / "train.csv").is_file() and (rows["loader_img_s"] > 0).all()


def test_the_training_step_and_its_ceiling_run_the_trainings_optimizer(prepared, tmp_path):
    """The bench's step built its own AdamW: `optimizer.fused` changed train.py's step, not the
    ceiling it is compared against."""
    cfg = _cfg(prepared, tmp_path / "bench", "optimizer.fused=null", "optimizer.lr=3e-4")
    optimizer = bench._train_step(cfg, torch.device("cpu"), compile=False).optimizer
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["fused"] is None and optimizer.defaults["lr"] == 3e-4


def test_the_flops_of_a_training_image_are_its_convolutions_forward_and_backward():
    """Two 3x3 convolutions, no bias, on 8x8: forward 2 x MACs of each; backward the weight
    gradients of both and the input gradient of the second only (the image needs none)."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
        torch.nn.Conv2d(4, 1, 3, padding=1, bias=False),
    )
    optimizer = torch.optim.AdamW(net.parameters())
    step = TrainStep(net, optimizer, build_loss("dice_bce"), torch.device("cpu"), None, False)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    first, second = 2 * 8 * 8 * 3 * 4 * 9, 2 * 8 * 8 * 4 * 1 * 9  # 2 x MACs, per image
    assert training_flops_per_image(step, (8, 8)) == first + second + first + 2 * second
    # counted on a copy: the step's weights, gradients and optimizer are as they were
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters()) and not optimizer.state


@pytest.mark.gpu
@needs_cuda
def test_the_peak_is_measured_on_cuda():
    assert 10 < measured_peak_tflops(torch.device("cuda")) < 5000


@pytest.mark.gpu
@needs_cuda
def test_mfu_on_cuda_is_a_fraction_of_the_measured_peak(prepared, tmp_path, capsys):
    cfg = _cfg(
        prepared, tmp_path / "bench", "~loaders.torch", "~loaders.kornia",
        "loaders.dali.batch_size=4", "image_size=[64,64]",
    )  # fmt: skip
    rows = run(cfg)
    assert rows["peak_tflops"].between(10, 5000).all()
    assert rows[["ceiling_mfu", "train_mfu"]].gt(0).all().all()
    assert rows[["ceiling_mfu", "train_mfu"]].lt(1).all().all()  # above 1: a miscount
    assert "TFLOP/s (dense bf16 matrix-multiply peak, measured)" in capsys.readouterr().out

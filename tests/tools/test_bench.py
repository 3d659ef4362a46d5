"""The loader benchmark on this CPU (loaders only: training is measured on CUDA by default)."""

from __future__ import annotations

import json

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from nailseg.config import CONF_DIR
from nailseg.tools import bench
from nailseg.tools.bench import run


def _cfg(prepared, out, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("bench", overrides=[
            f"dataset.root={prepared}", "image_size=[32,32]", "warmup_batches=1", "measure_batches=2",
            "repeats=1", f"output_dir={out}", "~augs.heavy", *overrides,
        ])  # fmt: skip


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
    assert pd.read_csv(tmp_path / "bench" / "bench.csv")["model"].eq("Unet-resnet34").all()
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["config"]["repeats"] == 1
    # a ceiling is comparable only for one model: the table says which it measured
    assert "Unet-resnet34, 32x32, cpu" in capsys.readouterr().out


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
        "loaders.kornia.batch_size=4", "loaders.dali.batch_size=2",
        *(f"loaders.{name}.num_workers=0" for name in ("torch", "kornia")),
        *(f"loaders.{name}.persistent_workers=false" for name in ("torch", "kornia")),
    )  # fmt: skip
    run(cfg)
    rows = pd.read_csv(tmp_path / "bench" / "bench.csv").set_index("loader")
    assert measured == [2, 4]  # once per distinct batch size: dali reuses torch's
    assert rows["ceiling_batch_size"].to_dict() == rows["batch_size"].to_dict()
    assert rows.loc["torch", "ceiling_img_s"] == rows.loc["dali", "ceiling_img_s"]
    ratio = rows["train_img_s"] / rows["ceiling_img_s"]
    pd.testing.assert_series_equal(ratio, rows["train_vs_ceiling"], check_names=False, atol=1e-3)


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

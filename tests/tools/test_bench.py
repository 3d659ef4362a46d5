"""The loader benchmark on this CPU (loaders only: training is measured on CUDA by default)."""

from __future__ import annotations

import pandas as pd
from hydra import compose, initialize_config_dir

from nailseg.config import CONF_DIR
from nailseg.tools.bench import run


def test_loader_rows_and_a_table_that_names_the_model(prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per title, as in a wide terminal
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=[
            f"dataset.root={prepared}", "image_size=[32,32]", "warmup_batches=1", "measure_batches=2",
            "repeats=1", f"output_dir={tmp_path}", "~loaders.kornia", "~augs.heavy",
            "loaders.torch.batch_size=4", "loaders.torch.num_workers=0", "loaders.dali.batch_size=4",
            "model.encoder_name=resnet34",
        ])  # fmt: skip
    rows = run(cfg)
    assert sorted(rows["loader"]) == ["dali", "torch"] and (rows["loader_img_s"] > 0).all()
    assert rows["train_img_s"].isna().all()  # the CPU measures loaders only
    assert pd.read_csv(tmp_path / "bench.csv")["model"].eq("Unet-resnet34").all()
    # a ceiling is comparable only for one model: the table says which it measured
    assert "Unet-resnet34, 32x32, batch 4, cpu" in capsys.readouterr().out

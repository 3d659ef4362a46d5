"""train.py end to end on CPU: composition, typed config errors, DALI fits that never lose a batch,
resume, W&B offline records, and overfitting one batch of real photos."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf.errors import ValidationError
from train_helpers import compose_train, small_overrides, train
from wandb_records import history, run_id

from nailseg.data.augment import AugSpec
from nailseg.data.prepare import prepare
from nailseg.model.net import build_net, compile_net
from nailseg.train import run

ROOT = Path(__file__).resolve().parents[1]
MODELS, AUGS = ("unet", "segformer"), ("none", "light", "heavy", "geometric")


@pytest.mark.parametrize(("model", "aug"), list(itertools.product(MODELS, AUGS)))
def test_every_model_and_aug_composes_and_instantiates(model, aug, tmp_path):
    cfg = compose_train([f"model={model}", f"aug={aug}", "trainer=cpu"], tmp_path)
    spec = instantiate(cfg.aug, _convert_="all")
    assert isinstance(spec, AugSpec) and len(spec.ops) == len(cfg.aug.ops)
    net = instantiate(cfg.model)
    with torch.no_grad():
        assert net(torch.zeros(1, 3, 64, 64)).shape == (1, 1, 64, 64)
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    assert trainer.max_epochs == cfg.trainer.max_epochs
    assert callable(instantiate(cfg.loader))
    assert cfg.model.encoder_weights is None  # nothing is downloaded unless asked for


@pytest.mark.parametrize("logger", ["wandb", "csv", "tensorboard", "none"])
def test_every_logger_instantiates(logger, tmp_path):
    cfg = compose_train([f"logger={logger}"], tmp_path)
    loggers = [instantiate(c) for c in (cfg.logger or {}).values()]
    assert len(loggers) == (0 if logger == "none" else 1)


def test_any_smp_architecture_through_the_model_group(tmp_path):
    cfg = compose_train(["model.arch=FPN", "model.encoder_name=resnet18"], tmp_path)
    assert type(instantiate(cfg.model)).__name__ == "FPN"
    cfg = compose_train(["model.arch=NoSuchNet"], tmp_path)
    with pytest.raises(InstantiationException, match="NoSuchNet"):
        instantiate(cfg.model)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.max_epoch=3", "max_epoch"),
        ("model.encoder_nam=resnet34", "encoder_nam"),
        ("loader.batch_sise=8", "batch_sise"),
        ("dataset.image_sise=[64,64]", "image_sise"),
        ("seeed=1", "seeed"),
    ],
)
def test_typo_fails_at_start_naming_the_key(override, key, tmp_path):
    with pytest.raises(ConfigCompositionException, match=key):
        compose_train([override], tmp_path)


def test_wrong_type_fails_at_start_naming_the_key(tmp_path):
    with pytest.raises((ConfigCompositionException, ValidationError), match="max_epochs"):
        compose_train(["trainer.max_epochs=three"], tmp_path)
    with pytest.raises((ConfigCompositionException, ValidationError), match="p"):
        compose_train(["aug=heavy", "aug.ops.0.p=often"], tmp_path)


def test_unknown_compile_mode_fails_before_training(prepared, tmp_path):
    with pytest.raises(ValueError, match=r"reduce_overhead.*reduce-overhead"):
        train(prepared, tmp_path / "run", "module.compile=true", "module.compile_mode=reduce_overhead", "logger=none")  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_compiling_keeps_the_state_dict_keys_of_the_eager_net():
    net = build_net("unet", "resnet18", options={"encoder_depth": 3, "decoder_channels": [8, 4, 2]})
    keys = list(net.state_dict())
    assert compile_net(net, "reduce-overhead") is net and list(net.state_dict()) == keys


def test_typo_fails_from_the_command_line_before_any_work():
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer.max_epoch=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "max_epoch" in proc.stderr


def _metrics_csv(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "csv" / "metrics.csv")


def _per_epoch(frame: pd.DataFrame, key: str) -> list[int]:
    return [int(v) for v in frame[key].dropna()]


@pytest.mark.parametrize(
    ("model", "loader"),
    [("unet", "dali"), ("segformer", "dali"), ("unet", "torch"), ("unet", "kornia")],
)
def test_fast_dev_run(model, loader, prepared, tmp_path):
    extra = ["debug=fast", "logger=csv", f"loader={loader}", "aug=heavy"]
    if model == "segformer":  # replace the tiny UNet of small_overrides
        extra += [
            "model=segformer",
            "~model.options.encoder_depth",
            "~model.options.decoder_channels",
        ]
    train(prepared, tmp_path / "run", *extra)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["fit"]["train/samples"] == 4 and metrics["fit"]["val/samples"] == 4
    assert metrics["test"]["test/samples"] == 4
    assert metrics["choices"]["loader"] == loader


# (overrides, train samples per epoch, val samples per epoch); 12 train and 5 valid rows, batch 4
LOSSLESS_CASES = {
    # sanity check takes both val batches: Lightning stops exactly at len()
    "full epochs": ([], 12, 5),
    "limit_train_batches": (["trainer.limit_train_batches=2"], 8, 5),
    "sanity check abandons a pass": (["trainer.num_sanity_val_steps=1"], 12, 5),
    "limit_val_batches": (["trainer.limit_val_batches=1"], 12, 4),
    "all limits at once": (
        [
            "trainer.limit_train_batches=1",
            "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=1",
        ],
        4,
        4,
    ),
}


@pytest.mark.parametrize("case", list(LOSSLESS_CASES))
def test_no_batch_is_lost_between_epochs(case, prepared, tmp_path):
    overrides, train_samples, val_samples = LOSSLESS_CASES[case]
    run_dir = tmp_path / "run"
    train(
        prepared,
        run_dir,
        "trainer.max_epochs=3",
        "logger=csv",
        "test=false",
        "aug=heavy",
        *overrides,
    )
    frame = _metrics_csv(run_dir)
    assert _per_epoch(frame, "train/samples") == [train_samples] * 3
    assert _per_epoch(frame, "val/samples") == [val_samples] * 3


def test_early_stopping_then_test_sees_every_sample(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(
        prepared,
        run_dir,
        "callbacks=early_stopping",
        "callbacks.early_stopping.patience=0",
        "callbacks.early_stopping.min_delta=1.0",  # no epoch can improve that much: stops after 2
        "trainer.max_epochs=10",
        "logger=csv",
    )
    frame = _metrics_csv(run_dir)
    assert _per_epoch(frame, "train/samples") == [12, 12]
    assert _per_epoch(frame, "val/samples") == [5, 5]
    assert _per_epoch(frame, "test/samples") == [5]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["test"]["test/samples"] == 5 and metrics["best_checkpoint"]


def _wandb_file(run_dir: Path) -> Path:
    (found,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return found


def test_wandb_offline_run_holds_the_metrics(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=2", "logger=wandb")
    rows = history(_wandb_file(run_dir))
    logged = {k for row in rows for k in row}
    for key in (
        "train/loss_step",
        "train/samples",
        "train/images_per_s",
        "train/data_wait_frac",
        "val/dice",
        "val/iou",
        "val/samples",
        "val/dice_group_a",
        "test/dice",
        "lr-AdamW",
    ):
        assert key in logged, key
    assert [r["val/samples"] for r in rows if "val/samples" in r] == [5, 5]
    assert list(run_dir.glob("overlays/epoch_*.png"))
    assert (run_dir / "metrics.json").is_file()


def test_resume_continues_step_optimizer_and_wandb_run(prepared, tmp_path):
    runs = tmp_path / "runs"
    train(prepared, runs / "first", "trainer.max_epochs=2", "logger=wandb", "test=false")
    first = json.loads((runs / "first" / "metrics.json").read_text())
    assert first["global_step"] == 6  # 3 batches x 2 epochs
    train(prepared, runs / "second", "trainer.max_epochs=4", "logger=wandb", "ckpt_path=last")
    second = json.loads((runs / "second" / "metrics.json").read_text())
    assert second["global_step"] == 12 and second["epochs"] == 4
    assert run_id(_wandb_file(runs / "first")) == run_id(_wandb_file(runs / "second"))
    rows = history(_wandb_file(runs / "second"))
    assert [r["train/samples"] for r in rows if "train/samples" in r] == [12, 12]
    assert [r["epoch"] for r in rows if "train/samples" in r] == [2, 3]
    lrs = [r["lr-AdamW"] for r in rows if "lr-AdamW" in r]
    assert lrs and lrs[0] < 1e-3  # the schedule continued; a restart would log the initial lr
    with pytest.raises(FileNotFoundError, match=r"last\.ckpt"):
        train(prepared, tmp_path / "lonely" / "run", "ckpt_path=last")


def test_checkpoint_loads_with_weights_only(prepared, tmp_path):
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "logger=none")
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 and "state_dict" in checkpoint


@pytest.mark.real_data
def test_overfit_one_batch_of_real_photos(real_data, tmp_path):
    root = tmp_path / "nails"
    prepare(real_data, root, group_regex=r"^(\d+_\d+)_|^(None_\d+)-")
    cfg = compose_train(
        small_overrides(
            root,
            "debug=overfit",
            "dataset.image_size=[96,96]",
            "loader.batch_size=8",
            "logger=csv",
            "test=false",
            "module.optimizer.lr=0.003",
            "module.scheduler=null",
            "trainer.max_epochs=60",
        ),
        tmp_path / "run",
    )
    run_dir = tmp_path / "run"
    run(cfg)
    dice = _metrics_csv(run_dir)["val/dice"].dropna().tolist()
    assert max(dice) > 0.9, dice

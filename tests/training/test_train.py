"""train.py end to end on CPU: composition, typed config errors, DALI fits that never lose a batch,
resume, W&B offline records, and overfitting one batch of real photos."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import time
from pathlib import Path

import lightning as L
import numpy as np
import pandas as pd
import pytest
import torch
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy
from omegaconf.errors import ValidationError
from PIL import Image
from support.cli import run_command
from support.prep_settings import prepare
from support.prepared import write_split
from support.train import FreezeProbe, compose_train, small_overrides, train
from support.wandb_records import history, run_id, summary
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nailseg.errors import ConfigError
from nailseg.model.checkpoint import CheckpointError
from nailseg.model.net import build_net, compile_net
from nailseg.prep.format import read_table, write_table
from nailseg.training import callbacks, resume
from nailseg.training.build import build
from nailseg.training.jobs import isolated_job
from nailseg.training.run import run
from nailseg.viz import CAPTION_HEIGHT


@pytest.mark.slow
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


@pytest.mark.slow
def test_wrong_type_fails_at_start_naming_the_key(tmp_path):
    with pytest.raises((ConfigCompositionException, ValidationError), match="max_epochs"):
        compose_train(["trainer.max_epochs=three"], tmp_path)
    with pytest.raises((ConfigCompositionException, ValidationError), match="p"):
        compose_train(["aug=heavy", "aug.ops.0.p=often"], tmp_path)


DDP = "lightning.pytorch.strategies.DDPStrategy"


@pytest.mark.slow
def test_a_strategy_object_is_checked_at_start_naming_the_option(prepared, tmp_path):
    """DDPStrategy passes unknown options on to DistributedDataParallel, which would refuse a typo
    only when the fit starts; it is refused before anything is built or written."""
    with pytest.raises(ConfigError, match=r"trainer.strategy.static_grap: DDPStrategy"):
        train(prepared, tmp_path / "run", f"trainer.strategy={{_target_:{DDP},static_grap:true}}")
    with pytest.raises(ConfigError, match=r"trainer.strategy._target_=.*NoSuch"):
        train(prepared, tmp_path / "run", "trainer.strategy={_target_:lightning.NoSuch}")
    assert not (tmp_path / "run").exists()
    options = "static_graph:true,bucket_cap_mb:1"
    cfg = compose_train(
        small_overrides(
            prepared, "trainer.devices=2", f"trainer.strategy={{_target_:{DDP},{options}}}"
        ),
        tmp_path / "ok",
    )
    strategy = build(cfg).trainer.strategy  # what train.py builds; nothing is launched yet
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs == {"static_graph": True, "bucket_cap_mb": 1}  # to DDP itself


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.lr=-1"], r"optimizer.lr=-1.0: must be > 0"),
        (["optimizer=sgd", "optimizer.momentum=-1"], r"optimizer: Invalid momentum value"),
        (
            ["scheduler=onecycle", "scheduler.pct_start=1.5"],
            r"scheduler.pct_start=1.5: Expected float between 0 and 1",
        ),
        (["loader=torch", "loader.num_workers=-1"], r"loader.num_workers=-1: .* 0 for TorchLoader"),
        (["loader=dali", "loader.num_workers=0"], r"loader.num_workers=0: .* 1 for DaliLoader"),
        (["loader.prefetch=0"], r"loader.prefetch=0: must be at least 1"),
        (["loader.device=gpux"], r"loader.device='gpux': use one of"),
        (["normalize.std=[0,1,1]"], r"normalize.std=\[0.0, 1.0, 1.0\]: .* above 0"),
        (["callbacks.time_to_target.stop=no"], r"callbacks.time_to_target.stop='no'"),
        (["optimized_metric=val/dicee"], r"optimized_metric=val/dicee: not a value training"),
        (["trainer.check_val_every_n_epoch=0"], r"check_val_every_n_epoch=0: must be >= 1"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else "",
)
def test_a_bad_value_is_refused_naming_its_key_before_any_write(
    overrides, message, prepared, tmp_path
):
    """Each was refused only inside the fit (torch's, DALI's and the loaders' own checks; a
    misspelt metric at the first validation's end), after the logger's folders were written, or
    not at all (a std of 0 trained on NaN; `stop=no` stopped the fit: a non-empty string)."""
    with pytest.raises(ValueError, match=message):
        train(prepared, tmp_path / "run", "logger=csv", *overrides)
    assert not (tmp_path / "run").exists()


def test_a_bad_value_fails_before_the_built_in_data_is_made(tmp_path):
    """train.py made and prepared the synthetic set (seconds, megabytes) and only then refused a
    value any check could have refused first."""
    overrides = [f"paths.data_dir={tmp_path}", "dataset.synthetic.n=8"]  # its own folders here
    with pytest.raises(ConfigError, match=r"loader.batch_size=0"):
        run(compose_train([*overrides, "loader.batch_size=0"], tmp_path / "run"))
    assert not (tmp_path / "synthetic").exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_unknown_compile_mode_fails_before_training(prepared, tmp_path):
    with pytest.raises(ValueError, match=r"reduce_overhead.*reduce-overhead"):
        train(prepared, tmp_path / "run", "module.compile=true", "module.compile_mode=reduce_overhead", "logger=none")  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_compiling_keeps_the_state_dict_keys_of_the_eager_net():
    net = build_net("unet", "resnet18", options={"encoder_depth": 3, "decoder_channels": [8, 4, 2]})
    keys = list(net.state_dict())
    assert compile_net(net, "reduce-overhead") is net and list(net.state_dict()) == keys


def test_typo_fails_from_the_command_line_before_any_work(capsys):
    proc = run_command(["train.py", "trainer.max_epoch=3"], capsys)
    assert proc.returncode != 0 and "max_epoch" in proc.stderr


def _metrics_csv(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "csv" / "metrics.csv")


def _per_epoch(frame: pd.DataFrame, key: str) -> list[int]:
    return [int(v) for v in frame[key].dropna()]


@pytest.mark.parametrize(
    ("model", "loader"),
    [
        ("unet", "dali"),
        pytest.param("segformer", "dali", marks=pytest.mark.slow),
        ("unet", "torch"),
        pytest.param("unet", "kornia", marks=pytest.mark.slow),
    ],
)
def test_fast_dev_run(model, loader, prepared, tmp_path):
    # aug=robust: every op of the spec (heavy's among them) trains on each loader
    extra = ["debug=fast", "logger=csv", f"loader={loader}", "aug=robust"]
    if model == "segformer":  # replace the tiny UNet of small_overrides
        extra += [
            "model=segformer",
            "~model.options.encoder_depth",
            "~model.options.decoder_channels",
        ]
    train(prepared, tmp_path / "run", *extra)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["fit"]["train/samples"] == 4 and metrics["fit"]["val/samples"] == 4
    assert (
        metrics["evaluated_on"] == "valid" and metrics["final"]["metrics"]["val_best/samples"] == 4
    )
    assert metrics["choices"]["loader"] == loader


@pytest.mark.slow
def test_lr_falls_once_over_the_whole_fit_and_ends_near_its_minimum(prepared, tmp_path):
    # the schedule as composed (scheduler=cosine): 4 epochs of 3 steps, one decay, no restart
    train(prepared, tmp_path / "run", "trainer.max_epochs=4", "logger=csv", "test=false")
    lrs = _metrics_csv(tmp_path / "run")["lr-AdamW"].dropna().tolist()
    assert len(lrs) == 12 and lrs[0] == pytest.approx(1e-3)
    assert all(b < a for a, b in itertools.pairwise(lrs)), lrs
    assert lrs[-1] < 0.02 * lrs[0]


# a net that needs sides divisible by its output stride (smp's Unet takes any size)
SEGFORMER = [
    "model=segformer",
    "~model.options.encoder_depth",
    "~model.options.decoder_channels",
    "dataset.image_size=[32,36]",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loader.batch_size=13", r"loader.batch_size=13: the train split has 12 rows for 1 rank"),
        ("loader.batch_size=0", r"loader.batch_size=0: must be at least 1"),
        (SEGFORMER, r"dataset.image_size=\[32, 36\]: Segformer/mit_b0 .* divisible by 32"),
        ("module.threshold=1.5", r"module.threshold=1.5"),
        ("eval_split=testing", r"eval_split=testing"),
        ("eval_split=test", r"eval_split=test: .* has no test.csv"),
        ("optimizer.weight_decy=0.1", r"optimizer.weight_decy"),
        ("train=false", r"train=false evaluates a checkpoint"),
    ],
)
def test_bad_values_fail_before_any_work_naming_key_and_value(
    override, message, prepared, tmp_path
):
    overrides = override if isinstance(override, list) else [override]
    with pytest.raises(Exception, match=message):
        train(prepared, tmp_path / "run", *overrides, "logger=csv")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_test_split_is_reported_as_test_and_only_then(prepared, tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for _ in range(4)]
    masks = [(rng.random((40, 48, 1)) > 0.5).astype(np.uint8) for _ in range(4)]
    write_split(prepared, "test", images, masks, prefix="test_")
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=1", "logger=csv")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["evaluated_on"] == "test" and metrics["final"]["metrics"]["test/samples"] == 4
    assert _per_epoch(_metrics_csv(run_dir), "test/samples") == [4]


@pytest.mark.slow
def test_data_of_one_group_trains_and_reports_it(prepared, tmp_path):
    """A folder of photos in one group (Images/<one group>/) failed at the first validation:
    torchmetrics squeezes a one-group score to a 0-dim tensor, which the per-group logging
    indexed."""
    for split in ("train", "valid"):
        rows = read_table(prepared / f"{split}.csv")
        write_table(prepared / f"{split}.csv", rows.assign(group="a"))
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "logger=none")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    final = metrics["final"]["metrics"]
    assert final["val_best/samples_group_a"] == final["val_best/samples"] == 5


@pytest.mark.slow
def test_evaluation_only_run_scores_a_checkpoint_on_the_chosen_split(prepared, tmp_path):
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "logger=none", "test=false")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    for split, samples in (("valid", 5), ("train", 12)):
        out = tmp_path / f"eval_{split}"
        train(
            prepared, out, "train=false", f"ckpt_path={ckpt}", f"eval_split={split}", "logger=none"
        )
        metrics = json.loads((out / "metrics.json").read_text())
        prefix = "val" if split == "valid" else split
        assert metrics["evaluated_on"] == split and metrics["resumed_from"] == str(ckpt)
        assert metrics["final"]["metrics"][f"{prefix}_eval/samples"] == samples
        assert not (out / "checkpoints").exists()


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert _per_epoch(frame, "val_best/samples") == [5]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["final"]["metrics"]["val_best/samples"] == 5 and metrics["best"]["checkpoint"]


def _wandb_files(run_dir: Path) -> list[Path]:
    """The run's offline W&B files, one per session (a resumed fit adds one), oldest first."""
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_the_best_dice(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=3", "logger=wandb")
    (run_file,) = _wandb_files(run_dir)
    rows = history(run_file)
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
        "val/dice_best",
        "val_best/dice",
        "lr-AdamW",
        "val/overlays/_type",
        "val/examples/all_masks",  # each photo with truth and prediction as W&B masks
        "val_best/groups/_type",  # the final evaluation per group, as a table
    ):
        assert key in logged, key
    assert [r["val_best/groups/nrows"] for r in rows if "val_best/groups/nrows" in r] == [2]
    assert not any(k.startswith("test/") for k in logged)  # no test split, no test score
    dice = [r["val/dice"] for r in rows if "val/dice" in r]
    assert len(dice) == 3
    assert [r["val/dice_best"] for r in rows if "val/dice_best" in r] == pytest.approx(
        [max(dice[: i + 1]) for i in range(3)]
    )
    assert summary(run_file)["val/dice"]["max"] == pytest.approx(max(dice))
    assert list(run_dir.glob("overlays/epoch_*.png"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["best"]["value"] == pytest.approx(max(dice))
    # throughput: each epoch's logged value, and the median of those after the first two
    speeds = [r["train/images_per_s"] for r in rows if "train/images_per_s" in r]
    throughput = metrics["throughput"]
    assert [e["images_per_s"] for e in throughput["per_epoch"]] == pytest.approx(speeds)
    samples = [r["train/samples"] for r in rows if "train/samples" in r]
    assert [e["images"] for e in throughput["per_epoch"]] == samples and len(samples) == 3
    assert throughput["epochs_counted"] == [2] and throughput["images_per_s"] == speeds[2]
    assert metrics["world_size"] == 1


@pytest.mark.slow
def test_overlays_spread_over_the_groups_each_column_labelled(prepared, tmp_path):
    """The valid rows sorted by group (a's photos black, b's white), a batch holding one group:
    the 4 columns drawn are 2 of each group, a caption under each and one under the grid."""
    images = [np.full((40, 48, 3), 255 * (i % 2), np.uint8) for i in range(8)]  # groups a, b, ...
    masks = [np.pad(np.ones((20, 24, 1), np.uint8), ((10, 10), (12, 12), (0, 0)))] * 8
    write_split(prepared, "valid", images, masks, prefix="valid_")
    rows = read_table(prepared / "valid.csv")
    write_table(prepared / "valid.csv", rows.sort_values("group", kind="stable"))
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "+callbacks.overlays.max_images=4")
    shown = np.asarray(Image.open(tmp_path / "run" / "overlays" / "epoch_000.png"))
    tile, pad = 32 + 2, 2  # dataset.image_size=[32,32] and its padding
    assert shown.shape == (pad + 3 * tile + 2 * CAPTION_HEIGHT, pad + 4 * tile, 3)
    photos = [shown[pad : pad + 32, pad + c * tile : c * tile + tile].mean() for c in range(4)]
    assert [round(p) for p in photos] == [0, 0, 255, 255]
    below = pad + 2 * tile + 32  # the prediction row's captions: each column's group and Dice
    assert all(
        shown[below : below + CAPTION_HEIGHT, c * tile : (c + 1) * tile].any() for c in range(4)
    )
    assert shown[-CAPTION_HEIGHT:].any()  # the grid's: what the rows are


@pytest.mark.slow
def test_tensorboard_holds_the_overlays_and_the_best_value_as_hp_metric(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=2", "logger=tensorboard")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert events.Tags()["images"] == ["val/overlays"]
    best = json.loads((run_dir / "metrics.json").read_text())["best"]["value"]
    assert [s.value for s in events.Scalars("hp_metric")] == [pytest.approx(best)]


class Interrupt(L.Callback):
    """A crash of a real fit: raises before batch `batch` of epoch `epoch`, after the checkpoints
    (and log rows) of what ran before it."""

    def __init__(self, epoch: int, batch: int = 0) -> None:
        self.at = (epoch, batch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (trainer.current_epoch, batch_idx) == self.at:
            raise RuntimeError(f"interrupted at {self.at}")


def interrupted(root: Path, run_dir: Path, *extra: str, epoch: int, batch: int = 0) -> None:
    """`train` crashing at (`epoch`, `batch`), its W&B run closed as a crashed process's is."""
    crash = f"+callbacks.interrupt={{_target_:{__name__}.Interrupt,epoch:{epoch},batch:{batch}}}"
    with pytest.raises(RuntimeError, match="interrupted"), isolated_job():
        train(root, run_dir, *extra, crash)


@pytest.mark.slow
def test_ckpt_path_last_names_the_runs_it_skips_for_lacking_a_checkpoint(
    prepared, tmp_path, caplog
):
    runs = tmp_path / "runs"
    train(prepared, runs / "a", "trainer.max_epochs=1", "logger=none", "test=false")
    interrupted(prepared, runs / "b", "trainer.max_epochs=1", "logger=none", epoch=0)  # none saved
    with caplog.at_level(logging.INFO, logger="nailseg.training.resume"):
        train(prepared, runs / "c", "trainer.max_epochs=1", "logger=none", "ckpt_path=last")
    said = [r.getMessage() for r in caplog.records]
    assert f"ckpt_path=last: skipping {runs / 'b'}: it saved no checkpoint" in said
    assert f"resuming from {runs / 'a' / 'checkpoints' / 'last.ckpt'}" in said


@pytest.mark.slow
def test_resume_continues_its_run_folder_keeping_the_best_and_the_schedule(prepared, tmp_path):
    reference = tmp_path / "uninterrupted" / "run"
    train(prepared, reference, "trainer.max_epochs=4", "logger=csv", "test=false")
    runs = tmp_path / "runs"
    first_dir = runs / "first"
    interrupted(prepared, first_dir, "trainer.max_epochs=4", "logger=wandb", epoch=2)

    train(prepared, runs / "second", "trainer.max_epochs=4", "logger=wandb", "ckpt_path=last")
    second = json.loads((first_dir / "metrics.json").read_text())  # the run folder it continued
    assert second["global_step"] == 12 and second["epochs"] == 4
    assert second["resumed_from"] == str(first_dir / "checkpoints" / "last.ckpt")
    assert not (runs / "second" / "checkpoints").exists()
    files = _wandb_files(first_dir)
    assert len(files) == 2 and run_id(files[0]) == run_id(files[1])
    rows = history(files[1])
    assert [r["train/samples"] for r in rows if "train/samples" in r] == [12, 12]
    assert [r["epoch"] for r in rows if "train/samples" in r] == [2, 3]
    # the LR of every step, over both sessions (the crash came after step 6's was logged), is
    # the uninterrupted fit's: one schedule
    lrs = {r["trainer/global_step"]: r["lr-AdamW"] for f in files for r in history(f) if "lr-AdamW" in r}  # fmt: skip
    assert [lrs[step] for step in range(12)] == _metrics_csv(reference)[
        "lr-AdamW"
    ].dropna().tolist()
    dice = [r["val/dice"] for f in files for r in history(f) if "val/dice" in r]
    assert len(dice) == 4 and second["best"]["value"] == pytest.approx(max(dice))

    # nothing left to train: the best is the one restored from the checkpoint
    train(prepared, runs / "again", "trainer.max_epochs=4", "logger=none", "test=false", "ckpt_path=last")  # fmt: skip
    again = json.loads((first_dir / "metrics.json").read_text())
    assert again["best"] == second["best"]
    with pytest.raises(CheckpointError, match=r"last\.ckpt"):
        train(prepared, tmp_path / "lonely" / "run", "ckpt_path=last")


@pytest.mark.slow
def test_a_resumed_fit_keeps_every_earlier_csv_row_once_and_draws_them(prepared, tmp_path):
    # crashed inside epoch 2 (step 6 ran, step 7's LR was logged): both run again on resume; the
    # CSV log is kept beside any logger (none here), and drawn when the resumed fit ends
    run_dir = tmp_path / "runs" / "a"
    interrupted(prepared, run_dir, "trainer.max_epochs=4", "logger=none", epoch=2, batch=1)
    assert _metrics_csv(run_dir)["step"].max() == 7 and not (run_dir / "curves.png").exists()
    train(prepared, tmp_path / "runs" / "b", "trainer.max_epochs=4", "logger=none", "ckpt_path=last")  # fmt: skip
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    frame = _metrics_csv(run_dir)
    assert frame.dropna(subset=["val/dice"])["epoch"].tolist() == [0, 1, 2, 3]
    assert _per_epoch(frame, "train/samples") == [12] * 4
    for key in ("train/loss_step", "lr-AdamW"):
        assert frame.dropna(subset=[key])["step"].tolist() == list(range(12)), key
    assert _per_epoch(frame, "val_best/samples") == [5]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["trainer.accumulate_grad_batches=2"]])
def test_step_losses_reach_the_loggers_at_lightnings_own_steps(extra, prepared, tmp_path):
    # the LR monitor logs by Lightning's own rule; the loss, logged past Lightning, must match
    # it step for step, accumulation included (3 batches an epoch: steps of 2 and 1 batches)
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=4", "trainer.log_every_n_steps=2", "logger=csv", "test=false", *extra)  # fmt: skip
    frame = _metrics_csv(run_dir)
    losses = frame.dropna(subset=["train/loss_step"])
    assert losses["step"].tolist() == frame.dropna(subset=["lr-AdamW"])["step"].tolist()
    assert losses["step"].tolist() == list(range(1, 12 if not extra else 8, 2))
    steps_per_epoch = 3 if not extra else 2
    assert losses["epoch"].tolist() == [s // steps_per_epoch for s in losses["step"]]


@pytest.mark.slow
def test_the_step_losses_average_to_the_epochs_loss(prepared, tmp_path):
    # every step logged: each epoch's 3 equal batches average to the epoch's value exactly
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=2", "logger=csv", "test=false")
    frame = _metrics_csv(run_dir)
    steps = frame.dropna(subset=["train/loss_step"]).groupby("epoch")["train/loss_step"]
    assert steps.size().tolist() == [3, 3]
    epochs = frame.dropna(subset=["train/loss"]).set_index("epoch")["train/loss"]
    assert steps.mean().to_numpy() == pytest.approx(epochs.to_numpy(), rel=1e-6)


@pytest.mark.slow
def test_last_checkpoint_is_the_last_epoch_even_without_a_new_best(prepared, tmp_path):
    # val/samples never changes: only epoch 0 is a "best"; last.ckpt must still move on
    train(prepared, tmp_path / "run", "trainer.max_epochs=3", "optimized_metric=val/samples", "logger=none", "test=false")  # fmt: skip
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (2, 9)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("epoch_*.ckpt")] == [
        "epoch_000.ckpt"
    ]


@pytest.mark.slow
def test_checkpoint_loads_with_weights_only(prepared, tmp_path):
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "logger=none")
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 and "state_dict" in checkpoint


@pytest.mark.slow
def test_eval_scales_reach_validation_and_the_checkpoint(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=1", "module.eval_scales=[1.0,2.0]", "logger=csv")
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["eval_scales"] == [1.0, 2.0]
    assert _per_epoch(_metrics_csv(run_dir), "val/samples") == [5]  # each validation photo once


@pytest.mark.real_data
@pytest.mark.slow
def test_overfit_one_batch_of_real_photos(real_data, tmp_path):
    root = tmp_path / "nails"
    prepare(real_data, root, group_regex=r"^(\d+_\d+)_|^(None_\d+)-")
    cfg = compose_train(
        small_overrides(
            root,
            "debug=overfit",
            "dataset.image_size=[64,64]",
            "loader.batch_size=8",
            "logger=csv",
            "test=false",
            "optimizer.lr=0.003",
            "scheduler=none",
            "trainer.max_epochs=50",
        ),
        tmp_path / "run",
    )
    run_dir = tmp_path / "run"
    run(cfg)
    dice = _metrics_csv(run_dir)["val/dice"].dropna().tolist()
    assert max(dice) > 0.9, dice


def _checkpoint(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}}, path)
    return path


def test_a_sweep_job_resumes_its_own_checkpoint_never_a_siblings(tmp_path):
    sweep = tmp_path / "multirun" / "sweep"
    own = _checkpoint(sweep / "0" / "checkpoints" / "last.ckpt")
    sibling = _checkpoint(sweep / "1" / "checkpoints" / "last.ckpt")  # newer
    os.utime(own, ns=(1, 1))
    found = resume.resolve("last", sweep / "0", sweep_job=True)
    assert found.checkpoint == own and found.run_dir == sweep / "0"
    assert resume.resolve("last", sweep / "2", sweep_job=True) is None  # a job not yet run
    # a single run takes the newest run beside it
    assert resume.resolve("last", sweep / "new", sweep_job=False).checkpoint == sibling


@pytest.mark.slow
def test_the_builtin_data_is_generated_and_prepared_on_first_use(tmp_path):
    # what `python train.py model=segformer aug=heavy debug=fast` does on a fresh clone
    data = f"paths.data_dir={tmp_path}"  # the built-in set's own folders: tmp_path/synthetic/
    cfg = compose_train(
        [data, "dataset.synthetic.n=24", "model=segformer", "aug=heavy", "debug=fast"],
        tmp_path / "run",
    )
    run(cfg)
    assert (tmp_path / "synthetic" / "prepared" / "train.csv").is_file()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["fit"]["train/samples"] == 16  # one batch of the default 16
    with pytest.raises(ConfigError, match=r"python prepare\.py dataset=nails input_dir="):
        run(compose_train(["dataset=nails", f"dataset.root={tmp_path}/none"], tmp_path / "r2"))


def test_time_to_target_is_reported_when_reached_and_null_when_not(prepared, tmp_path):
    reached = {}
    for target in (0.0, 1.01):  # met by the first validation; never met
        run_dir = tmp_path / str(target)
        train(prepared, run_dir, "trainer.max_epochs=2", "logger=none", "test=false",
              f"callbacks.time_to_target.target={target}")  # fmt: skip
        reached[target] = json.loads((run_dir / "metrics.json").read_text())["time_to_target"]
    first = reached[0.0]
    assert (first["metric"], first["epoch"], first["global_step"]) == ("val/dice", 0, 3)
    assert first["value"] >= 0.0 and first["train_s"] > 0 and first["val_s"] > 0
    assert 0 < first["first_epoch_train_s"] <= first["train_s"]
    assert first["startup_s"] > 0
    assert first["seconds"] >= first["startup_s"] + first["train_s"] + first["val_s"] - 1e-6
    assert reached[1.01] is None


@pytest.mark.slow
def test_time_to_target_stop_ends_training_at_the_target(prepared, tmp_path):
    train(prepared, tmp_path / "run", "trainer.max_epochs=3", "logger=none", "test=false",
          "callbacks.time_to_target.target=0.0", "callbacks.time_to_target.stop=true")  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["time_to_target"]["epoch"] == 0
    assert metrics["epochs"] == 1 and metrics["global_step"] == 3  # of 3 epochs, only the first


def test_a_jobs_clock_starts_with_the_process_only_for_its_first_job(monkeypatch):
    monkeypatch.setattr(callbacks, "_job_started", None)
    callbacks.start_job_clock()
    assert callbacks._job_started == pytest.approx(callbacks.process_start_time(), abs=0.05)
    now = time.time()
    callbacks.start_job_clock()
    assert now <= callbacks._job_started <= time.time()  # a later job of a sweep


@pytest.mark.slow
def test_the_collector_leaves_what_exists_at_the_fit_start_alone_during_the_fit(prepared, tmp_path):
    """A full collection walked all ~620,000 objects of the built run: a 290-440 ms pause inside
    a training epoch of most 10-epoch fits on the H200."""
    FreezeProbe.seen.clear()
    train(prepared, tmp_path / "run", "trainer.max_epochs=2", "logger=none", "test=false",
          "+callbacks.freeze._target_=support.train.FreezeProbe")  # fmt: skip
    assert len(FreezeProbe.seen) == 2 and min(FreezeProbe.seen) > 100_000
    assert gc.get_freeze_count() == 0  # after the fit: the job's objects can be collected again

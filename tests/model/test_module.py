"""SegModule and the callbacks under a real Lightning Trainer on CPU, fed the batch contract.

One small fit (tiny smp Unet, 32x32 synthetic samples, uneven batches, offline W&B) is shared by the
tests below; each checks one promise: exact sample counts, metric names, overlays, checkpoints that
load with weights_only=True, throughput numbers.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from omegaconf import OmegaConf
from PIL import Image
from support.loaders import MEAN, STD
from support.loggers import KeptRows
from torch.utils.data import DataLoader, Dataset

from nailseg.model.module import SegModule
from nailseg.training import run_folder
from nailseg.training.callbacks import LearningRates, PredictionOverlays, TrainSpeedMonitor
from nailseg.viz import CAPTION_HEIGHT

GROUPS = ("a", "b")
# the module's settings
MODULE = {"loss": "dice_bce", "threshold": 0.5, "channels_last": False, "eval_scales": None}
SIZE = 32
N_TRAIN, TRAIN_BS, TRAIN_BATCHES = 14, 4, 3  # limit_train_batches=3 of 4 -> 12 samples per epoch
N_VAL, VAL_BS = 7, 3  # batches of 3, 3, 1; groups a: 4, b: 3
EPOCHS = 2


class ContractDataset(Dataset):
    """Samples in the batch contract's per-sample form: a bright square is the nail."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.masks = torch.zeros(n, 1, SIZE, SIZE)
        for i in range(n):
            y, x = torch.randint(0, SIZE - 12, (2,), generator=gen).tolist()
            self.masks[i, :, y : y + 12, x : x + 12] = 1.0
        self.images = self.masks.expand(-1, 3, -1, -1) * 2 - 1
        self.images = self.images + 0.3 * torch.randn(n, 3, SIZE, SIZE, generator=gen)

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "image": self.images[i],
            "mask": self.masks[i],
            "group": torch.tensor(i % len(GROUPS)),
            "index": torch.tensor(i),
        }


def _net() -> torch.nn.Module:
    # a shallow resnet18 Unet: a real smp net, yet several times faster than the full depth on CPU
    return smp.create_model(
        "unet",
        encoder_name="resnet18",
        encoder_weights=None,
        encoder_depth=3,
        decoder_channels=(32, 16, 8),
        in_channels=3,
        classes=1,
    )


def _module(**kwargs: Any) -> SegModule:
    # built the way Hydra builds them: partials from `_partial_: true`, lists as ListConfig
    optimizer = instantiate(
        {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, "betas": [0.9, 0.99]}
    )
    scheduler = instantiate(
        {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True, "T_max": None}
    )
    settings = {"group_names": OmegaConf.create(list(GROUPS)), **MODULE, **kwargs}
    return SegModule(_net(), optimizer, scheduler, **settings)


def _loader(n: int, batch_size: int, seed: int) -> DataLoader:
    return DataLoader(ContractDataset(n, seed), batch_size=batch_size, shuffle=False)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("run")
    run_folder.hold(root)  # what train.py writes into is the run folder it holds
    torch.manual_seed(0)
    model = _module()
    checkpoint = ModelCheckpoint(dirpath=root / "checkpoints", monitor="val/dice", mode="max")
    logger = WandbLogger(save_dir=str(root), offline=True, project="nailseg-test")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        limit_train_batches=TRAIN_BATCHES,
        log_every_n_steps=1,
        default_root_dir=root,
        logger=logger,
        callbacks=[
            checkpoint,
            TrainSpeedMonitor(),
            PredictionOverlays(every_n_epochs=5, max_images=8, mean=MEAN, std=STD),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    val = _loader(N_VAL, VAL_BS, seed=1)
    trainer.fit(model, _loader(N_TRAIN, TRAIN_BS, seed=0), val)
    fit_metrics = dict(trainer.callback_metrics)
    logger.experiment.finish()
    return {
        "root": root,
        "trainer": trainer,
        "model": model,
        "val": val,
        "metrics": fit_metrics,
        "best": checkpoint.best_model_path,
    }


def test_fit_logs_named_metrics_and_exact_sample_counts(fitted: dict[str, Any]) -> None:
    metrics = fitted["metrics"]
    expected = {"train/loss", "train/samples", "val/loss", "val/dice"}
    expected |= {"val/iou", "val/samples", "train/images_per_s", "train/data_wait_frac"}
    expected |= {f"val/{m}_group_{g}" for m in ("dice", "iou", "samples") for g in GROUPS}
    assert expected <= set(metrics), sorted(expected - set(metrics))
    # exact: limited train batches, uneven last val batch, sanity-check batches not leaking in
    assert metrics["train/samples"].item() == TRAIN_BATCHES * TRAIN_BS
    assert metrics["val/samples"].item() == N_VAL
    assert metrics["val/samples_group_a"].item() == 4
    assert metrics["val/samples_group_b"].item() == 3
    for name in ("val/dice", "val/iou", "val/dice_group_a", "val/iou_group_b"):
        assert 0.0 <= metrics[name].item() <= 1.0, name


class _TwoGroups(SegModule):
    """The encoder and the decoder as two parameter groups at their own learning rates (and the
    head as a third, at the optimizer's); `_NamedGroups` names them and the scheduler."""

    param_group_names: tuple[str, ...] = ()
    scheduler_name: str | None = None

    def configure_optimizers(self) -> Any:
        parts = (self.net.encoder, self.net.decoder, self.net.segmentation_head)
        groups = [{"params": part.parameters()} for part in parts]
        groups[0]["lr"], groups[1]["lr"] = 1e-3, 1e-2
        for group, name in zip(groups, self.param_group_names, strict=False):
            group["name"] = name
        optimizer = torch.optim.SGD(groups, lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "interval": "step",
                "name": self.scheduler_name,
            },
        }


class _NamedGroups(_TwoGroups):
    param_group_names = ("encoder", "decoder", "head")
    scheduler_name = "lr-steps"


class _TwoOptimizers(SegModule):
    """Two optimizers, as a GAN has them (manual optimization): beyond `LearningRates`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net.encoder.parameters()), torch.optim.SGD(self.net.decoder.parameters())]  # fmt: skip


def _fit_logging_rates(
    module: type[SegModule], monitor: L.Callback, accumulate: int, root: Path
) -> list[tuple[int | None, dict[str, float]]]:
    """The rows with learning rates a short CPU fit of `module` logged through `monitor`."""
    torch.manual_seed(0)
    logger = KeptRows()
    _bare_trainer(
        root,
        2,
        [monitor],
        logger=logger,
        log_every_n_steps=2,
        accumulate_grad_batches=accumulate,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    ).fit(
        module(_net(), functools.partial(torch.optim.SGD), None, group_names=(), **MODULE),
        _loader(N_TRAIN, TRAIN_BS, 0),
    )
    return [(step, row) for step, row in logger.rows if any("lr-" in k for k in row)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "accumulate", "names"),
    [
        (_TwoGroups, 1, {"lr-SGD/pg1", "lr-SGD/pg2", "lr-SGD/pg3"}),
        (_TwoGroups, 2, {"lr-SGD/pg1", "lr-SGD/pg2", "lr-SGD/pg3"}),
        (_NamedGroups, 1, {"lr-steps/encoder", "lr-steps/decoder", "lr-steps/head"}),
    ],
)
def test_learning_rates_are_logged_as_lightnings_monitor_logs_them(
    module, accumulate, names, tmp_path
) -> None:
    lightnings = _fit_logging_rates(module, LearningRateMonitor("step"), accumulate, tmp_path)
    ours = _fit_logging_rates(module, LearningRates(), accumulate, tmp_path)
    # Lightning's logs a step once per batch of it (twice with accumulate=2, the same rates)
    once = [row for i, row in enumerate(lightnings) if i == 0 or row != lightnings[i - 1]]
    assert ours == once and len(ours) >= 2
    assert len(lightnings) == accumulate * len(ours)
    assert set(ours[0][1]) == names


def test_learning_rates_refuse_what_they_cannot_name_as_lightning_does(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"2 optimizers.*LearningRateMonitor"):
        _fit_logging_rates(_TwoOptimizers, LearningRates(), 1, tmp_path)


def test_throughput_metrics(fitted: dict[str, Any]) -> None:
    metrics = fitted["metrics"]
    assert metrics["train/images_per_s"].item() > 0
    assert 0.0 <= metrics["train/data_wait_frac"].item() <= 1.0


def test_scheduler_length_filled_from_trainer(fitted: dict[str, Any]) -> None:
    config = fitted["trainer"].lr_scheduler_configs[0]
    assert config.interval == "step"
    assert config.scheduler.T_max == EPOCHS * TRAIN_BATCHES


def test_overlays_written_for_last_epoch_and_logged_to_wandb(fitted: dict[str, Any]) -> None:
    overlays = fitted["root"] / "overlays"
    # every_n_epochs=5 never fires in 2 epochs: only the end-of-training grid is drawn
    assert sorted(p.name for p in overlays.iterdir()) == [f"epoch_{EPOCHS - 1:03d}.png"]
    image = np.asarray(Image.open(overlays / f"epoch_{EPOCHS - 1:03d}.png"))
    pad, tile = 2, SIZE + 2
    # 3 rows x the first val batch (a plain DataLoader), captions under the predictions and grid
    assert image.shape == (pad + 3 * tile + 2 * CAPTION_HEIGHT, pad + VAL_BS * tile, 3)
    logged = list(Path(fitted["root"]).glob("wandb/offline-run-*/files/media/images/val/*.png"))
    assert logged, "overlay grid not logged to W&B"


def test_checkpoint_loads_weights_only(fitted: dict[str, Any]) -> None:
    ckpt = torch.load(fitted["best"], weights_only=True, map_location="cpu")
    hparams = ckpt["hyper_parameters"]
    assert hparams["group_names"] == list(GROUPS)
    assert set(hparams) == {"loss", "group_names", "threshold", "channels_last", "eval_scales"}
    restored = SegModule.load_from_checkpoint(
        fitted["best"],
        net=_net(),
        optimizer=functools.partial(torch.optim.AdamW),
        scheduler=None,
        weights_only=True,
    )
    assert restored.group_names == list(GROUPS)
    for key, value in restored.state_dict().items():
        assert torch.equal(value, ckpt["state_dict"][key]), key


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_test(fitted: dict[str, Any], tmp_path: Path) -> None:
    # a fresh trainer, as an evaluation tool would use: restores the fit's best checkpoint
    trainer = L.Trainer(
        accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False
    )
    model, val = fitted["model"], fitted["val"]
    (results,) = trainer.test(
        model, val, ckpt_path=fitted["best"], weights_only=True, verbose=False
    )
    assert results["test/samples"] == N_VAL
    assert results["test/samples_group_a"] == 4
    assert {"test/loss", "test/dice", "test/iou", "test/dice_group_b"} <= set(results)


def test_channels_last() -> None:
    model = _module(channels_last=True)
    conv = next(m for m in model.net.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, SIZE, SIZE))
    assert out.shape == (2, 1, SIZE, SIZE) and torch.isfinite(out).all()


def _conv_module() -> SegModule:
    """A one-layer model: for the tests of the callbacks, not of the net."""
    net = torch.nn.Conv2d(3, 1, 3, padding=1)
    return SegModule(
        net, functools.partial(torch.optim.SGD, lr=0.1), None, group_names=(), **MODULE
    )


def _bare_trainer(
    root: Path, max_epochs: int, callbacks: list[L.Callback], **settings: Any
) -> L.Trainer:
    """A CPU trainer with only the callbacks under test: no logger, checkpoints or bars, unless
    `settings` (more Trainer arguments) give a logger; `root` held as its run folder."""
    run_folder.hold(root)
    return L.Trainer(
        **{
            "accelerator": "cpu",
            "max_epochs": max_epochs,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": root,
            "callbacks": callbacks,
        }
        | settings
    )


class _SlowDataset(ContractDataset):
    """Every sample takes `delay` seconds to load: the loader, not the net, is the bottleneck."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n, seed=2)
        self.delay = delay

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return super().__getitem__(i)


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
def test_data_wait_counts_the_time_spent_loading(tmp_path: Path) -> None:
    model = _conv_module()
    trainer = _bare_trainer(tmp_path, 1, [TrainSpeedMonitor()])
    delay, n, val_delay = 0.05, 6, 0.5
    start = time.perf_counter()
    trainer.fit(
        model,
        DataLoader(_SlowDataset(n, delay=delay), batch_size=2),
        DataLoader(_SlowDataset(2, delay=val_delay), batch_size=2),
    )
    elapsed = time.perf_counter() - start
    metrics = trainer.callback_metrics
    assert metrics["train/samples"].item() == n
    # step time = images / rate; its waiting part must hold every sleep of the loader (a bound
    # that holds however loaded the machine is), and the whole excludes validation (sanity check
    # and epoch end: 4 slow validation samples)
    step_time = n / metrics["train/images_per_s"].item()
    wait = metrics["train/data_wait_frac"].item() * step_time
    assert n * delay <= wait <= step_time <= elapsed - 4 * val_delay


def test_overlays_every_n_epochs(tmp_path: Path) -> None:
    model = _conv_module()
    trainer = _bare_trainer(
        tmp_path, 3, [PredictionOverlays(every_n_epochs=2, max_images=2, mean=MEAN, std=STD)]
    )
    trainer.fit(model, _loader(4, 2, seed=0), _loader(4, 4, seed=1))
    # epoch 1 by the period, epoch 2 as the last; no temporary files left behind
    names = sorted(p.name for p in (tmp_path / "overlays").iterdir())
    assert names == ["epoch_001.png", "epoch_002.png"]
    assert np.asarray(Image.open(tmp_path / "overlays" / names[0])).shape == (
        2 + 3 * (SIZE + 2) + 2 * CAPTION_HEIGHT,
        2 + 2 * (SIZE + 2),
        3,
    )


@pytest.mark.slow
def test_overlays_do_not_recompile_a_compiled_net(tmp_path: Path) -> None:
    """Overlays run the eager net: a compiled one would recompile for their inference tensors."""
    from torch._dynamo.testing import CompileCounter

    frames = []
    for overlays in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        model = _conv_module()
        model.net.compile(backend=counter)
        trainer = _bare_trainer(
            tmp_path / str(overlays),
            2,
            [PredictionOverlays(every_n_epochs=1, max_images=2, mean=MEAN, std=STD)]
            if overlays
            else [],
        )
        trainer.fit(model, _loader(4, 2, seed=0), _loader(4, 4, seed=1))
        frames.append(counter.frame_count)
    assert (tmp_path / "True" / "overlays" / "epoch_001.png").is_file()
    assert frames[0] > 0 and frames[1] == frames[0]


def _validated(model: SegModule, tmp_path: Path) -> dict[str, float]:
    trainer = _bare_trainer(tmp_path, max_epochs=1, callbacks=[])
    (results,) = trainer.validate(model, _loader(N_VAL, VAL_BS, seed=3), verbose=False)
    return results


def _box_filter_module(eval_scales: list[float] | None) -> SegModule:
    """A net whose logits sit far from the threshold but at the square's edges, where scales
    differ: a 3×3 box sum of the image."""
    net = torch.nn.Conv2d(3, 1, 3, padding=1)
    with torch.no_grad():
        net.weight.fill_(0.5)
        net.bias.zero_()
    settings = MODULE | {"eval_scales": eval_scales}
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    return SegModule(net, optimizer, None, group_names=(), **settings)


def test_eval_scales_score_the_mean_probability_of_the_batch_at_each_scale(tmp_path) -> None:
    plain, scaled = _box_filter_module(None), _box_filter_module([1.0, 2.0])
    data = ContractDataset(N_VAL, seed=3)
    with torch.no_grad():  # the same by hand: at 64², bilinear antialiased in, bilinear out
        at_size = torch.sigmoid(plain(data.images))
        bigger = F.interpolate(data.images, (64, 64), mode="bilinear", antialias=True)
        back = F.interpolate(torch.sigmoid(plain(bigger)), (SIZE, SIZE), mode="bilinear")
    pred, true = ((at_size + back) / 2 > 0.5), data.masks > 0.5
    tp, fp, fn = (pred & true).sum(), (pred & ~true).sum(), (~pred & true).sum()
    expected = float(2 * tp / (2 * tp + fp + fn))

    got, alone = _validated(scaled, tmp_path / "scaled"), _validated(plain, tmp_path / "plain")
    assert got["val/dice"] == pytest.approx(expected, abs=1e-6)
    assert got["val/dice"] != pytest.approx(alone["val/dice"], abs=1e-4)  # the scale counted
    assert got["val/loss"] == pytest.approx(alone["val/loss"])  # the loss: the batch's own size
    assert got["val/samples"] == N_VAL
    # the factor 1 alone is no scales at all
    assert _validated(_box_filter_module([1.0]), tmp_path / "one") == alone
    assert scaled.hparams["eval_scales"] == [1.0, 2.0]  # recorded in every checkpoint

"""Lightning callbacks: training speed and loader wait, the learning rates, time to a target,
overlays of validation, the card every checkpoint carries, a progress bar safe under DDP. They
read only the batch contract and the module's `forward`: any loader backend."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from PIL import Image

from nailseg.model.checkpoint import CARD_KEY
from nailseg.model.metrics import scores
from nailseg.model.module import logs_step
from nailseg.training.run_folder import write_file
from nailseg.viz import PRED_COLOR, TRUTH_COLOR, WHITE, captioned, denormalize, grid, overlay

log = logging.getLogger(__name__)
WARMUP_EPOCHS = 2  # left out of a fit's throughput summary: cuDNN autotuning, first allocations
EPOCH_LINE = ("train/loss", "val/loss", "val/dice")  # the values of an epoch's line


def settled(epochs: Any) -> Any:
    """A fit's epochs after its first `WARMUP_EPOCHS` (all, in a shorter fit)."""
    return epochs[WARMUP_EPOCHS:] if len(epochs) > WARMUP_EPOCHS else epochs


class TrainSpeedMonitor(L.Callback):
    """Logs `train/images_per_s` (summed over ranks; the device synchronised only at the ends of
    the training time) and `train/data_wait_frac` (host time between batches) once per epoch."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []  # this process's epochs, values over all ranks
        self._reset()

    def _reset(self) -> None:
        self._segment_start: float | None = None  # start of the running training stretch
        self._last_end = self._elapsed = self._wait = 0.0
        self._images = 0

    @staticmethod
    def _synced_now(pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def _resume(self, pl_module: L.LightningModule) -> None:
        self._segment_start = self._last_end = self._synced_now(pl_module)

    def _pause(self, pl_module: L.LightningModule) -> None:
        if self._segment_start is not None:
            self._elapsed += self._synced_now(pl_module) - self._segment_start
            self._segment_start = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self._resume(pl_module)

    def on_train_batch_start(self, *_: Any) -> None:
        self._wait += time.perf_counter() - self._last_end

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, out: Any, batch: Any, *_: Any):
        self._last_end = time.perf_counter()
        self._images += len(batch["image"])

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(pl_module)  # a no-op outside a training epoch (sanity check, validate())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._resume(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(pl_module)
        # every rank joins; an epoch some rank did not time (resumed mid-epoch) is left out
        timed = self._elapsed > 0.0
        elapsed = self._elapsed if timed else 1.0
        local = torch.tensor(
            [self._images / elapsed, self._wait / elapsed, float(timed), float(self._images)]
        )
        total = trainer.strategy.reduce(local.to(pl_module.device), reduce_op="sum").cpu()
        if total[2] < trainer.world_size:
            return
        images_per_s, wait = float(total[0]), float(total[1]) / trainer.world_size
        # the values are reduced already; sync_dist only marks them as global (as in the module)
        pl_module.log("train/images_per_s", images_per_s, sync_dist=True)
        pl_module.log("train/data_wait_frac", wait, sync_dist=True)
        epoch = {"epoch": trainer.current_epoch, "images": int(total[3])}
        self.epochs.append(epoch | {"images_per_s": images_per_s, "data_wait_frac": wait})

    def summary(self) -> dict[str, Any] | None:
        """For metrics.json: the medians over the `settled` epochs, and every epoch's values."""
        if not self.epochs:
            return None
        counted = settled(self.epochs)
        return {
            "images_per_s": float(np.median([e["images_per_s"] for e in counted])),
            "data_wait_frac": float(np.median([e["data_wait_frac"] for e in counted])),
            "epochs_counted": [e["epoch"] for e in counted],
            "per_epoch": self.epochs,
        }


class RankSafeProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, showing only values every rank has computed already: reading
    a pending one computes it, a collective under DDP, which rank 0 alone would start (a hang)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return {**get_standard_metrics(trainer), **trainer._logger_connector._progress_bar_metrics}


class EpochLines(ProgressBar):
    """A line per epoch on rank 0 (seconds, `EPOCH_LINE`), once its values are in: at the next."""

    _shown, _epoch, _start = True, None, 0.0  # per instance once set

    def disable(self) -> None:
        self._shown = False

    def enable(self) -> None:
        self._shown = True

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.on_train_end(trainer, pl_module)
        self._epoch, self._start = trainer.current_epoch, time.monotonic()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self._epoch is not None and self._shown and trainer.is_global_zero:
            values = trainer._logger_connector._callback_metrics  # computed on every rank
            shown = [f"{k} {float(values[k]):.4g}" for k in EPOCH_LINE if k in values]
            last = f"/{trainer.max_epochs - 1}" if trainer.max_epochs not in (None, -1) else ""
            seconds = time.monotonic() - self._start
            log.info("epoch %d%s: %.1f s, %s", self._epoch, last, seconds, ", ".join(shown))
        self._epoch = None


def progress_bar() -> ProgressBar:
    """Rich's bar in a terminal; elsewhere (a pipe, a log file, SLURM) one line per epoch."""
    return RankSafeProgressBar() if sys.stdout.isatty() else EpochLines()


class LearningRates(L.Callback):
    """Lightning's `LearningRateMonitor(logging_interval="step")`, from the host's values (its
    copy of each rate to the device waits for every queued step); one optimizer only."""

    def __init__(self) -> None:
        self._logged: int | None = None  # the last step logged (an accumulating batch repeats it)
        self._base = ""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        schedulers, automatic = trainer.lr_scheduler_configs, pl_module.automatic_optimization
        if len(trainer.optimizers) != 1 or len(schedulers) > 1 or not automatic:
            raise ValueError(
                "callbacks.lr_monitor (nailseg's LearningRates) logs one optimizer with at most "
                f"one scheduler under automatic optimization; {type(pl_module).__name__} has "
                f"{len(trainer.optimizers)} optimizers, {len(schedulers)} schedulers, automatic "
                f"optimization {automatic}: use "
                "lightning.pytorch.callbacks.LearningRateMonitor as callbacks.lr_monitor"
            )
        named = schedulers[0].name if schedulers else None
        self._base = named or f"lr-{type(trainer.optimizers[0]).__name__}"

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        step = trainer.global_step  # the optimizer step this batch is part of
        if step == self._logged or not logs_step(trainer, step):
            return
        self._logged = step
        groups = trainer.optimizers[0].param_groups
        rates = {}
        for i, group in enumerate(groups):
            suffix = group.get("name", f"pg{i + 1}" if len(groups) > 1 else None)
            rates[self._base if suffix is None else f"{self._base}/{suffix}"] = float(group["lr"])
        for logger in trainer.loggers:
            logger.log_metrics(rates, step=step)


def process_start_time() -> float:
    """When this process started (epoch seconds), from /proc: start-up counts imports too."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + since_boot


_job_started: float | None = None  # when the running job started (`start_job_clock`)
_run_entered: float | None = None  # when its `run` began: its imports done


def start_job_clock() -> None:
    """Mark a training job's start, which `TimeToTarget` counts from: the process's start for its
    first job, now for a later one (a sweep's next job in the same process)."""
    global _job_started, _run_entered
    _job_started = process_start_time() if _job_started is None else time.time()
    _run_entered = time.time()


class TimeToTarget(L.Callback):
    """When validation first reaches `target` on `metric` (`mode` max: >=, min: <=): epoch, step
    and seconds since the job started, split into start-up, training, validation and epoch 0's
    training (`reached`, metrics.json's `time_to_target`; this process's start-up: `startup`).
    `stop` ends training there. A resumed fit keeps a target reached before, and adds the earlier
    processes' time to one reached later."""

    def __init__(self, metric: str, target: float, mode: str = "max", stop: bool = False) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"callbacks.time_to_target.mode={mode!r} is not max or min")
        if not isinstance(stop, bool):  # the callbacks group is untyped: `stop=no` is a string
            raise ValueError(f"callbacks.time_to_target.stop={stop!r} is not true or false")
        self.metric, self.target, self.mode, self.stop = metric, float(target), mode, stop
        self.reached: dict[str, Any] | None = None
        self._started = _job_started if _job_started is not None else process_start_time()
        self._entered = _run_entered if _run_entered is not None else self._started
        self._first_step: float | None = None  # when this process's first step ended
        self._fit_start = self._mark = 0.0
        self._earlier_s = self._earlier_startup_s = 0.0  # the processes before the checkpoint
        self._train = self._val = 0.0
        self._first_epoch: float | None = None

    def state_dict(self) -> dict[str, Any]:
        """At a save, the time since the last lap is training (checkpoints are saved after it)."""
        now = time.time()
        return {"reached": self.reached, **self._times(now, self._train + now - self._mark)}

    def _times(self, now: float, train_s: float) -> dict[str, Any]:
        startup = self._earlier_startup_s + self._fit_start - self._started
        seconds = self._earlier_s + now - self._started
        times = {"seconds": seconds, "startup_s": startup, "train_s": train_s, "val_s": self._val}
        return times | {"first_epoch_train_s": self._first_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._earlier_s, self._earlier_startup_s = state_dict["seconds"], state_dict["startup_s"]
        self._train, self._val = state_dict["train_s"], state_dict["val_s"]
        self._first_epoch = state_dict["first_epoch_train_s"]
        reached = state_dict["reached"]
        if reached is None or self._answers(reached):
            self.reached = reached
        else:
            log.warning(
                "the checkpoint's fit reached %s %s; this fit's target is %s %s: timed afresh",
                reached["metric"], reached["target"], self.metric, self.target,
            )  # fmt: skip

    def _answers(self, reached: dict[str, Any]) -> bool:
        same = (reached["metric"], reached["target"]) == (self.metric, self.target)
        return same and self._meets(reached["value"])

    def _meets(self, value: float) -> bool:
        return value >= self.target if self.mode == "max" else value <= self.target

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = self._mark = time.time()

    def on_train_batch_end(self, *args: Any) -> None:
        if self._first_step is None:
            self._first_step = time.time()

    def startup(self) -> dict[str, float | None]:
        """This process's start-up: to its `run` (imports, Hydra, checks), to the fit's start (data,
        net, trainer, loggers), to its first step's end (sanity validation, the first batch)."""
        first = None if self._first_step is None else self._first_step - self._fit_start
        imports, build = self._entered - self._started, self._fit_start - self._entered
        return {"imports_s": imports, "build_s": build, "first_step_s": first}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stop and self.reached is not None:
            log.info("%s reached its target before the checkpoint: no training", self.metric)
            trainer.should_stop = True

    def _lap(self) -> float:
        now = time.time()
        lap, self._mark = now - self._mark, now
        return lap

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._train += self._lap()
            if self._first_epoch is None and not trainer.sanity_checking:
                self._first_epoch = self._train

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._val += self._lap()
        value = trainer.callback_metrics.get(self.metric)
        if trainer.sanity_checking or self.reached is not None or value is None:
            return
        value = float(value)
        if self._meets(value):
            self.reached = {"metric": self.metric, "target": self.target, "value": value}
            self.reached |= {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
            self.reached |= self._times(self._mark, self._train)
            trainer.should_stop = trainer.should_stop or self.stop
            log.info(
                "%s reached %s (target %s) at epoch %d, %.1f s after the job started",
                self.metric, value, self.target, trainer.current_epoch, self.reached["seconds"],
            )  # fmt: skip


def spread(plan: Sequence[np.ndarray], groups: np.ndarray, n: int) -> list[tuple[int, int]]:
    """Up to `n` rows of a loader's `plan`, the first of each group in turn (`groups`: each row's
    group id), as (batch index, position in the batch) in the order they come."""
    queues: dict[int, list[tuple[int, int]]] = {}
    for b, rows in enumerate(plan):
        for p, row in enumerate(rows):
            queues.setdefault(int(groups[row]), []).append((b, p))
    turns = itertools.zip_longest(*queues.values())
    return sorted([pick for turn in turns for pick in turn if pick is not None][:n])


class PredictionOverlays(L.Callback):
    """Every `every_n_epochs` epochs and at the fit's end, rank 0 draws up to `max_images` of its
    validation rows, spread over the groups, into `<run>/overlays/epoch_XXX.png`, W&B and
    TensorBoard: rows image, truth (green), prediction (red), each column's group and Dice below."""

    def __init__(
        self,
        every_n_epochs: int = 5,
        max_images: int = 8,
        *,
        mean: Sequence[float],
        std: Sequence[float],
    ) -> None:
        if every_n_epochs < 1 or max_images < 1:
            raise ValueError("every_n_epochs and max_images must be >= 1")
        self.every_n_epochs, self.max_images = every_n_epochs, max_images
        self.mean, self.std = tuple(mean), tuple(std)
        self._wanted: list[tuple[int, int]] = []  # (batch index, position) of the rows kept
        self._kept: list[tuple[torch.Tensor, ...]] = []  # image, mask, group of the kept rows
        self._batch_epoch = -1
        self._drawn_epoch = -1

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        loader, self._kept = trainer.val_dataloaders, []
        if hasattr(loader, "plan"):  # a PlannedLoader: this rank's rows of each batch, unshuffled
            plan = loader.plan()[: int(trainer.num_val_batches[0])]
            self._wanted = spread(plan, loader.records.groups, self.max_images)
        else:
            self._wanted = [(0, p) for p in range(self.max_images)]

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: Any, out: Any, batch: Any, batch_idx: int, loader=0
    ) -> None:
        positions = [p for b, p in self._wanted if b == batch_idx and p < len(batch["image"])]
        if loader or not positions or trainer.sanity_checking or not trainer.is_global_zero:
            return
        # rows picked as views, stacked on the device: an index or a copy to the host would wait
        self._kept.append(
            tuple(torch.stack([batch[k][p] for p in positions]) for k in ("image", "mask", "group"))
        )
        self._batch_epoch = trainer.current_epoch

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # _batch_epoch matches only on rank 0 and outside the sanity check (see above)
        epoch = trainer.current_epoch
        if self._batch_epoch == epoch and (epoch + 1) % self.every_n_epochs == 0:
            self._draw(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # training may end at any epoch: draw the final model on the last validated rows
        if self._kept and self._drawn_epoch != self._batch_epoch:
            self._draw(trainer, pl_module)

    def _draw(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        images, masks, groups = (torch.cat(kept).cpu() for kept in zip(*self._kept, strict=True))
        threshold = float(pl_module.hparams.get("threshold", 0.5))
        was_training = pl_module.training
        pl_module.eval()
        # the kept rows are inference tensors; a compiled net would recompile for them
        precision = trainer.precision_plugin
        with (
            torch.inference_mode(),
            torch.compiler.set_stance("force_eager"),
            precision.forward_context(),
        ):
            logits = pl_module(precision.convert_input(images.to(pl_module.device)))
        pl_module.train(was_training)
        probs = torch.sigmoid(logits.float()).cpu()

        pictures = [denormalize(img.float().numpy(), self.mean, self.std) for img in images]
        truths, preds = masks[:, 0] > 0.5, probs[:, 0] > threshold
        counts = (truths & preds, ~truths & preds, truths & ~preds)  # tp, fp, fn of each image
        dice = scores(*(c.sum((1, 2)) for c in counts))[0].tolist()
        pairs = list(zip(pictures, truths.numpy(), preds.numpy(), strict=True))
        names = list(pl_module.hparams.get("group_names", []))
        labels = [names[g] if g < len(names) else f"group {g}" for g in groups.tolist()]
        epoch, step = self._batch_epoch, trainer.global_step
        canvas = captioned(
            grid(
                [pictures, [overlay(p, t, TRUTH_COLOR) for p, t, _ in pairs],
                 [captioned(overlay(p, m, PRED_COLOR), (f"{g} {d:.2f}", WHITE))
                  for (p, _, m), g, d in zip(pairs, labels, dice, strict=True)]]
            ),
            (f"epoch {epoch}: image / ", WHITE), ("truth", TRUTH_COLOR), (" / ", WHITE),
            ("prediction", PRED_COLOR), ("; group, Dice", WHITE),
        )  # fmt: skip
        path = Path(trainer.default_root_dir) / "overlays" / f"epoch_{epoch:03d}.png"
        write_file(path, lambda f: Image.fromarray(canvas).save(f, format="PNG"))
        self._drawn_epoch = epoch
        classes = {0: "background", 1: "nail"}
        masks = [
            {"truth": {"mask_data": t.astype(np.uint8), "class_labels": classes},
             "prediction": {"mask_data": m.astype(np.uint8), "class_labels": classes}}
            for _, t, m in pairs
        ]  # fmt: skip
        for logger in trainer.loggers:  # the grid; in W&B each photo with its masks too
            if isinstance(logger, WandbLogger):
                logger.log_image(key="val/overlays", images=[canvas], step=step)
                logger.log_image(key="val/examples", images=pictures, step=step, masks=masks)
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("val/overlays", canvas, step, dataformats="HWC")


class CheckpointCard(L.Callback):
    """Writes the run's card (model/checkpoint.py) and the W&B run id (`wandb_run_id`: the resumed
    checkpoint's, passed on by a resumed run without W&B) into every checkpoint."""

    def __init__(self, card: Mapping[str, Any], wandb_run_id: str | None = None) -> None:
        self.card = dict(card)
        self.wandb_run_id = wandb_run_id

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                self.wandb_run_id = logger.version
        checkpoint[CARD_KEY] = {**self.card, "wandb_run_id": self.wandb_run_id}

"""The LightningModule: one binary segmentation net, its loss, and epoch metrics from sums over
the whole epoch, reduced by "sum" across ranks: `train/{loss,loss_step,samples}`,
`val/{loss,dice,iou,samples}[_group_<name>]`, `val/dice_best` (module state, kept on resume),
and `<test_prefix>/...` for a final evaluation. Nothing in a step waits for the device: a logged
step's loss reaches the loggers once its copy to pinned host memory is done (`StepValues`).
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import nn
from torchmetrics import SumMetric

from nailseg.model.metrics import BatchMean, SegmentationScores, build_loss
from nailseg.model.scales import multiscale_probabilities
from nailseg.model.schedules import LENGTH_ARGS

_EVAL_STAGES = ("val", "test")


class SegModule(L.LightningModule):
    """Binary segmentation (logits) on the batch contract; `optimizer`, `scheduler`: partials;
    `eval_scales`: evaluation scores the mean probability over those factors of the size (its
    loss the batch's own); `test_prefix` names what the test stage logs."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: functools.partial,
        scheduler: functools.partial | None,
        loss: str,
        group_names: Sequence[str],
        threshold: float,
        channels_last: bool,
        eval_scales: Sequence[float] | None,
    ) -> None:
        super().__init__()
        # plain values only, so checkpoints load with weights_only=True; the net, optimizer and
        # schedule are not kept (the card's config holds them): load_from_checkpoint asks for them
        self.group_names = [str(name) for name in group_names]
        self.eval_scales = None if eval_scales is None else [float(s) for s in eval_scales]
        self.save_hyperparameters(
            {
                "loss": str(loss),
                "group_names": self.group_names,
                "threshold": float(threshold),
                "channels_last": bool(channels_last),
                "eval_scales": self.eval_scales,
            }
        )
        self.channels_last = bool(channels_last)
        self.net = net.to(memory_format=torch.channels_last) if self.channels_last else net
        self.loss_fn = build_loss(loss)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler

        self.train_loss = BatchMean()
        self.train_samples = SumMetric()  # updated once an epoch, from `_train_seen`
        self._train_seen = 0  # samples this epoch (this rank), counted on the host
        self._step_values = StepValues()  # logged steps' losses on their way to the loggers
        self._step_loss: torch.Tensor | None = None  # the last training step's
        self._stepped = 0  # optimizer steps before the last training batch
        self.eval_loss = nn.ModuleDict({stage: BatchMean() for stage in _EVAL_STAGES})
        self.eval_scores = nn.ModuleDict(
            {stage: SegmentationScores(len(self.group_names), threshold) for stage in _EVAL_STAGES}
        )
        self.register_buffer("val_dice_best", torch.tensor(float("nan")))
        self.test_prefix = "test"

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        return self.net(image)

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["image"])
        loss = self.loss_fn(logits, batch["mask"])
        n = len(batch["image"])
        # the step value reaches the loggers through `_step_values`: self.log(on_step=True) or
        # the progress bar would read it with a device sync (`StepValues`)
        self.train_loss.update(loss, n)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        self._step_loss = loss
        self._train_seen += n
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped = self.trainer.global_step  # optimizer steps so far: this batch's is the last
        if stepped != self._stepped and logs_step(self.trainer, stepped - 1):
            values = {"train/loss_step": self._step_loss}
            self._step_values.record(values, stepped - 1, self.current_epoch)
        self._stepped = stepped  # unchanged after a batch that accumulated gradients
        self._step_values.hand_over(self.loggers)

    def on_train_epoch_start(self) -> None:
        self._train_seen = 0
        self._stepped = self.trainer.global_step

    def on_train_epoch_end(self) -> None:
        self._step_values.hand_over(self.loggers, wait=True)
        # compute() sums over ranks; sync_dist only marks the (now identical) value as global
        self.train_samples.update(self._train_seen)
        self.log("train/samples", self.train_samples.compute(), sync_dist=True)
        self.train_samples.reset()

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        dice = self._log_eval_epoch("val", "val")
        if self.trainer.sanity_checking:  # a partial pass: neither logged nor a best
            return
        if not dice <= self.val_dice_best:  # also replaces the initial NaN
            self.val_dice_best.fill_(dice)
        self.log("val/dice_best", self.val_dice_best, sync_dist=True)

    def test_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_eval_epoch("test", self.test_prefix)

    def _eval_step(self, batch: Mapping[str, torch.Tensor], stage: str) -> None:
        logits = self(batch["image"])
        self.eval_loss[stage].update(self.loss_fn(logits, batch["mask"]), len(logits))
        if self.eval_scales is None:
            probs = torch.sigmoid(logits)
        else:
            probs = multiscale_probabilities(self, batch["image"], self.eval_scales, logits)
        self.eval_scores[stage].update(probs, batch["mask"], batch["group"])

    def _log_eval_epoch(self, stage: str, prefix: str) -> float:
        """Log the epoch's loss, scores and sample counts under `prefix/`; returns its Dice."""
        scores = self.eval_scores[stage].compute()
        scores["loss"] = self.eval_loss[stage].compute()
        values = {f"{prefix}/{metric}": scores[metric].float() for metric in EVAL_METRICS}
        # one entry per group; reshaped: torchmetrics squeezes the scores of one group to 0-dim
        groups = {m: scores[f"{m}_group"].reshape(-1) for m in EVAL_METRICS[1:]}  # no loss
        for i, name in enumerate(self.group_names):
            if groups["samples"][i] > 0:
                for metric, per_group in groups.items():
                    values[f"{prefix}/{metric}_group_{name}"] = per_group[i].float()
        for name, value in values.items():
            # the same on every rank already: sync_dist leaves it and silences Lightning's warning
            self.log(name, value, prog_bar=name == f"{prefix}/dice", sync_dist=True)
        self.eval_loss[stage].reset()
        self.eval_scores[stage].reset()
        return float(scores["dice"])

    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        # a fit of no finite length was refused before it started (training/checks.py)
        fit_steps = lambda: int(self.trainer.estimated_stepping_batches)  # noqa: E731
        scheduler = self.scheduler_factory(
            optimizer, **schedule_length_args(self.scheduler_factory, fit_steps)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


EVAL_METRICS = ("loss", "dice", "iou", "samples")  # every evaluation's; per group all but the loss
# what training logs each epoch: the module's loss, its sample count, and TrainSpeedMonitor's
# speed (`train/loss_step`, logged per step, is no epoch value to follow)
TRAIN_METRICS = frozenset({"loss", "samples", "images_per_s", "data_wait_frac"})


def monitorable(name: str) -> bool:
    """Whether a checkpoint or a sweep can follow `name`: a value validation (`val/<metric>`,
    `val/<metric>_group_<group>`, `val/dice_best`) or training logs each epoch."""
    stage, _, metric = name.partition("/")
    if stage == "train":
        return metric in TRAIN_METRICS
    base, per_group, _ = metric.partition("_group_")
    return stage == "val" and (
        metric == "dice_best" or base in (EVAL_METRICS[1:] if per_group else EVAL_METRICS)
    )


def schedule_length_args(
    factory: functools.partial, fit_steps: Callable[[], float]
) -> dict[str, Any]:
    """The length argument (`T_max`, `total_steps`) of the schedule `factory` builds: the config's
    value, else the whole fit (`fit_steps()`); empty for a schedule without one."""
    accepted = inspect.signature(factory.func).parameters
    for arg in LENGTH_ARGS:
        if arg in accepted:
            value = factory.keywords.get(arg)
            return {arg: fit_steps() if value is None else value}
    return {}


def logs_step(trainer: L.Trainer, step: int) -> bool:
    """Whether Lightning logs optimizer step `step` (0-based), by `should_update_logs`'s rule."""
    every = trainer.log_every_n_steps
    every_nth = every > 0 and ((step + 1) % every == 0 or trainer.should_stop)
    return bool(trainer.fast_dev_run) or every_nth


@dataclass
class _Pending:
    step: int
    epoch: int
    values: dict[str, torch.Tensor]  # host scalars; filled once `copied` completes
    copied: torch.cuda.Event | None  # None: the values were on the host already


class StepValues:
    """A queue of logged steps' values on their way from the device to the loggers."""

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def record(self, values: Mapping[str, torch.Tensor], step: int, epoch: int) -> None:
        """Queue scalar tensors as optimizer step `step`'s (on a GPU copied in stream order)."""
        device = next(iter(values.values())).device
        if device.type != "cuda":
            host = {name: value.detach() for name, value in values.items()}
            self._pending.append(_Pending(step, epoch, host, None))
            return
        host = {
            name: torch.empty((), dtype=value.dtype, pin_memory=True).copy_(
                value.detach(), non_blocking=True
            )
            for name, value in values.items()
        }
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
        self._pending.append(_Pending(step, epoch, host, copied))

    def hand_over(self, loggers: Iterable[Logger], wait: bool = False) -> None:
        """Log the queued steps whose values have arrived, as Lightning would; `wait`: all."""
        loggers = list(loggers)
        while self._pending and (wait or _arrived(self._pending[0])):
            pending = self._pending.popleft()
            if wait and pending.copied is not None:
                pending.copied.synchronize()
            metrics = {name: value.item() for name, value in pending.values.items()}
            metrics["epoch"] = pending.epoch
            for logger in loggers:
                logger.log_metrics(metrics, step=pending.step)


def _arrived(pending: _Pending) -> bool:
    return pending.copied is None or pending.copied.query()

"""The LightningModule: one binary segmentation net, its loss, and epoch-level metrics.

It reads only the batch contract (`image`, `mask`, `group`; see docs/DESIGN.md), so any loader
backend works. Every epoch number is computed from sums over the whole epoch (torchmetrics states
reduced with "sum" across DDP ranks), never from an average of per-batch or per-rank values:

    train/loss  train/loss_step  train/samples
    val/loss  val/dice  val/iou  val/samples  val/{dice,iou,samples}_group_<name>  val/dice_best
    <final>/loss <final>/dice ...: the final evaluation of a checkpoint, named by `final_prefix`

`*/samples` counts the samples actually seen (batch sizes, reset every epoch), so a loader that
drops, repeats or pads samples shows up in the logs. Nothing in a step waits for the device (no
`.item()`, no metric that checks its input on the host, nothing per step in the progress bar):
the CPU keeps queueing steps while the GPU runs them; epoch values are read once per epoch, and
the logged steps' losses once they have reached the host (step_log.py). Groups that
got no samples in an epoch are not logged that epoch (their scores would be NaN). `val/dice_best`
is the best `val/dice` so far; it is part of the module's state, so a resumed fit keeps it.

Optimizer and scheduler arrive as `functools.partial`s (Hydra `_partial_: true`): the optimizer
partial is called with the parameters; the scheduler partial with the optimizer. The scheduler is
stepped after every optimizer step (`interval: step`), so its length (`T_max`, `total_steps`)
counts optimizer steps; when the config leaves it unset (None) it is
`trainer.estimated_stepping_batches`, the number of steps the whole fit takes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import nn
from torchmetrics import SumMetric

from nailseg.model.losses import build_loss
from nailseg.model.metrics import BatchMean, SegmentationScores
from nailseg.model.schedules import LENGTH_ARGS
from nailseg.model.step_log import StepValues, logs_step

_EVAL_STAGES = ("val", "test")


class SegModule(L.LightningModule):
    """Binary segmentation (one output channel, logits) trained on the batch contract.

    `forward` returns logits; `predict_step` returns probabilities B×1×H×W. With `channels_last`
    the net's weights and every input use the channels-last memory format (faster convolutions
    with AMP on tensor-core GPUs). `test_prefix` names what the test stage logs: `test` for a
    test split; the final evaluation of another split sets its own name (`val_best`, ...), so a
    figure is never reported as a test score when it was not measured on a test split.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: functools.partial,
        scheduler: functools.partial | None = None,
        loss: str = "dice_bce",
        group_names: Sequence[str] = (),
        threshold: float = 0.5,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        # Only plain values go into hparams: checkpoints then load with torch.load(weights_only=True)
        # (a partial or an OmegaConf container would not), and the logger gets readable config.
        # The optimizer/scheduler are recorded as descriptions under names that are not __init__
        # arguments, so load_from_checkpoint asks for real ones instead of receiving a dict.
        self.group_names = [str(name) for name in group_names]
        self.save_hyperparameters(
            {
                "loss": str(loss),
                "group_names": self.group_names,
                "threshold": float(threshold),
                "channels_last": bool(channels_last),
                "optimizer_spec": describe_partial(optimizer),
                "scheduler_spec": describe_partial(scheduler) if scheduler is not None else None,
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
        # Lightning computes the epoch's value (synced across ranks, weighted by batch size)
        # and resets the metric at epoch end. The step value goes to the loggers through
        # `_step_values`, never through self.log(on_step=True): Lightning reads such a value
        # with a device sync at every logged step (step_log.py). Not in the progress bar
        # either: it would read the value, a device sync, every step.
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

    def predict_step(
        self, batch: Mapping[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> torch.Tensor:
        return torch.sigmoid(self(batch["image"]))

    def _eval_step(self, batch: Mapping[str, torch.Tensor], stage: str) -> None:
        logits = self(batch["image"])
        self.eval_loss[stage].update(self.loss_fn(logits, batch["mask"]), len(logits))
        self.eval_scores[stage].update(torch.sigmoid(logits), batch["mask"], batch["group"])

    def _log_eval_epoch(self, stage: str, prefix: str) -> float:
        """Log the epoch's loss, scores and sample counts (summed over ranks by torchmetrics'
        compute) under `prefix/`, reset for the next epoch; returns the epoch's Dice."""
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
            # the value is already the same on every rank: sync_dist's mean over ranks leaves it
            # as it is (counts exactly, scores to float rounding) and stops Lightning's DDP
            # warning that an unsynced epoch value would be rank-local
            self.log(name, value, prog_bar=name == f"{prefix}/dice", sync_dist=True)
        self.eval_loss[stage].reset()
        self.eval_scores[stage].reset()
        return float(scores["dice"])

    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        length = schedule_length_args(self.scheduler_factory, self._total_steps)
        scheduler = self.scheduler_factory(optimizer, **length)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    def _total_steps(self) -> int:
        steps = self.trainer.estimated_stepping_batches
        if steps == float("inf") or steps < 1:
            raise ValueError(
                "cannot size the LR schedule: the trainer has no finite length "
                f"(estimated_stepping_batches={steps}); set trainer.max_epochs or max_steps, "
                "or give the scheduler's T_max/total_steps explicitly"
            )
        return int(steps)


EVAL_METRICS = ("loss", "dice", "iou", "samples")  # every evaluation's; per group all but the loss
# what training logs each epoch: the module's loss, its sample count, and TrainSpeedMonitor's
# speed (`train/loss_step`, logged per step, is no epoch value to follow)
TRAIN_METRICS = frozenset({"loss", "samples", "images_per_s", "data_wait_frac"})


def monitorable(name: str) -> bool:
    """Whether a checkpoint or a sweep can follow `name`: a value validation logs at its end
    (`val/<metric>`, per group `val/<metric>_group_<group>`, and `val/dice_best`) or training
    each epoch (`train/loss`, ...)."""
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
    value, or when it leaves it None the whole fit (`fit_steps()`); empty for a schedule without
    one. A resume compares it with the checkpoint's before the fit (`resume.check_schedule`)."""
    accepted = inspect.signature(factory.func).parameters
    for arg in LENGTH_ARGS:
        if arg in accepted:
            value = factory.keywords.get(arg)
            return {arg: fit_steps() if value is None else value}
    return {}


def describe_partial(factory: functools.partial) -> dict[str, Any]:
    """A loggable, checkpoint-safe description of a partial: its target and plain-valued kwargs."""
    return {
        "_target_": f"{factory.func.__module__}.{factory.func.__qualname__}",
        **({"args": _plain(factory.args)} if factory.args else {}),
        **{key: _plain(value) for key, value in factory.keywords.items()},
    }


def _plain(value: Any) -> Any:
    """`value` as built-in types only (OmegaConf containers and tuples become dicts and lists;
    anything else its repr), so torch.load(weights_only=True) and every logger accept it."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return repr(value)

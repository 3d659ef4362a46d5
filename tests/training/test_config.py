"""The configs users run: every option of every group, composed with Hydra's compose API and built
through `build()`, the path `train.py` takes (no training step runs).

One assertion per kind of truth: schemas carry no values (YAML holds every default); the built
loader, model, trainer and optimizer are the classes the chosen options name; the LR schedule
spans exactly the fit (`trainer.estimated_stepping_batches`) and reaches its minimum only at the
last step. Option lists are read from `conf/`, so a new option is covered the day it is added.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import optuna
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigNode, ConfigStore
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import InterpolationResolutionError
from support.cli import run_command
from support.prepared import write_prepared
from support.train import CONF, TINY_UNET, compose_train

import benchmarks  # noqa: F401  (the bench_* schemas are stored on its import)
import nailseg
import nailseg.bench  # its bench_schema is stored on import
from nailseg.inference.segmenter import resolve_spec
from nailseg.model.checkpoint import load_net
from nailseg.model.schedules import schedule_length
from nailseg.training.build import Built, build
from nailseg.training.jobs import isolated_job

GROUPS = sorted(
    p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml"))
)
OPTIONS = [(group, p.stem) for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))]
LOADERS = {"dali": "DaliLoader", "torch": "TorchLoader", "kornia": "KorniaLoader"}
MODELS = {"unet": "Unet", "segformer": "Segformer"}
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}
CUDA = torch.cuda.is_available()
# the GPU presets (skipped below without CUDA) with only the device swapped: the rest is built
ON_CPU = ["trainer.accelerator=cpu", "trainer.precision=32-true", "loader.device=cpu"]


def _dataclasses_in(hint: Any) -> Iterator[type]:
    """The dataclasses a type hint names, inside lists, dicts and unions too."""
    for arg in typing.get_args(hint):
        yield from _dataclasses_in(arg)
    if dataclasses.is_dataclass(hint):
        yield hint


def _schemas() -> list[type]:
    """Every schema some module of the package stores in Hydra's ConfigStore, and every schema
    inside one."""
    for module in pkgutil.walk_packages(nailseg.__path__, "nailseg."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    repo = ConfigStore.instance().repo
    todo = [OmegaConf.get_type(node.node) for node in repo.values() if isinstance(node, ConfigNode)]
    found: list[type] = []
    while todo:
        node = todo.pop()
        if node in found or not dataclasses.is_dataclass(node):
            continue
        found.append(node)
        todo += [t for hint in typing.get_type_hints(node).values() for t in _dataclasses_in(hint)]
    return found


@pytest.mark.parametrize("schema", _schemas(), ids=lambda s: s.__name__)
def test_schemas_carry_types_only(schema):
    # a value in a schema and another in YAML is how every run got a cycling LR schedule
    valued = {
        f.name: f.default
        for f in dataclasses.fields(schema)
        if f.default_factory is not dataclasses.MISSING
        or f.default not in (MISSING, None, dataclasses.MISSING)
    }
    assert not valued, f"{schema.__name__} holds values that belong in conf/: {valued}"


TRAIN_ROWS = 72


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A prepared root with a full batch of 64 (experiment=gpu_384_graphs), two of 32, and no
    test split."""
    return write_prepared(
        tmp_path_factory.mktemp("config") / "prepared", n_train=TRAIN_ROWS, n_valid=8
    )


def _compose(data: Path, run_dir: Path, *overrides: str):
    return compose_train([f"dataset.root={data}", *overrides], run_dir)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_with_its_values(group, option, data, tmp_path):
    cfg = _compose(data, tmp_path, f"{group}={option}")
    if group == "loader":
        assert cfg.loader._target_.endswith(LOADERS[option])
    if group == "model":
        assert cfg.model.arch == MODELS[option] and cfg.model.encoder_weights is None
    if group == "scheduler" and option != "none":
        length = "T_max" if option == "cosine" else "total_steps"
        assert cfg.scheduler[length] is None  # the whole fit, unless set explicitly


class _DryRun(Exception):
    """Raised once the fit is set up: nothing is trained."""


class _Probe(L.Callback):
    """What the trainer built for the fit (optimizers, schedules, the fit's length), read at
    `on_fit_start`: after `configure_optimizers`, before the first step."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps = trainer.estimated_stepping_batches
        self.optimizers = list(trainer.optimizers)
        self.schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        raise _DryRun


def dry_fit(built: Built) -> _Probe:
    probe = _Probe()
    built.trainer.callbacks.append(probe)
    with pytest.raises(_DryRun), isolated_job():  # closes the W&B run the fit's setup opened
        built.trainer.fit(built.module, datamodule=built.datamodule)
    return probe


def per_step(scheduler, steps: int) -> list[dict[str, float]]:
    """The learning rate and momentum (SGD's momentum, AdamW's beta1) each optimizer step of the
    fit runs with, stepping the schedule as Lightning does (after every optimizer step)."""
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for step in range(steps):
            group = scheduler.optimizer.param_groups[0]
            momentum = group["betas"][0] if "betas" in group else group["momentum"]
            used.append({"lr": group["lr"], "momentum": momentum})
            if step < steps - 1:
                scheduler.step()
    return used


def _needs_cuda(cfg) -> bool:
    return cfg.trainer.accelerator in ("gpu", "cuda")


@pytest.mark.slow
@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_builds_what_it_names_and_a_schedule_spanning_the_fit(
    group, option, data, tmp_path
):
    cfg = _compose(data, tmp_path / "run", f"{group}={option}")
    if _needs_cuda(cfg) and not CUDA:
        pytest.skip(f"{group}={option} trains on a GPU; this machine has no CUDA")
    if cfg.dataset.mix:  # a preset mixing other prepared roots in (dataset=nails_synthetic)
        for i, source in enumerate(cfg.dataset.mix):
            source.root = str(write_prepared(tmp_path / f"mix{i}", n_train=8, n_valid=2))
    built = build(cfg)
    chosen = {"loader": "dali", "model": "unet", "optimizer": "adamw"} | {group: option}
    assert built.datamodule.loader.func.__name__ == LOADERS.get(chosen["loader"], "DaliLoader")
    assert type(built.module.net).__name__ == MODELS.get(chosen["model"], cfg.model.arch)
    assert isinstance(built.trainer, L.Trainer)
    expected = "CUDAAccelerator" if _needs_cuda(cfg) else "CPUAccelerator"
    assert type(built.trainer.accelerator).__name__ == expected

    probe = dry_fit(built)
    (optimizer,) = probe.optimizers
    assert type(optimizer).__name__ == OPTIMIZERS[chosen["optimizer"]]
    if cfg.scheduler is None:
        assert probe.schedulers == []
        return
    (scheduler,) = probe.schedulers
    assert schedule_length(scheduler.state_dict()) == probe.steps
    lrs = [step["lr"] for step in per_step(scheduler, probe.steps)]
    assert all(lr > lrs[-1] for lr in lrs[:-1]), "the schedule's minimum must be its last step"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("experiment", "aug", "epochs", "batch"),
    [
        ("gpu_384", "heavy", 50, 32),
        ("fast_384", "light", 30, 32),
        ("gpu_384_graphs", "heavy", 50, 64),
    ],
)
def test_a_gpu_preset_builds_its_settings_on_any_machine(
    experiment, aug, epochs, batch, data, tmp_path
):
    # what the preset sets reaches the built objects and the schedule spans its fit
    built = build(_compose(data, tmp_path, f"experiment={experiment}", *ON_CPU))
    alone = _compose(data, tmp_path / "aug", f"aug={aug}")
    assert [op.name for op in built.datamodule.aug.ops] == [o["op"] for o in alone.aug.ops]
    assert built.trainer.max_epochs == epochs and built.datamodule.image_size == (384, 384)
    assert built.cfg.loader.batch_size == batch and built.cfg.model.encoder_name == "resnet34"
    probe = dry_fit(built)
    (scheduler,) = probe.schedulers
    assert schedule_length(scheduler.state_dict()) == probe.steps == epochs * (TRAIN_ROWS // batch)


@pytest.mark.slow
def test_the_wild_preset_mixes_the_synthetic_photos_into_gpu_384_with_aug_photo(data, tmp_path):
    synthetic = write_prepared(tmp_path / "synthetic-mix" / "prepared", n_train=8, n_valid=2)
    wild = ["experiment=wild", f"paths.data_dir={tmp_path}", *ON_CPU]
    built = build(_compose(data, tmp_path / "run", *wild))
    photo = _compose(data, tmp_path / "photo", "aug=photo")
    assert [op.name for op in built.datamodule.aug.ops] == [o["op"] for o in photo.aug.ops]
    assert {"zoom_out", "jpeg"} <= {op.name for op in built.datamodule.aug.ops}
    assert not {"hue", "saturation", "grayscale"} & {op.name for op in built.datamodule.aug.ops}
    assert [(s.name, s.root, s.weight) for s in built.datamodule.sources] == [
        ("", data, 1.0),
        ("synthetic", synthetic, 1.0),
    ]
    assert built.trainer.max_epochs == 60 and built.datamodule.image_size == (384, 384)
    assert built.cfg.loader.batch_size == 32 and built.cfg.model.encoder_name == "resnet34"
    # the photos it mixes in are those `python prepare.py dataset=synthetic_mix` makes
    made = compose_train(["dataset=synthetic_mix", f"paths.data_dir={tmp_path}"]).dataset.root
    assert Path(made) == synthetic
    with pytest.raises(FileNotFoundError, match=r"dataset\.mix\[0\]\.root=.*python prepare"):
        build(
            _compose(
                data, tmp_path / "none", *wild[:1], f"paths.data_dir={tmp_path / 'x'}", *ON_CPU
            )
        )


@pytest.mark.slow
def test_the_graphs_preset_compiles_the_net_as_cuda_graphs_with_the_lr_scaled(data, tmp_path):
    """gpu_384_graphs: gpu_384's step compiled (reduce-overhead) at batch 64, AdamW's rate
    scaled by about the square root of the batch's growth."""
    base = _compose(data, tmp_path / "base", "experiment=gpu_384", *ON_CPU)
    built = build(_compose(data, tmp_path, "experiment=gpu_384_graphs", *ON_CPU))
    assert built.cfg.module.compile and built.cfg.module.compile_mode == "reduce-overhead"
    assert built.module.net._compiled_call_impl is not None  # nn.Module.compile's, in place
    (optimizer,) = dry_fit(built).optimizers
    scale = optimizer.defaults["lr"] / base.optimizer.lr
    assert scale == pytest.approx(2**0.5, rel=0.02)  # the YAML rounds it to 1.4e-3


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "fused"), [([], True), (["optimizer.fused=null"], None)])
def test_adamws_fused_kernel_reaches_the_fits_optimizer(overrides, fused, data, tmp_path):
    probe = dry_fit(build(_compose(data, tmp_path, *overrides)))
    (optimizer,) = probe.optimizers
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is fused


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "on"), [([], True), (["module.channels_last=null"], False)])
def test_the_net_trains_channels_last_on_the_cpu_too_by_default(overrides, on, data, tmp_path):
    """oneDNN runs UNet's convolutions faster channels-last (the default UNet-r18 on 2 cores:
    +22% training images/s); null keeps it to CUDA."""
    module = build(_compose(data, tmp_path, *overrides)).module
    kernels = [p for p in module.net.parameters() if p.dim() == 4]
    assert module.channels_last is on
    layout = torch.channels_last if on else torch.contiguous_format
    assert kernels and all(p.is_contiguous(memory_format=layout) for p in kernels)


def test_the_benchs_training_step_has_train_pys_defaults():
    """bench.yaml holds the training step's settings at its top level (its command line's
    `channels_last=`, `loss=`, ...), a second copy of train.py's `module:` defaults; the optimizer
    is the same group. A default changed in one file only would make the ceiling another
    training's than the one it is compared with."""
    bench, train = _compose_app("bench", []), _compose_app("train", [])
    for key in ("loss", "channels_last", "compile", "compile_mode"):
        assert bench[key] == train.module[key], key
    assert bench.cudnn_benchmark == train.trainer.benchmark
    assert bench.optimizer == train.optimizer


def _encoder(net: torch.nn.Module) -> tuple[str, int]:
    return type(net.encoder).__name__, sum(p.numel() for p in net.encoder.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["gpu_384", "fast_384", "gpu_384_graphs"])
@pytest.mark.parametrize(("model", "encoder"), [("unet", "resnet34"), ("segformer", None)])
def test_a_preset_gives_its_encoder_to_unet_only(experiment, model, encoder, data, tmp_path):
    # "override model=segformer for SegFormer": SegFormer keeps its own encoder, not the ResNet
    chosen = [f"model={model}"] + ([f"model.encoder_name={encoder}"] if encoder else [])
    alone = _compose(data, tmp_path / "alone", *chosen)
    built = build(_compose(data, tmp_path, f"experiment={experiment}", f"model={model}", *ON_CPU))
    assert built.cfg.model == alone.model
    assert _encoder(built.module.net) == _encoder(instantiate(alone.model))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["gpu_384", "fast_384"])
def test_debug_overfit_wins_over_an_experiment_and_the_command_line_over_both(
    experiment, data, tmp_path
):
    overfit = [f"experiment={experiment}", "debug=overfit", *ON_CPU]
    built = build(_compose(data, tmp_path, *overfit))
    assert built.datamodule.aug.ops == ()  # aug=none: one batch seen exactly, again and again
    assert built.trainer.overfit_batches == 1 and built.trainer.max_epochs == 100
    built = build(_compose(data, tmp_path / "heavy", *overfit, "aug=heavy"))
    heavy = _compose(data, tmp_path / "alone", "aug=heavy")
    assert [op.name for op in built.datamodule.aug.ops] == [o["op"] for o in heavy.aug.ops]


@pytest.mark.parametrize(
    ("metric", "mode", "direction"),
    [("val/dice", "max", "maximize"), ("val/loss", "min", "minimize")],
)
def test_optuna_optimizes_the_metric_in_its_mode(metric, mode, direction):
    overrides = ["hparams_search=optuna", f"optimized_metric={metric}", f"optimized_mode={mode}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.sweeper.direction == direction
    # what the sweeper hands Optuna: a study that keeps the trial best in optimized_mode
    study = optuna.create_study(direction=cfg.hydra.sweeper.direction)
    assert study.direction.name == direction.upper()


@pytest.mark.slow
def test_optuna_refuses_an_unknown_mode_naming_it():
    overrides = ["hparams_search=optuna", "optimized_mode=mx"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with pytest.raises(InterpolationResolutionError, match="optimized_mode=mx"):
        cfg.hydra.sweeper.direction  # noqa: B018 (resolving is the test)


@pytest.mark.slow
def test_a_schedule_length_set_explicitly_is_kept(data, tmp_path):
    probe = dry_fit(build(_compose(data, tmp_path, "scheduler.T_max=7")))
    (scheduler,) = probe.schedulers
    assert schedule_length(scheduler.state_dict()) == 7 != probe.steps


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_onecycle_keeps_the_optimizers_momentum_unless_told_to_cycle_it(optimizer, data, tmp_path):
    # 0.5: outside OneCycleLR's momentum range, so a schedule that touched it would show
    momentum = "optimizer.betas=[0.5,0.999]" if optimizer == "adamw" else "optimizer.momentum=0.5"
    chosen = [f"optimizer={optimizer}", momentum, "scheduler=onecycle"]
    probe = dry_fit(build(_compose(data, tmp_path / "kept", *chosen)))
    (scheduler,) = probe.schedulers
    assert {step["momentum"] for step in per_step(scheduler, probe.steps)} == {0.5}

    cfg = _compose(data, tmp_path / "cycled", *chosen, "scheduler.cycle_momentum=true")
    probe = dry_fit(build(cfg))
    (scheduler,) = probe.schedulers
    steps = per_step(scheduler, probe.steps)
    used = [step["momentum"] for step in steps]
    peak = max(range(len(steps)), key=lambda i: steps[i]["lr"])
    # down to base_momentum while the LR rises to its peak, back up to max_momentum as it anneals
    assert used[0] == used[-1] == pytest.approx(cfg.scheduler.max_momentum)
    assert used[peak] == min(used) == pytest.approx(cfg.scheduler.base_momentum)


def _compose_app(app: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(app, overrides=overrides)


@pytest.mark.parametrize("dataset", sorted(p.stem for p in (CONF / "dataset").glob("*.yaml")))
def test_prepare_composes_from_the_dataset(dataset):
    cfg = _compose_app("prepare", [f"dataset={dataset}"])
    assert cfg.input_dir == cfg.dataset.raw_dir and cfg.output_dir == cfg.dataset.root
    assert cfg.split.group_regex == cfg.dataset.group_regex


@pytest.mark.parametrize("model", [None, "unet"])
@pytest.mark.parametrize("app", ["predict", "export"])
def test_predict_and_export_build_the_checkpoints_net(app, model, trained_run):
    ckpt = trained_run
    overrides = [f"ckpt={ckpt}"] + (["input=x", "output=y"] if app == "predict" else [])
    if model is not None:
        overrides += [f"model={model}", *TINY_UNET[1:]]
    spec = resolve_spec(_compose_app(app, overrides))
    assert type(load_net(ckpt, spec.model)).__name__ == "Unet" and spec.image_size == (32, 32)


def test_train_help_names_every_group_and_option():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        help_text = compose("train", return_hydra_config=True).hydra.help.template
    listed = {
        line.split()[0]: {o.strip() for o in line.split(None, 1)[1].split(",")}
        for line in help_text.splitlines()
        if line.startswith("  ") and line.split()[0] in GROUPS
    }
    for group in GROUPS:
        assert listed.get(group, set()) == {o for g, o in OPTIONS if g == group}, group


@pytest.mark.parametrize(
    ("app", "key", "required"),
    [
        ("train", "trainer.max_epochs", []),
        ("prepare", "mask_threshold", []),
        ("predict", "batch_size", ["ckpt=c", "input=i", "output=o"]),
        ("bench", "measure_batches", []),
        ("bench_prepare", "repeats", []),
        ("bench_scale", "counts", []),
        ("bench_predict", "onnx_batch", ["ckpt=c"]),
        ("bench_zoomed", "seeds", ["ckpt=c"]),
    ],
)
def test_every_entry_points_config_is_typed(app, key, required):
    """The bench configs had no schema: `repeats=abc` composed, and failed mid-benchmark."""
    with pytest.raises(ConfigCompositionException) as err:
        _compose_app(app, [*required, f"{key}=abc"])
    assert f"full_key: {key}" in str(err.value.__cause__)


@pytest.mark.parametrize(
    ("command", "name", "given", "missing"),
    [
        ("nailseg predict", "nailseg predict", [], "ckpt=, input=, output="),
        ("nailseg predict", "nailseg predict", ["ckpt=x.ckpt"], "input=, output="),
        ("nailseg export", "nailseg export", [], "ckpt="),
        ("nailseg compare", "nailseg compare", [], "sweep_dir="),
        ("benchmarks.predict", "benchmarks.predict", [], "ckpt="),
        ("benchmarks.zoomed", "benchmarks.zoomed", [], "ckpt="),
        ("nailseg.synth", "nailseg.synth", [], "out="),
    ],
)
def test_a_required_value_left_out_is_named_in_one_line(
    command, name, given, missing, tmp_path, capsys
):
    """Left out, a required (`???`) value raised a trace from deep inside the run. `name`: what
    the command calls itself."""
    # from tmp_path: nothing is written, not there either
    proc = run_command(["-m", *command.split(), *given], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"{name}: missing {missing} (python -m {name} --help says what each is)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("command", "name"), [("predict", "nailseg predict"), ("export", "nailseg export")]
)
def test_a_model_key_without_the_model_is_named_in_one_line(command, name, tmp_path, capsys):
    """predict's and export's model is the checkpoint's (null) unless model= names one:
    `model.encoder_name=resnet18` alone failed inside Hydra with an AssertionError."""
    argv = ["-m", "nailseg", command, "ckpt=x.ckpt", "model.encoder_name=resnet18"]
    proc = run_command(argv, capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"{name}: model.encoder_name=resnet18 changes the model, and model= does not name "
        "one (the model is the checkpoint's): give it as well, e.g. model=unet "
        "model.encoder_name=resnet18"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_stored_study_rerun_seeds_its_sampler_past_the_trials_it_holds(tmp_path):
    """The sampler's seed was ${seed} alone: rerunning a stored study to add trials drew the
    first trials again (the helper's walk: lr 0.000561, resnet18, light, dice_bce twice)."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    overrides = ["hparams_search=optuna", f"hydra.sweeper.storage={storage}", "seed=7"]

    def sampler_seed() -> int:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
        return cfg.hydra.sweeper.sampler.seed

    assert sampler_seed() == 7 and not (tmp_path / "optuna.db").exists()  # nothing written
    study = optuna.create_study(study_name="nailseg", storage=storage)
    for _ in range(3):
        study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    assert sampler_seed() == 10

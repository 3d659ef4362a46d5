"""Every user error is one line, before anything is written (issue #32, item 4): train.py's
values out of range and devices this machine lacks are refused before Hydra makes the run folder
and any logger its run; predict and export refuse a checkpoint of the wrong kind, naming `ckpt=`,
before their output exists."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from support.cli import run_command
from support.inference import compose_cli
from support.train import compose_train, train

from nailseg.config import CONF_DIR
from nailseg.errors import ConfigError
from nailseg.inference.segmenter import resolve_spec
from nailseg.model.checkpoint import CheckpointError
from nailseg.training.checks import check

CUDA = torch.cuda.device_count()  # counted without a CUDA context
# a loader device and a trainer request this machine does not have, whatever it has
ABSENT_DEVICE = f"cuda:{CUDA}" if CUDA else "gpu"
ABSENT_GPUS = (
    (f"trainer.accelerator=gpu trainer.devices={CUDA + 1}", f"trainer.devices={CUDA + 1}: ")
    if CUDA
    else ("trainer.accelerator=gpu", "trainer.accelerator=gpu: torch sees no GPU")
)


def _refused(capsys: pytest.CaptureFixture[str], cwd: Path, *argv: str) -> str:
    """`python *argv` started in `cwd`, a new folder, must fail with its last line of stderr
    (returned) and no trace, leaving the folder empty."""
    cwd.mkdir()
    proc = run_command(argv, capsys, cwd=cwd)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.max_epochs=-1"], "train.py: ConfigError: trainer.max_epochs=-1: "),
        (
            ["trainer.max_epoch=3"],
            "trainer.max_epoch=3: no such key; did you mean trainer.max_epochs?",
        ),
        (
            ["+trainer.max_epoch=3"],
            "trainer.max_epoch: no such key; did you mean trainer.max_epochs?",
        ),
        ([f"loader.device={ABSENT_DEVICE}"], f"ConfigError: loader.device={ABSENT_DEVICE}: "),
        (
            ["-m", f"loader.device=cpu,{ABSENT_DEVICE}"],
            f"job 1 of 2 (loader.device={ABSENT_DEVICE}): ConfigError: loader.device=",
        ),
    ],
    ids=["endless-fit", "misspelt-key", "misspelt-added-key", "loader-device", "sweep-job-device"],
)
def test_train_refuses_in_one_line_before_the_run_folder_and_wandb(args, message, tmp_path, capsys):
    """max_epochs=-1 failed inside the fit (the cosine schedule has no length then), an absent
    loader device as the loader was built: each with a trace of hundreds of lines, after the run
    folder and the W&B run were made; a sweep ran job 0 before job 1 failed so. (An absent
    trainer device, refused by the same check, is among the in-process cases below.)"""
    run_dir, sweep_dir = tmp_path / "run", tmp_path / "sweep"
    last = _refused(
        capsys,
        tmp_path / "cwd",
        "train.py",
        *args,
        f"hydra.run.dir={run_dir}",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert message in last and last.startswith("train.py: "), last
    assert not run_dir.exists() and not sweep_dir.exists()  # W&B's folder is the run folder's


# (override, the start of the refusal): each value passed the checks and failed later, after the
# run folder and the loggers' runs were made, or was taken and misread
OUT_OF_RANGE = [
    ("trainer.max_epochs=-2", "trainer.max_epochs=-2: must be >= 1 (or -1: no limit)"),
    ("trainer.max_epochs=-1", "trainer.max_epochs=-1: a fit without an end"),
    (
        "trainer.max_epochs=null trainer.max_time=00:01:00:00",
        "trainer.max_time=00:01:00:00 (trainer.max_epochs unset)",
    ),
    ("trainer.max_steps=0", "trainer.max_steps=0: must be >= 1 (or -1: no limit)"),
    ("trainer.min_epochs=-1", "trainer.min_epochs=-1: must be >= 0"),
    ("trainer.min_steps=-1", "trainer.min_steps=-1: must be >= 0"),
    ("trainer.num_nodes=0", "trainer.num_nodes=0: `num_nodes` must be a positive integer"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: must be >= 1"),
    ("trainer.log_every_n_steps=-1", "trainer.log_every_n_steps=-1: must be >= 0"),
    ("trainer.num_sanity_val_steps=-2", "trainer.num_sanity_val_steps=-2: must be >= 0"),
    ("trainer.reload_dataloaders_every_n_epochs=-1", "trainer.reload_dataloaders_every_n_"),
    ("trainer.fast_dev_run=-1", "trainer.fast_dev_run=-1: fast_dev_run=-1 is not a valid"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1.0: must be >= 0"),
    ("trainer.gradient_clip_algorithm=clip", "trainer.gradient_clip_algorithm=clip: "),
    ("trainer.limit_train_batches=0", "trainer.limit_train_batches=0: the fit would train no"),
    ("trainer.limit_train_batches=1.5", "trainer.limit_train_batches=1.5: You have passed"),
    ("trainer.limit_val_batches=-1", "trainer.limit_val_batches=-1: You have passed"),
    ("trainer.limit_test_batches=-0.5", "trainer.limit_test_batches=-0.5: You have passed"),
    ("trainer.overfit_batches=-1", "trainer.overfit_batches=-1: You have passed"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0: must be > 0"),
    ("trainer.val_check_interval=1.5", "trainer.val_check_interval=1.5: You have passed"),
    ("trainer.max_time=1h", "trainer.max_time=1h: `Timer(duration='1h')` is not a valid"),
    ("trainer.accelerator=xpu", "trainer.accelerator=xpu: You selected an invalid accelerator"),
    ("trainer.precision=17", "trainer.precision=17: Precision '17' is invalid"),
    ("trainer.accelerator=cpu trainer.devices=0", "trainer.devices=0: "),
    ("trainer.accelerator=cpu trainer.devices=-1", "trainer.devices=-1: "),
    ("loader.num_workers=-1", "loader.num_workers=-1: must be at least"),
    ("loader.prefetch=0", "loader.prefetch=0: must be at least 1"),
    ("loader.seed=-1", "loader.seed=-1: must be at least 0"),
    ("module.eval_scales=[]", "module.eval_scales=[]: give one factor of the input size or more"),
    ("module.eval_scales=[1,-2]", "module.eval_scales=[1,-2]: each factor must be a number > 0"),
    ("seed=-1", "seed=-1: must be in [0, 4294967295]"),
    ("dataset.image_size=[0,32]", "dataset.image_size=[0, 32]: must be"),
    ("dataset.synthetic.n=0", "dataset.synthetic.n=0: must be at least 1"),
    ("optimizer.lr=0", "optimizer.lr=0.0: must be > 0"),
    ("optimizer=sgd optimizer.lr=-0.1", "optimizer.lr=-0.1: must be > 0"),
    ("scheduler.T_max=0", "scheduler.T_max=0: must be >= 1 (null: the whole fit)"),
    ("scheduler.eta_min=-1", "scheduler.eta_min=-1.0: must be >= 0"),
    ("scheduler=onecycle scheduler.total_steps=0", "scheduler.total_steps=0: must be >= 1"),
    ("scheduler=cosine_warmup scheduler.warmup_fraction=1.5", "scheduler: scheduler.warmup_fr"),
    (f"loader.device={ABSENT_DEVICE}", f"loader.device={ABSENT_DEVICE}: torch sees"),
    ABSENT_GPUS,
]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "message"), OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_a_value_out_of_range_is_refused_naming_its_key(overrides, message):
    with pytest.raises(ConfigError) as refused:
        check(compose_train(overrides.split()))
    assert str(refused.value).startswith(message), str(refused.value)


@pytest.mark.slow
def test_an_endless_fit_trains_with_a_step_limit(prepared, tmp_path):
    """trainer.max_epochs=-1 is Lightning's fit without an epoch limit: with max_steps the cosine
    schedule spans those steps."""
    train(prepared, tmp_path / "run", "trainer.max_epochs=-1", "trainer.max_steps=3", "logger=none")
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", mmap=True)
    assert last["global_step"] == 3


def _onnx_model(path: Path) -> Path:
    """A real ONNX model (one Identity node), as export writes one."""
    tensor = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    out = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    node = onnx.helper.make_node("Identity", ["x"], ["y"])
    graph = onnx.helper.make_graph([node], "g", [tensor], [out])
    onnx.save(onnx.helper.make_model(graph), path)
    return path


def test_predict_and_export_point_an_onnx_model_given_as_ckpt_to_its_checkpoint(tmp_path, capsys):
    """`predict ckpt=model.onnx` failed reading it as a checkpoint, with torch's words about
    mmap and zip files, not saying what to pass."""
    model = _onnx_model(tmp_path / "model.onnx")
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.png").write_bytes(b"")
    out = tmp_path / "out"
    args = [f"ckpt={model}", f"input={photos}", f"output={out}"]
    last = _refused(capsys, tmp_path / "p", "-m", "nailseg", "predict", *args)
    assert last.startswith(f"predict failed: ckpt={model} is an ONNX model"), last
    assert "engine=onnx" in last
    before = model.read_bytes()  # export's output would be beside it: model.onnx itself
    last = _refused(capsys, tmp_path / "e", "-m", "nailseg", "export", f"ckpt={model}")
    assert last.startswith(f"export failed: ckpt={model} is an ONNX model"), last
    assert model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "model.onnx", "p", "photos"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("run", "is a folder: pass a checkpoint file"),
        ("nothing.ckpt", ": no such checkpoint"),
        ("photo.png", "is not a checkpoint"),
        ("arrays.npz", "cannot be loaded as a checkpoint"),
    ],
)
def test_a_ckpt_that_is_no_checkpoint_is_named(name, message, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    np.savez(tmp_path / "arrays.npz", a=np.zeros(1))  # a zip archive, as torch.save writes
    ckpt = tmp_path / name
    for app, args in (("predict", ["input=x", "output=y"]), ("export", [])):
        cfg = compose_cli(app, [f"ckpt={ckpt}", *args])
        with pytest.raises(CheckpointError) as refused:
            resolve_spec(cfg)
        assert str(refused.value).startswith(f"ckpt={ckpt}") and message in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "slurm"])
def test_a_sweep_run_on_other_machines_is_checked_without_this_machines_devices(launcher):
    """train.py's own precheck: jobs that SLURM runs on its nodes are not refused for a device
    the submitting machine lacks; any other value of theirs still is, before submitting."""
    choice = ["hydra/launcher=slurm"] if launcher == "slurm" else []
    cases = [(f"loader.device={ABSENT_DEVICE}", launcher == "basic"), ("seed=-1", True)]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for value, refused in cases:
            config = compose("train", overrides=[*choice, value], return_hydra_config=True)
            precheck = instantiate(config.hydra.callbacks.precheck)
            if not refused:
                precheck.on_multirun_start(config, config_name="train")
                continue
            key = re.escape(value.partition("=")[0])
            with pytest.raises(SystemExit, match=rf"job 0 of 1 \(.*\): ConfigError: {key}="):
                precheck.on_multirun_start(config, config_name="train")

"""What a user coming from lightning-hydra-template expects: defaults anchored at the project root
(`paths`), `tags`, debug runs apart with loggers off, an evaluation that reads model and size
from its checkpoint, schemas that are not offered as options, CI and pre-commit hygiene."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from support.cli import run_command
from support.ddp import ROOT, job_dirs
from support.prepared import write_prepared
from support.train import CONF, TINY_UNET, compose_train, small_overrides
from support.wandb_records import run_record

import benchmarks  # noqa: F401  (the bench_* schemas are stored on its import)
import nailseg.bench  # noqa: F401  (bench_schema, likewise)
from nailseg import config
from nailseg.model.checkpoint import CheckpointError
from nailseg.training.run import run

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
# the tiny net's and data's size, as small_overrides sets them: what an evaluation may leave out
RESTATED = ("dataset.image_size=", "model=", "+model.")


# --- paths: every default under the project, whichever folder a command starts in -------------


FOLDER_KEYS = {
    "train": ["dataset.root", "dataset.raw_dir"],
    "prepare": ["input_dir", "output_dir", "dataset.root"],
    "bench": ["output_dir", "dataset.root"],
    "bench_prepare": ["input_dir", "output_dir"],
    "bench_predict": ["input_dir", "output_dir"],
    "bench_scale": ["output_dir"],
}


def _in_project(cfg, keys: list[str]) -> None:
    assert cfg.paths.root_dir == str(ROOT)
    for key in keys:
        assert OmegaConf.select(cfg, key).startswith(f"{ROOT}/"), key


@pytest.mark.parametrize("app", sorted(FOLDER_KEYS))
def test_a_commands_default_folders_are_in_the_project_from_another_folder(
    app, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(app, overrides=["ckpt=x.ckpt"] if app == "bench_predict" else [])
    _in_project(cfg, FOLDER_KEYS[app])


def test_prepare_started_in_another_folder_resolves_its_defaults_in_the_project(tmp_path, capsys):
    proc = run_command(["prepare.py", "--cfg", "job", "--resolve"], capsys, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _in_project(OmegaConf.create(proc.stdout), FOLDER_KEYS["prepare"])
    assert list(tmp_path.iterdir()) == []


def _runs_tagged(folder: Path, tag: str) -> list[Path]:
    """The run folders under `folder` whose metrics.json carries `tag`: this test's own."""
    return [
        m.parent
        for m in folder.glob("*/metrics.json")
        if tag in json.loads(m.read_text()).get("tags", [])
    ]


@pytest.mark.slow
def test_a_debug_run_from_another_folder_writes_its_own_folder_in_the_project(tmp_path, capsys):
    """`cd elsewhere && python /project/train.py` wrote outputs/ into `elsewhere`; a path the user
    names (dataset.root=prepared) stays relative to the folder they are in."""
    write_prepared(tmp_path / "prepared")
    tag = f"test-{uuid.uuid4().hex}"
    debug_dir = ROOT / "outputs" / "debug"
    made = [p for p in (ROOT / "outputs", debug_dir) if not p.exists()]
    overrides = small_overrides(
        Path("prepared"), "debug=default", f"tags=[{tag},conventions]", logger=None
    )
    try:
        proc = run_command(["train.py", *overrides], capsys, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (run_dir,) = _runs_tagged(debug_dir, tag)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["tags"] == [tag, "conventions"] and metrics["final"]["metrics"]
        assert metrics["epochs"] == 1  # debug's one short epoch
        assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]
        logged = {"wandb", "tensorboard"} & {p.name for p in run_dir.iterdir()}
        assert not logged, f"debug runs keep the loggers off: {logged}"
        assert (run_dir / "csv" / "metrics.csv").is_file()  # the local record every run keeps
    finally:
        for run_dir in _runs_tagged(debug_dir, tag):  # only the run this test started
            shutil.rmtree(run_dir)
        for folder in reversed(made):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _compose_with_hydra(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "debug").glob("*.yaml")))
def test_every_debug_option_runs_apart_with_the_loggers_off(option):
    cfg = _compose_with_hydra(f"debug={option}")
    assert cfg.logger is None and cfg.task_name == "debug"
    run_dir, sweep_dir = cfg.hydra.run.dir, cfg.hydra.sweep.dir
    assert Path(run_dir).parent == ROOT / "outputs" / "debug"
    assert Path(sweep_dir).parent == ROOT / "multirun" / "debug"
    plain = _compose_with_hydra()
    assert Path(plain.hydra.run.dir).parent == ROOT / "outputs" / "train"
    assert Path(plain.hydra.sweep.dir).parent == ROOT / "multirun"
    # the command line wins over the preset
    assert _compose_with_hydra(f"debug={option}", "logger=csv").logger.csv is not None


# --- tags --------------------------------------------------------------------------------------


@pytest.mark.slow  # the shared sweep: three trainings in a subprocess
def test_each_job_of_a_sweep_gets_the_tags_in_its_wandb_run_and_metrics(failing_sweep):
    jobs = job_dirs(failing_sweep)
    for job in jobs:
        (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")
        assert list(run_record(run_file).tags) == ["dev"], job.name
    assert [json.loads((jobs[i] / "metrics.json").read_text())["tags"] for i in (0, 2)] == [
        ["dev"],
        ["dev"],
    ]


# --- evaluation of a checkpoint: model and size from its card ----------------------------------


@pytest.fixture
def trained(trained_run) -> tuple[Path, Path]:
    """A tiny UNet (not the default model) trained one epoch at 32² (not the default size), and
    its data."""
    return trained_run.parents[2] / "prepared", trained_run


def _unrestated(data: Path, *extra: str) -> list[str]:
    """small_overrides without the model and image size, then `extra`."""
    return [o for o in small_overrides(data) if not o.startswith(RESTATED)] + list(extra)


def test_an_evaluation_reads_the_model_and_size_from_the_checkpoint(trained, tmp_path, capsys):
    data, ckpt = trained
    args = _unrestated(data, "train=false", f"ckpt_path={ckpt}", "logger=none")
    out = tmp_path / "eval"
    proc = run_command(["train.py", *args, f"hydra.run.dir={out}"], capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(ckpt) and metrics["final"]["metrics"]["val_eval/samples"]


@pytest.mark.parametrize(
    ("restated", "key"),
    [
        (["dataset.image_size=[64,64]"], "dataset.image_size"),
        (["model=segformer"], "model"),
        (["+model.options.encoder_depth=4"], "model"),
    ],
)
def test_an_evaluation_refuses_a_restated_value_the_checkpoint_does_not_have(
    restated, key, trained, tmp_path
):
    data, ckpt = trained
    overrides = _unrestated(data, "train=false", f"ckpt_path={ckpt}", "logger=none", *restated)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(key)}: {re.escape(str(ckpt))} was"):
        run(compose_train(overrides, tmp_path / "eval"))
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_an_evaluation_takes_a_restated_value_that_is_the_checkpoints(trained, tmp_path):
    data, ckpt = trained
    overrides = small_overrides(data, "train=false", f"ckpt_path={ckpt}", "logger=none")
    assert all(o in overrides for o in TINY_UNET)
    run(compose_train(overrides, tmp_path / "eval"))
    assert (tmp_path / "eval" / "metrics.json").is_file()


# --- schemas: types for every group, never one of its options --------------------------------


def test_completion_offers_a_groups_options_not_its_schema(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COMP_LINE", "python train.py model=")
    proc = run_command(["train.py", "-sc", "query=bash"], capsys, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["model=segformer", "model=unet"]


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_a_groups_options_are_its_yaml_files_each_typed_by_its_schema(group):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    assert options == sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    schemas = set(config.SCHEMAS.values())
    for option in options:
        cfg = _compose_with_hydra(f"{group}={option}")
        if group in config.TrainConfig.__dataclass_fields__ and cfg[group] is not None:
            assert OmegaConf.get_type(cfg[group]) in schemas | {dict}, (group, option)


# --- CI and pre-commit ---------------------------------------------------------------------------

HYGIENE_HOOKS = {
    "trailing-whitespace",
    "end-of-file-fixer",
    "check-yaml",
    "check-added-large-files",
    "check-merge-conflict",
}
LARGE_KB = 500  # check-added-large-files' default limit
CONFLICT = re.compile(rb"^(<<<<<<< |=======$|>>>>>>> )", re.MULTILINE)


def test_ci_runs_the_projects_checks_and_pre_commit_has_the_hygiene_hooks_beside_ruff():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    (job,) = workflow["jobs"].values()
    assert job["runs-on"].startswith("ubuntu")
    python = [
        s["with"]["python-version"] for s in job["steps"] if "setup-python" in s.get("uses", "")
    ]
    assert python == ["3.11"]
    assert [s["run"] for s in job["steps"] if "run" in s] == ["bash .ci/run"]
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"]
    ids = {hook["id"] for repo in hooks for hook in repo["hooks"]}
    assert ids >= HYGIENE_HOOKS | {"ruff-check", "ruff-format"}


def test_every_tracked_file_passes_the_hygiene_hooks():
    """What the pre-commit hooks check, without fetching them: no trailing whitespace, one final
    newline, YAML that parses, no large file, no conflict marker."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    problems = []
    for name in filter(None, listed.stdout.split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet from the index
            continue
        data = path.read_bytes()
        if len(data) > LARGE_KB * 1024:
            problems.append(f"{name}: larger than {LARGE_KB} KB")
        if b"\0" in data:  # binary: the text hooks skip it
            continue
        if re.search(rb"[ \t]\r?$", data, re.MULTILINE):
            problems.append(f"{name}: trailing whitespace")
        if data and (not data.endswith(b"\n") or data.endswith(b"\n\n")):
            problems.append(f"{name}: not one final newline")
        if CONFLICT.search(data):
            problems.append(f"{name}: a merge conflict marker")
        if name.endswith((".yaml", ".yml")):
            try:
                yaml.safe_load(data)
            except yaml.YAMLError as err:
                problems.append(f"{name}: invalid YAML ({err})")
    assert not problems, "\n".join(problems)

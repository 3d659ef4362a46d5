"""The entry points as a user starts them: a config that cannot work is refused before Hydra writes
anything, every job of a sweep before the first job runs (in this process, as the shell would
start them), and the first run on the built-in data trains with worker processes (a new process:
what it forks depends on what its own process ran before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import quick_first, run_command
from support.train import TINY_UNET

ROOT = Path(__file__).resolve().parents[2]


def _start(script: str, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"},
    )


def _written(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


HEAVY = ("torch", "lightning", "segmentation_models_pytorch", "nvidia.dali")


@pytest.mark.parametrize(
    ("args", "answer"),
    quick_first(
        [
            (["--help"], "python train.py [group=option ...]"),
            (
                ["model=unetx"],
                "train.py: ConfigError: model=unetx: no such option (segformer, unet)",
            ),
            (
                ["trainer.max_epochs=abc"],
                "train.py: ConfigError: trainer.max_epochs=abc: Value 'abc'",
            ),
            (
                ["trainer.max_epoch=3"],
                "train.py: ConfigError: trainer.max_epoch=3: no such key; did you mean "
                "trainer.max_epochs?",
            ),
            (["+module.los=dice"], "train.py: ConfigError: module.los: no such key; did you mean"),
            (
                ["+trainer.max_epoch=3"],
                "trainer.max_epoch: no such key; did you mean trainer.max_epochs?",
            ),
            (
                ["loader.batch_size=0"],
                "train.py: ConfigError: loader.batch_size=0: must be at least 1",
            ),
            (
                ["model.encoder_weights=imagenet", "paths.root_dir=ROOT"],
                "model.encoder_weights=imagenet: resnet18's imagenet weights are not on disk",
            ),
            (
                ["dataset=nails", "dataset.root=ROOT"],
                "dataset.root=ROOT is not prepared (no train.csv)",
            ),
            (["-m", "dataset=nails", "dataset.root=ROOT,/b"], "dataset.root=ROOT is not prepared"),
            (
                ["init_from=ROOT/a.ckpt"],
                "ConfigError: init_from: ckpt=ROOT/a.ckpt: no such checkpoint",
            ),
        ],
        kind=lambda case: case[0] == ["--help"],
    ),
)
def test_help_a_typo_and_a_root_not_prepared_answer_before_torch_loads(tmp_path, args, answer):
    """A root not prepared, a value out of range, a misspelt key and pretrained weights not on
    disk were refused only after torch, Lightning and smp had loaded (~10 s; the weights after a
    minute of hub retries, leaving a run folder); Hydra answered a misspelt key over five lines
    advising `+key=`, which makes the typo a new key."""
    root = str(tmp_path / "not-prepared")
    argv = [a.replace("ROOT", root) for a in args]
    probe = (
        "import atexit, runpy, sys\n"
        f"atexit.register(lambda: print('imported:', [m for m in {HEAVY!r} if m in sys.modules],"
        " file=sys.stderr))\n"
        f"sys.argv = [{str(ROOT / 'train.py')!r}, *{argv!r}]\n"
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "no-cache")}
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert answer.replace("ROOT", root) in proc.stdout + proc.stderr
    assert lines[-1] == "imported: []"
    if args[0] != "--help":  # the refusal alone, in one line
        assert len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_misspelt_added_key_is_refused_in_one_line_before_the_run_folder(tmp_path, capsys):
    """Hydra's advice `+trainer.max_epoch=3` reached Lightning's TypeError after 15 s, with the
    run folder written."""
    proc = run_command(["train.py", "+trainer.max_epoch=3"], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "train.py: ConfigError: trainer.max_epoch: no such key; did you mean trainer.max_epochs?"
    )
    assert _written(tmp_path) == []


def test_a_bad_value_is_refused_in_one_line_before_the_run_folder_is_made(tmp_path, capsys):
    """Hydra made outputs/train/<time>/ (.hydra/, train.log) before train.py checked the config,
    and the error came as a trace."""
    proc = run_command(["train.py", "loader.batch_size=0"], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("train.py: ConfigError: loader.batch_size=0: must be at least 1")
    assert _written(tmp_path) == []


@pytest.mark.slow
def test_a_sweep_with_a_bad_job_is_refused_before_its_first_job_runs(tmp_path, capsys):
    """The sweep ran (and trained) job 0 before job 1's bad value stopped it; a choice that does
    not exist in job 1 alone (model=unett) did the same."""
    proc = run_command(["train.py", "-m", "loader.batch_size=4,0"], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert "job 1 of 2 (loader.batch_size=0): ConfigError: loader.batch_size=0" in proc.stderr
    proc = run_command(["train.py", "-m", "model=unet,unett"], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert "job 1 of 2 (model=unett): MissingConfigException" in proc.stderr
    assert _written(tmp_path) == []


@pytest.mark.slow
def test_a_sweep_over_a_users_own_configs_is_checked_with_them(tmp_path, capsys):
    """Each job was composed without the command line's hydra overrides, so a config added with
    `hydra.searchpath` (a user's own experiment) was "not found" and the sweep refused."""
    mine = tmp_path / "my_conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("# @package _global_\nloader:\n  batch_size: 4\n")
    args = [f"hydra.searchpath=[file://{mine.parent}]", "experiment=mine"]
    proc = run_command(["train.py", "-m", *args, "trainer.max_epochs=1,0"], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert (
        "job 1 of 2 (experiment=mine trainer.max_epochs=0): ConfigError: trainer.max_epochs=0"
        in (proc.stderr)
    )
    assert _written(tmp_path) == ["my_conf", "my_conf/experiment", "my_conf/experiment/mine.yaml"]


def test_prepare_refuses_a_missing_input_before_the_run_folder_is_made(tmp_path, capsys):
    missing = f"input_dir={tmp_path / 'nope'}"
    proc = run_command(["prepare.py", missing, "output_dir=out"], capsys, cwd=tmp_path)
    assert proc.returncode == 1
    assert f"input_dir={tmp_path / 'nope'} does not exist" in proc.stderr
    assert _written(tmp_path) == []


@pytest.mark.slow
def test_the_first_run_on_the_built_in_data_trains_with_worker_processes(tmp_path):
    """train.py generated the built-in set in its own process (OpenCV's thread pool ran), then
    forked the DataLoader workers, which hung for ever in cv2.setNumThreads(1)."""
    proc = _start(
        "train.py",
        f"paths.root_dir={tmp_path}",  # the built-in data and the run folder: not the project's
        "loader=torch",
        "loader.num_workers=2",
        "loader.batch_size=4",
        "debug=fast",
        "logger=none",
        "dataset.synthetic.n=8",
        "dataset.image_size=[32,32]",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
        *TINY_UNET,
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "synthetic" / "prepared" / "train.csv").is_file()


@pytest.mark.slow
def test_a_refusal_that_needs_the_data_or_a_checkpoint_comes_in_one_line(
    prepared, tmp_path, capsys
):
    """Checks that read the prepared data, the net or a checkpoint run as the job starts; their
    refusals came as a trace (a misspelt model option as Hydra's 'Error in call to target')."""
    refusals = {
        "loader.batch_size=500": "ConfigError: loader.batch_size=500: the train split has 12 rows",
        "+model.options.decoder_atention_type=scse": "ConfigError: model: model.options."
        "decoder_atention_type='scse': refused: not an argument Unet takes here",
        f"ckpt_path={tmp_path / 'no.ckpt'}": "CheckpointError: ckpt=",
    }
    for override, message in refusals.items():
        args = [f"paths.root_dir={tmp_path}", f"dataset.root={prepared}", override, "logger=none"]
        proc = run_command(["train.py", *args], capsys, cwd=tmp_path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(f"train.py: {message}"), override

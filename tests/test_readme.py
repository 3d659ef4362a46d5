"""Every command in README.md's code blocks, run as written, in the README's order, with small
sizes appended (Hydra takes the last value of a key) and its placeholders filled: a README that
goes stale fails here. Runs write under a temporary `paths.root_dir`, never into the checkout."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from support.cli import run_command
from support.slurm import slurm_sweep
from support.train import compose_train

# each registers its schemas in Hydra's store as it is imported: before any state is saved

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PROGRAMS = ("python", "make", "source")
RUN_BY_CI = "make test"  # .ci/run runs it, and with it this file

# appended to every train.py / prepare.py command: seconds on 2 cores, not minutes
SMALL_DATA = ["dataset.image_size=[32,32]"]
SMALL_SYNTHETIC = ["dataset.synthetic.n=24"]
SMALL_FIT = ["loader.batch_size=4", "trainer.max_epochs=1"]
# ++: experiment=cpu (make train's on a CPU) sets the decoder's widths already
TINY_UNET = ["++model.options.encoder_depth=3", "++model.options.decoder_channels=[16,8,4]"]
SMALL_STUDY = ["hydra.sweeper.n_trials=2"]
GENERATED = ("dataset=synthetic", "dataset=synthetic_mix")  # the generator's sets: fewer photos


def readme_commands(text: str) -> list[str]:
    """The commands of the README's code blocks (4-space indented), continuation lines joined,
    comments dropped."""
    commands: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not line.startswith("    "):
            pending = ""
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        words = shlex.split(pending, comments=True)
        if words and words[0] in PROGRAMS:
            commands.append(shlex.join(words))
        pending = ""
    return commands


COMMANDS = readme_commands(README.read_text())


@dataclass
class Story:
    """What the README's commands leave behind for the ones after them."""

    root: Path
    outputs: list[str] = field(default_factory=list)

    @property
    def raw(self) -> Path:
        return self.root / "data" / "synthetic" / "raw"

    def newest(self, pattern: str) -> Path:
        found = sorted(self.root.glob(pattern), key=lambda p: p.stat().st_mtime_ns)
        assert found, f"no {pattern} under {self.root}: an earlier README command made none"
        return found[-1]

    def placeholders(self) -> dict[str, str]:
        run = lambda: str(self.newest("outputs/train/*/checkpoints/last.ckpt").parents[1])  # noqa: E731
        return {
            "RAW": lambda: str(self.raw),
            "RUN": run,
            "PHOTOS": lambda: str(self.raw / "Images"),
            "MASKS": lambda: str(self.raw / "Masks"),
            "OUT": lambda: str(self.root / "predicted"),
            "SWEEP": lambda: str(self.newest("multirun/*/multirun.yaml").parent),
        }

    def fill(self, command: str) -> list[str]:
        """The command's words with its placeholders (whole words, or before a `/`) filled."""
        table = self.placeholders()
        pattern = re.compile(rf"(?<![\w.-])({'|'.join(table)})(?=/|\b)")
        return [pattern.sub(lambda m: table[m.group(1)](), word) for word in shlex.split(command)]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Story:
    return Story(tmp_path_factory.mktemp("readme"))


def small(argv: list[str], root: Path) -> list[str]:
    """A train.py / prepare.py command line with the small settings appended."""
    script, args = argv[0], argv[1:]
    extra = [f"paths.root_dir={root}", *SMALL_DATA]
    if not any(a.startswith("dataset=") and a not in GENERATED for a in args):
        extra += SMALL_SYNTHETIC
    if script == "train.py":
        extra += SMALL_FIT
        if not any(a.startswith(("model=", "model.")) for a in args) or "model=unet" in args:
            extra += TINY_UNET
        if "hparams_search=optuna" in args:
            extra += SMALL_STUDY
    return [script, *args, *extra]


def gpus_asked(words: list[str]) -> int:
    """The GPUs a single `python train.py` run's config trains on (a preset may say trainer=gpu)."""
    if words[1] != "train.py" or "-m" in words:
        return 0
    trainer = compose_train(words[2:]).trainer
    if trainer.accelerator != "gpu":
        return 0
    return max(trainer.devices, 1) if isinstance(trainer.devices, int) else 1  # -1: every GPU


def run_python(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`python <argv>` in this process, as the shell starts it: its exit status and output."""
    done = run_command(argv, capsys)
    return done.returncode, done.stdout + done.stderr


# make's own variables and the Makefile's (ARGS=, DATASET=, ...): set when this runs under `make test`
MAKE_VARIABLES = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"} | set(
    re.findall(r"^([A-Z_]+) \??:?=", (ROOT / "Makefile").read_text(), re.M)
)


def make(*args: str) -> subprocess.CompletedProcess[str]:
    """`make *args` in the project as a user's shell starts it, not as a sub-make of `make test`."""
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}
    return subprocess.run(["make", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def make_lines(words: list[str]) -> Iterator[list[str]]:
    """The python commands `make <words>` runs (`make -n`), each without the interpreter."""
    shown = make("-n", *words[1:])
    assert shown.returncode == 0, shown.stderr
    for line in shown.stdout.splitlines():
        program, *argv = shlex.split(line)
        assert program.endswith("/python"), f"make {words[1]} runs more than python: {line}"
        yield argv


def test_the_readme_has_its_commands():
    assert len(COMMANDS) >= 15 and RUN_BY_CI in COMMANDS
    assert "python train.py model=segformer aug=heavy" in COMMANDS


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_each_readme_command_runs_as_written(command, story, capsys, monkeypatch, tmp_path):
    words = story.fill(command)
    if command == RUN_BY_CI:
        assert RUN_BY_CI in (ROOT / ".ci" / "run").read_text()
    elif words[0] == "source":
        python = f"source {words[1]} && python -c 'import nailseg, sys; print(sys.prefix)'"
        shown = subprocess.run(["bash", "-c", python], cwd=ROOT, capture_output=True, text=True)
        assert shown.stdout.strip() == str(ROOT / ".venv"), shown.stderr
    elif words[:2] == ["make", "install"]:
        assert make("-q", "install").returncode == 0
    elif words[0] == "make":
        for argv in make_lines(words):
            code, printed = run_python(small(argv, story.root), capsys)
            assert code == 0, printed
    elif "hydra/launcher=slurm" in words:
        jobs = slurm_sweep(monkeypatch, tmp_path, argv=tuple(words[2:]))
        assert [job["overrides"][-1] for job in jobs] == ["model=unet", "model=segformer"]
        assert {(j["nodes"], j["tasks_per_node"], j["gpus_per_node"]) for j in jobs} == {(2, 4, 4)}
    elif words[1:3] == ["train.py", "--help"]:
        code, printed = run_python(words[1:], capsys)
        assert code == 0 and "Groups" in printed
    else:
        argv = words[1:] if words[1] == "-m" else small(words[1:], story.root)
        code, printed = run_python(argv, capsys)
        if gpus_asked(words) > torch.cuda.device_count():
            assert code != 0 and len(printed.strip().splitlines()) == 1, printed
            assert "GPU" in printed
        else:
            assert code == 0, printed

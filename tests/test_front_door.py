"""`python -m nailseg <command>` and the `nailseg` script: one front door for every command, each
still a Hydra app with its own help, its overrides passed through unchanged."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from omegaconf import open_dict
from support.cli import quick_first

import nailseg
from nailseg.__main__ import COMMANDS, main, run
from nailseg.config import CONF_DIR
from nailseg.training.jobs import hydra_child_command

ROOT = Path(__file__).resolve().parents[1]
# sys.argv[0] as `python -m nailseg` sets it
MAIN = str(Path(nailseg.__file__).with_name("__main__.py"))


def test_the_front_door_lists_each_command_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "nailseg"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: python -m nailseg <command>")
    for name in COMMANDS:
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert len(line.split()) > 2, line  # the name and what it does


def test_an_unknown_command_is_one_line_naming_it_and_the_commands(monkeypatch):
    monkeypatch.setattr(sys, "argv", [MAIN, "bench_predict", "ckpt=x.ckpt"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == (
        "python -m nailseg: unknown command 'bench_predict'; the commands: prepare, train, "
        "predict, export, compare, bench"
    )


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_has_its_own_hydra_help_through_the_front_door(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [MAIN, name, "--help"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    assert f"nailseg {name} " in capsys.readouterr().out.split("\n\n")[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["train", "prepare"])
def test_help_is_hydras_own_without_its_walk_over_the_config_groups(name, monkeypatch, capsys):
    """`--help` skips Hydra's listing of every config group (about a second) for a template
    that does not print it; the text is the one Hydra prints with the listing."""
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    helps = []
    for start in (lambda: run(name), importlib.import_module(COMMANDS[name][0]).main):
        with pytest.raises(SystemExit) as exit_:
            start()  # ours, then Hydra's own
        assert exit_.value.code == 0
        helps.append(capsys.readouterr().out)
    assert helps[0] == helps[1] and helps[0].startswith(f"python {name}.py ")


@pytest.mark.parametrize(
    ("args", "answer"),
    quick_first(
        [
            (["train", "--help"], "nailseg train [group=option ...]"),
            (["prepare", "--help"], "nailseg prepare [options]"),
            (
                ["train", "loader.batch_size=0"],
                "nailseg train: ConfigError: loader.batch_size=0: must",
            ),
            (["train", "model=unetx"], "nailseg train: ConfigError: model=unetx: no such option"),
            (["prepare", "input_dir=ROOT/nope", "output_dir=ROOT/out"], "ROOT/nope does not exist"),
        ],
        kind=lambda case: (case[0][0], "--help" in case[0]),
    ),
)
def test_train_and_prepare_answer_help_and_errors_before_torch_loads(tmp_path, args, answer):
    """As the `nailseg` script starts them: the answer, with none of torch, Lightning, smp or
    DALI imported, and nothing written."""
    heavy = ("torch", "lightning", "segmentation_models_pytorch", "nvidia.dali")
    argv = [a.replace("ROOT", str(tmp_path)) for a in args]
    probe = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print('imported:', [m for m in {heavy!r} if m in sys.modules],"
        " file=sys.stderr))\n"
        f"sys.argv = ['nailseg', *{argv!r}]\n"
        "from nailseg.__main__ import main\n"
        "sys.exit(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert answer.replace("ROOT", str(tmp_path)) in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "imported: []"
    assert proc.returncode == (0 if "--help" in args else 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_hydra_names_the_command_as_the_user_typed_it(monkeypatch, capsys):
    """Hydra's own help builds its shell-completion lines from sys.argv[0]: it names the front
    door and the command, not nailseg/__main__.py."""
    monkeypatch.setattr(sys, "argv", [MAIN, "compare", "--hydra-help"])
    with pytest.raises(SystemExit):
        main()
    out = capsys.readouterr().out
    assert 'eval "$(python -m nailseg compare -sc install=bash)"' in out
    assert "__main__" not in out


@pytest.mark.slow
def test_the_nailseg_script_runs_a_command_with_its_arguments_unchanged(tmp_path):
    """The console script from pyproject's [project.scripts], end to end: compare takes a bare
    folder as `sweep_dir=` and refuses a folder that is no sweep in one line."""
    script = Path(sys.executable).with_name("nailseg")
    proc = subprocess.run(
        [str(script), "compare", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"nailseg compare: {tmp_path}: no job folders (subfolders with .hydra/) in it; expected "
        "a sweep's folder (multirun/<time>) whose jobs are its subfolders\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv0", "started_as"),
    [
        ("nailseg train", ["-m", "nailseg", "train"]),  # the script, or python -m nailseg
        (str(ROOT / "train.py"), [str(ROOT / "train.py")]),
    ],
)
def test_a_ddp_rank_restarts_the_command_the_user_ran(argv0, started_as, monkeypatch):
    """Lightning's DDP ranks under Hydra start the same command with the job's overrides."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", ["seed=3"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir, cfg.hydra.runtime.cwd = "/run", "/home"
    state = Singleton.get_state()
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)
    monkeypatch.setattr(sys, "argv", [argv0, "seed=3"])
    try:
        command, cwd = hydra_child_command(1)
    finally:
        Singleton.set_state(state)
    assert command[: 1 + len(started_as)] == [sys.executable, *started_as]
    assert command[len(started_as) + 1] == "seed=3" and cwd == "/home"

"""pyproject.toml and environment.yaml install the same, pinned packages; the wheel carries the
configs, and an installed nailseg runs from any folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_pins() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])


def _conda_pins() -> tuple[set[str], list]:
    env = yaml.safe_load((ROOT / "environment.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    return set(pip), env["dependencies"]


def test_pyproject_and_environment_agree():
    conda, deps = _conda_pins()
    assert _pyproject_pins() == conda
    assert "python=3.11" in deps


def test_every_dependency_is_pinned_to_the_tested_versions():
    pins = _pyproject_pins()
    assert all("==" in pin for pin in pins), [p for p in pins if "==" not in p]
    for required in (
        "torch==2.14.1",
        "torchvision==0.29.1",
        "lightning==2.6.6",
        "nvidia-dali-cuda120==2.4.0",
        "hydra-core==1.3.8",
        "omegaconf==2.3.1",
        "segmentation-models-pytorch==0.6.0",
        "wandb==0.31.0",
        "kornia==0.9.0",
    ):
        assert required in pins


def test_the_nailseg_script_is_the_front_door():
    """`nailseg <command>` runs what `python -m nailseg <command>` runs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"nailseg": "nailseg.__main__:main"}


def _source(folder: Path) -> Path:
    """What `pip install .` builds from, copied out of the checkout: the build writes build/ and
    nailseg.egg-info/ beside the sources."""
    folder.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, folder / name)
    for name in ("nailseg", "conf"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.mark.slow
def test_the_wheel_carries_every_module_and_config_file(tmp_path):
    """conf/ stays at the checkout's top; the wheel has it inside the package, where an
    installed nailseg finds it (config.CONF_DIR)."""
    source = _source(tmp_path / "checkout")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("nailseg-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("nailseg-")}
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "nailseg").rglob("*.py")}
    configs = {f"nailseg/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "conf").rglob("*.*")}
    assert names == modules | configs


@pytest.mark.slow
def test_pip_install_gives_commands_that_write_under_the_current_folder(tmp_path):
    """README's `pip install .` into a fresh virtualenv (the project's installed packages reused
    through a .pth file, offline): `nailseg prepare` and `nailseg train` run from an empty
    folder outside the checkout, and what they write lands under it."""
    assert "    pip install ." in (ROOT / "README.md").read_text()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (Path(site) / "project-packages.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-build-isolation", "--no-index", "."],
        cwd=_source(tmp_path / "checkout"), check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    conf = subprocess.run(
        [str(python), "-c", "from nailseg.config import CONF_DIR; print(CONF_DIR)"],
        cwd=work, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert conf == str(Path(site) / "nailseg" / "conf")  # the wheel's, not the checkout's
    small = ["dataset.synthetic.n=8", "dataset.image_size=[32,32]"]
    for command in (
        ["prepare", "dataset=synthetic", *small],
        ["train", "debug=fast", *small, "loader.batch_size=2", "logger=none"],
    ):
        done = subprocess.run(
            [str(venv / "bin" / "nailseg"), *command],
            cwd=work, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "data" / "synthetic" / "prepared" / "train.csv").is_file()
    (run,) = (work / "outputs" / "debug").iterdir()
    assert (run / "metrics.json").is_file() and (run / "train.log").is_file()
    assert f"run folder: {run}" in done.stdout + done.stderr

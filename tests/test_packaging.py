"""pyproject.toml and environment.yaml must install the same, pinned packages."""

from __future__ import annotations

import tomllib
from pathlib import Path

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

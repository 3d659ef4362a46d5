"""The user-error family: a request that cannot run (a value out of range, a misspelt key, a
missing or foreign file). Its message names the key, file or value at fault, so every command
prints it as one line (`refusal`) instead of a trace. Every layer may raise it: it imports nothing.
"""

from __future__ import annotations

import sys
from typing import Any


class UserError(Exception):
    """A request that cannot run, named in its message; each command exits with it in one line."""


def refusal(command: str, err: BaseException, where: str = "") -> str:
    """The one line a command exits with: `train.py: job 1 of 2 (...): ConfigError: ...`."""
    return f"{command}: {where}{type(err).__name__}: {' '.join(str(err).split())}"


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the request names (or needs, such as prepared data) does not exist."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the key and the value."""


class PrepareError(UserError, ValueError):
    """A prepare request refused, or a run left with nothing usable: the message says why."""


def require_values(cfg: Any, command: str) -> None:
    """Exit with one line naming the required keys (`???`) the command line left out, before
    anything is read or written."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        keys = ", ".join(f"{key}=" for key in missing)
        sys.exit(f"{command}: missing {keys} (python -m {command} --help says what each is)")


def require_model_group(command: str, overrides: list[str]) -> None:
    """Exit with one line when the command line sets a key of `model` without naming the model
    (predict's and export's `model` is null, the checkpoint's, unless `model=` names one)."""
    keys = [arg.lstrip("+~").partition("=")[0] for arg in overrides]
    if "model" in keys:
        return
    for arg, key in zip(overrides, keys, strict=True):
        if key.startswith("model."):
            sys.exit(
                f"{command}: {arg} changes the model, and model= does not name one (the model "
                f"is the checkpoint's): give it as well, e.g. model=unet {arg}"
            )

"""The user-error family: a request that cannot run (a value out of range, a misspelt key, a
missing or foreign file). Its message names the key, file or value at fault, so every command
prints it as one line (`refusal`) instead of a trace. Every layer may raise it: it imports nothing.
"""

from __future__ import annotations


class UserError(Exception):
    """A request that cannot run, named in its message; each command exits with it in one line."""


def refusal(command: str, err: BaseException, where: str = "") -> str:
    """The one line a command exits with: `train.py: job 1 of 2 (...): ConfigError: ...`."""
    return f"{command}: {where}{type(err).__name__}: {' '.join(str(err).split())}"


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the request names (or needs, such as prepared data) does not exist."""

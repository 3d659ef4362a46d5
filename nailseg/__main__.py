"""nailseg's front door: `python -m nailseg <command> [overrides]`, or the `nailseg` script.

Each command is a Hydra app with its own `--help`; the overrides after the command's name reach
it unchanged. The command's module is imported only when it runs, so listing the commands is
quick, and a process that imports this module to start workers (predict's forkserver) loads
nothing more.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (the module whose `main` runs it, what it does)
COMMANDS = {
    "prepare": ("nailseg.prepare", "images + masks -> the prepared npy and CSVs"),
    "train": ("nailseg.train", "train, evaluate or sweep (-m)"),
    "predict": ("nailseg.inference.predict", "masks (and overlays) for photos, from a checkpoint"),
    "export": ("nailseg.inference.export", "a checkpoint as ONNX, or the folder smp loads"),
    "compare": ("nailseg.compare", "a table and plot of a train sweep's jobs"),
    "bench": ("nailseg.bench", "loader benchmark: images/s of each loader x aug"),
}


def usage(program: str) -> str:
    """The command list: one line each."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: {program} <command> [overrides] (<command> --help: its options)", ""]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def _program() -> str:
    """How the user started this: `python -m nailseg` or the script's name."""
    if os.path.basename(sys.argv[0]) == "__main__.py":
        return "python -m nailseg"
    return os.path.basename(sys.argv[0]) or "nailseg"


def run(name: str) -> None:
    """Run command `name`'s Hydra app on the command line: a misspelt key or option exits in one
    line, named by the program (`os.path.basename(sys.argv[0])`), and `--help` answers without
    Hydra's walk over every config group."""
    from nailseg.training.checks import command_line

    with command_line(os.path.basename(sys.argv[0])):
        importlib.import_module(COMMANDS[name][0]).main()


def main() -> None:
    """Run the command named by the first argument with the rest of the command line. Hydra
    reads `sys.argv[0]` for the program name its help and shell completion print (a name not
    ending in `.py` as an installed app's), so it becomes `<program> <command>`."""
    program, args = _program(), sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(usage(program))
        return
    name, *overrides = args
    if name not in COMMANDS:
        sys.exit(f"{program}: unknown command {name!r}; the commands: {', '.join(COMMANDS)}")
    sys.argv = [f"{program} {name}", *overrides]
    run(name)


if __name__ == "__main__":
    main()

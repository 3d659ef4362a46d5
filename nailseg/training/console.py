"""What a run shows and keeps: the resolved config as a tree at start, and the log in its folder.

Lightning gives its loggers a console handler of their own, and stops them from propagating, when
it is imported before logging is configured (which Hydra does later): its messages then never
reached Hydra's log file, and `train.log` stayed empty. `run_log` routes them to the root logger
and, when a resumed fit writes to an earlier run's folder, also appends the log there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.tree import Tree

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# the top-level keys shown first, in the order data flows; the rest follow as composed
ORDER = ("dataset", "loader", "aug", "normalize", "model", "optimizer", "scheduler", "module")


def print_config_tree(cfg: DictConfig, console: Console | None = None) -> None:
    """The resolved config, one branch per top-level key (groups first, in data-flow order)."""
    tree = Tree("config", guide_style="dim")
    keys = [k for k in ORDER if k in cfg] + [k for k in cfg if k not in ORDER]
    for key in keys:
        node = cfg[key]
        if OmegaConf.is_config(node):
            text = OmegaConf.to_yaml(node, resolve=True).rstrip()
            tree.add(f"[bold]{key}[/]").add(Syntax(text, "yaml", theme="ansi_dark"))
        else:
            tree.add(f"[bold]{key}[/]: {escape(str(node))}")
    (console or Console()).print(tree)


def route_library_logs() -> None:
    """Lightning's messages go to the root logger's handlers (Hydra's console and log file), once
    logging is configured; before that they keep their own console handler."""
    if not logging.getLogger().handlers:
        return
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True


@contextmanager
def run_log(run_dir: Path, job_log: Path | None) -> Iterator[None]:
    """When `run_dir` is not where the job's log file `job_log` is (a resumed fit writing to its
    earlier run's folder), the log is also appended to `run_dir`'s file of that name."""
    root = logging.getLogger()
    extra = None
    if job_log is not None and job_log.parent.absolute() != run_dir.absolute():
        extra = logging.FileHandler(run_dir / job_log.name, mode="a")
        if root.handlers:
            extra.setFormatter(root.handlers[0].formatter)
        root.addHandler(extra)
    try:
        yield
    finally:
        if extra is not None:
            root.removeHandler(extra)
            extra.close()

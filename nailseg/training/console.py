"""What a run shows and keeps: the resolved config as a tree (also `config_tree.txt`), the
model's parameters, and no library chatter. Lightning's loggers, imported
before Hydra configures logging, keep a console handler of their own and never reach Hydra's log
file: `route_library_logs` sends them to the root logger.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from typing import Any

import yaml
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size
from lightning.pytorch.utilities.model_summary import get_human_readable_count as count
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table
from rich.tree import Tree

from nailseg.tables import print_table

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# the top-level keys shown first, in the order data flows; the rest follow as composed
ORDER = ("dataset", "loader", "aug", "normalize", "model", "optimizer", "scheduler", "module")
CONFIG_TREE = "config_tree.txt"  # the printed tree, kept in the run folder
# Lightning's info messages that say nothing about the run: its advertisements, that our
# ParameterSummary replaces its own summary, and how it counts the schedule's steps
LIGHTNING_CHATTER = (
    "💡 Tip:",
    "Trainer already configured with model summary callbacks",
    "Loading `train_dataloader` to estimate number of stepping batches",
)
# (category, message regex, module regex) of library warnings known to be harmless here
KNOWN_WARNINGS = (
    (  # Lightning 2.6 still uses the LeafSpec that torch deprecated
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"lightning\.pytorch\.utilities\._pytree",
    ),
)


def _drop_chatter(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_CHATTER)


def quiet_libraries() -> None:
    """Silence what libraries print on every run that says nothing about it: Lightning's tips,
    the known warnings, W&B's banner (the run's summary names its folder; WANDB_SILENT=false
    brings it back)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_drop_chatter)
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
    os.environ.setdefault("WANDB_SILENT", "true")


def _pruned(value: Any) -> Any:
    """`value` without its null leaves and empty mappings or lists (they set nothing)."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {} and v != []}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("...\n").strip()


def _as_yaml(value: Any) -> str:
    """YAML with collections of plain values on one line (`image_size: [384, 384]`)."""
    if not isinstance(value, dict):
        return _flow(value)
    lines = []
    for key, item in value.items():
        inner = item.values() if isinstance(item, dict) else item if isinstance(item, list) else []
        if any(isinstance(v, dict | list) for v in inner):
            dump = yaml.safe_dump({key: item}, default_flow_style=None, sort_keys=False, width=1000)
            lines.append(dump.rstrip())
        else:
            lines.append(f"{key}: {_flow(item)}")
    return "\n".join(lines)


def config_tree(cfg: DictConfig, choices: dict[str, str] | None = None) -> Tree:
    """The resolved config, one branch per top-level key (groups first, in data-flow order, each
    with the option chosen), without null or empty values."""
    choices = choices or {}
    tree = Tree("config", guide_style="dim")
    values = _pruned(OmegaConf.to_container(cfg, resolve=True))
    keys = [k for k in ORDER if k in values] + [k for k in values if k not in ORDER]
    for key in keys:
        node = values[key]
        label = f"[bold]{key}[/]" + (f" ({escape(choices[key])})" if key in choices else "")
        if isinstance(node, dict):
            syntax = Syntax(_as_yaml(node), "yaml", theme="ansi_dark", word_wrap=True)
            tree.add(label).add(syntax)
        else:
            tree.add(f"{label}: {escape(_as_yaml(node))}")
    for key in [k for k in choices if k in cfg and k not in values]:  # sets nothing: logger=none
        tree.add(f"[bold]{key}[/] ({escape(choices[key])})")
    return tree


def print_config_tree(
    cfg: DictConfig, console: Console | None = None, choices: dict[str, str] | None = None
) -> str:
    """Print `config_tree`; returns it as plain text (the run folder's `CONFIG_TREE`)."""
    tree = config_tree(cfg, choices)
    (console or Console()).print(tree)
    plain = Console(file=io.StringIO(), width=1000, color_system=None)
    plain.print(tree)
    return "\n".join(line.rstrip() for line in plain.file.getvalue().splitlines()) + "\n"


class ParameterSummary(RichModelSummary):
    """Lightning's table of the model's parameters without its FLOPs, which it counts only for a
    module with an `example_input_array` (0 otherwise)."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [(name, cells) for name, cells in summary_data if name != "FLOPs"]
        table = Table(header_style="bold magenta")
        for name, _ in columns:
            table.add_column(name, justify="right" if name == "Params" else "left")
        for row in zip(*(cells for _, cells in columns), strict=True):
            table.add_row(*row)
        print_table(table)
        frozen = total_parameters - trainable_parameters
        Console().print(
            f"parameters: {count(trainable_parameters).strip()} trainable, "
            f"{count(frozen).strip()} frozen "
            f"({get_formatted_model_size(model_size)} MB)",
            highlight=False,
        )


def route_library_logs() -> None:
    """Lightning's messages go to the root logger's handlers (Hydra's console and log file), once
    logging is configured; before that they keep their own console handler."""
    if not logging.getLogger().handlers:
        return
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True

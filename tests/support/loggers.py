"""A Lightning logger that keeps what it is given, to compare what callbacks log."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import Logger


class KeptRows(Logger):
    """Every `log_metrics` call as a (step, metrics) row, in order."""

    name = "kept"
    version = 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

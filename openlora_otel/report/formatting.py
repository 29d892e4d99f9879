"""How the report writes a value: a number, a count, a duration, a share, the title, a shortened name.

The text summary, the PNG and the HTML page write the same cells of a run (its steps, last loss,
time), so they share these writers: a value reads the same printed, on the picture and on the page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from openlora_otel.report.model import Run

__all__ = [
    "NOT_AVAILABLE",
    "duration",
    "integer",
    "number",
    "percent",
    "report_title",
    "shortened",
]

# What the table shows for a value the run does not have.
NOT_AVAILABLE = "n/a"


def report_title(runs: Sequence[Run], serving: Sequence[Any] = ()) -> str:
    if serving:
        adapters = ", ".join(dict.fromkeys(item.adapter.name for item in serving))
        return f"Adapter report: {shortened(adapters, 80)}"
    names = ", ".join(dict.fromkeys(run.name for run in runs))
    return f"Training report: {shortened(names, 80)}"


def shortened(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def integer(value: int | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:,}"


def number(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.4g}"


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return NOT_AVAILABLE
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def percent(share: float | None) -> str:
    return NOT_AVAILABLE if share is None else f"{100 * share:.1f} %"

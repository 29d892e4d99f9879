"""``openlora-otel report``: curves of runs, from history files or a Prometheus (openlora_otel.report)."""

from __future__ import annotations

from typing import Any

from openlora_otel import report


def register(commands: Any) -> None:
    report.add_parser(commands).set_defaults(func=report.main)

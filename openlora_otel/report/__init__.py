"""A picture of one or more runs, from history files or a Prometheus server (``openlora-otel report``).

Reads runs (:mod:`.history`, :mod:`.prometheus`), turns them into curves against the step
(:mod:`.model`, :mod:`.goodput`) and draws a PNG and an HTML page (:mod:`.render`). Not imported by
``import openlora_otel``; matplotlib (the ``report`` extra) only when a picture is drawn.
See docs/architecture.md.
"""

from __future__ import annotations

from openlora_otel.report.model import ReportError, Run

__all__ = ["ReportError", "Run"]

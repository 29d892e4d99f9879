"""A picture of one or more runs, from history files or a Prometheus server (``openlora-otel report``,
:mod:`openlora_otel.commands.report`).

Reads runs (:mod:`.history` for ``OPENLORA_HISTORY_DIR`` files, :mod:`.prometheus`
for a server), turns them into curves against the optimizer step
(:mod:`.model`; where the time went: :mod:`.goodput`) and draws them
(:mod:`.render`: a PNG, :mod:`.png`, and a self-contained HTML page, :mod:`.page`,
both from one :mod:`.drawing`; a run's summary in words: :mod:`.summary`).
Nothing here is imported by ``import openlora_otel``; matplotlib (the
``report`` extra) is imported only when a picture is drawn.
"""

from __future__ import annotations

from openlora_otel.report.model import ReportError, Run

__all__ = ["ReportError", "Run"]

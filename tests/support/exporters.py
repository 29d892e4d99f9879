"""An exporter that records which process exported: forked children must export nothing of their own."""

from __future__ import annotations

import os
from pathlib import Path

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult


class PidFileExporter(MetricExporter):
    """Appends the exporting process's pid to a file: shows who exported."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        with self.path.open("a") as handle:
            handle.write(f"{os.getpid()}\n")
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def exporter_pids(path: Path) -> set[int]:
    return {int(line) for line in path.read_text().split()} if path.exists() else set()

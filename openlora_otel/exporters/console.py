"""Console exporter: periodic dumps of every metric to standard output, for debugging."""

from __future__ import annotations

import sys

from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

from openlora_otel.config import TelemetryConfig
from openlora_otel.exporters.outage import GuardedExporter

__all__ = ["build_console_reader"]


def build_console_reader(config: TelemetryConfig) -> PeriodicExportingMetricReader:
    """A reader that prints every ``OTEL_METRIC_EXPORT_INTERVAL`` milliseconds."""
    exporter = GuardedExporter(ConsoleMetricExporter(out=sys.stdout), describe="console export")
    return PeriodicExportingMetricReader(
        exporter,
        export_interval_millis=config.export_interval_ms,
        export_timeout_millis=config.export_timeout_ms,
    )

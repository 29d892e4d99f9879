"""A wrapper for push exporters: log an outage once, never raise, never export from a forked child.

The SDK logs one error per failed export for the whole outage; the wrapper folds them into one
warning, and one line when exports recover. What it logs, and what the SDK logs on its export
loggers while it is installed, goes through :func:`openlora_otel.redaction.redact`: the SDK's
reasons can quote credentials. See docs/how-to/collector.md.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from openlora_otel.redaction import redact

__all__ = ["GuardedExporter"]

_logger = logging.getLogger("openlora_otel.exporters")

# Loggers the SDK's OTLP exporters report failed exports on (one line per attempt).
_SDK_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.sdk.metrics._internal.export",
)


class _CaptureDuringExport(logging.Filter):
    """Swallows the SDK's per-attempt export errors while our wrapper is exporting, keeping the last one
    (redacted); any other record on those loggers is let through with the secrets redacted."""

    def __init__(self, secrets: frozenset[str]) -> None:
        super().__init__()
        self._active = threading.local()
        self._secrets = secrets
        self.last_message: str | None = None

    def capturing(self, on: bool) -> None:
        self._active.on = on

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self._active, "on", False):
            if record.levelno >= logging.WARNING:
                self.last_message = redact(record.getMessage(), self._secrets)
            return False
        _scrub(record, self._secrets)
        return True


def _scrub(record: logging.LogRecord, secrets: Iterable[str]) -> None:
    """Redact ``record`` in place: its message, and the traceback text a handler would print."""
    message = record.getMessage()
    clean = redact(message, secrets)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact(record.exc_text, secrets)


class GuardedExporter(MetricExporter):
    """Wraps an exporter: never raises, logs the first failure and the recovery, once each,
    and exports nothing from a forked child process.

    ``on_result`` (tests, doctor) is called with every export's success flag.
    ``secrets`` are the credentials to scrub from every message (see
    :meth:`openlora_otel.config.OTLPConfig.secrets`); URL user info in any
    ``scheme://`` form is scrubbed regardless.
    """

    def __init__(
        self,
        inner: MetricExporter,
        *,
        describe: str,
        on_result: Callable[[bool], None] | None = None,
        secrets: Iterable[str] = (),
    ) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._pid = os.getpid()
        self._secrets = frozenset(secrets)
        self._describe = redact(describe, self._secrets)
        self._on_result = on_result
        self._failing = False
        self.failures = 0
        self.successes = 0
        self._filter = _CaptureDuringExport(self._secrets)
        self._loggers = [logging.getLogger(name) for name in _SDK_EXPORT_LOGGERS]
        for logger in self._loggers:
            # First in line: the SDK's own DuplicateFilter (on the gRPC exporter's logger)
            # drops a failure message it saw in the last 20 s, from any exporter, before a
            # filter added after it sees the record; the warning would then say "no reason given".
            logger.filters.insert(0, self._filter)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker): the SDK restarts the export thread
            # there, but its metrics are frozen copies of the parent's. Exporting them
            # would duplicate every series, so the child exports nothing.
            return MetricExportResult.SUCCESS
        self._filter.capturing(True)
        self._filter.last_message = None
        error: BaseException | None = None
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:
            result, error = MetricExportResult.FAILURE, exc
        finally:
            self._filter.capturing(False)
        ok = result is MetricExportResult.SUCCESS
        if ok:
            self.successes += 1
            if self._failing:
                self._failing = False
                _logger.warning("%s recovered; metrics are flowing again", self._describe)
        else:
            self.failures += 1
            if not self._failing:
                self._failing = True
                reason = str(error) if error is not None else self._filter.last_message
                _logger.warning(
                    "%s failed (%s); training continues, export is retried every interval "
                    "and this is logged again only when it recovers",
                    self._describe,
                    redact(reason or "no reason given", self._secrets),
                )
        if self._on_result is not None:
            self._on_result(ok)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        for logger in self._loggers:
            logger.removeFilter(self._filter)
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)

"""OTLP push to an OpenTelemetry Collector, over http/protobuf or gRPC.

Every setting is passed to the SDK exporter explicitly (timeout in seconds,
endpoint, headers, TLS files), so the SDK's own environment parsing never
decides anything. The exporter is wrapped so that an unreachable collector is
reported once, with the SDK's reason, and its recovery once, instead of one
error line per export interval for the whole run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)

from openlora_otel._deps import require
from openlora_otel.config import OTLPConfig, TelemetryConfig

__all__ = ["GuardedExporter", "build_otlp_exporter", "build_otlp_reader", "temporality_for"]

_logger = logging.getLogger(__name__)

# Loggers the SDK's OTLP exporters report failed exports on (one line per attempt).
_SDK_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.sdk.metrics._internal.export",
)

_CUMULATIVE = AggregationTemporality.CUMULATIVE
_DELTA = AggregationTemporality.DELTA


def temporality_for(preference: str) -> dict[type, AggregationTemporality]:
    """The per-instrument temporality map for ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``."""
    table = {
        "cumulative": {},
        "delta": {Counter: _DELTA, ObservableCounter: _DELTA, Histogram: _DELTA},
        "lowmemory": {Counter: _DELTA, Histogram: _DELTA},
    }[preference]
    base: dict[type, AggregationTemporality] = {
        kind: _CUMULATIVE
        for kind in (
            Counter,
            UpDownCounter,
            Histogram,
            ObservableCounter,
            ObservableUpDownCounter,
            ObservableGauge,
        )
    }
    base.update(table)
    return base


def build_otlp_exporter(otlp: OTLPConfig) -> MetricExporter:
    """The SDK OTLP metric exporter for ``otlp.protocol``, configured explicitly."""
    temporality = temporality_for(otlp.temporality)
    if otlp.protocol == "grpc":
        require("opentelemetry.exporter.otlp.proto.grpc", "OTLP over gRPC")
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcExporter,
        )

        endpoint = otlp.endpoint.split("://", 1)[-1]
        credentials = None
        if not otlp.insecure:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(otlp.certificate),
                private_key=_read(otlp.client_key),
                certificate_chain=_read(otlp.client_certificate),
            )
        return GrpcExporter(
            endpoint=endpoint,
            insecure=otlp.insecure,
            credentials=credentials,
            # gRPC metadata keys must be lowercase.
            headers={k.lower(): v for k, v in otlp.headers},
            timeout=otlp.timeout_s,
            compression=grpc.Compression.Gzip
            if otlp.compression == "gzip"
            else grpc.Compression.NoCompression,
            preferred_temporality=temporality,
        )

    require("opentelemetry.exporter.otlp.proto.http", "OTLP over http/protobuf")
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpExporter,
    )

    return HttpExporter(
        endpoint=otlp.endpoint,
        certificate_file=otlp.certificate,
        client_key_file=otlp.client_key,
        client_certificate_file=otlp.client_certificate,
        headers=dict(otlp.headers),
        timeout=otlp.timeout_s,
        compression=Compression.Gzip if otlp.compression == "gzip" else Compression.NoCompression,
        preferred_temporality=temporality,
    )


def build_otlp_reader(config: TelemetryConfig) -> PeriodicExportingMetricReader:
    """A periodic reader pushing to the configured OTLP endpoint.

    One export (the SDK's retries included) is capped at the export interval:
    the next interval retries anyway and, with cumulative temporality, carries
    everything the failed one had. So a collector that comes back gets data
    within two intervals, and no export outlives the shutdown bound by much.
    """
    otlp = config.otlp
    cap_s = config.export_interval_ms / 1000.0
    if otlp.timeout_s > cap_s:
        otlp = dataclasses.replace(otlp, timeout_s=cap_s)
    exporter = GuardedExporter(build_otlp_exporter(otlp), describe=_describe(otlp))
    return PeriodicExportingMetricReader(
        exporter,
        export_interval_millis=config.export_interval_ms,
        export_timeout_millis=config.export_timeout_ms,
    )


def _describe(otlp: OTLPConfig) -> str:
    return f"OTLP {otlp.protocol} export to {otlp.redacted_endpoint()}"


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as handle:
        return handle.read()


class _CaptureDuringExport(logging.Filter):
    """Swallows the SDK's per-attempt export errors while our wrapper is exporting, keeping the last one."""

    def __init__(self) -> None:
        super().__init__()
        self._active = threading.local()
        self.last_message: str | None = None

    def capturing(self, on: bool) -> None:
        self._active.on = on

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self._active, "on", False):
            if record.levelno >= logging.WARNING:
                self.last_message = record.getMessage()
            return False
        return True


class GuardedExporter(MetricExporter):
    """Wraps an exporter: never raises, logs the first failure and the recovery, once each.

    ``on_result`` (tests, doctor) is called with every export's success flag.
    """

    def __init__(
        self,
        inner: MetricExporter,
        *,
        describe: str,
        on_result: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._describe = describe
        self._on_result = on_result
        self._failing = False
        self.failures = 0
        self.successes = 0
        self._filter = _CaptureDuringExport()
        self._loggers = [logging.getLogger(name) for name in _SDK_EXPORT_LOGGERS]
        for logger in self._loggers:
            logger.addFilter(self._filter)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
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
                reason = error or self._filter.last_message or "no reason given"
                _logger.warning(
                    "%s failed (%s); training continues, export is retried every interval "
                    "and this is logged again only when it recovers",
                    self._describe,
                    reason,
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

"""OTLP push to an OpenTelemetry Collector, over http/protobuf or gRPC.

Every setting is passed to the SDK exporter explicitly, so the SDK's own environment parsing decides
nothing; an outage is reported once (:mod:`.guard`). An http/protobuf endpoint with query values is
warned about at setup: libraries log the request line at DEBUG, so a token belongs in a header.
See docs/how-to/collector.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from urllib.parse import urlsplit

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
    PeriodicExportingMetricReader,
)

from openlora_otel._deps import require
from openlora_otel.config import OTLPConfig, TelemetryConfig
from openlora_otel.exporters.outage import GuardedExporter

__all__ = ["build_otlp_exporter", "build_otlp_reader", "temporality_for"]

_logger = logging.getLogger(__name__)


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
            preferred_aggregation=_histogram_aggregation(otlp),
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
        preferred_aggregation=_histogram_aggregation(otlp),
    )


def _histogram_aggregation(otlp: OTLPConfig) -> dict[type, Any]:
    """OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION as the config has it (the exporter would read
    the environment itself): for histograms of the provider without a view of ours (an application's own)."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import (
        ExplicitBucketHistogramAggregation,
        ExponentialBucketHistogramAggregation,
    )

    if otlp.histogram_aggregation == "base2_exponential_bucket_histogram":
        return {Histogram: ExponentialBucketHistogramAggregation()}
    return {Histogram: ExplicitBucketHistogramAggregation()}


def build_otlp_reader(config: TelemetryConfig) -> PeriodicExportingMetricReader:
    """A periodic reader pushing to the configured OTLP endpoint.

    One export (the SDK's retries included) is capped at the export interval:
    the next interval retries anyway and, with cumulative temporality, carries
    everything the failed one had. So a collector that comes back gets data
    within two intervals, and no export outlives the shutdown bound by much.
    """
    otlp = config.otlp
    _warn_of_query_values(otlp)
    cap_s = config.export_interval_ms / 1000.0
    if otlp.timeout_s > cap_s:
        otlp = dataclasses.replace(otlp, timeout_s=cap_s)
    exporter = GuardedExporter(build_otlp_exporter(otlp), describe=_describe(otlp), secrets=otlp.secrets())
    return PeriodicExportingMetricReader(
        exporter,
        export_interval_millis=config.export_interval_ms,
        export_timeout_millis=config.export_timeout_ms,
    )


def _warn_of_query_values(otlp: OTLPConfig) -> None:
    """One warning when the http/protobuf endpoint's query carries values (a token, most likely): they
    are sent in the request line, which urllib3 logs at DEBUG in full. Names only; never a value."""
    if otlp.protocol != "http/protobuf":
        return  # gRPC sends no query: the endpoint is a host and port
    names = []
    for item in urlsplit(otlp.endpoint).query.split("&"):
        name, equals, value = item.partition("=")
        if value or (item and not equals):
            # A bare item (?TOKEN) is all value: named as such, as redaction hides it.
            names.append(name if equals else "a bare value")
    if names:
        _logger.warning(
            "openlora-otel: the OTLP endpoint %s carries query values (%s): they are sent in every request "
            "line, which HTTP libraries log at DEBUG (urllib3: POST /v1/metrics?...); put a token in a "
            'header instead: OTEL_EXPORTER_OTLP_HEADERS="name=value" (docs/how-to/collector.md)',
            otlp.redacted_endpoint(),
            ", ".join(dict.fromkeys(names)),
        )


def _describe(otlp: OTLPConfig) -> str:
    return f"OTLP {otlp.protocol} export to {otlp.redacted_endpoint()}"


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as handle:
        return handle.read()

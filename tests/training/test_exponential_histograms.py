"""Exponential histograms (OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram):
every histogram openlora-otel emits is one, its windows merged into the SDK's exponential aggregation with
counts, sums, minimum and maximum exact; an application's own histograms on the provider follow the variable too."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import yaml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ExponentialHistogram,
    Histogram,
    InMemoryMetricReader,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.names import INFERENCE_METRICS, TRAINING_METRICS, histogram_quantile
from openlora_otel.window_histograms import ExponentialCounts, exponential_merging_works
from tests.support.readings import points

ROOT = Path(__file__).resolve().parents[2]
EXPONENTIAL = {
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "base2_exponential_bucket_histogram",
    "OTEL_METRICS_EXPORTER": "none",
    "OPENLORA_QUIET": "true",
    "OPENLORA_GPU_METRICS": "off",
    "OPENLORA_HOST_METRICS": "false",
}


def _quantile(point, q: float) -> float:
    """The q-quantile of an exponential histogram point: the upper bound of the bucket that holds it."""
    base = 2 ** (2**-point.scale)
    rank = q * point.count - point.zero_count
    seen = 0
    for position, count in enumerate(point.positive.bucket_counts):
        seen += count
        if seen >= rank:
            return base ** (point.positive.offset + position + 1)
    return math.inf


def test_this_sdk_merges_exponential_windows() -> None:
    assert exponential_merging_works()


def test_step_durations_are_an_exponential_histogram_with_exact_counts_sum_and_extremes() -> None:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(EXPONENTIAL), metric_readers=[reader])
    rng = random.Random(7)
    try:
        values = [rng.lognormvariate(-2.0, 0.4) for _ in range(3000)]
        for value in values[:2000]:
            telemetry.training.record_step(loss=1.0, step_time_s=value)
        reader.get_metrics_data()  # two windows: cumulative over both
        for value in values[2000:]:
            telemetry.training.record_step(loss=1.0, step_time_s=value)
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()
    metric = next(
        m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        if m.name == "openlora.training.step.duration"
    )  # fmt: skip
    assert isinstance(metric.data, ExponentialHistogram)
    (point,) = metric.data.data_points
    assert point.count == len(values) and math.isclose(point.sum, math.fsum(values), rel_tol=1e-12)
    assert (point.min, point.max) == (min(values), max(values))
    assert sum(point.positive.bucket_counts) == len(values) and point.zero_count == 0
    # The SDK's own aggregation, fed each value: the same scale, and each quantile within one of its buckets.
    direct = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[direct], views=[View(instrument_name="h", aggregation=ExponentialBucketHistogramAggregation())]
    )
    histogram = provider.get_meter("x").create_histogram("h")
    for value in values:
        histogram.record(value)
    (reference,) = points(direct.get_metrics_data(), "h")
    provider.shutdown()
    assert point.scale == reference.scale
    width = 2 ** (2**-point.scale)
    for q in (0.5, 0.9, 0.99):
        exact = sorted(values)[math.ceil(q * len(values)) - 1]
        assert _quantile(reference, q) / width <= exact <= _quantile(reference, q)
        assert abs(math.log(_quantile(point, q) / _quantile(reference, q))) <= math.log(width) + 1e-9, q


def test_every_serving_histogram_is_exponential() -> None:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(EXPONENTIAL), metric_readers=[reader])
    try:
        inference = telemetry.inference
        with inference.loading_adapter("a"):
            pass
        for _ in range(5):
            with inference.request("a") as request:
                request.first_token()
                request.tokens(input=12, output=30)
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()
    kinds = {
        m.name: type(m.data)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if isinstance(m.data, (Histogram, ExponentialHistogram))
    }
    histograms = {spec.name for spec in (*TRAINING_METRICS, *INFERENCE_METRICS) if spec.kind == "histogram"}
    served = histograms - {"openlora.training.step.duration"}
    assert served <= set(kinds), sorted(kinds)
    assert {kinds[name] for name in served} == {ExponentialHistogram}, kinds
    (tokens,) = [p for p in points(data, "openlora.inference.token.usage") if p.attributes["gen_ai.token.type"] == "output"]
    assert (tokens.count, tokens.sum, tokens.min, tokens.max) == (5, 150, 30, 30)


def test_an_applications_own_histogram_follows_the_variable_on_the_otlp_exporter() -> None:
    from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
    from opentelemetry.sdk.metrics._internal.aggregation import _ExponentialBucketHistogramAggregation

    from openlora_otel.exporters.otlp import build_otlp_exporter

    config = TelemetryConfig.from_env({**EXPONENTIAL, "OTEL_METRICS_EXPORTER": "otlp"})
    exporter = build_otlp_exporter(config.otlp)
    preferred = exporter._preferred_aggregation[HistogramInstrument]
    assert isinstance(preferred, ExponentialBucketHistogramAggregation)
    assert preferred._create_aggregation.__qualname__.startswith("ExponentialBucketHistogramAggregation")
    assert _ExponentialBucketHistogramAggregation  # the class that aggregation makes
    explicit = build_otlp_exporter(TelemetryConfig.from_env({"OTEL_METRICS_EXPORTER": "otlp"}).otlp)
    assert not isinstance(explicit._preferred_aggregation[HistogramInstrument], ExponentialBucketHistogramAggregation)


def test_zeros_are_kept_one_by_one_and_what_record_would_drop_is_dropped() -> None:
    counts = ExponentialCounts()
    for value in (0.0, 0.0, 0.25, 0.25, 3.0, math.nan, math.inf, -1.0):
        counts.add(value)
    assert counts.count == 5 and (counts.shortest, counts.longest) == (0.0, 3.0)
    assert sorted(counts.counts) == [1, 1, 1, 2] and math.isclose(sum(counts.sums), 3.5)


def test_a_nan_time_to_first_token_costs_no_other_series_its_window() -> None:
    # Found in review: a NaN reached the SDK's exponential aggregation, which raised in the collection
    # and lost every later series' pending window with it.
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(EXPONENTIAL), metric_readers=[reader])
    try:
        inference = telemetry.inference
        with inference.request("a") as request:
            request.first_token(at=math.nan)
        with inference.request("b") as request:
            request.first_token()
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()
    durations = {p.attributes["openlora.adapter.name"]: p for p in points(data, "gen_ai.server.request.duration")}
    assert {name: p.count for name, p in durations.items()} == {"a": 1, "b": 1}
    ttft = {p.attributes["openlora.adapter.name"]: p for p in points(data, "gen_ai.server.time_to_first_token")}
    assert ttft["b"].count == 1 and not math.isnan(ttft["b"].sum)
    assert "a" not in ttft or (ttft["a"].count == 0 and ttft["a"].sum == 0)


def test_an_explicit_window_in_an_exponential_histogram_keeps_count_and_sum_and_bounds() -> None:
    from opentelemetry.context import Context
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    from openlora_otel.window_histograms import BucketCounts, _exponential_classes

    histogram, _ = _exponential_classes()
    from opentelemetry.sdk.metrics import SimpleFixedSizeExemplarReservoir
    from opentelemetry.sdk.metrics._internal.aggregation import AggregationTemporality

    bounds = (0.005, 0.01, 0.1, 1.0)
    counts = BucketCounts(bounds)
    for value in [0.001] * 50 + [0.009] * 5 + [0.2]:  # most values far below the window's mean
        counts.add(value)
    aggregation = histogram({}, SimpleFixedSizeExemplarReservoir, AggregationTemporality.DELTA, 0)
    aggregation.aggregate(Measurement(counts.window(), 0, None, Context()))  # type: ignore[arg-type]
    point = aggregation.collect(AggregationTemporality.CUMULATIVE, 1)
    assert point.count == 56 and math.isclose(point.sum, 50 * 0.001 + 5 * 0.009 + 0.2)
    assert sum(point.negative.bucket_counts) == 0 and (point.min, point.max) == (0.001, 0.2)


def test_the_dashboards_quantile_is_the_packages() -> None:
    """The builder writes the quantile query out (it imports nothing of the package): the same text."""
    import sys

    sys.path.insert(0, str(ROOT / "grafana"))
    try:
        from dashboard_builder.common import histogram_quantile as builders
    finally:
        sys.path.remove(str(ROOT / "grafana"))
    for by in ((), ("job", "instance")):
        inner = lambda series: f"rate({series}[5m])"  # noqa: E731
        assert builders(0.9, "h", by, inner) == histogram_quantile(0.9, "h", by, inner)
    assert histogram_quantile(0.5, "h", (), lambda s: f"rate({s}[1m])") == (
        "histogram_quantile(0.5, sum by (le) (rate(h_bucket[1m])) or sum (rate(h[1m])))"
    )


def test_the_native_histogram_rules_cover_every_histogram() -> None:
    """deploy/prometheus/native-histograms.yml records the _count and _sum of each histogram of openlora_otel.names."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "native-histograms.yml").read_text())
    recorded = {rule["record"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    names = {
        spec.prometheus_collector for spec in (*TRAINING_METRICS, *INFERENCE_METRICS) if spec.kind == "histogram"
    }
    assert len(names) == 6
    assert recorded == {
        **{f"{name}_count": f"histogram_count({name})" for name in names},
        **{f"{name}_sum": f"histogram_sum({name})" for name in names},
    }


@pytest.mark.parametrize("config_file", ["otlp.yml", "central.yml"])
def test_the_shipped_prometheus_configs_load_them(config_file: str) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / config_file).read_text())
    assert "native-histograms.yml" in config["rule_files"]


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_a_loaded_adapters_request_series_exists_at_zero_before_its_first_request(temporality: str) -> None:
    # As with explicit buckets: the series is there at 0, so the first request is a rise rate() sees.
    # Found in review: an empty exponential window made no point at all.
    from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    from openlora_otel.inference import InferenceMetrics, inference_views

    preferred = {} if temporality == "cumulative" else {HistogramInstrument: AggregationTemporality.DELTA}
    reader = InMemoryMetricReader(preferred_temporality=preferred)
    provider = MeterProvider(metric_readers=[reader], views=inference_views(exponential=True))
    metrics = InferenceMetrics(
        provider.get_meter("test"), model="m", window_histogram=True, exponential_histograms=True
    )
    metrics.adapter_loaded("a1", load_time_s=0.5)
    counts = []
    for requests in (0, 1, 0):
        for _ in range(requests):
            with metrics.request("a1"):
                pass
        (point,) = [p for p in points(reader.get_metrics_data(), "gen_ai.server.request.duration")]
        counts.append(point.count)
    provider.shutdown()
    assert counts == ([0, 1, 1] if temporality == "cumulative" else [0, 1, 0])

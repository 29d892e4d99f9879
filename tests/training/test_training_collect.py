"""A collection costs O(buckets), not O(steps), and commits each window exactly once.

The step-duration histogram takes a whole window per collection (setup_telemetry's
provider has ``step_duration_view()``); counts are synchronous counters, so a
collection aborted after the window was taken neither loses nor repeats it.
Timing targets are in ``benchmarks/bench_collect.py``; these tests check exactness
and the number of SDK calls.
"""

from __future__ import annotations

import bisect
import logging

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, MetricsTimeoutError
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.names import STEP_DURATION_BUCKETS
from openlora_otel.training.metrics import TrainingMetrics, step_duration_view
from tests.support.readings import SlowOnce, points, value

# Dyadic step times (exact in binary, so every sum below is exact), spread over
# the first, middle and overflow buckets and over both sides of bucket edges.
STEP_TIMES = (2.0**-11, 0.0625, 0.09375, 0.125, 0.375, 0.3125, 1.5, 48.0, 70.0, 0.5)


def expected(steps: int) -> tuple[list[int], float, float, float]:
    counts = [0] * (len(STEP_DURATION_BUCKETS) + 1)
    total = 0.0
    for i in range(steps):
        t = STEP_TIMES[i % len(STEP_TIMES)]
        counts[bisect.bisect_left(STEP_DURATION_BUCKETS, t)] += 1
        total += t
    used = STEP_TIMES[: min(steps, len(STEP_TIMES))]
    return counts, total, min(used), max(used)


def record(training: TrainingMetrics, steps: int) -> None:
    step = training.record_step
    for i in range(steps):
        step(loss=1.0, tokens=3, samples=1, step_time_s=STEP_TIMES[i % len(STEP_TIMES)])


class CountingRecord:
    """Wraps the histogram instrument to count ``record`` calls (one SDK measurement each)."""

    def __init__(self, instrument) -> None:
        self._instrument = instrument
        self.calls = 0

    def record(self, amount, attributes=None, context=None) -> None:
        self.calls += 1
        self._instrument.record(amount, attributes, context)


@pytest.fixture
def telemetry(memory_reader: InMemoryMetricReader):
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    yield telemetry
    telemetry.shutdown()


def test_a_large_window_is_one_measurement_with_exact_counts_sum_min_max(telemetry, memory_reader) -> None:
    training = telemetry.training
    collection = training._collection
    counting = collection._duration = CountingRecord(collection._duration)
    steps = 200_003
    record(training, steps)
    data = memory_reader.get_metrics_data()
    [point] = points(data, "openlora.training.step.duration")
    counts, total, shortest, longest = expected(steps)
    assert list(point.bucket_counts) == counts
    assert point.count == steps
    assert point.sum == total
    assert (point.min, point.max) == (shortest, longest)
    assert counting.calls == 1  # O(buckets): one measurement for the whole window, not one per step
    assert value(data, "openlora.training.steps") == steps
    assert value(data, "openlora.training.tokens") == 3 * steps

    # The next window adds to the cumulative point, again in one measurement.
    record(training, 7)
    [point] = points(memory_reader.get_metrics_data(), "openlora.training.step.duration")
    more, more_total, _, _ = expected(7)
    assert list(point.bucket_counts) == [a + b for a, b in zip(counts, more, strict=True)]
    assert (point.count, point.sum) == (steps + 7, total + more_total)
    assert counting.calls == 2


def test_every_reader_gets_every_window_once_including_delta_readers() -> None:
    cumulative = InMemoryMetricReader()
    delta = InMemoryMetricReader(
        preferred_temporality={Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA}
    )
    registry = CollectorRegistry(auto_describe=False)
    prometheus = PrometheusMetricReader(registry=registry)
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("none",)), metric_readers=[cumulative, delta, prometheus]
    )
    training = telemetry.training
    record(training, 1000)
    first = cumulative.get_metrics_data()  # this reader takes the window
    record(training, 10)
    second = delta.get_metrics_data()  # this one takes the next, and sees the first too
    [point] = points(first, "openlora.training.step.duration")
    assert (point.count, value(first, "openlora.training.steps")) == (1000, 1000)
    [point] = points(second, "openlora.training.step.duration")
    assert (point.count, value(second, "openlora.training.steps")) == (1010, 1010)
    assert scraped(registry)["openlora_training_step_duration_seconds_count"] == 1010
    assert scraped(registry)["openlora_training_steps_total"] == 1010
    record(training, 5)
    third = delta.get_metrics_data()  # a delta reader: only what came since its last collection
    [point] = points(third, "openlora.training.step.duration")
    assert (point.count, value(third, "openlora.training.steps")) == (5, 5)
    [point] = points(cumulative.get_metrics_data(), "openlora.training.step.duration")
    assert point.count == 1015
    telemetry.shutdown()


def test_a_foreign_meter_replays_exactly(memory_reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[memory_reader])  # no step_duration_view()
    training = TrainingMetrics(provider.get_meter("mine"))
    record(training, 5000)
    data = memory_reader.get_metrics_data()
    [point] = points(data, "openlora.training.step.duration")
    counts, total, _, _ = expected(5000)
    assert list(point.bucket_counts) == counts
    assert point.count == 5000
    assert point.sum == pytest.approx(total, rel=1e-12)
    provider.shutdown()


def test_window_histogram_without_the_view_warns_once_and_replays(
    memory_reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    provider = MeterProvider(metric_readers=[memory_reader])
    training = TrainingMetrics(provider.get_meter("mine"), window_histogram=True)  # but no view
    record(training, 10)
    memory_reader.get_metrics_data()
    record(training, 10)
    record(training, 10)
    [point] = points(memory_reader.get_metrics_data(), "openlora.training.step.duration")
    assert point.count == 1 + 20  # the first window counted as one step, then exact
    assert sum("replayed one by one" in r.getMessage() for r in caplog.records) == 1
    provider.shutdown()


def test_the_view_on_your_own_provider(memory_reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[memory_reader], views=[step_duration_view()])
    training = TrainingMetrics(provider.get_meter("mine"), window_histogram=True)
    collection = training._collection
    counting = collection._duration = CountingRecord(collection._duration)
    record(training, 3000)
    [point] = points(memory_reader.get_metrics_data(), "openlora.training.step.duration")
    assert (point.count, list(point.bucket_counts)) == (3000, expected(3000)[0])
    assert counting.calls == 1
    # Another histogram of that name, recorded the usual way, still aggregates normally.
    other = provider.get_meter("other").create_histogram("openlora.training.step.duration", unit="s")
    other.record(0.003)
    other.record(0.004)
    found = points(memory_reader.get_metrics_data(), "openlora.training.step.duration")
    assert sorted(p.count for p in found) == [2, 3000]
    provider.shutdown()


def scraped(registry: CollectorRegistry) -> dict[str, float]:
    wanted = (
        "openlora_training_steps_total",
        "openlora_training_tokens_total",
        "openlora_training_samples_total",
        "openlora_training_loss_nonfinite_total",
        "openlora_training_step_duration_seconds_count",
        "openlora_training_step_duration_seconds_sum",
    )
    found = {}
    for line in generate_latest(registry).decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            found[name] = float(line.rsplit(" ", 1)[1])
    return found


def test_an_aborted_collection_neither_doubles_nor_loses_the_window() -> None:
    registry = CollectorRegistry(auto_describe=False)
    reader = PrometheusMetricReader(registry=registry)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[reader])
    training = telemetry.training
    SlowOnce(telemetry.meter, seconds=0.3)
    for i in range(1000):
        training.record_step(loss=float("nan") if i % 10 == 0 else 1.0, tokens=7, samples=2, step_time_s=0.5)
    with pytest.raises(MetricsTimeoutError):
        reader.collect(timeout_millis=100)  # takes the window, then times out
    exact = {
        "openlora_training_steps_total": 1000,
        "openlora_training_tokens_total": 7000,
        "openlora_training_samples_total": 2000,
        "openlora_training_loss_nonfinite_total": 100,
        "openlora_training_step_duration_seconds_count": 1000,
        "openlora_training_step_duration_seconds_sum": 500.0,
    }
    assert scraped(registry) == exact  # not doubled (the SDK's observable counters would be)
    assert scraped(registry) == exact  # and no counter reset after it
    training.record_step(tokens=1, step_time_s=0.5)
    after = scraped(registry)
    assert after["openlora_training_steps_total"] == 1001
    assert after["openlora_training_tokens_total"] == 7001
    assert after["openlora_training_step_duration_seconds_count"] == 1001
    telemetry.shutdown()


def test_an_aborted_collection_on_a_foreign_meter_is_exact_too(memory_reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[memory_reader])
    meter = provider.get_meter("mine")
    training = TrainingMetrics(meter)
    SlowOnce(meter, seconds=0.3)
    record(training, 500)
    with pytest.raises(MetricsTimeoutError):
        memory_reader.collect(timeout_millis=100)
    for _ in range(2):
        data = memory_reader.get_metrics_data()
        assert value(data, "openlora.training.steps") == 500
        assert value(data, "openlora.training.tokens") == 1500
        [point] = points(data, "openlora.training.step.duration")
        assert point.count == 500
    provider.shutdown()


def test_no_sdk_warning_when_collections_find_nothing_new(telemetry, memory_reader, caplog) -> None:
    caplog.set_level(logging.WARNING)
    telemetry.training.record_step(loss=1.0, tokens=1, step_time_s=0.1)
    for _ in range(3):
        memory_reader.get_metrics_data()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []

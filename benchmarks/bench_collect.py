"""One collection after N unscraped steps: per-step replay vs one merged window, side by side.

- replay: ``TrainingMetrics`` on a provider without ``step_duration_view()`` (any
  foreign meter, and the only path before it existed): every step's duration is
  recorded into the SDK histogram at collection, one ``record`` call per step.
- merged: the provider ``setup_telemetry`` builds: the histogram takes the whole
  window's buckets, sum, min and max as one measurement.

For each N the steps are recorded first (not timed), then one collection is timed
(wall clock), through an in-memory reader (no timeout) and through the Prometheus
reader as a scrape sees it (the SDK's 10 s collect timeout applies: past it the
scrape fails, which is an HTTP 500 on the real endpoint). Every merged result is
checked exact: count, every bucket count, sum, min and max. Target: under 50 ms
after 2,000,000 steps.

    python benchmarks/bench_collect.py [--steps 100000,400000,2000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import bisect
import gc
import statistics
import time

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider, MetricsTimeoutError
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import View
from prometheus_client import CollectorRegistry, generate_latest

from openlora_otel.names import STEP_DURATION_BUCKETS
from openlora_otel.training.metrics import TrainingMetrics, step_duration_view

# Dyadic step times: every sum is exact in binary, so "exact" can mean equal.
STEP_TIMES = (2.0**-11, 0.0625, 0.09375, 0.375, 0.3125, 1.5, 48.0, 70.0, 0.5, 0.125)


class KeepingReader(MetricReader):
    """A reader that keeps the last collection and is never timed out (to time a long replay fully)."""

    def __init__(self) -> None:
        super().__init__()
        self.data = None

    def _receive_metrics(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> None:
        self.data = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def build(merged: bool, reader: MetricReader) -> tuple[MeterProvider, TrainingMetrics]:
    views: list[View] = [step_duration_view()] if merged else []
    provider = MeterProvider(metric_readers=[reader], views=views, shutdown_on_exit=False)
    return provider, TrainingMetrics(provider.get_meter("bench"), window_histogram=merged)


def record(training: TrainingMetrics, steps: int) -> None:
    step = training.record_step
    times = STEP_TIMES
    n = len(times)
    for i in range(steps):
        step(loss=1.0, tokens=512, samples=4, step_time_s=times[i % n])


def expected(steps: int) -> tuple[list[int], float, float, float]:
    counts = [0] * (len(STEP_DURATION_BUCKETS) + 1)
    full, rest = divmod(steps, len(STEP_TIMES))
    total = 0.0
    for i, t in enumerate(STEP_TIMES):
        k = full + (1 if i < rest else 0)
        counts[bisect.bisect_left(STEP_DURATION_BUCKETS, t)] += k
        total += k * t
    used = STEP_TIMES[: min(steps, len(STEP_TIMES))]
    return counts, total, min(used), max(used)


def histogram_point(data):
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "openlora.training.step.duration":
                    return metric.data.data_points[0]
    raise AssertionError("no step-duration histogram")


def time_in_memory(merged: bool, steps: int) -> tuple[float, str]:
    reader = KeepingReader()
    provider, training = build(merged, reader)
    record(training, steps)
    gc.collect()
    started = time.perf_counter()
    reader.collect(timeout_millis=3_600_000)
    took = time.perf_counter() - started
    point = histogram_point(reader.data)
    counts, total, shortest, longest = expected(steps)
    exact = list(point.bucket_counts) == counts and point.count == steps and point.sum == total
    minmax = (point.min, point.max) == (shortest, longest)
    check = "exact" if exact and minmax else ("counts+sum exact, min/max not" if exact else "NOT EXACT")
    if not exact and abs(point.sum - total) <= 1e-9 * total and list(point.bucket_counts) == counts:
        check = "counts exact, sum within 1e-9" + ("" if minmax else ", min/max = bucket means")
    provider.shutdown()
    return took, check


def time_scrape(merged: bool, steps: int) -> tuple[float, str]:
    registry = CollectorRegistry(auto_describe=False)
    reader = PrometheusMetricReader(registry=registry)
    provider, training = build(merged, reader)
    record(training, steps)
    gc.collect()
    started = time.perf_counter()
    try:
        text = generate_latest(registry).decode()
        count = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("openlora_training_step_duration_seconds_count")
        ]
        outcome = "count exact" if count == [steps] else f"WRONG count {count}"
    except MetricsTimeoutError:
        outcome = "collect timed out (HTTP 500)"
    took = time.perf_counter() - started
    provider.shutdown()
    return took, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="100000,400000,2000000", help="comma-separated step counts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds for the merged path (replay runs once)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.steps.split(",")]

    print("one collection after N unscraped steps (wall time)")
    print(f"  {'N':>9}  {'reader':<10}{'replay':>12}  {'merged':>10}  {'ratio':>8}  checks")
    for steps in sizes:
        replay_mem, replay_check = time_in_memory(False, steps)
        merged_mem = [time_in_memory(True, steps) for _ in range(args.rounds)]
        merged_s = statistics.median(t for t, _ in merged_mem)
        checks = {c for _, c in merged_mem}
        print(
            f"  {steps:>9}  {'in-memory':<10}{replay_mem * 1e3:>9.1f} ms  {merged_s * 1e3:>7.2f} ms"
            f"  {replay_mem / merged_s:>7.0f}x  replay: {replay_check}; merged: {', '.join(sorted(checks))}"
        )
        replay_scrape, replay_outcome = time_scrape(False, steps)
        merged_scrapes = [time_scrape(True, steps) for _ in range(args.rounds)]
        merged_scrape = statistics.median(t for t, _ in merged_scrapes)
        outcomes = {o for _, o in merged_scrapes}
        print(
            f"  {steps:>9}  {'scrape':<10}{replay_scrape * 1e3:>9.1f} ms  {merged_scrape * 1e3:>7.2f} ms"
            f"  {replay_scrape / merged_scrape:>7.0f}x  replay: {replay_outcome}; merged: {', '.join(sorted(outcomes))}"
        )
        if steps >= 2_000_000:
            verdict = "OK" if max(merged_s, merged_scrape) < 0.050 else "MISSED"
            print(f"  target: under 50 ms after {steps} steps: {verdict}")


if __name__ == "__main__":
    main()

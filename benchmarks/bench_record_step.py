"""Per-step CPU cost of recording six training values, side by side in one run.

- prometheus_client: the seeds' recipe: three gauges set, two counters incremented,
  one histogram observed per step (six updates).
- naive OpenTelemetry: the same six values as SDK synchronous instrument calls.
- openlora-otel: one ``TrainingMetrics.record_step(...)`` call with the same six values,
  on a provider built as ``setup_telemetry`` builds it (``step_duration_view()``), and
  on a plain provider (any foreign meter), where collection replays every step's duration.

Each variant runs in the same process, interleaved in rounds, measured with
``time.process_time`` (CPU time, so other load on the machine counts less); the
median per-step cost over the rounds is reported, plus ratios. A reader collects
periodically in the OpenTelemetry variants, as in a real run (off the timed loop).

Then RSS growth over one million ``record_step`` calls (target: under 5 MB).

    python benchmarks/bench_record_step.py [--steps 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import resource
import statistics
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from openlora_otel.names import STEP_DURATION_BUCKETS
from openlora_otel.training.metrics import TrainingMetrics, step_duration_view


def prometheus_variant(read_loss=lambda: 2.0, read_grad=lambda: 1.0, data_wait: bool = False):
    """The seeds' recipe; ``read_*`` give the host values (``.item()`` calls in the tensor variant).

    ``data_wait``: a seventh update, the step's wait for data (what ``data_time_s`` adds);
    the window max/min that openlora-otel also keeps have no prometheus_client counterpart
    short of computing them by hand, so that side gets them for free here.
    """
    registry = CollectorRegistry()
    loss = Gauge("openlora_training_loss", "loss", registry=registry)
    grad = Gauge("openlora_gradient_norm", "grad", registry=registry)
    lr = Gauge("openlora_learning_rate", "lr", registry=registry)
    tokens = Counter("openlora_tokens", "tokens", registry=registry)
    samples = Counter("openlora_samples", "samples", registry=registry)
    duration = Histogram("openlora_step_seconds", "step", buckets=STEP_DURATION_BUCKETS, registry=registry)
    wait = Gauge("openlora_data_wait_seconds", "data wait", registry=registry)

    def step(i: int) -> None:
        loss.set(read_loss())
        grad.set(read_grad())
        lr.set(1e-4)
        tokens.inc(512)
        samples.inc(4)
        duration.observe(0.1)

    def step_with_wait(i: int) -> None:
        step(i)
        wait.set(0.01)

    return (step_with_wait if data_wait else step), lambda: None


def naive_otel_variant():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("bench")
    loss = meter.create_gauge("loss")
    grad = meter.create_gauge("grad")
    lr = meter.create_gauge("lr")
    tokens = meter.create_counter("tokens")
    samples = meter.create_counter("samples")
    duration = meter.create_histogram(
        "duration", explicit_bucket_boundaries_advisory=list(STEP_DURATION_BUCKETS)
    )

    def step(i: int) -> None:
        loss.set(2.0)
        grad.set(1.0)
        lr.set(1e-4)
        tokens.add(512)
        samples.add(4)
        duration.record(0.1)

    return step, reader.collect


def openlora_training(reader: InMemoryMetricReader, merged: bool = True) -> TrainingMetrics:
    """As ``setup_telemetry`` builds it (merged), or on a provider without the view (replay)."""
    provider = MeterProvider(metric_readers=[reader], views=[step_duration_view()] if merged else [])
    return TrainingMetrics(provider.get_meter("bench"), window_histogram=merged)


def openlora_variant(merged: bool = True, data_wait: bool = False):
    reader = InMemoryMetricReader()
    record = openlora_training(reader, merged).record_step

    def step(i: int) -> None:
        record(loss=2.0, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1)

    def step_with_wait(i: int) -> None:
        record(
            loss=2.0, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1, data_time_s=0.01
        )

    return (step_with_wait if data_wait else step), reader.collect


def prometheus_tensor_variant():
    """The seeds' recipe when loss and grad norm are tensors: ``.item()`` each (a device sync on a GPU)."""
    import torch

    loss, grad = torch.tensor(2.0), torch.tensor(1.0)
    return prometheus_variant(loss.item, grad.item)


def openlora_tensor_variant():
    """The same call with loss and grad norm as (CPU) torch tensors: the deferred path."""
    import torch

    reader = InMemoryMetricReader()
    record = openlora_training(reader).record_step
    loss, grad = torch.tensor(2.0), torch.tensor(1.0)

    def step(i: int) -> None:
        record(loss=loss, grad_norm=grad, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1)

    return step, reader.collect


def time_variant(step, collect, steps: int, collect_every: int) -> tuple[float, float]:
    """CPU seconds per step of the loop, and of the collections between chunks (timed apart)."""
    total = 0.0
    collecting = 0.0
    done = 0
    while done < steps:
        chunk = min(collect_every, steps - done)
        gc.disable()
        started = time.process_time()
        for i in range(chunk):
            step(i)
        total += time.process_time() - started
        gc.enable()
        started = time.process_time()
        collect()
        collecting += time.process_time() - started
        done += chunk
    return total / steps, collecting / steps


def rss_mb() -> float:
    """Current resident set size (not the peak, which earlier variants may have set)."""
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * resource.getpagesize() / (1024 * 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-steps", type=int, default=1_000_000)
    args = parser.parse_args()

    variants = {
        "prometheus_client (6 updates)": prometheus_variant(),
        "naive OpenTelemetry (6 calls)": naive_otel_variant(),
        "openlora-otel record_step": openlora_variant(),
        "openlora-otel, any meter (replay)": openlora_variant(merged=False),
        "prometheus_client + data wait (7)": prometheus_variant(data_wait=True),
        "openlora-otel + data_time_s": openlora_variant(data_wait=True),
    }
    with contextlib.suppress(ImportError):  # torch is optional
        variants["prometheus_client, tensor .item()"] = prometheus_tensor_variant()
        variants["openlora-otel, tensor loss/grad"] = openlora_tensor_variant()
    results: dict[str, list[float]] = {name: [] for name in variants}
    collecting: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (step, collect) in variants.items():
            per_step, per_step_collect = time_variant(step, collect, args.steps, collect_every=10_000)
            results[name].append(per_step)
            collecting[name].append(per_step_collect)

    medians = {name: statistics.median(values) * 1e6 for name, values in results.items()}
    collect_medians = {name: statistics.median(values) * 1e6 for name, values in collecting.items()}
    base = medians["prometheus_client (6 updates)"]
    ours = medians["openlora-otel record_step"]
    print(f"CPU time per step, median of {args.rounds} rounds x {args.steps} steps")
    print(f"  {'':<36}{'step path':>10}{'collection':>12}  (collection: per step, off the training thread)")
    for name, micros in medians.items():
        print(f"  {name:<36}{micros:8.3f} us{collect_medians[name]:9.3f} us")
    print(f"ratio openlora-otel / prometheus_client: {ours / base:.2f}  (target <= 1.0)")
    ratio = medians["openlora-otel + data_time_s"] / medians["prometheus_client + data wait (7)"]
    print(f"ratio with the data wait, openlora-otel / prometheus_client: {ratio:.2f}  (target <= 1.0)")
    if "openlora-otel, tensor loss/grad" in medians:
        ratio = medians["openlora-otel, tensor loss/grad"] / medians["prometheus_client, tensor .item()"]
        print(f"ratio with CPU tensors, openlora-otel / prometheus_client + .item(): {ratio:.2f}")
    print(f"ratio openlora-otel / naive OpenTelemetry: {ours / medians['naive OpenTelemetry (6 calls)']:.2f}")

    step, collect = openlora_variant()
    for i in range(10_000):  # warm up allocations before the baseline
        step(i)
    collect()
    gc.collect()
    before = rss_mb()
    for i in range(args.memory_steps):
        step(i)
        if i % 100_000 == 99_999:
            collect()
    gc.collect()
    print(
        f"RSS over {args.memory_steps} record_step calls: {before:.1f} MB -> {rss_mb():.1f} MB, "
        f"growth {rss_mb() - before:.2f} MB (target < 5 MB)"
    )


if __name__ == "__main__":
    main()

"""GPU collection cost with a fake NVML at realistic latency, side by side, and proof it stays off the training thread.

For 1 and 8 GPUs, with every NVML call taking ``--latency-us`` (50 µs default;
real calls take tens of µs to a few ms):

1. One snapshot, batched vs per value: the same values read through one
   ``nvmlDeviceGetFieldValues`` call per GPU, or (as before batching) each
   through its own call; NVML calls, values and time per snapshot.
2. One collection of all GPU instruments: one shared snapshot per collection
   vs what a callback-per-instrument design does (each callback does its own
   NVML round trip), simulated by turning snapshot sharing off.

Then a training loop calls ``record_step`` on the main thread while a reader
collects on another thread and XID errors arrive, and the fake NVML reports
which threads called it.

    python benchmarks/bench_gpu_collect.py [--latency-us 50] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel.hardware import gpu_snapshot, gpu_thread
from openlora_otel.hardware.gpu import GpuCollector, GpuMetrics
from openlora_otel.training.metrics import TrainingMetrics
from tests.support.fake_nvml import FakeNvml, h100s

OLD_CALLS_PER_GPU = 12  # the snapshot before batching: one call per value


class ThreadRecordingNvml(FakeNvml):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: dict[str, int] = {}

    def _call(self, name, gpu=None):
        thread = threading.current_thread().name
        self.threads[thread] = self.threads.get(thread, 0) + 1
        super()._call(name, gpu)


def one_collection(gpus: int, latency_s: float, shared: bool, repeat: int) -> tuple[float, float]:
    fake = FakeNvml(h100s(gpus), latency_s=latency_s)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    GpuMetrics(provider.get_meter("bench"), GpuCollector(fake, devices="all", torch_devices=lambda: None))
    fresh = gpu_thread.FRESH_FOR_S
    times, calls = [], []
    try:
        gpu_thread.FRESH_FOR_S = fresh if shared else 0.0
        reader.get_metrics_data()  # discovery
        for _ in range(repeat):
            time.sleep(fresh if shared else 0)  # the next collection needs a new snapshot
            fake.calls.clear()
            started = time.perf_counter()
            reader.get_metrics_data()
            times.append(time.perf_counter() - started)
            calls.append(fake.total_calls)
    finally:
        gpu_thread.FRESH_FOR_S = fresh
        provider.shutdown()
    return statistics.median(times), statistics.median(calls)


def one_snapshot(gpus: int, latency_s: float, batched: bool, repeat: int) -> tuple[float, float, float]:
    """Median time, NVML calls and values of one snapshot (after the first, which discovers)."""
    cards = h100s(gpus)
    if not batched:
        for card in cards:
            card.unsupported.add("field_values")  # every value through its own call
    fake = FakeNvml(cards, latency_s=latency_s, driver="580.82.07")
    collector = GpuCollector(fake, devices="all", torch_devices=lambda: None)
    collector.snapshot()
    times, calls, values = [], [], []
    for _ in range(repeat):
        fake.calls.clear()
        started = time.perf_counter()
        snapshot = collector.snapshot()
        times.append(time.perf_counter() - started)
        calls.append(fake.total_calls)
        values.append(sum(len(_flat(r.values)) for r in snapshot.readings))
    return statistics.median(times), statistics.median(calls), statistics.median(values)


def _flat(values: dict) -> list:
    """Count the numbers a reading holds (tuples such as (used, total) count per element)."""
    out: list = []
    for key, value in values.items():
        if key == "xid":
            continue
        out.extend(value if isinstance(value, tuple) else (value.values() if isinstance(value, dict) else [value]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    latency = args.latency_us / 1e6
    print(f"one snapshot, fake NVML at {args.latency_us:g} us per call, median of {args.repeat}")
    print(
        f"{'GPUs':>5}{'batched ms':>12}{'calls':>7}{'values':>8}{'per-value ms':>14}{'calls':>7}{'values':>8}"
        f"{'ratio':>8}{'calls/GPU':>11}"
    )
    for count in (1, 8):
        batched_t, batched_c, batched_v = one_snapshot(count, latency, True, args.repeat)
        single_t, single_c, single_v = one_snapshot(count, latency, False, args.repeat)
        print(
            f"{count:>5}{batched_t * 1e3:>12.2f}{batched_c:>7.0f}{batched_v:>8.0f}{single_t * 1e3:>14.2f}"
            f"{single_c:>7.0f}{single_v:>8.0f}{single_t / batched_t:>7.1f}x"
            f"{(batched_c - 1) / count:>6.1f} vs {(single_c - 1) / count:.1f}"
        )
    print(
        f"  (calls/GPU: batched vs per value, the XID drain not counted; before this change a snapshot made "
        f"{OLD_CALLS_PER_GPU} calls per GPU for 12 values)"
    )
    print(
        f"one collection of all GPU instruments, fake NVML at {args.latency_us:g} us per call, median of {args.repeat}"
    )
    print(f"{'GPUs':>5}{'shared ms':>12}{'calls':>8}{'per-instrument ms':>20}{'calls':>8}{'ratio':>8}")
    for count in (1, 8):
        shared_t, shared_c = one_collection(count, latency, True, args.repeat)
        naive_t, naive_c = one_collection(count, latency, False, args.repeat)
        print(
            f"{count:>5}{shared_t * 1e3:>12.2f}{shared_c:>8.0f}{naive_t * 1e3:>20.2f}{naive_c:>8.0f}{naive_t / shared_t:>7.1f}x"
        )

    fake = ThreadRecordingNvml(h100s(8), latency_s=latency)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("bench")
    GpuMetrics(meter, GpuCollector(fake, devices="all", torch_devices=lambda: None))
    training = TrainingMetrics(meter)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(0.05):
            reader.get_metrics_data()

    scraper = threading.Thread(target=scrape, name="scraper")
    scraper.start()
    threading.current_thread().name = "training"
    started = time.perf_counter()
    steps = 0
    while time.perf_counter() - started < 2.0:
        training.record_step(loss=1.0, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4)
        steps += 1
        if steps % 10_000 == 0:
            fake.inject_xid(fake.gpus[steps // 10_000 % 8], 79)  # the driver reports an XID meanwhile
    stop.set()
    scraper.join()
    gpu_time = gpu_snapshot.time
    later = type("Later", (), {"monotonic": staticmethod(lambda: gpu_time.monotonic() + 1.0)})
    try:  # one more collection a snapshot later drains what arrived after the last one
        gpu_snapshot.time = gpu_thread.time = later
        reader.get_metrics_data()
    finally:
        gpu_snapshot.time = gpu_thread.time = gpu_time
    provider.shutdown()
    on_training = fake.threads.get("training", 0)
    print(f"{steps} record_step calls on the training thread while collecting every 50 ms:")
    print(f"  NVML calls by thread: {dict(sorted(fake.threads.items()))}")
    print(f"  NVML calls on the training thread: {on_training}")
    print(f"  XID events injected {steps // 10_000}, left undrained {len(fake.xid_queue)}")


if __name__ == "__main__":
    main()

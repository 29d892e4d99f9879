"""GPU collection cost with a fake NVML at realistic latency, side by side, and proof it stays off the training thread.

For 1 and 8 GPUs, with every NVML call taking ``--latency-us`` (50 µs default;
real calls take tens of µs to a few ms), one collection of all GPU instruments:

- openlora-otel: one shared snapshot per collection;
- per-instrument: what a callback-per-instrument design does (each callback
  does its own NVML round trip), simulated by turning snapshot sharing off.

Then a training loop calls ``record_step`` on the main thread while a reader
collects on another thread, and the fake NVML reports which threads called it.

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

from openlora_otel import gpu
from openlora_otel.gpu import GpuCollector, GpuMetrics
from openlora_otel.training import TrainingMetrics
from tests.fake_nvml import FakeNvml, h100s


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
    fresh = gpu._FRESH_FOR_S
    times, calls = [], []
    try:
        gpu._FRESH_FOR_S = fresh if shared else 0.0
        reader.get_metrics_data()  # discovery
        for _ in range(repeat):
            time.sleep(fresh if shared else 0)  # the next collection needs a new snapshot
            fake.calls.clear()
            started = time.perf_counter()
            reader.get_metrics_data()
            times.append(time.perf_counter() - started)
            calls.append(fake.total_calls)
    finally:
        gpu._FRESH_FOR_S = fresh
        provider.shutdown()
    return statistics.median(times), statistics.median(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    latency = args.latency_us / 1e6
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
    stop.set()
    scraper.join()
    provider.shutdown()
    on_training = fake.threads.get("training", 0)
    print(f"{steps} record_step calls on the training thread while collecting every 50 ms:")
    print(f"  NVML calls by thread: {dict(sorted(fake.threads.items()))}")
    print(f"  NVML calls on the training thread: {on_training}")


if __name__ == "__main__":
    main()

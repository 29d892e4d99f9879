"""GpuMetrics on a fake NVML, read in memory: a collector and reader to build, the series to read, and
the GPU snapshots' clock that the tests step (tests/conftest.py's ``stepped_time`` and ``collect`` fixtures)."""

from __future__ import annotations

import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel.hardware import gpu_reads, gpu_snapshot, gpu_thread
from openlora_otel.hardware.gpu import GpuCollector, GpuMetrics
from tests.support.fake_nvml import FakeNvml
from tests.support.readings import points

# The modules whose ``time`` is the GPU snapshots' clock: when one is taken and how old it is (gpu_snapshot,
# gpu_thread), when the PCIe link is read again and the time between GPM samples (gpu_reads).
CLOCKED = (gpu_snapshot, gpu_thread, gpu_reads)


class SteppedTime:
    """The GPU snapshots' clock, moved on by the tests: each collect() starts a new collection period."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


def build(fake: FakeNvml, **kwargs):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    kwargs.setdefault("devices", "all")
    allocator = kwargs.pop("allocator", list)
    collector = GpuCollector(fake, pid=42, torch_devices=lambda: None, **kwargs)
    metrics = GpuMetrics(provider.get_meter("test"), collector, allocator_stats=allocator)
    return reader, metrics


def series(data, name: str) -> list[tuple[dict, float]]:
    return [(dict(p.attributes), p.value) for p in points(data, name)]

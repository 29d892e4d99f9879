"""GpuMetrics on a fake NVML, read in memory: a collector and reader to build, the series to read, and
gpu_snapshot.py's clock that the tests step (tests/conftest.py's ``stepped_time`` and ``collect`` fixtures)."""

from __future__ import annotations

import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel.hardware.gpu import GpuCollector, GpuMetrics
from tests.support.fake_nvml import FakeNvml
from tests.support.readings import points


class SteppedTime:
    """gpu.py's clock, moved on by the tests: each collect() starts a new collection period."""

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
    metrics._pid = 42
    return reader, metrics


def series(data, name: str) -> list[tuple[dict, float]]:
    return [(dict(p.attributes), p.value) for p in points(data, name)]

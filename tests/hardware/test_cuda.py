"""On a CUDA machine: the step path and the collection never sync, with extremes and the guard on.

Skipped without CUDA (CI has none). ``torch.cuda.set_sync_debug_mode("error")``
makes any synchronizing call raise, on whichever thread makes it.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.training.guard import DivergenceGuard
from tests.support.readings import value

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _wait_for(reader: InMemoryMetricReader, name: str, timeout: float = 10.0) -> object:
    """Collect until a value whose GPU read-back was carried arrives (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = value(reader.get_metrics_data(), name)
        if got is not None:
            return got
        time.sleep(0.05)
    return None


def test_a_cuda_loop_with_extremes_and_the_guard_never_syncs(memory_reader: InMemoryMetricReader, caplog) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    training = telemetry.training
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05))
    device = torch.device("cuda")
    weights = torch.randn(256, 256, device=device, requires_grad=True)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    caplog.set_level(logging.WARNING, logger="openlora_otel")
    try:
        for step in range(1200):
            loss = (weights @ weights).square().mean()
            if step == 700:
                loss = loss * 100.0  # one spike
            loss.backward()
            grad_norm = torch.linalg.vector_norm(weights.grad)
            weights.grad = None
            training.record_step(loss=loss.detach(), grad_norm=grad_norm, tokens=256, data_time_s=0.001)
            if step in (100, 1100):
                # Collections interleaved with the steps; the 1000 steps between them make the
                # step path fold kept tensors on the device (every 512).
                memory_reader.get_metrics_data()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert _wait_for(memory_reader, "openlora.training.loss.max") is not None
    assert not guard.tripped
    # A sync on any thread raises under the debug mode; the collection and the guard's check
    # survive it with a warning, so no openlora-otel warning means no sync anywhere.
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("openlora_otel")]
    telemetry.shutdown()


def test_the_guard_trips_on_cuda_losses_without_a_sync(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    tripped = threading.Event()
    guard = telemetry.training.attach_guard(
        DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05, on_trip=lambda trip: tripped.set())
    )
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            telemetry.training.record_step(loss=torch.full((), math.nan, device="cuda"))
        assert tripped.wait(10)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert guard.trip is not None and guard.trip.reason == "nonfinite_loss"
    telemetry.shutdown()

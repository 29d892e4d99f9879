"""Forked children (DataLoader workers with the fork start method) export nothing of their own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import (
    PeriodicExportingMetricReader,
)

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.exporters.outage import GuardedExporter
from tests.support.exporters import PidFileExporter, exporter_pids
from tests.support.processes import wait_for_child


def run_with_fork(tmp_path: Path, child_body) -> tuple[int, set[int]]:
    pids = tmp_path / "pids"
    reader = PeriodicExportingMetricReader(GuardedExporter(PidFileExporter(pids), describe="test"), 50)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[reader])
    telemetry.training.record_step(loss=1.0, tokens=10)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            child_body(telemetry)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    telemetry.shutdown()
    return child, exporter_pids(pids)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.process  # a forked child
def test_forked_child_runs_for_several_intervals_and_exports_nothing(tmp_path: Path) -> None:
    child, pids = run_with_fork(tmp_path, lambda telemetry: time.sleep(0.5))
    assert os.getpid() in pids
    assert child not in pids


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.process  # a forked child
def test_shutdown_in_forked_child_returns_and_exports_nothing(tmp_path: Path) -> None:
    # A child that shuts down (or runs atexit) must not hang on the parent's
    # Prometheus server thread, which does not exist in the child.
    def body(telemetry) -> None:
        telemetry.training.record_step(loss=2.0)
        telemetry.shutdown(timeout_s=1.0)

    started = time.monotonic()
    child, pids = run_with_fork(tmp_path, body)
    assert time.monotonic() - started < 5
    assert child not in pids


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.process  # a forked child
def test_forked_child_with_prometheus_endpoint_can_shut_down(tmp_path: Path) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0))
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        telemetry.shutdown(timeout_s=1.0)
        os._exit(0)
    assert wait_for_child(child, 10, "shutdown in the forked child hung") == 0
    # The parent's endpoint still serves after the child closed its copy of the socket.
    import urllib.request

    with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
        assert response.status == 200
    telemetry.shutdown()


def test_configured_push_readers_are_guarded() -> None:
    from openlora_otel.exporters.console import build_console_reader
    from openlora_otel.exporters.otlp import build_otlp_reader

    config = TelemetryConfig()
    for reader in (build_console_reader(config), build_otlp_reader(config)):
        try:
            assert isinstance(reader._exporter, GuardedExporter)
        finally:
            reader.shutdown(timeout_millis=100)

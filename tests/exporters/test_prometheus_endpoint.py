"""The pull endpoint behaves like a server: bounded connections, clean shutdown, fork-safe, clear errors."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from openlora_otel import ConfigError, TelemetryConfig, setup_telemetry
from openlora_otel.exporters import prometheus as prometheus_module
from tests.support.otlp_receiver import HangingEndpoint
from tests.support.polling import wait_until
from tests.support.processes import child_env, wait_for_child

ROOT = Path(__file__).resolve().parents[2]


def _config(**changes: object) -> TelemetryConfig:
    return TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False).replace(
        **changes
    )


def _port(telemetry) -> int:
    return int(telemetry.prometheus_url.rsplit(":", 1)[1].split("/")[0])


def _endpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("openlora-otel-prometheus")]


def _connect_idle(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sockets.append(sock)
    return sockets


def test_idle_connections_hold_a_bounded_number_of_threads_and_none_after_shutdown() -> None:
    telemetry = setup_telemetry(config=_config())
    idle = _connect_idle(_port(telemetry), 300)
    try:
        # Every connection is accepted (by the kernel) at once; the server serves at most MAX_CONNECTIONS.
        wait_until(lambda: len(_endpoint_threads()) >= prometheus_module.MAX_CONNECTIONS, 5, interval=0.05)
        assert len(_endpoint_threads()) <= prometheus_module.MAX_CONNECTIONS + 1  # + the accept loop
        started = time.monotonic()
        telemetry.shutdown()
        assert time.monotonic() - started < 2.5
        assert _endpoint_threads() == []
    finally:
        for sock in idle:
            sock.close()


def test_idle_connections_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prometheus_module._Handler, "timeout", 0.3)
    telemetry = setup_telemetry(config=_config())
    idle = _connect_idle(_port(telemetry), 10)
    try:
        # Each idle connection holds a thread for a while...
        assert wait_until(lambda: len(_endpoint_threads()) > 1, 5, interval=0.05)
        # Without a request they are dropped after the connection timeout; their threads end, but for
        # the few kept waiting for the next scrape.
        server = telemetry._prometheus._server
        assert wait_until(lambda: not server._active, 5, interval=0.05)
        assert wait_until(lambda: len(_endpoint_threads()) <= 1 + prometheus_module.IDLE_THREADS, 5, interval=0.05)
        with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
            assert response.status == 200
    finally:
        for sock in idle:
            sock.close()
        telemetry.shutdown()


def test_scrapes_one_after_another_are_served_by_a_waiting_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # A scrape on a fresh thread costs more CPU (docs/benchmarks.md): the thread that served one waits
    # for the next; a burst beyond the waiting threads gets threads of its own, which then end.
    served: list[int] = []
    telemetry = setup_telemetry(config=_config())
    reader = telemetry._prometheus.reader
    original = reader.scrape
    monkeypatch.setattr(reader, "scrape", lambda *a, **k: (served.append(threading.get_ident()), original(*a, **k))[1])
    server = telemetry._prometheus._server
    try:
        for _ in range(10):
            with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
                assert response.status == 200
            # As a scraper's next scrape comes: after this one's thread is back waiting.
            assert wait_until(lambda: server._idle == 1, 5, interval=0.01)
        assert len(set(served)) == 1, served
        idle = _connect_idle(_port(telemetry), 6)  # six connections at once: six threads
        assert wait_until(lambda: len(_endpoint_threads()) >= 7, 5, interval=0.05)
        for sock in idle:
            sock.close()
        assert wait_until(lambda: len(_endpoint_threads()) <= 1 + prometheus_module.IDLE_THREADS, 5, interval=0.05)
    finally:
        telemetry.shutdown()
    assert _endpoint_threads() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.process  # a forked child
def test_a_forked_child_does_not_keep_the_port() -> None:
    telemetry = setup_telemetry(config=_config())
    port = _port(telemetry)
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child: a DataLoader worker that outlives the parent's telemetry
        # fork() returns here after the at-fork hooks ran (ours closes the inherited socket); until the
        # child is scheduled the socket is still open in it, so the parent waits for this byte.
        os.write(started, b"1")
        time.sleep(5)
        os._exit(0)
    try:
        os.close(started)
        assert os.read(ready, 1) == b"1"  # on a loaded machine the child can run seconds after fork()
        os.close(ready)
        telemetry.shutdown()
        # The port is free again while the child still runs, and nobody answers on it.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_shutdown_with_prometheus_and_a_hanging_collector_holds_its_bound() -> None:
    hanging = HangingEndpoint()
    try:
        config = _config(exporters=("prometheus", "otlp"))
        config = config.replace(
            otlp=config.otlp.__class__(endpoint=f"http://127.0.0.1:{hanging.port}/v1/metrics", timeout_s=5.0)
        )
        telemetry = setup_telemetry(config=config)
        telemetry.training.record_step(loss=1.0)
        started = time.monotonic()
        telemetry.shutdown(timeout_s=1.0)
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, elapsed  # the bound, with room for a loaded machine
        assert [t for t in _endpoint_threads() if t.is_alive()] == []
    finally:
        hanging.close()


def test_busy_default_port_says_it_is_the_default_and_how_to_choose() -> None:
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 9464))
    except OSError:
        holder.close()
        pytest.skip("port 9464 is taken on this machine")
    holder.listen()
    try:
        config = TelemetryConfig.from_env({"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"})
        with pytest.raises(ConfigError) as info:
            setup_telemetry(config=config.replace(handle_sigterm=False))
        message = str(info.value)
        assert "default port 9464" in message
        assert "OTEL_EXPORTER_PROMETHEUS_PORT is not set" in message
        assert "OTEL_EXPORTER_PROMETHEUS_PORT=9464" not in message
        assert "0 for any free port" in message
        # Set explicitly, the message names the variable and its value instead.
        config = TelemetryConfig.from_env(
            {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": "9464"}
        )
        with pytest.raises(ConfigError) as info:
            setup_telemetry(config=config.replace(handle_sigterm=False))
        assert "OTEL_EXPORTER_PROMETHEUS_PORT=9464" in str(info.value)
    finally:
        holder.close()


def test_a_failing_collection_answers_500_warns_once_and_the_server_survives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = setup_telemetry(config=_config())
    failing = {"on": True}

    def callback(options):
        if failing["on"]:
            raise RuntimeError("collection broke")
        return []

    telemetry.meter.create_observable_gauge("test.broken", callbacks=[callback])
    # The SDK logs a failing callback itself and goes on; make the whole collection fail instead,
    # as an SDK collect timeout (MetricsTimeoutError) does.
    reader = telemetry._prometheus.reader
    original = reader.collect

    def broken_collect(*args, **kwargs):
        if failing["on"]:
            raise RuntimeError("collection broke")
        return original(*args, **kwargs)

    reader.collect = broken_collect
    caplog.set_level(logging.DEBUG, logger="openlora_otel")
    try:
        for _ in range(3):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(telemetry.prometheus_url, timeout=5)
            assert info.value.code == 500
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "scrape failed" in r.message]
        assert len(warnings) == 1
        failing["on"] = False
        with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
            assert response.status == 200
    finally:
        telemetry.shutdown()


_ANNOUNCE_SCRIPT = """
import logging, sys
if sys.argv[1] == "info":
    logging.basicConfig(level=logging.INFO)
from openlora_otel import setup_telemetry
telemetry = setup_telemetry()
print("URL", telemetry.prometheus_url)
telemetry.shutdown()
"""


@pytest.mark.process
@pytest.mark.parametrize(
    ("mode", "quiet", "expected"),
    [("plain", "", 1), ("plain", "true", 0), ("info", "", 1), ("info", "true", 1)],
)
def test_where_the_metrics_are_is_said_once(mode: str, quiet: str, expected: int) -> None:
    env = child_env(
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT="0", PYTHONPATH=str(ROOT)
    )
    if quiet:
        env["OPENLORA_QUIET"] = quiet
    result = subprocess.run(
        [sys.executable, "-c", _ANNOUNCE_SCRIPT, mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    url = result.stdout.split("URL ", 1)[1].split()[0]
    assert result.stderr.count(url) == expected, result.stderr


def test_closing_the_endpoint_does_not_wait_for_a_poll_interval() -> None:
    # socketserver's default accept loop checks for shutdown every 0.5 s: closing took up to that.
    durations = []
    for _ in range(3):
        endpoint = prometheus_module.build_prometheus(_config())
        started = time.monotonic()
        assert endpoint.close(timeout_s=2.0)
        durations.append(time.monotonic() - started)
    assert min(durations) < 0.2, durations


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.process  # a forked child
def test_fork_while_a_scrape_holds_the_server_lock_does_not_hang_the_child() -> None:
    endpoint = prometheus_module.build_prometheus(_config())
    server = endpoint._server
    assert server is not None
    with server._lock:  # as a scrape thread would, at the moment a DataLoader forks
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child: the fork hook ran before this line
            os._exit(0)
    try:
        assert wait_for_child(child, 10, "the forked child hung in the fork hook") == 0
    finally:
        endpoint.close()


def test_an_address_not_of_this_machine_names_the_host_variable() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never assigned to a local interface.
    with pytest.raises(ConfigError) as info:
        setup_telemetry(config=_config(prometheus_host="192.0.2.1"))
    assert info.value.variable == "OTEL_EXPORTER_PROMETHEUS_HOST"
    assert "192.0.2.1" in str(info.value)

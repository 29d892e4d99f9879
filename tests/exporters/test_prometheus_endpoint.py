"""The pull endpoint behaves like a server: bounded connections, clean shutdown, fork-safe, clear errors."""

from __future__ import annotations

import http.client
import logging
import os
import re
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
from tests.support.prometheus_server import PROMETHEUS_MAJORS

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


def _raw_exchange(port: int, request: bytes) -> tuple[bytes, bool]:
    """Send ``request`` on a new connection; the answer's head, and whether the server then closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        while len(body) < length:
            body += sock.recv(65536)
        sock.settimeout(2)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    return head, closed


def test_scrapes_reuse_one_kept_connection() -> None:
    # Prometheus 2 and 3 keep a target's connection between scrapes when it answers HTTP/1.1.
    telemetry = setup_telemetry(config=_config())
    endpoint = telemetry._prometheus
    server = endpoint._server
    try:
        connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=5)
        for _ in range(5):
            connection.request("GET", "/metrics", headers={"Accept": "text/plain;version=0.0.4"})
            response = connection.getresponse()
            assert response.status == 200 and response.version == 11 and not response.will_close
            assert b"target_info" in response.read()
        assert server._accepted == 1 and endpoint.scrapes == 5
        connection.close()
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize(
    ("request_bytes", "why"),
    [
        (b"GET /metrics HTTP/1.0\r\n\r\n", "HTTP/1.0"),
        (b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "HTTP/1.0 asking to keep it"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "asked to close"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", "a body it does not read"),
    ],
)
def test_a_connection_is_closed_after_its_answer_when(request_bytes: bytes, why: str) -> None:
    endpoint = prometheus_module.build_prometheus(_config())
    try:
        head, closed = _raw_exchange(endpoint.port, request_bytes)
        assert head.startswith(b"HTTP/1.1 200 OK"), why
        assert closed, why
        assert b"\r\nConnection: close" in head, why  # an HTTP/1.1 answer without it would be kept
    finally:
        assert endpoint.close(timeout_s=2.0)


def test_kept_connections_are_bounded_and_end_after_the_idle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prometheus_module, "KEEP_ALIVE_MAX", 2)
    monkeypatch.setattr(prometheus_module, "KEEP_ALIVE_IDLE_S", 0.5)
    endpoint = prometheus_module.build_prometheus(_config())
    server = endpoint._server
    try:
        connections = [http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=5) for _ in range(3)]
        kept = []
        for connection in connections:  # one scrape each, all three open at once
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            response.read()
            kept.append(not response.will_close)
        assert kept == [True, True, False]  # the third would have been a third kept connection
        # Nobody asks again: the kept ones are closed after the idle wait, and their threads end.
        assert wait_until(lambda: not server._active, 5, interval=0.05)
        assert wait_until(lambda: len(_endpoint_threads()) <= 1 + prometheus_module.IDLE_THREADS, 5, interval=0.05)
        for connection in connections:
            connection.close()
    finally:
        assert endpoint.close(timeout_s=2.0)


def test_an_answer_cut_short_closes_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    # A client that stops reading: the write times out part-way, and nothing may follow the part that went
    # out on that connection (a next answer would land inside the first one's body).
    monkeypatch.setattr(prometheus_module._Handler, "timeout", 0.3)
    endpoint = prometheus_module.build_prometheus(_config())
    body = b"x" * (16 << 20)
    monkeypatch.setattr(endpoint.reader, "scrape", lambda *args, **kwargs: (body, "text/plain"))
    server = endpoint._server
    try:
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(1.5)  # not reading: the server's write times out
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            try:
                while chunk := sock.recv(1 << 20):
                    received += chunk
            except ConnectionResetError:  # closed with the second request unread: a reset, as a close
                pass
        assert len(received) < len(body)  # cut short, then closed...
        assert received.count(b"HTTP/1.1 200") <= 1  # ...and no second answer inside the first one's body
        assert wait_until(lambda: not server._active, 5, interval=0.05)
    finally:
        assert endpoint.close(timeout_s=2.0)


def test_close_ends_kept_connections_at_once() -> None:
    endpoint = prometheus_module.build_prometheus(_config())
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=5)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        response.read()
        assert not response.will_close
        started = time.monotonic()
        assert endpoint.close(timeout_s=2.0)  # the kept connection's thread waits for the next request
        assert time.monotonic() - started < 1.0
        assert _endpoint_threads() == []
    finally:
        connection.close()


@pytest.mark.e2e
@PROMETHEUS_MAJORS
def test_prometheus_keeps_one_connection_for_its_scrapes(tmp_path: Path, major: int) -> None:
    from tests.support.prometheus_server import Prometheus, prometheus_binary

    prometheus_binary(major)
    telemetry = setup_telemetry(config=_config(final_scrape_timeout_s=0.0))
    endpoint = telemetry._prometheus
    prometheus = None
    try:
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{endpoint.port}"], scrape_interval="500ms", major=major)
        assert wait_until(lambda: endpoint.scrapes >= 6, 30, interval=0.1), endpoint.scrapes
        # Six scrapes or more (with up, its samples in Prometheus) on the first connection Prometheus opened.
        assert endpoint._server._accepted == 1, (endpoint._server._accepted, endpoint.scrapes)
        assert prometheus.wait_for("up == 1")
    finally:
        if prometheus is not None:
            prometheus.stop()
        telemetry.shutdown()


def test_closing_the_endpoint_does_not_wait_for_a_poll_interval() -> None:
    # socketserver's default accept loop checks for shutdown every 0.5 s: closing took up to that.
    durations = []
    for _ in range(3):
        endpoint = prometheus_module.build_prometheus(_config())
        started = time.monotonic()
        assert endpoint.close(timeout_s=2.0)
        durations.append(time.monotonic() - started)
    assert min(durations) < 0.2, durations


def test_an_idle_endpoint_sleeps_until_a_connection_or_close(monkeypatch: pytest.MonkeyPatch) -> None:
    # socketserver's loop woke every poll interval to look for a shutdown: at 50 ms about 2 ms of CPU a
    # second in every training process, with nobody scraping. Ours waits on the socket and a wake pair.
    waits: list[float | None] = []
    real = prometheus_module.selectors.DefaultSelector

    class Counting(real):  # type: ignore[misc, valid-type]
        def select(self, timeout: float | None = None):  # type: ignore[override]
            waits.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(prometheus_module.selectors, "DefaultSelector", Counting)
    endpoint = prometheus_module.build_prometheus(_config())
    try:
        time.sleep(0.5)
        assert waits == [None]  # one wait, without a timeout, all along
        with urllib.request.urlopen(endpoint.url, timeout=10) as response:
            assert response.status == 200
        assert wait_until(lambda: len(waits) == 2, 5)  # woken by the connection, then waiting again
        assert waits == [None, None]
    finally:
        started = time.monotonic()
        assert endpoint.close(timeout_s=2.0)
    assert time.monotonic() - started < 0.5


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

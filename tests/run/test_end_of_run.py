"""The end of a run: final values reach the scraper, SIGTERM still exports, shutdown always releases.

Subprocess tests run small scripts (``tests/scripts/``-style bodies below) in a
fresh interpreter, because SIGTERM, exit status and atexit only mean something
for a whole process.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.otlp_receiver import HangingEndpoint, HttpReceiver
from tests.support.processes import free_port
from tests.support.prometheus_server import Prometheus, prometheus_binary
from tests.support.sigterm import CHAINED_HANDLER, RECORD_5000, WAIT_FOR_STOP, otlp_child_env, run_child

ROOT = Path(__file__).resolve().parents[2]


def _openlora_threads() -> list[str]:
    """Threads of the endpoint and the SIGTERM guard (an SDK export hung by another test may linger)."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("openlora-otel-prometheus", "openlora-otel-sigterm"))
    ]


def _port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- 1. the end of a run reaches Prometheus -------------------------------------------------
@pytest.mark.e2e
def test_final_values_of_a_short_run_reach_prometheus(tmp_path: Path) -> None:
    prometheus_binary()
    port = free_port()
    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"], scrape_interval="1s")
    try:
        # Prometheus knows the target (down for now) before the run starts, as in a real deployment.
        prometheus.wait_for('up{job="openlora"}', timeout=20)
        config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=port, handle_sigterm=False)
        telemetry = setup_telemetry(config=config)
        training = telemetry.training
        started = time.monotonic()
        steps = 0
        while time.monotonic() - started < 3.0:  # a 3 s run, about three scrapes
            training.record_step(loss=1.0, tokens=10, step_time_s=0.01)
            steps += 1
            time.sleep(0.01)
        assert telemetry.prometheus_url is not None
        shutdown_started = time.monotonic()
        assert telemetry.shutdown()
        waited = time.monotonic() - shutdown_started
        assert waited < 1.5 * 1.0 + 0.5 + 1.0  # about one scrape interval, never the 15 s limit
        final = prometheus.wait_for(f"max_over_time(openlora_training_steps_total[5m]) == {steps}", timeout=10)
        assert final, (steps, prometheus.query("max_over_time(openlora_training_steps_total[5m])"))
        tokens = prometheus.query("max_over_time(openlora_training_tokens_total[5m])")
        assert float(tokens[0]["value"][1]) == 10 * steps
        # The final scrape also says how the run ended, under its run id (after `running` during it).
        outcomes = prometheus.query("last_over_time(openlora_run_outcome[5m])")
        assert {(o["metric"]["openlora_run_outcome"], o["metric"]["openlora_run_id"]) for o in outcomes} == {
            ("running", telemetry.run_id),
            ("finished", telemetry.run_id),
        }
    finally:
        prometheus.stop()


def test_a_run_never_scraped_does_not_wait() -> None:
    config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    telemetry.training.record_step(loss=1.0)
    started = time.monotonic()
    assert telemetry.shutdown()
    assert time.monotonic() - started < 1.0  # the default wait is 15 s: not taken


def test_a_run_shorter_than_a_scrape_interval_waits_for_its_first_scrape_when_one_is_expected() -> None:
    """OPENLORA_PROMETHEUS_EXPECT_SCRAPE=true: a run that ends before Prometheus's first scrape (a run
    that diverges at once, a scrape interval longer than the run) still gets its values scraped."""
    config = TelemetryConfig.from_env(
        {
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(free_port()),
            "OPENLORA_HANDLE_SIGTERM": "false",
            "OPENLORA_PROMETHEUS_EXPECT_SCRAPE": "true",
        }
    )
    assert config.expect_scrape
    telemetry = setup_telemetry(config=config)
    assert telemetry.prometheus_url is not None
    for _ in range(7):
        telemetry.training.record_step(loss=1.0, tokens=10)
    scraped: list[str] = []
    scraper = threading.Timer(0.8, lambda: scraped.append(_scrape(telemetry.prometheus_url)))
    scraper.start()
    started = time.monotonic()
    assert telemetry.shutdown()
    waited = time.monotonic() - started
    scraper.join(5)
    assert 0.7 < waited < 5.0, waited  # until the scrape came, not the 15 s bound
    assert re.search(r"^openlora_training_steps_total(\{[^}]*\})? 7\.0$", scraped[0], re.MULTILINE), scraped[0]


def test_an_expected_scrape_that_never_comes_is_waited_for_within_the_bound() -> None:
    config = TelemetryConfig(
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        handle_sigterm=False,
        expect_scrape=True,
        final_scrape_timeout_s=0.5,
    )
    telemetry = setup_telemetry(config=config)
    started = time.monotonic()
    telemetry.shutdown()
    assert 0.4 < time.monotonic() - started < 2.0


# What Prometheus sends; a plain GET (curl, a browser) does not count as a scrape.
SCRAPER = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}


def _scrape(url: str, headers: dict[str, str] = SCRAPER) -> str:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def test_a_plain_get_is_not_a_scrape_and_does_not_make_shutdown_wait() -> None:
    config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    assert telemetry.prometheus_url is not None
    _scrape(telemetry.prometheus_url, headers={"Accept": "*/*", "User-Agent": "curl/8.5.0"})
    started = time.monotonic()
    telemetry.shutdown()
    assert time.monotonic() - started < 1.0


def test_push_exporters_deliver_before_the_final_scrape_wait() -> None:
    receiver = HttpReceiver()
    try:
        config = TelemetryConfig(
            exporters=("prometheus", "otlp"),
            prometheus_host="127.0.0.1",
            prometheus_port=0,
            handle_sigterm=False,
            final_scrape_timeout_s=3.0,
        )
        config = config.replace(otlp=config.otlp.__class__(endpoint=receiver.http_endpoint + "/v1/metrics"))
        telemetry = setup_telemetry(config=config)
        _scrape(telemetry.prometheus_url)  # type: ignore[arg-type]
        for _ in range(10):
            telemetry.training.record_step(loss=1.0)
        started = time.monotonic()
        waiter = threading.Thread(target=telemetry.shutdown)
        waiter.start()
        # Nobody scrapes again: shutdown waits up to 3 s, but the OTLP export is already there.
        assert receiver.wait_for(lambda r: _steps_received(r) == 10, timeout=2.0)
        assert time.monotonic() - started < 2.0
        waiter.join(10)
    finally:
        receiver.close()


def test_a_scrape_is_counted_before_its_answer_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Otherwise a run that ends the moment its first scrape was read would skip the final wait.
    from openlora_otel.exporters import prometheus as prometheus_module

    seen: list[int] = []
    original = prometheus_module._Handler._send

    def send(self, *args, **kwargs):
        seen.append(self.server._scrapes)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(prometheus_module._Handler, "_send", send)
    config = TelemetryConfig(
        prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False, final_scrape_timeout_s=0
    )
    telemetry = setup_telemetry(config=config)
    _scrape(telemetry.prometheus_url)  # type: ignore[arg-type]
    telemetry.shutdown(timeout_s=1)
    assert seen == [1]


def test_final_scrape_wait_is_bounded_by_the_variable() -> None:
    config = TelemetryConfig(
        prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False, final_scrape_timeout_s=0.5
    )
    telemetry = setup_telemetry(config=config)
    assert telemetry.prometheus_url is not None
    _scrape(telemetry.prometheus_url)  # scraped once, then the scraper goes away
    started = time.monotonic()
    telemetry.shutdown()
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 2.0


def test_final_scrape_wait_follows_the_observed_interval() -> None:
    config = TelemetryConfig(
        prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False, final_scrape_timeout_s=15.0
    )
    telemetry = setup_telemetry(config=config)
    url = telemetry.prometheus_url
    assert url is not None
    for _ in range(4):  # a scraper every 0.2 s that then stops
        _scrape(url)
        time.sleep(0.2)
    started = time.monotonic()
    telemetry.shutdown()
    # 1.5 x 0.2 s + 0.5 s, far below the 15 s limit.
    assert time.monotonic() - started < 3.0


def test_final_scrape_sees_every_step_recorded_before_shutdown() -> None:
    config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    url = telemetry.prometheus_url
    assert url is not None
    _scrape(url)
    bodies: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            try:
                bodies.append(_scrape(url))
            except OSError as error:  # the endpoint closed: the run is over
                errors.append(error)
                return
            stop.wait(0.1)

    thread = threading.Thread(target=scraper)
    for _ in range(123):
        telemetry.training.record_step(loss=2.0)
    thread.start()
    telemetry.shutdown()
    stop.set()
    thread.join(10)
    found = [re.findall(r"^openlora_training_steps_total\{.*\} (\S+)$", body, re.M) for body in bodies]
    assert ["123.0"] in found, (found, errors)


# -- 5. odd arguments, failing shutdowns ---------------------------------------------------------
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1, 0, 1e308, True])
def test_shutdown_refuses_odd_timeouts_and_stays_usable(bad: object) -> None:
    config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    port = int(telemetry.prometheus_url.rsplit(":", 1)[1].split("/")[0])  # type: ignore[union-attr]
    with pytest.raises((ValueError, TypeError)):
        telemetry.shutdown(timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError)):
        telemetry.force_flush(timeout_s=bad)  # type: ignore[arg-type]
    assert not telemetry.is_shutdown
    assert telemetry.shutdown(timeout_s=1)
    assert _port_is_free(port)
    assert _openlora_threads() == []


def test_a_failing_shutdown_still_releases_port_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    config = TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0, handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    port = int(telemetry.prometheus_url.rsplit(":", 1)[1].split("/")[0])  # type: ignore[union-attr]

    def broken(*args: object, **kwargs: object) -> None:
        raise OverflowError("timestamp too large")

    monkeypatch.setattr(telemetry.meter_provider, "shutdown", broken)
    assert telemetry.shutdown() is False
    assert telemetry.is_shutdown
    assert _port_is_free(port)
    assert _openlora_threads() == []


# -- 2. SIGTERM -------------------------------------------------------------------------
def _otlp_env(receiver: HttpReceiver, **extra: str) -> dict[str, str]:
    return otlp_child_env(receiver.http_endpoint, OTEL_SERVICE_NAME="sigterm-test", **extra)


def _steps_received(receiver: HttpReceiver) -> float:
    points = receiver.metrics().get("openlora.training.steps", [])
    return max((point.as_double or point.as_int for _, point in points), default=0)


@pytest.mark.process
def test_sigterm_exports_every_recorded_step_and_exits_143() -> None:
    receiver = HttpReceiver()
    try:
        result, took = run_child(RECORD_5000, _otlp_env(receiver))
        assert result.returncode == 143, result.stderr[-2000:]
        assert "NOT KILLED" not in result.stdout
        assert _steps_received(receiver) == 5000
        tokens = receiver.metrics()["openlora.training.tokens"]
        assert max(p.as_int for _, p in tokens) == 35000
        assert took < 10
    finally:
        receiver.close()


@pytest.mark.process
def test_sigterm_handling_can_be_turned_off() -> None:
    receiver = HttpReceiver()
    try:
        result, _ = run_child(RECORD_5000, _otlp_env(receiver, OPENLORA_HANDLE_SIGTERM="false"))
        assert result.returncode == -signal.SIGTERM  # Python's default: killed, nothing exported
        assert receiver.received == []
    finally:
        receiver.close()


@pytest.mark.process
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_application_sigterm_handler_keeps_working(when: str) -> None:
    handler = """
def on_term(signum, frame):
    print("APP HANDLER RAN", flush=True)
    sys.exit(3)
"""
    install = "signal.signal(signal.SIGTERM, on_term)\n"
    body = handler + (install if when == "before" else "") + "telemetry = setup_telemetry()\n"
    body += install if when == "after" else ""
    body += """
for _ in range(5000):
    telemetry.training.record_step(loss=1.0, tokens=7)
print("READY", flush=True)
time.sleep(60)
"""
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver))
        assert "APP HANDLER RAN" in result.stdout
        assert result.returncode == 3, result.stderr[-2000:]
        # The application's sys.exit ran atexit, and with it the final export.
        assert _steps_received(receiver) == 5000
    finally:
        receiver.close()


@pytest.mark.process
def test_sigterm_reaches_a_main_thread_stuck_in_c_code() -> None:
    # A rank stuck in a collective never returns to Python; pbkdf2 with a huge
    # iteration count stands in for it (a C loop that releases the GIL and ignores signals).
    body = """
import hashlib
telemetry = setup_telemetry()
for _ in range(5000):
    telemetry.training.record_step(loss=1.0)
print("READY", flush=True)
hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)
print("NOT KILLED", flush=True)
"""
    receiver = HttpReceiver()
    try:
        result, took = run_child(body, _otlp_env(receiver))
        assert result.returncode == 143, result.stderr[-2000:]
        assert _steps_received(receiver) == 5000
        assert took < 10
    finally:
        receiver.close()


@pytest.mark.process
def test_sigterm_while_recording_ends_the_run_within_the_bound() -> None:
    body = """
telemetry = setup_telemetry()
training = telemetry.training
for _ in range(1000):
    training.record_step(loss=1.0, tokens=1)
print("READY", flush=True)
while True:  # still recording when the signal comes
    training.record_step(loss=1.0, tokens=1)
"""
    receiver = HttpReceiver()
    try:
        result, took = run_child(body, _otlp_env(receiver))
        assert result.returncode == 143, result.stderr[-2000:]
        assert _steps_received(receiver) >= 1000
        assert took < 10
    finally:
        receiver.close()


@pytest.mark.process
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigterm_to_a_forked_worker_ends_only_the_worker() -> None:
    body = """
telemetry = setup_telemetry()
telemetry.training.record_step(loss=1.0)
ready, started = os.pipe()
child = os.fork()
if child == 0:
    os.write(started, b"1")  # running, its at-fork hooks done
    time.sleep(30)  # a worker that runs until signalled
    os._exit(0)
os.close(started)
assert os.read(ready, 1) == b"1"  # the worker runs before it is sent SIGTERM (EOF if it died)
os.kill(child, signal.SIGTERM)
_, status = os.waitpid(child, 0)
print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
time.sleep(0.5)  # the parent must not have been told to stop
print("PARENT ALIVE", flush=True)
print("READY", flush=True)
"""
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver), sigterms=0)
        assert f"CHILD {-signal.SIGTERM}" in result.stdout, result.stderr[-2000:]
        assert "PARENT ALIVE" in result.stdout
        assert result.returncode == 0, result.stderr[-2000:]
        assert _steps_received(receiver) == 1  # the parent's normal exit exported
    finally:
        receiver.close()


def test_shutdown_waits_for_a_shutdown_in_progress_on_another_thread() -> None:
    hanging = HangingEndpoint()
    try:
        config = TelemetryConfig(
            exporters=("otlp",),
            handle_sigterm=False,
            shutdown_timeout_s=1.0,
        )
        config = config.replace(
            otlp=config.otlp.__class__(endpoint=f"http://127.0.0.1:{hanging.port}/v1/metrics", timeout_s=0.5)
        )
        telemetry = setup_telemetry(config=config)
        telemetry.training.record_step(loss=1.0)  # something to export, so the final export hangs
        first = threading.Thread(target=telemetry.shutdown)
        first.start()
        deadline = time.monotonic() + 5
        while not telemetry.is_shutdown and time.monotonic() < deadline:  # the first one has begun
            time.sleep(0.001)
        assert telemetry.is_shutdown
        started = time.monotonic()
        telemetry.shutdown()  # returns only once the first one finished
        assert time.monotonic() - started > 0.3
        first.join(5)
    finally:
        hanging.close()


@pytest.mark.process
def test_an_application_handler_that_calls_ours_keeps_control_of_the_exit() -> None:
    # Lightning's signal connector installs its handler after ours and calls the previous one.
    body = (
        "telemetry = setup_telemetry()\n"
        + CHAINED_HANDLER
        + """
for _ in range(5000):
    telemetry.training.record_step(loss=1.0, tokens=7)
print("READY", flush=True)
"""
        + WAIT_FOR_STOP
        + """
time.sleep(3)  # the application's own graceful stop: a checkpoint, say
print("CHECKPOINT WRITTEN", flush=True)
sys.exit(0)
"""
    )
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver))
        assert "CHECKPOINT WRITTEN" in result.stdout, result.stderr[-2000:]
        assert result.returncode == 0, result.stderr[-2000:]
        assert _steps_received(receiver) == 5000
    finally:
        receiver.close()


@pytest.mark.process
def test_a_late_watcher_leaves_a_shutdown_the_application_began_alone() -> None:
    # The demo's pattern: its own handler during a wait, ours put back, then shutdown().
    # The watcher thread may get the GIL only after all that (seen on a loaded CI
    # machine); the main thread then sits in the shutdown, which is not "stuck in C".
    body = """
import threading
from openlora_otel.run import sigterm
heard = sigterm.SigtermGuard._on_wakeup
def late(self):
    time.sleep(0.3)
    heard(self)
sigterm.SigtermGuard._on_wakeup = late
telemetry = setup_telemetry()
slow = []
def callback(options):
    if slow:
        time.sleep(1.0)  # a final collection that takes a while
    return []
telemetry.meter.create_observable_gauge("test.slow", callbacks=[callback])
for _ in range(5000):
    telemetry.training.record_step(loss=1.0, tokens=7)
stop = threading.Event()
previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
print("READY", flush=True)
stop.wait(30)
signal.signal(signal.SIGTERM, previous)
slow.append(1)
telemetry.shutdown()
time.sleep(1.0)  # then the application's own end: a summary, a checkpoint
print("SHUTDOWN RETURNED", flush=True)
sys.exit(5)
"""
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver, OPENLORA_SHUTDOWN_TIMEOUT="10000"))
        assert "SHUTDOWN RETURNED" in result.stdout, result.stderr[-2000:]
        assert result.returncode == 5, result.stderr[-2000:]
        assert _steps_received(receiver) == 5000
    finally:
        receiver.close()


@pytest.mark.process
def test_two_sigterms_in_a_row_still_export_once_and_exit_143() -> None:
    receiver = HttpReceiver()
    try:
        result, _ = run_child(RECORD_5000, _otlp_env(receiver), sigterms=2)
        assert result.returncode == 143, result.stderr[-2000:]
        assert _steps_received(receiver) == 5000
    finally:
        receiver.close()


@pytest.mark.process
def test_shutdown_off_the_main_thread_leaves_no_stray_wakeup_writes(tmp_path: Path) -> None:
    # Closing the wakeup socket while it is still installed would let the C signal handler
    # write into whatever file gets that descriptor number next.
    body = f"""
import threading
signal.signal(signal.SIGUSR1, lambda signum, frame: None)
telemetry = setup_telemetry()
worker = threading.Thread(target=telemetry.shutdown)
worker.start()
worker.join()
files = [open({str(tmp_path)!r} + f"/file{{i}}", "wb") for i in range(4)]
for _ in range(3):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)  # one delivery each: a signal sent while the same one is pending is lost
for handle in files:
    handle.write(b"CKPT")
    handle.close()
print("READY", flush=True)
"""
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver), sigterms=0)
        assert result.returncode == 0, result.stderr[-2000:]
        for index in range(4):
            assert (tmp_path / f"file{index}").read_bytes() == b"CKPT"
    finally:
        receiver.close()


@pytest.mark.process
def test_asyncio_keeps_its_signal_handling_after_shutdown() -> None:
    body = """
import asyncio

async def main():
    telemetry = setup_telemetry()
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, got.set)
    telemetry.shutdown()
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(got.wait(), 5)
    print("ASYNCIO GOT IT", flush=True)

asyncio.run(main())
print("READY", flush=True)
"""
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver), sigterms=0)
        assert "ASYNCIO GOT IT" in result.stdout, result.stderr[-2000:]
        assert result.returncode == 0
    finally:
        receiver.close()

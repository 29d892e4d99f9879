"""The OTLP leg at the protocol level: real requests, decoded by test receivers on loopback."""

from __future__ import annotations

import logging
import time

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.otlp_receiver import GrpcReceiver, HangingEndpoint, HttpReceiver, Receiver
from tests.support.processes import child_env, free_port

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")




def otlp_env(protocol: str, port: int, **extra: str) -> dict[str, str]:
    return {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        **extra,
    }


def test_final_values_delivered_at_shutdown_with_names_units_and_resource(receiver: Receiver) -> None:
    protocol = receiver.protocol  # type: ignore[attr-defined]
    env = otlp_env(
        protocol,
        receiver.port,
        # A long interval: only the final collect at shutdown can deliver these values.
        OTEL_METRIC_EXPORT_INTERVAL="600000",
        OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20t0ken,x-team=ml",
        OTEL_EXPORTER_OTLP_COMPRESSION="gzip",
        OTEL_RESOURCE_ATTRIBUTES="team=nlp",
        RANK="2",
    )
    telemetry = setup_telemetry("otlp-test", run_id="run-otlp", config=TelemetryConfig.from_env(env))
    meter = telemetry.meter
    meter.create_counter("openlora.training.tokens", unit="{token}").add(1234)
    meter.create_gauge("openlora.training.loss", unit="1").set(2.5)
    meter.create_histogram("openlora.training.step.duration", unit="s").record(0.25)
    assert telemetry.shutdown() is True
    assert receiver.wait_for(lambda r: "openlora.training.tokens" in r.metrics(), timeout=5)

    found = receiver.metrics()
    [(tokens_metric, tokens)] = found["openlora.training.tokens"]
    assert (tokens_metric.unit, tokens.as_int or tokens.as_double) == ("{token}", 1234)
    assert tokens_metric.sum.is_monotonic
    assert tokens_metric.sum.aggregation_temporality == 2  # cumulative
    [(loss_metric, loss)] = found["openlora.training.loss"]
    assert (loss_metric.unit, loss.as_double) == ("1", 2.5)
    [(step_metric, step)] = found["openlora.training.step.duration"]
    assert (step_metric.unit, step.count, step.sum) == ("s", 1, 0.25)
    assert list(tokens.attributes) == []  # identity is in the Resource only

    attributes = receiver.resource_attributes()
    assert attributes["service.name"] == "otlp-test"
    assert attributes["openlora.run.id"] == "run-otlp"
    assert attributes["team"] == "nlp"
    assert attributes["openlora.rank"] == 2
    headers = receiver.received[0].headers
    assert headers["authorization"] == "Bearer t0ken"
    assert headers["x-team"] == "ml"
    if protocol == "http/protobuf":
        assert headers["content-encoding"] == "gzip"
        assert headers["content-type"] == "application/x-protobuf"


def test_per_signal_http_endpoint_is_used_as_is() -> None:
    server = HttpReceiver(path="/custom/metrics")
    try:
        env = {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://127.0.0.1:{server.port}/custom/metrics",
        }
        telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
        telemetry.meter.create_counter("c").add(1)
        telemetry.shutdown()
        assert server.wait_for(lambda r: "c" in r.metrics(), timeout=5)
    finally:
        server.close()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_endpoint_down_at_start_then_up(protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    interval_s = 0.5
    port = free_port()
    env = otlp_env(protocol, port, OTEL_METRIC_EXPORT_INTERVAL=str(int(interval_s * 1000)))
    caplog.set_level(logging.WARNING)
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
    counter = telemetry.meter.create_counter("openlora.test.steps")
    # Several intervals against a dead endpoint: recording never blocks or raises.
    started = time.monotonic()
    while time.monotonic() - started < 4 * interval_s:
        t0 = time.perf_counter()
        counter.add(1)
        assert time.perf_counter() - t0 < 0.05
        time.sleep(0.01)
    server: Receiver = HttpReceiver(port) if protocol == "http/protobuf" else GrpcReceiver(port)
    try:
        up_at = time.monotonic()
        assert server.wait_for(lambda r: "openlora.test.steps" in r.metrics(), timeout=2 * interval_s + 0.5)
        arrived_after = time.monotonic() - up_at
        assert arrived_after <= 2 * interval_s + 0.5
        [(_, point)] = server.metrics()["openlora.test.steps"][-1:]
        assert point.as_int > 0
        telemetry.shutdown()
    finally:
        server.close()  # type: ignore[attr-defined]
    # The outage was reported once, with a reason, and the recovery once; the SDK's
    # per-attempt errors were folded into that one line. Only this test's endpoint counts: an
    # exporter another test left behind may still be logging into the same capture.
    ours = [
        r for r in caplog.records if r.name == "openlora_otel.exporters" and f":{port}" in r.getMessage()
    ]
    failed = [r for r in ours if "failed" in r.getMessage()]
    recovered = [r for r in ours if "recovered" in r.getMessage()]
    assert len(failed) == 1 and len(recovered) == 1, [r.getMessage() for r in ours]
    sdk_errors = [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    assert sdk_errors == []


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize("endpoint", ["refused", "hanging"])
def test_shutdown_is_bounded_when_endpoint_unreachable(protocol: str, endpoint: str) -> None:
    hanging = HangingEndpoint() if endpoint == "hanging" else None
    port = hanging.port if hanging else free_port()
    env = otlp_env(protocol, port, OPENLORA_SHUTDOWN_TIMEOUT="1000", OTEL_METRIC_EXPORT_INTERVAL="600000")
    try:
        telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
        telemetry.meter.create_counter("c").add(1)
        started = time.monotonic()
        telemetry.shutdown()
        took = time.monotonic() - started
    finally:
        if hanging:
            hanging.close()
    assert took < 1.0 + 0.5, f"shutdown took {took:.2f} s with a 1 s bound"


def test_force_flush_delivers_now() -> None:
    server = HttpReceiver()
    try:
        env = otlp_env("http/protobuf", server.port, OTEL_METRIC_EXPORT_INTERVAL="600000")
        telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
        telemetry.meter.create_counter("flushed").add(5)
        assert telemetry.force_flush(timeout_s=5) is True
        assert server.wait_for(lambda r: "flushed" in r.metrics(), timeout=5)
        telemetry.shutdown()
    finally:
        server.close()


EXIT_SCRIPT = """
import sys
from openlora_otel import setup_telemetry
telemetry = setup_telemetry("exit-test")
telemetry.meter.create_counter("openlora.exit.steps").add(42)
print("recorded", flush=True)
# no shutdown(): the interpreter-exit hook must deliver within the bound
"""


def _run_exit_script(env_extra: dict[str, str]) -> tuple[float, str]:
    import subprocess
    import sys

    env = child_env(**env_extra)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return time.monotonic() - started, result.stdout


@pytest.mark.process
def test_values_are_delivered_at_interpreter_exit() -> None:
    server = HttpReceiver()
    try:
        _, stdout = _run_exit_script(
            otlp_env("http/protobuf", server.port, OTEL_METRIC_EXPORT_INTERVAL="600000")
        )
        assert "recorded" in stdout
        assert server.wait_for(lambda r: "openlora.exit.steps" in r.metrics(), timeout=5)
        [(_, point)] = server.metrics()["openlora.exit.steps"]
        assert point.as_int == 42
    finally:
        server.close()


@pytest.mark.process
def test_interpreter_exit_is_bounded_with_a_hanging_endpoint() -> None:
    hanging = HangingEndpoint()
    try:
        baseline, _ = _run_exit_script({"OTEL_METRICS_EXPORTER": "none"})
        took, _ = _run_exit_script(
            otlp_env(
                "http/protobuf",
                hanging.port,
                OPENLORA_SHUTDOWN_TIMEOUT="1000",
                OTEL_METRIC_EXPORT_INTERVAL="600000",
            )
        )
    finally:
        hanging.close()
    # Interpreter start-up and imports are in both; the exit hook may add at most the bound.
    assert took - baseline < 1.0 + 1.0, f"exit took {took:.2f} s vs {baseline:.2f} s without export"


def test_failure_reason_survives_the_sdks_duplicate_filter(caplog: pytest.LogCaptureFixture) -> None:
    """The gRPC exporter's logger has the SDK's DuplicateFilter, which drops a message equal to
    the previous one (within 20 s, from any exporter). With DEBUG off nothing comes between
    two exporters' identical failures, so a filter behind it never saw the second one and the
    warning said "no reason given". Ours runs first."""
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        env = otlp_env(
            "grpc", free_port(), OTEL_METRIC_EXPORT_INTERVAL="600000", OTEL_EXPORTER_OTLP_TIMEOUT="100"
        )
        telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
        telemetry.meter.create_counter("c").add(1)
        telemetry.force_flush(timeout_s=5)
        telemetry.shutdown(timeout_s=2)
    failed = [r.getMessage() for r in caplog.records if r.name == "openlora_otel.exporters"]
    assert len(failed) == 3, failed
    assert all("StatusCode.UNAVAILABLE" in message for message in failed), failed


@pytest.mark.parametrize(
    ("protocol", "query", "named"),
    [
        ("http/protobuf", "?api_key=Zq7PW-s3cret&tenant=&Zq7PW-bare", "api_key, a bare value"),
        ("http/protobuf", "?token=Zq7PW-s3cret", "token"),
        ("http/protobuf", "?tenant=", None),
        ("http/protobuf", "", None),
        ("grpc", "", None),
    ],
)
def test_query_values_in_the_endpoint_are_warned_about_once_by_name(
    protocol: str, query: str, named: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """urllib3 logs `POST /v1/metrics?api_key=...` at DEBUG: a token belongs in OTEL_EXPORTER_OTLP_HEADERS."""
    from openlora_otel.exporters.otlp import build_otlp_reader

    caplog.set_level(logging.WARNING)
    env = otlp_env(protocol, 9, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:9/otlp{query}")
    build_otlp_reader(TelemetryConfig.from_env(env)).shutdown(timeout_millis=1000)
    warned = [r.getMessage() for r in caplog.records if "carries query values" in r.getMessage()]
    if named is None:
        assert warned == []
        return
    assert len(warned) == 1 and f"carries query values ({named})" in warned[0], warned
    assert "OTEL_EXPORTER_OTLP_HEADERS" in warned[0] and "Zq7PW" not in warned[0]

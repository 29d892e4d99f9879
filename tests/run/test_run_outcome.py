"""How a run ended: ``openlora.run.outcome`` is ``running`` during the run, and the final collection
(the final export, the final scrape) says ``finished``, ``stopped_by_guard``, ``terminated`` or
``failed``; a process that reports nothing is ``vanished`` by the rules (tests/rules/run_outcome_test.yml,
tests/deploy/test_alerting.py)."""

from __future__ import annotations

import math
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.run.outcome import error_type
from openlora_otel.training.guard import DivergenceGuard
from tests.support.otlp_receiver import HttpReceiver
from tests.support.readings import points
from tests.support.sigterm import CHAINED_HANDLER, RECORD_5000, WAIT_FOR_STOP, otlp_child_env, run_child

OUTCOME = "openlora.run.outcome"
ROOT = Path(__file__).resolve().parents[2]


class KeepExports(MetricExporter):
    """Keeps every export; the last one is the final collection."""

    def __init__(self) -> None:
        super().__init__()
        self.exports: list = []

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


@pytest.fixture
def final():
    """A Telemetry with a push reader; ``final.outcome()`` is what its final export said."""
    exporter = KeepExports()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    telemetry = setup_telemetry(
        run_id="run-x", config=TelemetryConfig(exporters=("none",)), metric_readers=[reader]
    )

    def outcome() -> dict:
        (point,) = points(exporter.exports[-1], OUTCOME)
        assert point.value == 1
        return dict(point.attributes)

    telemetry.final_outcome = outcome  # type: ignore[attr-defined]
    yield telemetry
    telemetry.shutdown()


def test_running_during_the_run_then_finished_in_the_final_collection(final) -> None:
    final.training.record_step(loss=1.0, tokens=5)
    final.force_flush()
    assert final.final_outcome() == {"openlora.run.id": "run-x", "openlora.run.attempt": 1, "openlora.run.outcome": "running"}
    assert final.outcome == "running"
    assert final.shutdown()
    assert final.final_outcome() == {"openlora.run.id": "run-x", "openlora.run.attempt": 1, "openlora.run.outcome": "finished"}
    assert final.outcome == "finished"


def test_an_exception_in_the_with_block_is_failed_with_its_type_never_its_message(final) -> None:
    with pytest.raises(ValueError), final:
        raise ValueError("secret token 123")
    outcome = final.final_outcome()
    assert outcome == {
        "openlora.run.id": "run-x",
        "openlora.run.attempt": 1,
        "openlora.run.outcome": "failed",
        "error.type": "ValueError",
    }
    assert "secret" not in repr(outcome)


def test_ctrl_c_in_the_with_block_is_terminated_by_sigint(final) -> None:
    with pytest.raises(KeyboardInterrupt), final:
        raise KeyboardInterrupt
    assert final.final_outcome() == {
        "openlora.run.id": "run-x",
        "openlora.run.attempt": 1,
        "openlora.run.outcome": "terminated",
        "openlora.run.signal": "SIGINT",
    }


def test_sys_exit_in_the_with_block_is_no_failure(final) -> None:
    with pytest.raises(SystemExit), final:
        sys.exit(2)
    assert final.final_outcome()["openlora.run.outcome"] == "finished"


def test_a_shutdown_called_while_handling_an_exception_is_failed(final) -> None:
    try:
        raise OSError("disk full")
    except OSError:
        final.shutdown()
    assert final.final_outcome()["openlora.run.outcome"] == "failed"
    assert final.final_outcome()["error.type"] == "OSError"


def test_a_latched_guard_trip_is_stopped_by_guard_even_when_an_exception_follows(final) -> None:
    # One page per cause: the trip already pages (OpenloraDivergenceGuardTripped), never a failure too.
    training = final.training
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=3600))
    for _ in range(3):
        training.record_step(loss=math.nan)
    training._collection._check_current_window(guard)
    assert guard.tripped
    with pytest.raises(RuntimeError), final:
        raise RuntimeError("the loop noticed the NaNs too")
    assert final.final_outcome() == {"openlora.run.id": "run-x", "openlora.run.attempt": 1, "openlora.run.outcome": "stopped_by_guard"}


def test_a_guard_reset_after_its_trip_is_finished(final) -> None:
    training = final.training
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=3600))
    for _ in range(3):
        training.record_step(loss=math.nan)
    training._collection._check_current_window(guard)
    guard.reset()
    final.shutdown()
    assert final.final_outcome()["openlora.run.outcome"] == "finished"


def test_the_outcome_is_decided_once() -> None:
    from opentelemetry.sdk.metrics import MeterProvider

    from openlora_otel.run.outcome import RunOutcome

    outcome = RunOutcome(MeterProvider().get_meter("t"), TelemetryConfig(run_id="r"))
    outcome.note_exception(ValueError("x"))
    assert outcome.decide() == "failed"
    outcome.note_signal(15)
    assert outcome.decide() == "failed"


def test_error_type_is_bounded_and_qualified() -> None:
    class Local(Exception):
        pass

    assert error_type(ValueError("m")) == "ValueError"
    assert error_type(urllib.error.URLError("m")) == "urllib.error.URLError"
    assert error_type(Local()).endswith("Local") and len(error_type(Local())) <= 100
    long = type("E" * 300, (Exception,), {})
    assert len(error_type(long)) == 100


def test_the_pull_endpoint_serves_the_outcome_with_the_run_id() -> None:
    telemetry = setup_telemetry(
        run_id="run-y", config=TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0)
    )
    try:
        with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
            body = response.read().decode()
        (line,) = [x for x in body.splitlines() if x.startswith("openlora_run_outcome{")]
        assert 'openlora_run_id="run-y"' in line and 'openlora_run_outcome="running"' in line
        assert line.endswith(" 1.0")
    finally:
        telemetry.shutdown()


# -- whole processes: an uncaught exception, SIGTERM, SIGINT --------------------------------------
def _otlp_env(receiver: HttpReceiver, **extra: str) -> dict[str, str]:
    return otlp_child_env(receiver.http_endpoint, OPENLORA_QUIET="true", OPENLORA_RUN_ID="child-run", **extra)


def _final_outcome(receiver: HttpReceiver) -> dict:
    outcomes = receiver.metrics().get(OUTCOME, [])
    assert outcomes, receiver.metrics().keys()
    _, point = outcomes[-1]
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in point.attributes}


@pytest.mark.process
def test_an_uncaught_exception_without_the_context_manager_is_failed() -> None:
    import subprocess

    receiver = HttpReceiver()
    try:
        script = (
            "from openlora_otel import setup_telemetry\n"
            "telemetry = setup_telemetry()\n"
            "telemetry.training.record_step(loss=1.0, tokens=7)\n"
            "raise MemoryError('the message is never exported')\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", script],
            env=_otlp_env(receiver),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1 and "MemoryError" in result.stderr
        assert _final_outcome(receiver) == {
            "openlora.run.id": "child-run",
            "openlora.run.attempt": 1,
            "openlora.run.outcome": "failed",
            "error.type": "MemoryError",
        }
    finally:
        receiver.close()


@pytest.mark.process
def test_sigterm_is_terminated_with_the_signal_name() -> None:
    receiver = HttpReceiver()
    try:
        result, _ = run_child(RECORD_5000, _otlp_env(receiver))
        assert result.returncode == 143, result.stderr[-2000:]
        assert _final_outcome(receiver) == {
            "openlora.run.id": "child-run",
            "openlora.run.attempt": 1,
            "openlora.run.outcome": "terminated",
            "openlora.run.signal": "SIGTERM",
        }
    finally:
        receiver.close()


@pytest.mark.process
def test_a_chained_sigterm_that_the_application_ends_with_sys_exit_is_terminated() -> None:
    # Lightning's signal connector: its handler calls ours, then the application stops its own way.
    body = "telemetry = setup_telemetry()\n" + CHAINED_HANDLER + 'print("READY", flush=True)\n' + WAIT_FOR_STOP + "sys.exit(0)\n"
    receiver = HttpReceiver()
    try:
        result, _ = run_child(body, _otlp_env(receiver))
        assert result.returncode == 0, result.stderr[-2000:]
        assert _final_outcome(receiver)["openlora.run.signal"] == "SIGTERM"
        assert _final_outcome(receiver)["openlora.run.outcome"] == "terminated"
    finally:
        receiver.close()


@pytest.mark.process
def test_ctrl_c_without_the_context_manager_is_terminated_by_sigint() -> None:
    body = """
telemetry = setup_telemetry()
print("READY", flush=True)
time.sleep(60)
"""
    import signal
    import subprocess
    import textwrap

    from tests.support.sigterm import CHILD_PRELUDE

    receiver = HttpReceiver()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(body)],
            env=_otlp_env(receiver),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline().strip() == "READY"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert "KeyboardInterrupt" in stderr
        assert _final_outcome(receiver)["openlora.run.outcome"] == "terminated"
        assert _final_outcome(receiver)["openlora.run.signal"] == "SIGINT"
    finally:
        receiver.close()

"""Training values over a real OTLP export: nothing a caller passes can make later exports fail.

OTLP carries integer points as int64; one count past 2**63 - 1 made every export of
the run fail. Such arguments are refused at the call, and cumulative counters stop
at the maximum instead of overflowing.
"""

from __future__ import annotations

import math

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.otlp_receiver import Receiver

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

INT64_MAX = 2**63 - 1




def latest(receiver: Receiver, name: str) -> object:
    return receiver.metrics()[name][-1][1]


def flush_and_receive(telemetry, receiver: Receiver, requests: int) -> None:
    telemetry.force_flush(timeout_s=5)
    assert receiver.wait_for(lambda r: len(r.received) >= requests, timeout=5), "an export did not arrive"


def test_exports_keep_succeeding_after_huge_values(receiver: Receiver) -> None:
    env = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,  # type: ignore[attr-defined]
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",  # only our flushes export
    }
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
    training = telemetry.training
    training.record_step(tokens=5, samples=1, step_time_s=0.5)
    training.set_adapter(r=8, alpha=16, trainable_params=10, total_params=1000)
    with pytest.raises(ValueError, match="2\\*\\*63 - 1"):
        training.record_step(tokens=2**63)
    with pytest.raises(ValueError, match="2\\*\\*63 - 1"):
        training.set_adapter(r=8, alpha=16, total_params=2**63)
    training.record_eval(loss=math.nan, accuracy=math.inf)
    flush_and_receive(telemetry, receiver, 1)
    assert latest(receiver, "openlora.training.tokens").as_int == 5
    assert latest(receiver, "openlora.model.parameters").as_int == 1000  # the refused call changed nothing

    for _ in range(3):
        training.record_step(tokens=2**62, samples=1, step_time_s=0.5)  # together past int64
    flush_and_receive(telemetry, receiver, 2)
    assert latest(receiver, "openlora.training.tokens").as_int == INT64_MAX
    training.record_step(tokens=1, samples=1, step_time_s=0.25)
    flush_and_receive(telemetry, receiver, 3)
    assert latest(receiver, "openlora.training.tokens").as_int == INT64_MAX
    assert latest(receiver, "openlora.training.samples").as_int == 5
    assert latest(receiver, "openlora.training.steps").as_int == 5
    duration = latest(receiver, "openlora.training.step.duration")
    assert (duration.count, duration.sum) == (5, 2.25)
    assert telemetry.shutdown() is True

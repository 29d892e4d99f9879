"""End to end on the embedded default path: a real Prometheus scrapes our /metrics endpoint."""

from __future__ import annotations

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.processes import free_port
from tests.support.prometheus_server import Prometheus, prometheus_binary

pytestmark = pytest.mark.e2e


def test_prometheus_scrapes_values_and_resource_attributes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    prometheus_binary()
    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "e2e-finetune")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=nlp")
    monkeypatch.setenv("OPENLORA_RUN_ID", "run-e2e-1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    telemetry = setup_telemetry()
    assert telemetry.config == TelemetryConfig.from_env().replace(run_id="run-e2e-1")
    meter = telemetry.meter
    meter.create_counter("openlora.training.tokens", unit="{token}").add(4096)
    meter.create_gauge("openlora.training.loss", unit="1").set(1.75)
    meter.create_histogram("openlora.training.step.duration", unit="s").record(0.3)

    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    try:
        up = prometheus.wait_for('up{job="openlora"} == 1')
        assert up, prometheus.log.read_text()[-2000:]
        tokens = prometheus.wait_for("openlora_training_tokens_total")
        assert float(tokens[0]["value"][1]) == 4096
        loss = prometheus.wait_for("openlora_training_loss")
        assert float(loss[0]["value"][1]) == 1.75
        count = prometheus.wait_for("openlora_training_step_duration_seconds_count")
        assert float(count[0]["value"][1]) == 1
        # No run identity on the series themselves...
        assert "openlora_run_id" not in loss[0]["metric"]
        # ...it is in target_info, joinable on job/instance.
        info = prometheus.wait_for('target_info{openlora_run_id="run-e2e-1"}')
        labels = info[0]["metric"]
        assert labels["service_name"] == "e2e-finetune"
        assert labels["team"] == "nlp"
        assert labels["openlora_rank"] == "0"
        assert labels["openlora_world_size"] == "1"
        joined = prometheus.wait_for(
            "openlora_training_loss * on(job, instance) group_left(openlora_run_id) target_info"
        )
        assert joined[0]["metric"]["openlora_run_id"] == "run-e2e-1"
        # A value recorded later shows up at a later scrape.
        meter.create_counter("openlora.training.samples", unit="{sample}").add(8)
        samples = prometheus.wait_for("openlora_training_samples_total")
        assert float(samples[0]["value"][1]) == 8
    finally:
        prometheus.stop()
        telemetry.shutdown()


def test_training_metrics_scraped_by_prometheus(tmp_path) -> None:
    prometheus_binary()
    telemetry = setup_telemetry(
        "e2e-training",
        run_id="run-e2e-2",
        config=TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0),
    )
    port = int(telemetry.prometheus_url.rsplit(":", 1)[1].split("/")[0])
    training = telemetry.training
    for loss in (4.0, 2.0):
        training.record_step(
            loss=loss, grad_norm=1.0, learning_rate=1e-3, tokens=256, samples=2, step_time_s=0.2
        )
    training.set_adapter(
        r=8, alpha=16, target_modules=["q_proj", "v_proj"], trainable_params=10, total_params=1000
    )
    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    try:
        loss = prometheus.wait_for("openlora_training_loss")
        assert float(loss[0]["value"][1]) == 3.0
        steps = prometheus.wait_for("openlora_training_steps_total")
        assert float(steps[0]["value"][1]) == 2
        tokens = prometheus.wait_for("openlora_training_tokens_total")
        assert float(tokens[0]["value"][1]) == 512
        p50 = prometheus.wait_for(
            "histogram_quantile(0.5, sum by (le) (openlora_training_step_duration_seconds_bucket))"
        )
        assert 0.1 < float(p50[0]["value"][1]) <= 0.25
        ratio = prometheus.wait_for("openlora_adapter_trainable_ratio")
        assert float(ratio[0]["value"][1]) == 0.01
        # Later steps appear at later scrapes; the loss gauge follows the new window.
        training.record_step(loss=1.0, tokens=256)
        steps = prometheus.wait_for("openlora_training_steps_total == 3")
        assert steps
    finally:
        prometheus.stop()
        telemetry.shutdown()

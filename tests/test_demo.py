"""`openlora-otel demo`: a real fine-tune, scraped by a real Prometheus; signals; options; the loss falls."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, _deps, setup_telemetry
from openlora_otel.cli import main
from openlora_otel.demo.train import DemoOptions, run_demo
from tests.conftest import child_env, free_port, value
from tests.otlp_receiver import HttpReceiver
from tests.prometheus_server import Prometheus, prometheus_binary


def demo_process(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "openlora_otel", "demo", *args],
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(stream, needle: str, timeout: float) -> str:
    """Read lines (bounded in time) until one contains ``needle``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not seen in: {''.join(seen)[-2000:]}")


@pytest.mark.e2e
def test_demo_metrics_scraped_by_prometheus_then_sigterm(tmp_path) -> None:
    prometheus_binary()
    port = free_port()
    env = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
    demo = demo_process("--steps", "40", "--eval-every", "20", "--linger", "60", env=env)
    prometheus = None
    try:
        wait_for_line(demo.stderr, "serving the final values", timeout=120)
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
        assert prometheus.wait_for("openlora_training_steps_total == 40", timeout=30)
        assert float(prometheus.wait_for("openlora_adapter_rank")[0]["value"][1]) == 8
        assert float(prometheus.wait_for("openlora_training_tokens_total")[0]["value"][1]) == 40 * 16 * 64
        assert prometheus.wait_for("openlora_training_eval_loss")
        assert prometheus.wait_for('openlora_training_eval_value{openlora_eval_metric="perplexity"}')
        assert prometheus.wait_for("openlora_training_step_duration_seconds_count == 40")
        assert prometheus.wait_for('target_info{service_name="openlora-demo"}')
        demo.send_signal(signal.SIGTERM)
        stdout, stderr = demo.communicate(timeout=20)
    finally:
        if prometheus:
            prometheus.stop()
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
    assert demo.returncode == 143, stderr
    assert "stopped by SIGTERM after 40 steps" in stdout
    assert "Traceback" not in stderr


def test_sigint_mid_training_stops_at_the_next_step_and_flushes() -> None:
    receiver = HttpReceiver()
    env = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",  # only the flush at shutdown can deliver
    }
    demo = demo_process("--steps", "100000", "--eval-every", "0", env=env)
    try:
        wait_for_line(demo.stderr, "openlora-otel demo: LoRA", timeout=120)
        time.sleep(2.0)  # a few dozen steps
        demo.send_signal(signal.SIGINT)
        stdout, stderr = demo.communicate(timeout=30)
        assert demo.returncode == 130, stderr
        assert "stopped by SIGINT" in stdout and "telemetry flushed" in stdout
        assert "Traceback" not in stderr
        assert receiver.wait_for(lambda r: "openlora.training.steps" in r.metrics(), timeout=5)
        steps = receiver.metrics()["openlora.training.steps"][-1][1].as_int
        assert 0 < steps < 100000
        assert f"after {steps} steps" in stdout
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
        receiver.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-3"], "argument --steps: must be > 0"),
        (["--steps", "ten"], "argument --steps: expected an integer > 0"),
        (["--lr", "0"], "argument --lr: must be > 0"),
        (["--batch-size", "0"], "argument --batch-size: must be > 0"),
        (["--eval-every", "-1"], "argument --eval-every: must be >= 0"),
        (["--linger", "-5"], "argument --linger: must be >= 0"),
        (["--exporter", "zipkin"], "argument --exporter: 'zipkin' is not valid"),
    ],
)
def test_bad_options_are_usage_errors(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_environment_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "abc")
    assert main(["demo", "--steps", "1"]) == 2
    assert "OTEL_EXPORTER_PROMETHEUS_PORT='abc' is not valid" in capsys.readouterr().err


def test_missing_peft_names_the_extra(monkeypatch, capsys) -> None:
    real = _deps.is_installed
    monkeypatch.setattr(_deps, "is_installed", lambda name: False if name == "peft" else real(name))
    assert main(["demo", "--steps", "1", "--exporter", "none"]) == 2
    assert "openlora-otel[demo]" in capsys.readouterr().err


@pytest.mark.parametrize("hf_trainer", [False, True])
def test_a_short_run_records_every_training_metric(
    hf_trainer: bool, memory_reader: InMemoryMetricReader
) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    options = DemoOptions(steps=12, eval_every=6, quiet=True, hf_trainer=hf_trainer)
    result = run_demo(options, telemetry, where="memory")
    data = memory_reader.get_metrics_data()
    assert result.steps == 12 and result.exit_code == 0
    assert value(data, "openlora.training.steps") == 12
    assert value(data, "openlora.training.tokens") == 12 * 16 * 64
    assert value(data, "openlora.training.samples") == 12 * 16
    assert value(data, "openlora.training.loss") is not None
    assert value(data, "openlora.training.gradient_norm") is not None
    assert value(data, "openlora.training.learning_rate") is not None
    assert value(data, "openlora.training.eval.loss") == pytest.approx(result.final_eval_loss)
    assert value(data, "openlora.adapter.rank") == 8
    assert value(data, "openlora.adapter.target_modules") == 7
    assert 0 < value(data, "openlora.adapter.trainable.ratio") < 1
    telemetry.shutdown()


def test_default_length_run_learns(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    result = run_demo(DemoOptions(quiet=True, seed=0), telemetry, where="memory")
    telemetry.shutdown()
    assert result.steps == DemoOptions().steps
    # About 3.5 (close to ln of the 32-character alphabet) down to about 1.4 with seed 0.
    assert result.first_eval_loss > 3.0
    assert result.final_eval_loss < result.first_eval_loss - 1.5
    assert math.isfinite(result.final_eval_loss)

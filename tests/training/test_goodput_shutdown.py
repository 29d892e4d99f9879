"""The progress file gets the run's last step at shutdown and on SIGTERM, whatever the exporter (issue 29).

With the pull endpoint nobody collects at shutdown: a run never scraped used to leave no file, and
one scraped at step 3 that ended at step 7 left 3; the next attempt then counted too few steps lost.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.demo import needs_the_demo
from tests.support.otlp_receiver import HttpReceiver
from tests.support.processes import child_env
from tests.support.sigterm import ROOT, run_child

SCRAPER = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}


def _config(exporter: str, receiver: HttpReceiver) -> TelemetryConfig:
    config = TelemetryConfig(
        exporters=(exporter,),
        run_id="r1",
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        final_scrape_timeout_s=0.2,  # a scraped endpoint waits this long for a last scrape that never comes
        handle_sigterm=False,
        host_metrics=False,
        gpu_metrics="off",
        export_interval_ms=3_600_000,  # no periodic export: only the "scrape" below and the shutdown collect
    )
    return config.replace(otlp=config.otlp.__class__(endpoint=receiver.http_endpoint + "/v1/metrics"))


def _step_in(directory: Path) -> int | None:
    path = directory / "openlora-progress.json"
    return json.loads(path.read_text())["step"] if path.exists() else None


@pytest.mark.parametrize("scraped", [False, True], ids=["never-scraped", "scraped-at-step-3"])
@pytest.mark.parametrize("exporter", ["prometheus", "otlp", "console", "none"])
def test_shutdown_writes_the_last_step_whatever_the_exporter(
    exporter: str, scraped: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    receiver = HttpReceiver()
    try:
        telemetry = setup_telemetry(config=_config(exporter, receiver))
        training = telemetry.training
        training.track_progress(tmp_path)
        for step in range(1, 8):
            training.record_step(loss=1.0)
            if step == 3 and scraped:
                if exporter == "prometheus":
                    request = urllib.request.Request(telemetry.prometheus_url or "", headers=SCRAPER)
                    urllib.request.urlopen(request, timeout=10).read()
                else:
                    telemetry.force_flush()  # what an export interval would do
                assert _step_in(tmp_path) == (None if exporter == "none" else 3)
        telemetry.shutdown()
    finally:
        receiver.close()
    assert _step_in(tmp_path) == 7


def test_steps_recorded_while_a_collection_takes_its_window_are_not_left_out(tmp_path: Path) -> None:
    """save_progress() counts the steps in the clock and those in the window not taken yet, once each."""
    config = TelemetryConfig(exporters=("none",), run_id="r1", handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    try:
        training = telemetry.training
        training.track_progress(tmp_path)
        assert training.resumed(10, reached=10) == 0
        for _ in range(4):
            training.record_step()
        telemetry.force_flush()  # nothing collects with `none`: the window keeps the 4 steps
        training.save_progress()
        assert _step_in(tmp_path) == 14
    finally:
        telemetry.shutdown()
    assert _step_in(tmp_path) == 14


@pytest.mark.process
@pytest.mark.parametrize("exporter", ["prometheus", "none"])
def test_sigterm_writes_the_last_step(exporter: str, tmp_path: Path) -> None:
    body = f"""
    telemetry = setup_telemetry(run_id="r1")
    telemetry.training.track_progress({str(tmp_path)!r})
    for _ in range(7):
        telemetry.training.record_step(loss=1.0)
    print("READY", flush=True)
    time.sleep(60)
    """
    env = child_env(
        OTEL_METRICS_EXPORTER=exporter,
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT="0",
        OPENLORA_GPU_METRICS="off",
        PYTHONPATH=str(ROOT),
    )
    result, _ = run_child(body, env)
    assert result.returncode == 143, result.stderr[-2000:]
    assert _step_in(tmp_path) == 7


def test_the_demo_resumed_after_a_run_nobody_scraped_counts_the_steps_done_again(tmp_path: Path) -> None:
    """The issue's scenario: --checkpoint-dir on the default exporter (a pull endpoint nobody scrapes),
    stopped after step 8 with a checkpoint at step 5, then --resume: 3 steps lost, not 0."""
    needs_the_demo()
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.demo.train import run_demo
    from tests.support.readings import value

    options = DemoOptions(
        steps=10, batch_size=2, eval_every=0, quiet=True, checkpoint_dir=str(tmp_path), checkpoint_every=5
    )
    config = TelemetryConfig(run_id="demo-run", prometheus_host="127.0.0.1", prometheus_port=0)
    config = config.replace(handle_sigterm=False, gpu_metrics="off")
    assert config.enabled_exporters == ("prometheus",)  # the default
    telemetry = setup_telemetry(config=config)
    try:
        result = run_demo(DemoOptions(**{**options.__dict__, "stop_at_step": 8}), telemetry, where="nowhere")
    finally:
        telemetry.shutdown()
    assert result.steps == 8 and _step_in(tmp_path) == 8

    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=config.replace(run_attempt=2), metric_readers=[reader])
    try:
        result = run_demo(DemoOptions(**{**options.__dict__, "resume": True}), telemetry, where="nowhere")
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()
    assert result.steps == 10
    assert value(data, "openlora.training.steps.lost") == 8 - 5
    assert _step_in(tmp_path) == 10

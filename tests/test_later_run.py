"""A bad run, then a healthy run on the same host:port, pulled by a real Prometheus (2.42 and 3.16)
evaluating the shipped rules: the bad run's alerts name it, and no alert, firing or pending, ever names
the healthy run, neither while it loads (its target_info is scraped before its first step) nor while
the bad run's values are still in the rules' windows. The promtool cases for every alert built on a
counter or a window are in tests/rules/later_run_test.yml."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.metrics_paths import MetricsPath
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
LOADING_S = 6.0  # the healthy run's setup before its first step: several scrapes and evaluations
TRAINING_S = 4.0


def _config(port: int) -> TelemetryConfig:
    return TelemetryConfig(
        prometheus_host="127.0.0.1",
        prometheus_port=port,
        expect_scrape=True,  # the final scrape at shutdown: the bad run's last values reach Prometheus
        gpu_metrics="off",
        host_metrics=False,
        quiet=True,
    )


def _names_the_healthy_run(prometheus) -> list[dict]:  # type: ignore[no-untyped-def]
    # Over the whole test: an alert that was pending or firing for one evaluation between two polls counts.
    return prometheus.query('last_over_time(ALERTS{openlora_run_id="healthy-run"}[10m])')


@pytest.mark.e2e
@pytest.mark.parametrize("major", [2, 3], ids=["prometheus2", "prometheus3"])
def test_a_healthy_run_after_a_nan_run_on_the_same_port_is_never_alerted(tmp_path: Path, major: int) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    with MetricsPath("pull", major, tmp_path, rule_files=[str(RULES)]) as metrics:
        prometheus = metrics.scrape([target])
        bad = setup_telemetry("openlora-demo", config=_config(port), run_id="bad-run", run_name="lr-too-high")
        try:
            for _ in range(5):
                bad.training.record_step(loss=math.nan, grad_norm=math.nan, tokens=100)
            bad.training.record_step(loss=2.0, grad_norm=1.0, tokens=100)
            assert prometheus.wait_for(
                'ALERTS{alertname="OpenloraLossNonFinite", alertstate="firing", openlora_run_id="bad-run"}',
                timeout=60,
            ), prometheus.query("up")
        finally:
            assert bad.shutdown()

        healthy = setup_telemetry("openlora-demo", config=_config(port), run_id="healthy-run", run_name="lr-1e-3")
        try:
            # Loading: the new process answers scrapes (its target_info), the bad run's NaN counts are
            # still in the 5-minute windows, and no step was taken yet.
            assert prometheus.wait_for('target_info{openlora_run_id="healthy-run"}', timeout=30)
            deadline = time.monotonic() + LOADING_S
            while time.monotonic() < deadline:
                assert not _names_the_healthy_run(prometheus)
                time.sleep(0.5)
            deadline = time.monotonic() + TRAINING_S
            while time.monotonic() < deadline:
                healthy.training.record_step(loss=1.0, grad_norm=0.5, tokens=100)
                time.sleep(0.1)
            assert prometheus.wait_for(
                'openlora_training_steps_total > 0 and on (job, instance) target_info{openlora_run_id="healthy-run"}',
                timeout=30,
            )
            time.sleep(2)  # two more evaluations with the healthy run's steps
            assert not _names_the_healthy_run(prometheus)
        finally:
            assert healthy.shutdown()
        # The bad run's NaNs are still in the window: its alert is still there, naming it (its
        # annotations say "run lr-too-high"), and it never moved over to the healthy run.
        found = prometheus.query('last_over_time(ALERTS{alertname="OpenloraLossNonFinite"}[10m])')
        named = {s["metric"].get("openlora_run_id") for s in found}
    assert "bad-run" in named and "healthy-run" not in named, found

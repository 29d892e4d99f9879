"""A bad run, then a healthy run on the same target, evaluated by a real Prometheus (2.42 and 3.16) with
the shipped rules: the bad run's alerts name it, and no alert, firing or pending, ever names the healthy
run: not while it loads (its target_info is scraped before its first step), not while it trains, and
not after it exited, with the bad run's counts still in the rules' windows (issue 29: the moment the
healthy run exited, OpenloraLossNonFinite and OpenloraDivergenceGuardTripped fired, critical, named
after it). In process on the pull path, and with two real demo processes on the pull path and through
the Collector (both processes with one service.instance.id, so one target). The promtool cases for
every alert built on a counter or a window are in tests/rules/later_run_test.yml."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.demo import needs_the_demo
from tests.support.metrics_paths import MetricsPath
from tests.support.processes import child_env, free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
LOADING_S = 6.0  # the healthy run's setup before its first step: several scrapes and evaluations
TRAINING_S = 4.0
EXPIRATION_S = 10  # the Collector's metric_expiration in the demo test
AFTER_EXIT_S = 6.0  # evaluations (one a second) after the healthy run exited, its target refusing scrapes


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

        healthy = setup_telemetry(
            "openlora-demo", config=_config(port), run_id="healthy-run", run_name="lr-1e-3"
        )
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
        # The healthy run exited, the bad run's NaNs are still in the windows: several evaluations
        # with nothing on the target to say whose they are.
        assert prometheus.wait_for(f'up{{instance="{target}"}} == 0', timeout=30)
        time.sleep(AFTER_EXIT_S)
        assert not _names_the_healthy_run(prometheus)
        # The bad run's NaNs are still in the window: its alert is still there, naming it (its
        # annotations say "run lr-too-high"), and it never moved over to the healthy run.
        found = prometheus.query('last_over_time(ALERTS{alertname="OpenloraLossNonFinite"}[10m])')
        named = {s["metric"].get("openlora_run_id") for s in found}
    assert "bad-run" in named and "healthy-run" not in named, found


def _demo(
    metrics: MetricsPath, port: int, instance: str, run_id: str, name: str, *args: str
) -> tuple[int, str]:
    """``openlora-otel demo ARGS`` to the end, its metrics sent the path's way: (exit status, output)."""
    if metrics.push:
        env = {**metrics.push_env(instance), "OTEL_METRICS_EXPORTER": "otlp"}
    else:
        env = {
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
            # The run's last values reach Prometheus even when it ends between two scrapes.
            "OPENLORA_PROMETHEUS_EXPECT_SCRAPE": "true",
        }
    demo = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "demo", "--run-name", name, "--quiet", *args],
        cwd=ROOT,
        env=child_env(OPENLORA_RUN_ID=run_id, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=180,
    )
    return demo.returncode, demo.stdout + demo.stderr


@pytest.mark.e2e
@pytest.mark.process
@pytest.mark.parametrize(
    ("path", "major"), [("pull", 2), ("collector", 3)], ids=["pull-prometheus2", "collector-prometheus3"]
)
def test_two_demo_runs_on_one_target_the_healthy_one_is_never_paged(
    tmp_path: Path, path: str, major: int
) -> None:
    """Issue 29's reproduction: `demo --nan-at-step 5 --steps 40`, then `demo --steps 30` on the same
    target, scraped every second with the shipped rules; then the evaluations after the healthy run exited."""
    needs_the_demo()
    port = free_port()
    instance = f"trainer-{port}"  # the push path's target: one service.instance.id for both processes
    bad_id, healthy_id = f"nan-{os.getpid()}-{port}", f"ok-{os.getpid()}-{port}"
    # Through the Collector the processes' series outlive them by metric_expiration (5 m shipped; 10 s
    # here, so that the test sees the healthy run's series expire, and with them its target_info).
    overrides = {"exporters": {"prometheus": {"metric_expiration": f"{EXPIRATION_S}s"}}}
    with MetricsPath(
        path, major, tmp_path, rule_files=[str(RULES)], collector_overrides=overrides
    ) as metrics:
        prometheus = metrics.scrape([f"127.0.0.1:{port}"])
        code, output = _demo(
            metrics, port, instance, bad_id, "lr-too-high", "--steps", "40", "--nan-at-step", "5"
        )
        assert code == 3, output  # stopped by the divergence guard
        for name in ("OpenloraLossNonFinite", "OpenloraDivergenceGuardTripped"):
            assert prometheus.wait_for(
                f'ALERTS{{alertname="{name}", alertstate="firing", openlora_run_id="{bad_id}", openlora_run_name="lr-too-high"}}',
                timeout=60,
            ), prometheus.query("ALERTS")
        code, output = _demo(metrics, port, instance, healthy_id, "lr-1e-3", "--steps", "30")
        assert code == 0, output
        # Through the Collector its last push is batched (up to 2 s) before a scrape takes it.
        assert prometheus.wait_for(
            f'last_over_time(target_info{{openlora_run_id="{healthy_id}"}}[5m])', timeout=30
        )
        if metrics.push:
            deadline = time.monotonic() + EXPIRATION_S + 30
            while (
                prometheus.query(f'target_info{{openlora_run_id="{healthy_id}"}}')
                and time.monotonic() < deadline
            ):
                time.sleep(0.5)
            assert not prometheus.query(f'target_info{{openlora_run_id="{healthy_id}"}}'), "never expired"
        else:
            assert prometheus.wait_for(f'up{{instance="127.0.0.1:{port}"}} == 0', timeout=30)
        time.sleep(
            AFTER_EXIT_S
        )  # evaluations after the healthy run exited, the bad run's NaNs in the windows
        # Over the whole test: no alert, pending or firing, ever named the healthy run (by id or by name).
        named = prometheus.query(
            f'last_over_time(ALERTS{{openlora_run_id="{healthy_id}"}}[10m]) or last_over_time(ALERTS{{openlora_run_name="lr-1e-3"}}[10m])'
        )
        assert not named, named
        # The bad run's pages named it, and only it.
        paged = prometheus.query(
            'last_over_time(ALERTS{alertname=~"OpenloraLossNonFinite|OpenloraDivergenceGuardTripped"}[10m])'
        )
        assert {(a["metric"]["openlora_run_id"], a["metric"]["openlora_run_name"]) for a in paged} == {
            (bad_id, "lr-too-high")
        }, paged

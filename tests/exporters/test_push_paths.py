"""Faults on the push paths, with the real Collector (our distribution) and Prometheus 3.16.

- the end of a run: SIGTERM, and a run that ends by itself, with a 60 s export interval so that only
  the final export can carry the steps: every step reaches Prometheus through the single Collector,
  through the agent and gateway tiers, and straight into Prometheus 3's OTLP receiver;
- the Collector restarts mid-run: training goes on, the samples of the outage are missing, and the
  step counter comes back at its true total (cumulative temporality: nothing recorded is lost);
- the store refuses the gateway's remote writes: OpenloraCollectorExportFailing's expression holds
  on the gateway's own metrics, scraped and evaluated by a real Prometheus;
- a Collector over its memory limit refuses points: OpenloraCollectorRefusingPoints's expression
  holds on its own metrics, and once the limit is lifted the steps all arrive;
- VictoriaMetrics' own OTLP ingestion, which the dashboards do not work on: what it makes instead.

The losses are printed (pytest -s) and stated in docs/how-to/collector.md ("Faults on the push paths").
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from openlora_otel import TelemetryConfig, setup_telemetry
from tests.support.collector_server import Collector
from tests.support.metrics_paths import MetricsPath, push_env
from tests.support.polling import wait_until
from tests.support.processes import child_env
from tests.support.prometheus_server import Prometheus
from tests.support.sigterm import CHILD_PRELUDE, RECORD_5000, run_child

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"


def steps_total(prometheus: Prometheus, instance: str) -> float | None:
    found = prometheus.query(f'sum(openlora_training_steps_total{{instance="{instance}"}})')
    return float(found[0]["value"][1]) if found else None


def watch_self_metrics(workdir: Path, collector: Collector) -> Prometheus:
    """Prometheus 3 scraping ``collector``'s own metrics as collector/prometheus.yml does (job
    openlora-collector-self), with the rules evaluated."""
    return Prometheus(
        workdir,
        [f"127.0.0.1:{collector.ports['self_metrics']}"],
        job="openlora-collector-self",
        rule_files=[str(RULES)],
        major=3,
    )


def alert_expr(name: str) -> str:
    (rule,) = [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if rule.get("alert") == name
    ]
    return rule["expr"]


_RECORD_3000_AND_END = """
telemetry = setup_telemetry()
for _ in range(3000):
    telemetry.training.record_step(loss=1.0, tokens=7)
"""


@pytest.mark.parametrize("path", ["collector", "gateway", "otlp"])
@pytest.mark.parametrize("end", ["sigterm", "normal"])
def test_the_end_of_a_run_reaches_prometheus_on_the_push_paths(tmp_path: Path, path: str, end: str) -> None:
    with MetricsPath(path, 3, tmp_path) as metrics:
        instance = f"{end}-run"
        env = child_env(
            PYTHONPATH=str(ROOT),
            OTEL_SERVICE_NAME="end-of-run",
            # Only the final export can deliver the steps: the first periodic one is 60 s away.
            **{**metrics.push_env(instance), "OTEL_METRIC_EXPORT_INTERVAL": "60000"},
        )
        if end == "sigterm":
            result, _ = run_child(RECORD_5000, env)
            assert result.returncode == 143, result.stderr[-2000:]
            expected = 5000
        else:
            script = CHILD_PRELUDE + textwrap.dedent(_RECORD_3000_AND_END)
            result = subprocess.run(
                [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, result.stderr[-2000:]
            expected = 3000
        prometheus = metrics.scrape([])
        # The collectors batch for up to 2 s a tier, Prometheus scrapes every second.
        assert wait_until(lambda: steps_total(prometheus, instance) == expected, timeout=30), (
            steps_total(prometheus, instance),
            result.stderr[-2000:],
        )


def test_a_collector_restart_mid_run_costs_the_outages_samples_and_no_step(tmp_path: Path) -> None:
    with MetricsPath("collector", 3, tmp_path) as metrics:
        assert metrics.collector is not None
        instance = "restart-run"
        telemetry = setup_telemetry(
            "openlora-demo", run_id="restart-run", config=TelemetryConfig.from_env(metrics.push_env(instance))
        )
        prometheus = metrics.scrape([])
        steps, running = [0], threading.Event()
        running.set()

        def train() -> None:
            while running.is_set():
                telemetry.training.record_step(loss=1.0, tokens=8)
                steps[0] += 1
                time.sleep(0.005)

        trainer = threading.Thread(target=train)
        trainer.start()
        try:
            assert wait_until(lambda: (steps_total(prometheus, instance) or 0) > 0, timeout=30)
            metrics.collector.stop()
            down_at, steps_at_stop = time.time(), steps[0]
            time.sleep(5)  # five export intervals fail; training goes on
            steps_in_outage = steps[0] - steps_at_stop
            metrics.collector.restart()
            up_at = time.time()
            time.sleep(2)
        finally:
            running.clear()
            trainer.join(timeout=10)
        final = steps[0]
        assert steps_in_outage > 100
        assert wait_until(lambda: steps_total(prometheus, instance) == final, timeout=30), (
            steps_total(prometheus, instance),
            final,
        )
        caught_up = time.time() - up_at
        # No point of the outage reached Prometheus (its exporter was gone), and the counter never reset.
        window = f"{max(1, int(up_at - down_at) - 1)}s"
        during = prometheus.get(
            "/api/v1/query",
            query=f'count_over_time(openlora_training_steps_total{{instance="{instance}"}}[{window}])',
            time=f"{up_at - 0.5:.3f}",
        )["data"]["result"]
        resets = prometheus.query(f'resets(openlora_training_steps_total{{instance="{instance}"}}[5m])')
        assert all(float(s["value"][1]) == 0 for s in resets), resets
        print(
            f"collector down {up_at - down_at:.1f} s: {steps_in_outage} steps recorded meanwhile, "
            f"samples in the outage {[s['value'][1] for s in during] or 0}, all {final} steps in "
            f"Prometheus {caught_up:.1f} s after the restart"
        )
        telemetry.shutdown()


def test_a_store_refusing_the_gateways_writes_shows_as_export_failing(tmp_path: Path) -> None:
    store_dir, watcher_dir = tmp_path / "store", tmp_path / "watcher"
    store_dir.mkdir()
    watcher_dir.mkdir()
    # A Prometheus without the remote-write receiver: it refuses every write (HTTP 404).
    refusing = Prometheus(store_dir, [], major=3)
    gateway = watcher = telemetry = None
    try:
        gateway = Collector(
            tmp_path,
            ROOT / "deploy" / "collector" / "gateway.yaml",
            name="gateway",
            env={"OPENLORA_REMOTE_WRITE_URL": f"{refusing.url}/api/v1/write", "OPENLORA_REMOTE_WRITE_AUTHORIZATION": ""},
        )
        watcher = watch_self_metrics(watcher_dir, gateway)
        telemetry = setup_telemetry(
            "openlora-demo", run_id="refused-run", config=TelemetryConfig.from_env(push_env(gateway.otlp_http))
        )
        for _ in range(50):
            telemetry.training.record_step(loss=1.0, tokens=8)
        expr = alert_expr("OpenloraCollectorExportFailing")
        assert wait_until(lambda: bool(watcher.query(expr)), timeout=60), watcher.query(
            '{__name__=~"otelcol_exporter_.*"}'
        )
        (firing,) = watcher.query(expr)
        assert firing["metric"]["exporter"] == "prometheus_remote_write", firing
        assert firing["metric"]["instance"] == f"127.0.0.1:{gateway.ports['self_metrics']}", firing
        failed = watcher.query('sum({__name__=~"otelcol_exporter_send_failed_metric_points(_total)?"})')
        sent = watcher.query('sum({__name__=~"otelcol_exporter_sent_metric_points(_total)?"})')
        print(f"store refusing: {failed[0]['value'][1]} points failed, {sent[0]['value'][1] if sent else 0} sent")
        assert not refusing.query("openlora_training_steps_total")
    finally:
        if telemetry is not None:
            telemetry.shutdown()
        for server in (watcher, gateway, refusing):
            if server is not None:
                server.stop()


def test_a_collector_over_its_memory_limit_refuses_points_and_nothing_is_lost_after(tmp_path: Path) -> None:
    store_dir, watcher_dir = tmp_path / "store", tmp_path / "watcher"
    store_dir.mkdir()
    watcher_dir.mkdir()
    # A limit far below what the Collector itself needs: memory_limiter refuses everything.
    tight = {
        "processors": {
            "memory_limiter": {"limit_percentage": 0, "spike_limit_percentage": 0, "limit_mib": 2, "spike_limit_mib": 1}
        }
    }
    collector = Collector(tmp_path, ROOT / "collector" / "otelcol.yaml", overrides=tight)
    prometheus = watcher = telemetry = None
    try:
        prometheus = Prometheus(
            store_dir,
            [f"127.0.0.1:{collector.ports['prometheus']}"],
            job="openlora-collector",
            honor_labels=True,
            major=3,
        )
        watcher = watch_self_metrics(watcher_dir, collector)
        instance = "refused-points-run"
        telemetry = setup_telemetry(
            "openlora-demo",
            run_id="refused-points",
            config=TelemetryConfig.from_env(push_env(collector.otlp_http, instance)),
        )
        for _ in range(200):
            telemetry.training.record_step(loss=1.0, tokens=8)
        expr = alert_expr("OpenloraCollectorRefusingPoints")
        assert wait_until(lambda: bool(watcher.query(expr)), timeout=60), watcher.query(
            '{__name__=~"otelcol_receiver_.*|otelcol_processor_.*"}'
        )
        assert steps_total(prometheus, instance) is None  # nothing got through
        refused = watcher.query('sum({__name__=~"otelcol_receiver_refused_metric_points(_total)?"})')
        # The limit lifted (restarted as shipped): the next export carries every step recorded meanwhile.
        collector.restart(overrides={})
        assert wait_until(lambda: steps_total(prometheus, instance) == 200, timeout=30), steps_total(
            prometheus, instance
        )
        print(f"memory limit: {refused[0]['value'][1] if refused else '?'} points refused, then all 200 steps arrived")
    finally:
        if telemetry is not None:
            telemetry.shutdown()
        for server in (watcher, prometheus, collector):
            if server is not None:
                server.stop()


def test_victoriametrics_otlp_ingestion_labels_every_series_and_makes_no_target_info(tmp_path: Path) -> None:
    """Why the dashboards do not run on VictoriaMetrics' own OTLP ingestion (docs/how-to/prometheus-otlp.md): no target_info, no
    job or instance; the Resource is on every series instead. Send to it through the gateway's remote
    write (tests/support/metrics_paths.py, ``gateway``) and they do."""
    with MetricsPath("otlp", 0, tmp_path) as metrics:
        telemetry = setup_telemetry(
            "openlora-demo", run_id="vm-otlp", config=TelemetryConfig.from_env(metrics.push_env("vm-otlp-instance"))
        )
        try:
            for _ in range(10):
                telemetry.training.record_step(loss=1.0, tokens=8)
            telemetry.force_flush()
            store = metrics.scrape([])
            assert wait_until(lambda: bool(store.query("openlora_training_steps_total")), timeout=30)
            (series,) = store.query("openlora_training_steps_total")
            labels = series["metric"]
            assert "job" not in labels and "instance" not in labels, labels
            assert labels["service_instance_id"] == "vm-otlp-instance" and labels["openlora_run_id"] == "vm-otlp"
            assert store.query("target_info") == []
        finally:
            telemetry.shutdown()

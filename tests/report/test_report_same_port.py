"""`openlora-otel report --prometheus`: two runs that used the same port one after the other stay apart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from openlora_otel.report.model import curves
from openlora_otel.report.prometheus import read_prometheus
from tests.support.demo import demo_process, needs_the_demo, wait_for_line
from tests.support.processes import free_port, reap
from tests.support.prometheus_server import Prometheus, prometheus_binary


@pytest.mark.e2e
def test_two_runs_one_after_the_other_on_the_same_port_are_read_apart(tmp_path: Path) -> None:
    """The docs' case (docs/how-to/run-history.md): `demo --run-name a`, then `demo --run-name b`, both on the default port,
    one Prometheus scraping it. Each run's curves are its own: run a does not get b's steps."""
    prometheus_binary()
    needs_the_demo()
    port = free_port()
    common = ("--steps", "30", "--batch-size", "2", "--data-delay-ms", "50", "--linger", "2")
    env = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"], scrape_interval="250ms")
    ended: dict[str, float] = {}
    try:
        for name, lr, steps in (("a", "3e-3", "30"), ("b", "1e-3", "20")):
            demo = demo_process(*common[:1], steps, *common[2:], "--run-name", name, "--lr", lr, env=env)
            try:
                wait_for_line(demo.stderr, "keeping the final values", timeout=300)
                assert demo.wait(timeout=60) == 0
            finally:
                demo.terminate()
                reap(demo, 20)
                demo.stdout.close()
                demo.stderr.close()
            ended[name] = time.time()
        # A scrape after run b exited: whatever either run served is in Prometheus.
        assert prometheus.wait_for(f'up{{instance="127.0.0.1:{port}"}} == 0', timeout=30), prometheus.query("up")
        only_a = read_prometheus(prometheus.url, ["a"])
        assert [r.name for r in only_a] == ["a"], "--run a names one run, called a"
        run_a, run_b = read_prometheus(prometheus.url, ["a", "b"])
        assert (run_a.name, run_b.name) == ("a", "b")
        assert run_a.run_id != run_b.run_id
        # Run a ended before run b started: none of its rows is from b's time.
        assert max(row.time_s for row in run_a.rows) <= ended["a"] + 1, "run a holds rows of run b"
        loss_a = curves(run_a.rows)["loss"]
        steps_a = [x for x, _ in loss_a]
        assert steps_a == sorted(steps_a) and steps_a[-1] == 30, steps_a
        loss_b = curves(run_b.rows)["loss"]
        steps_b = [x for x, _ in loss_b]
        assert steps_b == sorted(steps_b) and steps_b[-1] == 20, steps_b
        assert min(row.time_s for row in run_b.rows) >= ended["a"] - 1, "run b holds rows of run a"
    finally:
        prometheus.stop()

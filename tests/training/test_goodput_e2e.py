"""A demo interrupted and resumed, pulled by a real Prometheus (2.42 and 3.16) evaluating the shipped rules:
how each attempt ended, its goodput over both attempts, the steps the second did again, and the same in `openlora-otel report`
from the two attempts' history lines. The promtool cases are in tests/rules/goodput_test.yml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.demo import demo_process, needs_the_demo
from tests.support.metrics_paths import MetricsPath
from tests.support.processes import child_env, free_port, reap

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
RUN = "goodput-e2e"
CHECKPOINT_EVERY = 5
STOP_AT = 9  # the first attempt reaches step 9; its last checkpoint is step 5: 4 steps are lost


def _attempt(port: int, checkpoints: Path, history: Path, *extra: str) -> str:
    process = demo_process(
        "--steps", "16", "--batch-size", "2", "--eval-every", "4", "-q", "--exporter", "prometheus",
        "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(CHECKPOINT_EVERY), *extra,
        env={
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
            # The final scrape at shutdown: each attempt's last values reach Prometheus.
            "OPENLORA_PROMETHEUS_EXPECT_SCRAPE": "true",
            "OPENLORA_RUN_ID": RUN,
            "OPENLORA_HISTORY_DIR": str(history),
            "OPENLORA_GPU_METRICS": "off",
        },
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=240)
    finally:
        reap(process, 10)
    assert process.returncode == 0, err[-3000:]
    return out


def _one(prometheus, expr: str, timeout: float = 60.0) -> float:  # type: ignore[no-untyped-def]
    found = prometheus.wait_for(expr, timeout=timeout)
    assert len(found) == 1, (expr, found)
    return float(found[0]["value"][1])


@pytest.mark.e2e
@pytest.mark.process
@pytest.mark.parametrize("major", [2, 3], ids=["prometheus2", "prometheus3"])
def test_an_interrupted_and_resumed_demo_shows_its_goodput_and_lost_steps(tmp_path: Path, major: int) -> None:
    needs_the_demo()
    port = free_port()
    checkpoints, history = tmp_path / "checkpoints", tmp_path / "history"
    with MetricsPath("pull", major, tmp_path, rule_files=[str(RULES)]) as metrics:
        prometheus = metrics.scrape([f"127.0.0.1:{port}"])
        _attempt(port, checkpoints, history, "--stop-at-step", str(STOP_AT))
        _attempt(port, checkpoints, history, "--resume")
        run = f'openlora_run_id="{RUN}"'

        # Both attempts of the run, on the same host:port, told apart by openlora.run.attempt.
        attempts = prometheus.query(f"count by (openlora_run_attempt) (last_over_time(target_info{{{run}}}[10m]))")
        assert {s["metric"]["openlora_run_attempt"] for s in attempts} == {"1", "2"}, attempts

        # How each attempt ended, each under its own attempt number (--stop-at-step ends the first cleanly).
        ended = prometheus.wait_for(f'count(run:openlora_run:outcome{{{run}}}) == 2', timeout=60)
        assert ended, prometheus.query(f"run:openlora_run:outcome{{{run}}}")
        outcomes = prometheus.query(f"run:openlora_run:outcome{{{run}}}")
        assert {(s["metric"]["openlora_run_attempt"], s["metric"]["openlora_run_outcome"]) for s in outcomes} == {
            ("1", "finished"),
            ("2", "finished"),
        }

        lost = _one(prometheus, f"run:openlora_training_steps_lost:increase1h{{{run}}} > 0")
        assert lost == STOP_AT - CHECKPOINT_EVERY

        def phase(name: str) -> float:
            # Waited for above 0: the goodput group evaluates on its own schedule, from 1 s steps of the
            # scrapes, and may still hold the second attempt's scrape from before its first step (its
            # steps lost already counted, no step redone yet) when the outcome group has seen its end.
            return _one(
                prometheus,
                f'run:openlora_training_time_seconds:increase1h{{{run}, openlora_training_phase="{name}"}} > 0',
            )

        assert phase("lost_progress") > 0
        assert phase("checkpoint_load") > 0 and phase("checkpoint_save") > 0 and phase("evaluation") > 0
        assert phase("productive") > 0 and phase("startup") > 0
        goodput = _one(prometheus, f"run:openlora_training_goodput:ratio1h{{{run}}}")
        assert 0 < goodput < 1
        # The ratio is productive time over all of it, both attempts together: one query, so that the
        # three records come from one evaluation of their group.
        seconds = "run:openlora_training_time_seconds:increase1h"
        parts = prometheus.query(
            f"label_replace(run:openlora_training_goodput:ratio1h{{{run}}}, 'part', 'ratio', '', '')"
            f" or label_replace(sum by (openlora_run_id) ({seconds}{{{run}}}), 'part', 'every', '', '')"
            f" or label_replace(sum by (openlora_run_id) ({seconds}{{{run}, openlora_training_phase='productive'}}),"
            " 'part', 'productive', '', '')"
        )
        values = {s["metric"]["part"]: float(s["value"][1]) for s in parts}
        assert values["ratio"] == pytest.approx(values["productive"] / values["every"], rel=1e-6), values

    # The report, from the two attempts' lines in the one history file of the run id.
    assert [p.name for p in history.iterdir()] == [f"{RUN}.jsonl"]
    report = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "report", str(history), "--format", "html", "--out", str(tmp_path) + "/"],
        env=child_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "Where the time went (2 attempts" in report.stdout, report.stdout
    assert f"attempt 2: {STOP_AT - CHECKPOINT_EVERY} steps lost" in report.stdout, report.stdout


# A process the goodput copies must not miss: it answers two scrapes (1 s apart) right after an
# evaluation (they are 30 s apart) and is gone. Its seconds and lost steps were booked by then.
SHORT_ATTEMPT = b"""\
# TYPE target_info gauge
target_info{openlora_run_id="short-attempt",openlora_run_attempt="2"} 1
# TYPE openlora_training_time_seconds_total counter
openlora_training_time_seconds_total{openlora_training_phase="lost_progress"} 40
openlora_training_time_seconds_total{openlora_training_phase="productive"} 3
# TYPE openlora_training_steps_lost_total counter
openlora_training_steps_lost_total 4
"""


@pytest.mark.e2e
@pytest.mark.parametrize("major", [2, 3], ids=["prometheus2", "prometheus3"])
def test_an_attempt_that_lived_between_two_evaluations_still_counts(tmp_path: Path, major: int) -> None:
    """A resumed attempt that redid its lost steps and ended within a few seconds, its last scrape gone
    stale before the next evaluation: the copies read the last minute at 1 s steps, so its seconds and
    lost steps count (a loaded CI machine once lost them in the test above)."""
    import http.server
    import threading

    from tests.support.polling import wait_until
    from tests.support.prometheus_server import Prometheus

    class Target(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(SHORT_ATTEMPT)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    prometheus = Prometheus(
        tmp_path, [f"127.0.0.1:{port}"], rule_files=[str(RULES)], major=major, evaluation_interval="30s"
    )
    server = None
    try:
        # Right after an evaluation of the goodput group the target comes up, answers two scrapes
        # (1 s apart) and is gone, its series stale, some 25 s before the next evaluation.
        def last_goodput_evaluation() -> str:
            groups = prometheus.get("/api/v1/rules")["data"]["groups"]
            return next(g.get("lastEvaluation", "") for g in groups if g["name"] == "openlora-goodput")

        first = last_goodput_evaluation()
        assert wait_until(lambda: last_goodput_evaluation() != first, 40), "no evaluation of the goodput group"
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Target)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        assert wait_until(lambda: prometheus.query("sum_over_time(up[1m]) >= 2"), 20), prometheus.query("up")
        server.shutdown()
        server.server_close()
        run = 'openlora_run_id="short-attempt"'
        lost = prometheus.wait_for(f'run:openlora_training_time_seconds:increase1h{{{run}, openlora_training_phase="lost_progress"}}', 70)
        assert [float(s["value"][1]) for s in lost] == [40.0], lost
        steps = prometheus.wait_for(f"run:openlora_training_steps_lost:increase1h{{{run}}}", 20)
        assert [float(s["value"][1]) for s in steps] == [4.0], steps
    finally:
        prometheus.stop()
        if server is not None:
            server.server_close()

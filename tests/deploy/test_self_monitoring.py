"""The monitoring watches itself: the openlora-prometheus alerts fire on a real Prometheus (2.42 and
3.16) scraping itself, for real faults, and resolve when the fault is gone (the notifications alert's
resolution, two minutes of waiting, on 3.16).

One Prometheus per release, with the faults the issue names: a rule group whose rule fails at every
evaluation (a many-to-many match), a remote write to a port nothing listens on, and an Alertmanager
that is stopped while alerts fire and started again. It evaluates a copy of the shipped groups whose
only change is a 2 s ``for`` (the shipped ones are minutes); the expressions, windows and thresholds
are the shipped ones, which the test checks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.support.alertmanager import Alertmanager
from tests.support.alerts import firing, shortened_rules
from tests.support.built import built
from tests.support.polling import wait_until
from tests.support.processes import free_port
from tests.support.prometheus_server import PROMETHEUS_MAJORS, ServerProcess, prometheus_binary

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SELF_GROUPS = ("openlora-prometheus", "openlora-alertmanager")
SHORT_FOR = "2s"

# A recording rule that fails at every evaluation: two series on each side of a match on no labels.
FAILING_RULES = """\
groups:
  - name: broken
    rules:
      - record: broken:many_to_many
        expr: |
          (label_replace(vector(1), "a", "x", "", "") or label_replace(vector(1), "a", "y", "", ""))
          + on () (label_replace(vector(1), "b", "x", "", "") or label_replace(vector(1), "b", "y", "", ""))
  - name: always
    rules:
      # Something always firing, so that Prometheus sends to the Alertmanager on every resend.
      - alert: AlwaysFiring
        expr: vector(1)
"""


def test_the_test_copy_differs_from_the_shipped_rules_only_in_for() -> None:
    copy = shortened_rules(SELF_GROUPS, SHORT_FOR)["groups"]
    assert [g["name"] for g in copy] == list(SELF_GROUPS)
    assert all(rule.get("for", SHORT_FOR) == SHORT_FOR for g in copy for rule in g["rules"])


def start_alertmanager(workdir: Path, port: int) -> ServerProcess:
    config = workdir / "alertmanager.yml"
    if not config.exists():
        # Routes to a webhook nobody serves: only Prometheus's sends to it matter here.
        config.write_text(
            'route: {receiver: nowhere}\nreceivers: [{name: nowhere, webhook_configs: [{url: "http://127.0.0.1:9/"}]}]\n'
        )
    return Alertmanager(workdir, _alertmanager(), config, port)


def _alertmanager() -> str:
    import shutil

    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager") or built("alertmanager")


@PROMETHEUS_MAJORS
def test_rule_remote_write_and_notification_faults_fire_and_notifications_resolve(
    tmp_path: Path, major: int
) -> None:
    (tmp_path / "self.yml").write_text(yaml.safe_dump(shortened_rules(SELF_GROUPS, SHORT_FOR), sort_keys=False))
    (tmp_path / "faults.yml").write_text(FAILING_RULES)
    am_port, port, dead_port = free_port(), free_port(), free_port()
    alertmanager = start_alertmanager(tmp_path, am_port)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["self.yml", "faults.yml"],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        # Nothing listens there: every send is refused and retried.
        "remote_write": [{"url": f"http://127.0.0.1:{dead_port}/api/v1/write"}],
        "scrape_configs": [
            {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
            {"job_name": "alertmanager", "static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = ServerProcess(
        "prometheus",
        [
            prometheus_binary(major),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--rules.alert.resend-delay=2s",
            "--log.level=warn",
        ],
        port,
        tmp_path,
        "/-/ready",
    )
    timings: dict[str, float] = {}
    try:
        start = time.monotonic()
        # (b) The rule that fails at every evaluation: its group is named.
        rule_failures = wait_until(lambda: firing(prometheus).get("OpenloraPrometheusRuleFailures"), 60)
        assert rule_failures, firing(prometheus)
        assert {a["labels"]["rule_group"] for a in rule_failures} == {f"{tmp_path / 'faults.yml'};broken"}
        timings["rule failures fire"] = time.monotonic() - start
        # (c) Remote write to a dead port: retried, so failing; on 3.x also behind (its sent timestamp is
        # 0 until a send succeeds; 2.42 exports none until then, see the rule).
        url = f"http://127.0.0.1:{dead_port}/api/v1/write"
        failing = wait_until(lambda: firing(prometheus).get("OpenloraPrometheusRemoteWriteFailing"), 60)
        assert failing and {a["labels"]["url"] for a in failing} == {url}, firing(prometheus)
        timings["remote write failing fires"] = time.monotonic() - start
        if major == 3:
            behind = wait_until(lambda: firing(prometheus).get("OpenloraPrometheusRemoteWriteBehind"), 60)
            assert behind and {a["labels"]["url"] for a in behind} == {url}, firing(prometheus)
            timings["remote write behind fires"] = time.monotonic() - start
        # The Alertmanager takes the sends: nothing about notifications fires.
        assert wait_until(
            lambda: prometheus.query("sum(prometheus_notifications_sent_total) > 0"), 30
        ), "no alert was sent to the Alertmanager"
        assert "OpenloraPrometheusNotificationsFailing" not in firing(prometheus)
        # (a) The Alertmanager goes away while alerts fire: every resend (2 s) fails.
        alertmanager.stop()
        stopped = time.monotonic()
        notifying = wait_until(lambda: firing(prometheus).get("OpenloraPrometheusNotificationsFailing"), 60)
        assert notifying, firing(prometheus)
        assert {a["labels"]["alertmanager"] for a in notifying} == {f"http://127.0.0.1:{am_port}/api/v2/alerts"}
        assert notifying[0]["labels"]["severity"] == "critical"
        timings["notifications failing fires"] = time.monotonic() - stopped
        if major == 2:
            # The resolution is waited for on Prometheus 3 alone: the same rule over the same counters
            # resolves when the failures leave its 2 m window, about two minutes of waiting per version.
            print(f"prometheus {major}: " + ", ".join(f"{k} after {v:.0f} s" for k, v in timings.items()))
            return
        # Back on the same port: the sends succeed, and the alert resolves once the failures have left
        # the rule's 2 m window.
        alertmanager = start_alertmanager(tmp_path, am_port)
        back = time.monotonic()
        assert wait_until(
            lambda: "OpenloraPrometheusNotificationsFailing" not in firing(prometheus), 200, interval=2
        ), firing(prometheus)
        timings["notifications failing resolves"] = time.monotonic() - back
        print(f"prometheus {major}: " + ", ".join(f"{k} after {v:.0f} s" for k, v in timings.items()))
    finally:
        prometheus.stop()
        alertmanager.stop()

"""The shipped rules' alerts leave the long-term stores' rulers and reach a person: a run whose loss goes
NaN, pushed through the agent and the gateway (the gateway path of tests/support/metrics_paths.py),
fires OpenloraLossNonFinite on Thanos Ruler (deploy/thanos/rule.default, sending to an Alertmanager
0.35 on collector/alertmanager.yml) and on Cortex's ruler (sending to Cortex's own Alertmanager, the
same configuration as the tenant's), and the notification reaches a webhook on the critical route with
the run's id, name and rank. Thanos Ruler drops its ``rule_replica`` label from what it sends, so the
alerts of two rulers for high availability are one alert to Alertmanager."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.alertmanager import Alertmanager, Webhook, shipped_config
from tests.support.built import built
from tests.support.metrics_paths import MetricsPath
from tests.support.processes import child_env, reap

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
RANK_GROUP = ROOT / "tests" / "support" / "rank_group.py"
RUN_ID, RUN_NAME = "gone-nan", "lora-gone-nan"


@pytest.mark.parametrize("store", ["thanos", "cortex"])
def test_a_run_gone_nan_reaches_a_webhook_from_the_stores_ruler(tmp_path: Path, store: str) -> None:
    webhook = Webhook()
    config_text = shipped_config(webhook.url)
    rules = tmp_path / "openlora.yml"
    rules.write_text(RULES.read_text())
    alertmanager = group = None
    try:
        if store == "thanos":
            config = tmp_path / "alertmanager.yml"
            config.write_text(config_text)
            alertmanager = Alertmanager(tmp_path, built("alertmanager"), config)
            options = {"alertmanager_url": alertmanager.url}
        else:
            options = {"alertmanager_config": config_text}
        with MetricsPath("gateway", store, tmp_path, rule_files=[str(rules)], store_options=options) as path:
            env = child_env(**path.push_env(), OPENLORA_RUN_ID=RUN_ID, OPENLORA_RUN_NAME=RUN_NAME, PYTHONPATH=str(ROOT))
            group = subprocess.Popen(
                [sys.executable, str(RANK_GROUP), "--first-rank", "0", "--count", "2", "--world-size", "2",
                 "--step-s", "0.5", "--nonfinite-loss-from", "6", "--max-s", "300"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            assert group.stdout is not None and group.stdout.readline().startswith("ready"), "the ranks did not start"
            # The rule fires at the first evaluation that sees the counter; the critical route waits 10 s.
            received = webhook.wait_for(lambda a: a["labels"]["alertname"] == "OpenloraLossNonFinite", 120)
            assert received, f"no notification from {store}'s ruler; the webhook got {webhook.alerts()}"
            alert = received[0]
            assert alert["receiver"] == "critical" and alert["status"] == "firing", alert
            labels = alert["labels"]
            assert labels["severity"] == "critical" and labels["openlora_run_id"] == RUN_ID, labels
            assert labels["openlora_run_name"] == RUN_NAME and labels["instance"] == "rank-0", labels
            assert "rule_replica" not in labels, labels
            # Only the rank whose loss went NaN.
            assert {a["labels"]["instance"] for a in received} == {"rank-0"}, received
    finally:
        if group is not None:
            group.terminate()
            reap(group, 30)
        if alertmanager is not None:
            alertmanager.stop()
        webhook.close()

"""From an alert to its diagnosis: every alert about a training run carries the `openlora-otel diagnose`
command for its run in its `diagnose` annotation (docs/how-to/alerts.md), and that command, as a real
Prometheus renders it for a firing alert, diagnoses the run."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import urllib.request
from pathlib import Path

import pytest
import yaml

from openlora_otel.cli import build_parser, main
from tests.support import gpu_fault_rank
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
TEMPLATE = "openlora-otel diagnose --prometheus {{ $externalURL }} --run {{ $labels.openlora_run_id }}"
# Alerts that are not about one training run: the monitoring's own, serving's, and two whose series
# may carry no run id (an endpoint that never answered, a Kubernetes Job).
NOT_A_RUN_GROUPS = ("openlora-inference", "openlora-prometheus", "openlora-alertmanager", "openlora-collector",
                    "openlora-thanos", "openlora-kubernetes")  # fmt: skip
WITHOUT_RUN_ID = {"OpenloraTrainingEndpointUnresponsive", "OpenloraKubernetesJobFailed"}


def alerts() -> list[tuple[str, dict]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(group["name"], rule) for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_training_alert_and_no_other_names_the_command() -> None:
    named = {rule["alert"] for _, rule in alerts() if "diagnose" in rule["annotations"]}
    expected = {rule["alert"] for group, rule in alerts() if group not in NOT_A_RUN_GROUPS} - WITHOUT_RUN_ID
    assert named == expected and len(named) == 27, sorted(named ^ expected)
    assert {rule["annotations"]["diagnose"] for _, rule in alerts() if "diagnose" in rule["annotations"]} == {TEMPLATE}
    # What it renders to is a command line the CLI takes.
    argv = shlex.split(TEMPLATE.replace("{{ $externalURL }}", "http://prometheus:9090/").replace(
        "{{ $labels.openlora_run_id }}", "0f3c9a"))  # fmt: skip
    assert argv[0] == "openlora-otel"
    parsed = build_parser().parse_args(argv[1:])
    assert (parsed.prometheus, parsed.run) == ("http://prometheus:9090/", ["0f3c9a"])


@pytest.mark.e2e
@pytest.mark.process
def test_a_firing_alerts_command_diagnoses_its_run(tmp_path: Path) -> None:
    """A two-rank run whose rank 1's GPU falls off the bus (a fake NVML: tests/support/gpu_fault_rank.py),
    scraped by Prometheus 3.16 with the shipped rules and its external URL set: OpenloraGpuFellOffTheBus
    fires while the rank lingers, and the command its annotation holds names that GPU first; so does
the stack's alert receiver given that alert, and it forwards that to a chat webhook."""
    from tests.support.processes import free_port_range
    from tests.support.prometheus_server import Prometheus

    port = free_port_range(2)
    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], rule_files=[str(RULES)],
                            major=3, external_url=True)  # fmt: skip
    processes = []
    try:
        assert prometheus.wait_for_scrapes(1)
        processes = gpu_fault_rank.start(tmp_path, "off-bus", 20, port, "--linger-s", "15")

        def firing() -> list[dict]:
            return [a for a in prometheus.get("/api/v1/alerts")["data"]["alerts"]
                    if a["labels"]["alertname"] == "OpenloraGpuFellOffTheBus" and a["state"] == "firing"]  # fmt: skip

        found = wait_until(firing, 60, "OpenloraGpuFellOffTheBus firing")
        command = found[0]["annotations"]["diagnose"]
        assert command == f"openlora-otel diagnose --prometheus {prometheus.url} --run gpu-off-bus", command
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main([*shlex.split(command)[1:], "--json"]) == 0
        (run,) = json.loads(printed.getvalue())["runs"]
        top = run["findings"][0]
        assert (top["kind"], top["severity"], top["rank"]) == ("gpu_fault", "critical", 1), run["findings"]
        assert top["runbook"] == found[0]["annotations"]["runbook_url"]

        # The stack's receiver, given the alert as Alertmanager's webhook sends it, diagnoses the run
        # from the same Prometheus and prints the top finding under it.
        # With a chat webhook (Slack's shape), the diagnosis goes there too.
        from openlora_otel.stack import AlertPrinter
        from openlora_otel.stack.chat import ChatForwarder
        from tests.support.alertmanager import Webhook

        out, err, hook = io.StringIO(), io.StringIO(), Webhook("/services/T0/B0/secret")
        printer = AlertPrinter(0, out, diagnose_from=prometheus.url, chat=ChatForwarder(hook.url, err)).start()
        try:
            alert = {"status": "firing", "labels": found[0]["labels"], "annotations": found[0]["annotations"]}
            body = json.dumps({"version": "4", "status": "firing", "alerts": [alert]}).encode()
            with urllib.request.urlopen(urllib.request.Request(printer.url, data=body), timeout=10) as response:
                assert response.status == 200
            wait_until(lambda: "runbook:" in out.getvalue(), 60, "the receiver's diagnosis")
            # The chat gets the lines once they are all printed: waited for before the receiver closes.
            wait_until(lambda: len(hook.notifications) >= 2, 30, "the diagnosis in the chat")
        finally:
            printer.close()
            hook.close()
        printed = out.getvalue()
        assert "diagnosis of run gpu-off-bus" in printed and "[critical] rank 1's GPU fell off the bus" in printed, printed
        messages = [m["text"] for m in hook.notifications]
        assert messages[0].startswith("[FIRING] critical OpenloraGpuFellOffTheBus") and err.getvalue() == ""
        assert "diagnosis of run gpu-off-bus" in messages[1] and "[critical] rank 1's GPU fell off the bus" in messages[1]
    finally:
        if processes:
            gpu_fault_rank.finish(processes, "off-bus")
        prometheus.stop()

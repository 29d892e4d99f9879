"""Alerts that reach a person: collector/alertmanager.yml (checked by amtool, routed and inhibited by a
real Alertmanager), the Alertmanager in compose, the alerting blocks of the Prometheus configs, and
real runs (one gone NaN, one that raises, one SIGKILLed) whose alerts reach a webhook through the stack
``openlora-otel stack`` writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.alertmanager import Alertmanager, Webhook, shipped_config
from tests.support.built import built
from tests.support.processes import free_port, free_port_range
from tests.support.real_parts import debian, missing

ROOT = Path(__file__).resolve().parents[2]
COLLECTOR = ROOT / "collector"
ALERTMANAGER_CONFIG = COLLECTOR / "alertmanager.yml"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"


def tool(*names: str) -> str:
    for name in names:
        binary = shutil.which(name)
        if binary:
            return binary
    missing(
        debian("prometheus-alertmanager"),
        f"{' or '.join(names)} is not installed (Debian package `prometheus-alertmanager`)",
    )


# The Alertmanager releases the tests run: Debian's 0.25 and 0.35, built from the module proxy by
# tools/build.sh (its web UI left out; the API and amtool are whole).
ALERTMANAGERS = pytest.mark.parametrize("release", ["0.25", "0.35"], ids=["alertmanager0.25", "alertmanager0.35"])


def alertmanager_tool(name: str, release: str) -> str:
    """``alertmanager`` or ``amtool`` of ``release``: 0.25 is Debian's package, 0.35 is build/bin's."""
    if release == "0.35":
        return built(name)
    return tool("prometheus-alertmanager", "alertmanager") if name == "alertmanager" else tool("amtool")


def amtool(*args: str, release: str = "0.25") -> subprocess.CompletedProcess:
    binary = alertmanager_tool("amtool", release)
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def uncommented(text: str) -> str:
    """collector/alertmanager.yml with its commented Slack and email receivers switched on."""
    lines = []
    for line in text.splitlines():
        match = re.fullmatch(r"    # (slack_configs:|email_configs:)", line)
        if match:
            lines.append(f"    {match.group(1)}")
        elif line.startswith("    #   "):
            lines.append("      " + line.removeprefix("    #   "))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


# -- collector/alertmanager.yml ---------------------------------------------------------------------------


@pytest.mark.process
@ALERTMANAGERS
def test_amtool_accepts_the_config_and_its_commented_receivers(tmp_path: Path, release: str) -> None:
    result = amtool("check-config", "collector/alertmanager.yml", release=release)
    assert result.returncode == 0, result.stdout + result.stderr
    # The Slack and email examples are valid for this Alertmanager when switched on.
    switched_on = tmp_path / "alertmanager.yml"
    switched_on.write_text(uncommented(ALERTMANAGER_CONFIG.read_text()))
    config = yaml.safe_load(switched_on.read_text())
    receivers = {r["name"]: r for r in config["receivers"]}
    assert "slack_configs" in receivers["critical"] and "email_configs" in receivers["warning"]
    result = amtool("check-config", str(switched_on), release=release)
    assert result.returncode == 0, result.stdout + result.stderr


def test_secrets_come_from_files_never_inline() -> None:
    config = yaml.safe_load(uncommented(ALERTMANAGER_CONFIG.read_text()))
    for receiver in config["receivers"]:
        for slack in receiver.get("slack_configs", []):
            assert "api_url" not in slack and slack["api_url_file"].startswith("/etc/alertmanager/secrets/")
        for email in receiver.get("email_configs", []):
            assert "auth_password" not in email and "auth_secret" not in email
            assert email["auth_password_file"].startswith("/etc/alertmanager/secrets/")
        for webhook in receiver.get("webhook_configs", []):
            url = webhook["url"]
            assert url.startswith("http://127.0.0.1:") and "@" not in url  # a local receiver, no token
    assert config.get("global", {}).keys() <= {"resolve_timeout"}  # no global SMTP or Slack secret
    # The secrets directory compose would mount is the one the files are read from.
    compose = (COLLECTOR / "docker-compose.yml").read_text()
    assert "# - ./secrets:/etc/alertmanager/secrets:ro" in compose


def _routed(*labels: str) -> str:
    result = amtool("config", "routes", "test", "--config.file=collector/alertmanager.yml", *labels)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


@pytest.mark.process
def test_every_alert_is_routed_by_its_severity_and_grouped_by_run() -> None:
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    assert config["route"]["group_by"] == ["alertname", "openlora_run_id"]
    for rule in alert_rules():
        severity = rule["labels"]["severity"]
        assert _routed(f"alertname={rule['alert']}", f"severity={severity}", "openlora_run_id=r1") == severity
    # Critical alerts go out faster than warnings.
    critical, warning = config["route"]["routes"]
    assert critical["receiver"] == "critical" and warning["receiver"] == "warning"
    assert critical["group_wait"] < config["route"]["group_wait"]


def test_every_per_run_alert_carries_the_run_labels_the_config_groups_and_inhibits_by() -> None:
    # An alert that names no run could neither be grouped per run nor inhibited by its run's
    # critical alert; the collector's own alerts, and those of the monitoring itself (Prometheus,
    # Alertmanager and Thanos: the openlora-prometheus, openlora-alertmanager and openlora-thanos
    # groups), are the only ones without a run.
    for rule in alert_rules():
        expr = rule["expr"]
        if rule["alert"].startswith(("OpenloraCollector", "OpenloraPrometheus", "OpenloraAlertmanager", "OpenloraThanos")):
            assert "openlora_run" not in expr
        elif rule["alert"] == "OpenloraKubernetesJobFailed":
            # A run that never reported: its id is the Job's uid from its pods' labels, its name the
            # Job's (kube-state-metrics' series; the how-to's allowlist).
            assert "group_left (openlora_run_id) namespace_job_name:openlora_kubernetes_job_run_id:topk" in expr
            assert expr.rstrip().endswith('"openlora_run_name", "$1", "job_name", "(.+)"\n)'), expr
        elif "group_left (openlora_run_id, openlora_run_name) instance:openlora_run:current" in expr:
            assert expr.rstrip().endswith("instance:openlora_run:current"), rule["alert"]
        elif "instance:openlora_run:current" in expr:
            # The run id from what the alert reads (a by_run copy, or target_info with it), the name
            # joined on that id (issue 29: never the name of the run after it on the same target).
            assert expr.rstrip().endswith(
                "* on (job, instance, openlora_run_id) group_left (openlora_run_name) instance:openlora_run:current"
            ), rule["alert"]
        else:
            assert expr.rstrip().endswith("group_left (openlora_run_name) run:openlora_run:name"), rule[
                "alert"
            ]
            assert "openlora_run_id" in rule["annotations"]["summary"]


# -- compose and the Prometheus configs ----------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((COLLECTOR / "docker-compose.yml").read_text())


def _flag(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    return value


def test_compose_runs_a_pinned_alertmanager_on_loopback_that_prometheus_sends_to() -> None:
    services = compose()["services"]
    alertmanager = services["alertmanager"]
    image, tag = alertmanager["image"].rsplit(":", 1)
    assert image == "prom/alertmanager" and re.fullmatch(r"v\d+\.\d+\.\d+", tag)
    # The pattern of the other services on the host's network: no ports, told to use loopback.
    assert alertmanager["network_mode"] == "host" and "ports" not in alertmanager
    listen = _flag(alertmanager["command"], "web.listen-address")
    assert listen.rsplit(":", 1)[0] == "127.0.0.1"
    assert _flag(alertmanager["command"], "cluster.listen-address") == ""  # no gossip port on 0.0.0.0
    config_file = _flag(alertmanager["command"], "config.file")
    assert f"./alertmanager.yml:{config_file}:ro" in alertmanager["volumes"]
    assert "alertmanager" in services["prometheus"]["depends_on"]
    # Prometheus (on the host's network too) sends to where Alertmanager listens.
    prometheus = yaml.safe_load((COLLECTOR / "prometheus.yml").read_text())
    assert prometheus["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": [listen]}]}]


def test_every_prometheus_config_that_loads_the_rules_sends_their_alerts() -> None:
    configs = [COLLECTOR / "prometheus.yml", *sorted((ROOT / "deploy").rglob("*.yml"))]
    loading = []
    for path in configs:
        config = yaml.safe_load(path.read_text())
        if isinstance(config, dict) and config.get("rule_files"):
            loading.append(path.relative_to(ROOT))
            targets = [
                t
                for am in config["alerting"]["alertmanagers"]
                for sc in am["static_configs"]
                for t in sc["targets"]
            ]
            assert targets == ["127.0.0.1:9093"], path
    assert {str(p) for p in loading} == {
        "collector/prometheus.yml",
        "deploy/prometheus/central.yml",
        "deploy/prometheus/otlp.yml",
    }
    # vmalert, the rule evaluator of the VictoriaMetrics variant, sends to the same place.
    vmalert = (ROOT / "deploy" / "prometheus" / "victoria-metrics" / "vmalert.default").read_text()
    assert "-notifier.url=http://127.0.0.1:9093" in vmalert


# -- a real Alertmanager ------------------------------------------------------------------------------


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    receiver = Webhook()
    yield receiver
    receiver.close()


@pytest.mark.e2e
@ALERTMANAGERS
def test_a_critical_alert_of_a_run_reaches_the_webhook_and_silences_that_runs_warnings(
    tmp_path: Path, webhook: Webhook, release: str
) -> None:
    binary = alertmanager_tool("alertmanager", release)
    config = tmp_path / "alertmanager.yml"
    config.write_text(shipped_config(webhook.url))
    server = Alertmanager(tmp_path, binary, config)
    try:

        def alert(name: str, severity: str, run: str) -> dict:
            return {
                "labels": {
                    "alertname": name,
                    "severity": severity,
                    "openlora_run_id": run,
                    "openlora_run_name": f"name-of-{run}",
                    "instance": "localhost:9464",
                },
                "annotations": {"summary": f"{name} in {run}"},
            }

        alerts = [
            alert("OpenloraLossNonFinite", "critical", "run-a"),
            alert("OpenloraLossDiverging", "warning", "run-a"),
            alert("OpenloraLossDiverging", "warning", "run-b"),
        ]
        request = urllib.request.Request(
            f"{server.url}/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        # Inhibition: run a's warning is suppressed by run a's critical alert, run b's is not.
        deadline = time.monotonic() + 15
        while True:
            state = {
                (a["labels"]["alertname"], a["labels"]["openlora_run_id"]): a["status"]
                for a in server.get("/api/v2/alerts")
            }
            if (
                state[("OpenloraLossDiverging", "run-a")]["state"] == "suppressed"
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.25)
        assert state[("OpenloraLossDiverging", "run-a")]["state"] == "suppressed"
        assert state[("OpenloraLossDiverging", "run-a")]["inhibitedBy"]
        assert state[("OpenloraLossDiverging", "run-b")]["state"] == "active"
        assert state[("OpenloraLossNonFinite", "run-a")]["state"] == "active"
        # The critical one reaches the webhook after the critical route's group_wait (10 s).
        (received,) = webhook.wait_for(lambda a: a["labels"]["alertname"] == "OpenloraLossNonFinite", 30)
        assert received["receiver"] == "critical" and received["status"] == "firing"
        assert received["labels"]["openlora_run_name"] == "name-of-run-a"
        (notification,) = [n for n in webhook.notifications if n["receiver"] == "critical"]
        assert notification["groupLabels"] == {
            "alertname": "OpenloraLossNonFinite",
            "openlora_run_id": "run-a",
        }
    finally:
        server.stop()


# -- a real run gone NaN, through the stack docs/how-to/local-stack.md starts ------------------------------


@pytest.mark.e2e
def test_a_run_gone_nan_reaches_a_webhook_with_its_run_name_and_id(tmp_path: Path, webhook: Webhook) -> None:
    """docs/how-to/local-stack.md: `openlora-otel stack --dir DIR --start`, then `openlora-otel demo --nan-at-step N --run-name NAME`.

    The demo's loss is NaN from step 20; its divergence guard stops it within a second (exit 3)
    after one final scrape. That scrape is the only one that sees the NaNs: OpenloraLossNonFinite and
    OpenloraDivergenceGuardTripped fire on it after the process is gone, named by the run.
    """
    import sys

    from tests.support.processes import child_env, reap
    from tests.support.stack import start_stack

    pytest.importorskip("torch")
    pytest.importorskip("peft")
    metrics_port, prometheus_port, alertmanager_port = free_port(), free_port(), free_port()
    # Fast timings for a test (the shipped ones are 5 s and 15 s): a scrape and an evaluation a second.
    process, _ = start_stack(
        tmp_path / "stack",
        "--port",
        str(metrics_port),
        "--webhook",
        webhook.url,
        "--prometheus-port",
        str(prometheus_port),
        "--alertmanager-port",
        str(alertmanager_port),
        "--scrape-interval",
        "1s",
        "--evaluation-interval",
        "1s",
    )
    try:
        run_id = f"nan-{os.getpid()}-{metrics_port}"
        started = time.monotonic()
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "openlora_otel",
                "demo",
                "--steps",
                "300",
                "--batch-size",
                "2",
                "--nan-at-step",
                "20",
                "--run-name",
                "lr-too-high",
                "--quiet",
            ],
            cwd=ROOT,
            env=child_env(
                OPENLORA_RUN_ID=run_id,
                OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
                # As the docs' example: the run may be over before the first scrape.
                OPENLORA_PROMETHEUS_EXPECT_SCRAPE="true",
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT),
            ),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert demo.returncode == 3, demo.stdout + demo.stderr  # stopped by the divergence guard
        ended = time.monotonic()
        names = ("OpenloraLossNonFinite", "OpenloraDivergenceGuardTripped")
        deadline = ended + 90
        while time.monotonic() < deadline:
            firing = {a["labels"]["alertname"]: a for a in webhook.alerts() if a["status"] == "firing"}
            if all(name in firing for name in names):
                break
            time.sleep(0.25)
        received = time.monotonic()
        assert all(name in firing for name in names), (
            f"received {webhook.notifications}; Prometheus log: {(tmp_path / 'stack' / 'prometheus.log').read_text()[-2000:]}"
        )
        for name in names:
            alert = firing[name]
            assert alert["receiver"] == "critical"
            assert alert["labels"]["openlora_run_id"] == run_id
            assert alert["labels"]["openlora_run_name"] == "lr-too-high"
            assert alert["labels"]["instance"] == f"localhost:{metrics_port}"
            assert "(run lr-too-high)" in alert["annotations"]["summary"]
        assert firing["OpenloraDivergenceGuardTripped"]["labels"]["openlora_guard_reason"] == "nonfinite_loss"
        # The final scrape said how it ended; the guard's page is the only one for that (no failed or vanished).
        query = urllib.parse.urlencode({"query": f'run:openlora_run:outcome{{openlora_run_id="{run_id}"}}'})
        with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/api/v1/query?{query}", timeout=5) as answer:
            outcomes = [r["metric"]["openlora_run_outcome"] for r in json.load(answer)["data"]["result"]]
        assert outcomes == ["stopped_by_guard"]
        assert not [a for a in webhook.alerts() if a["labels"]["alertname"].startswith("OpenloraRun")]
        print(
            f"demo ran {ended - started:.1f} s; both alerts at the webhook {received - ended:.1f} s after it exited"
        )
    finally:
        process.send_signal(signal.SIGTERM)
        reap(process, 40)
    assert process.returncode == 0


# -- real runs that fail and vanish, through the same stack -------------------------------------------

FAILING_RUN = """
import os, time
from openlora_otel import setup_telemetry
telemetry = setup_telemetry()
started = time.monotonic()
while telemetry._prometheus.scrapes < 2 and time.monotonic() - started < 30:
    telemetry.training.record_step(loss=1.0, tokens=10, step_time_s=0.01)
    time.sleep(0.01)
raise RuntimeError("CUDA error: an illegal memory access (this text is never exported)")
"""

KILLED_RUN = """
import os, time
from openlora_otel import setup_telemetry
telemetry = setup_telemetry()
started = time.monotonic()
while telemetry._prometheus.scrapes < 2 and time.monotonic() - started < 30:
    telemetry.training.record_step(loss=1.0, tokens=10, step_time_s=0.01)
    time.sleep(0.01)
print("SCRAPED", flush=True)
time.sleep(120)
"""


@pytest.mark.e2e
def test_a_run_that_raises_and_one_that_is_sigkilled_reach_the_webhook(tmp_path: Path, webhook: Webhook) -> None:
    """A process that raises reports `failed` in its final scrape (OpenloraRunFailed, with the exception's
    type and never its message); one that is SIGKILLed reports nothing and vanishes (OpenloraRunVanished).
    Neither is taken for the other."""
    import sys

    from tests.support.processes import child_env, reap
    from tests.support.stack import start_stack

    port = free_port_range(2)  # the stack's --ranks 2 scrapes port and port + 1
    prometheus_port, alertmanager_port = free_port(), free_port()
    process, _ = start_stack(
        tmp_path / "stack",
        "--ranks",
        "2",
        "--port",
        str(port),
        "--webhook",
        webhook.url,
        "--prometheus-port",
        str(prometheus_port),
        "--alertmanager-port",
        str(alertmanager_port),
        "--scrape-interval",
        "1s",
        "--evaluation-interval",
        "1s",
    )
    killed = None
    try:
        tag = f"{os.getpid()}-{port}"
        failing_id, killed_id = f"failing-{tag}", f"killed-{tag}"

        def env(run_id: str, name: str, metrics_port: int) -> dict[str, str]:
            return child_env(
                OPENLORA_RUN_ID=run_id,
                OPENLORA_RUN_NAME=name,
                OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
                OPENLORA_QUIET="true",
                PYTHONPATH=str(ROOT),
            )

        killed = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN],
            cwd=ROOT,
            env=env(killed_id, "oom-killed", port + 1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        failing = subprocess.run(
            [sys.executable, "-c", FAILING_RUN],
            cwd=ROOT,
            env=env(failing_id, "bad-kernel", port),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert failing.returncode == 1 and "RuntimeError" in failing.stderr, failing.stderr[-2000:]
        assert killed.stdout is not None and killed.stdout.readline().strip() == "SCRAPED"
        killed.kill()  # SIGKILL: no shutdown, no final scrape
        reap(killed, 10)
        ended = time.monotonic()
        names = ("OpenloraRunFailed", "OpenloraRunVanished")
        deadline = ended + 90
        while time.monotonic() < deadline:
            firing = {a["labels"]["alertname"]: a for a in webhook.alerts() if a["status"] == "firing"}
            if all(name in firing for name in names):
                break
            time.sleep(0.25)
        assert all(name in firing for name in names), (
            f"received {webhook.notifications}; Prometheus log: {(tmp_path / 'stack' / 'prometheus.log').read_text()[-2000:]}"
        )
        failed, vanished = firing["OpenloraRunFailed"], firing["OpenloraRunVanished"]
        assert failed["receiver"] == vanished["receiver"] == "critical"
        assert failed["labels"]["openlora_run_id"] == failing_id
        assert failed["labels"]["openlora_run_name"] == "bad-kernel"
        assert failed["labels"]["error_type"] == "RuntimeError"
        assert "illegal" not in json.dumps(failed)
        assert failed["labels"]["instance"] == f"localhost:{port}"
        assert vanished["labels"]["openlora_run_id"] == killed_id
        assert vanished["labels"]["openlora_run_name"] == "oom-killed"
        assert vanished["labels"]["instance"] == f"localhost:{port + 1}"
        # Each run has the one outcome: the failed run never vanished, the killed one never failed.
        query = urllib.parse.urlencode(
            {"query": 'group by (alertname, openlora_run_id) (count_over_time(ALERTS{alertname=~"OpenloraRun.*"}[10m]))'}
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/api/v1/query?{query}", timeout=5) as answer:
            seen = {
                (r["metric"]["alertname"], r["metric"]["openlora_run_id"])
                for r in json.load(answer)["data"]["result"]
            }
        assert seen == {("OpenloraRunFailed", failing_id), ("OpenloraRunVanished", killed_id)}
        print(f"both alerts at the webhook {time.monotonic() - ended:.1f} s after the SIGKILL")
    finally:
        if killed is not None and killed.poll() is None:
            killed.kill()
            reap(killed, 10)
        process.send_signal(signal.SIGTERM)
        reap(process, 40)
    assert process.returncode == 0

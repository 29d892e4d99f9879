"""collector/ and grafana/: promtool checks, config consistency, dashboard checks, and every query on real data."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from openlora_otel.config import TelemetryConfig
from openlora_otel.names import (
    ADAPTER_METRICS,
    GPU_METRICS,
    HOST_METRICS,
    INFERENCE_METRICS,
    RUN_METRICS,
    TRAINING_METRICS,
)
from tests.support import docs_text
from tests.support.dashboards import http_variable_options, run_every_query, substitute
from tests.support.metrics_paths import METRIC_PATHS
from tests.support.polling import wait_until
from tests.support.processes import child_env, free_port, reap
from tests.support.prometheus_server import PROMETHEUS_MAJORS
from tests.support.prometheus_server import promtool as run_promtool

if TYPE_CHECKING:
    from openlora_otel.telemetry import Telemetry
    from tests.support.fake_nvml import FakeGpu, FakeNvml
    from tests.support.prometheus_server import Prometheus

ROOT = Path(__file__).resolve().parents[2]
COLLECTOR = ROOT / "collector"
DASHBOARD = ROOT / "grafana" / "dashboards" / "openlora-training.json"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"


def promtool(*args: str, major: int = 2) -> subprocess.CompletedProcess:
    return run_promtool(*args, major=major, cwd=ROOT)


# -- promtool -------------------------------------------------------------------------------


@pytest.mark.process
@PROMETHEUS_MAJORS
def test_promtool_check_config(major: int) -> None:
    result = promtool("check", "config", "collector/prometheus.yml", major=major)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


@pytest.mark.process
def test_the_otlp_receivers_config_passes_promtool_3_and_says_2_cannot_load_it() -> None:
    result = promtool("check", "config", "deploy/prometheus/otlp.yml", major=3)
    assert result.returncode == 0, result.stdout + result.stderr
    old = promtool("check", "config", "deploy/prometheus/otlp.yml", major=2)
    assert old.returncode != 0 and "otlp" in old.stdout + old.stderr
    assert "Needs Prometheus 3.0 or later" in (ROOT / "deploy" / "prometheus" / "otlp.yml").read_text()


@pytest.mark.process
@PROMETHEUS_MAJORS
def test_promtool_check_rules(major: int) -> None:
    result = promtool("check", "rules", "openlora_otel/rules/openlora.yml", major=major)
    assert result.returncode == 0, result.stdout + result.stderr


RULE_TESTS = sorted((ROOT / "tests" / "rules").glob("*.yml"))


@pytest.mark.process
@PROMETHEUS_MAJORS
def test_promtool_test_rules_fire_and_stay_quiet(major: int) -> None:
    assert {p.name for p in RULE_TESTS} >= {"openlora_test.yml", "healthy_setup_test.yml", "inference_test.yml"}
    result = promtool("test", "rules", *(str(p.relative_to(ROOT)) for p in RULE_TESTS), major=major)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.process
def test_promtool_native_histogram_rule_tests() -> None:
    """tests/rules/native/: the inference records and alerts on native histograms with
    deploy/prometheus/native-histograms.yml (promtool 3: 2.42's test input has no native histograms)."""
    tests = sorted((ROOT / "tests" / "rules" / "native").glob("*.yml"))
    assert [p.name for p in tests] == ["native_histograms_test.yml"]
    order = [group["name"] for group in yaml.safe_load(RULES.read_text())["groups"]]
    for path in tests:
        assert yaml.safe_load(path.read_text())["group_eval_order"] == ["openlora-native-histograms", *order]
    result = promtool("test", "rules", *(str(p.relative_to(ROOT)) for p in tests), major=3)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_tests_evaluate_the_groups_in_the_rules_files_order() -> None:
    """promtool's order of the groups at one evaluation time is not fixed; several groups read a record
    of openlora-training (instance:openlora_run:current), so a case at a run's start or end passed or
    failed by chance (OpenloraInferenceAdapterLoadFailed one evaluation longer, a GPU alert one later)."""
    order = [group["name"] for group in yaml.safe_load(RULES.read_text())["groups"]]
    for path in RULE_TESTS:
        assert yaml.safe_load(path.read_text()).get("group_eval_order") == order, path.name


def rules() -> list[dict]:
    """Every rule, recording and alerting."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def test_every_alert_has_severity_summary_description_runbook_and_tests() -> None:
    from openlora_otel.stack import DEFAULT_RUNBOOK_BASE

    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    # The firing and quiet cases may be in any rule test file (the inference alerts have their own).
    tests = [test for path in RULE_TESTS for test in yaml.safe_load(path.read_text())["tests"]]
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for test in tests:
        for case in test.get("alert_rule_test", []):
            bucket = firing if case["exp_alerts"] else quiet
            bucket[case["alertname"]] = bucket.get(case["alertname"], 0) + 1
    for rule in alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        # One base for every URL (the docs site's runbooks page), the alert's name as the anchor, and the
        # page's section for the alert carries that anchor (tests/project/test_docs_site.py: the built page too).
        assert rule["annotations"]["runbook_url"] == f"{DEFAULT_RUNBOOK_BASE}#{name.lower()}", name
        assert f"\n### {name} {{#{name.lower()}}}\n" in runbooks, name
        assert firing.get(name) and quiet.get(name), f"{name} needs a firing and a quiet test case"
    # The runbooks page has a runbook for every alert and for no alert that no longer exists.
    assert set(re.findall(r"^### (\w+) \{#\w+\}$", runbooks, re.M)) == {rule["alert"] for rule in alerts()}
    # Each runbook states its rule's severity, expression and duration as the rules file has them.
    for rule in alerts():
        section = runbooks.split(f"### {rule['alert']} {{#{rule['alert'].lower()}}}\n", 1)[1].split("\n### ", 1)[0]
        stated = f"*{rule['labels']['severity']}* — `{' '.join(rule['expr'].split())}`"
        stated += f" for {rule['for']}" if "for" in rule else ""
        assert section.strip().splitlines()[0] == stated, rule["alert"]
    # Every recorded series is read by something: an alert, another rule, or a dashboard panel.
    readers = [r["expr"] for r in rules()] + [
        path.read_text() for path in (ROOT / "grafana" / "dashboards").glob("*.json")
    ]
    for rule in rules():
        if "record" in rule:
            others = [text for text in readers if text != rule["expr"]]
            assert any(rule["record"] in text for text in others), rule["record"]


def test_healthy_setups_are_checked_for_every_alert_over_their_whole_span() -> None:
    # ALERTS over the whole span: a rule added later is covered without being named here,
    # and an alert that fires for a while and resolves is caught too.
    tests = yaml.safe_load((ROOT / "tests" / "rules" / "healthy_setup_test.yml").read_text())["tests"]
    pull_targets = [
        s["values"] for test in tests for s in test["input_series"] if s["series"].startswith('up{job="openlora",')
    ]
    assert any(v.startswith("0x") and " 1" not in v for v in pull_targets), "an OTLP-only setup"
    assert any(v.count("1x") >= 2 for v in pull_targets), "two runs on one pull target"
    for test in tests:
        (check,) = test["promql_expr_test"]
        assert check["expr"] == (
            f'count by (alertname) (count_over_time(ALERTS{{alertstate="firing"}}[{check["eval_time"]}]))'
        )
        assert check["exp_samples"] == []


# -- the collector config against compose, Prometheus and setup_telemetry ----------------------


def collector_config() -> dict:
    return yaml.safe_load((COLLECTOR / "otelcol.yaml").read_text())


def compose() -> dict:
    return yaml.safe_load((COLLECTOR / "docker-compose.yml").read_text())


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _published(service: dict) -> dict[int, tuple[str, int]]:
    """Container port -> (host address, host port) for each ``ports`` entry ``ADDR:HOST:CONTAINER``."""
    published = {}
    for entry in service.get("ports", []):
        address, host_port, container_port = entry.split(":")
        published[int(container_port)] = (address, int(host_port))
    return published


def prometheus_config() -> dict:
    return yaml.safe_load((COLLECTOR / "prometheus.yml").read_text())


def scrape_targets() -> dict[str, list[str]]:
    return {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in prometheus_config()["scrape_configs"]
    }


def _collector_service() -> str:
    return next(name for name, s in compose()["services"].items() if "opentelemetry-collector" in s["image"])


def test_collector_ports_match_compose_prometheus_and_the_sdk_default() -> None:
    config = collector_config()
    published = _published(compose()["services"][_collector_service()])
    grpc = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert grpc.startswith("0.0.0.0:") and http.startswith("0.0.0.0:")  # reachable inside a container
    assert _port(grpc) in published and _port(http) in published

    # What setup_telemetry() sends by default with OTEL_METRICS_EXPORTER=otlp lands on the HTTP receiver.
    default = TelemetryConfig.from_env({"OTEL_METRICS_EXPORTER": "otlp"}).otlp
    assert default.protocol == "http/protobuf"
    assert default.endpoint == f"http://localhost:{published[_port(http)][1]}/v1/metrics"
    assert published[_port(http)][0] == "127.0.0.1"
    grpc_default = TelemetryConfig.from_env(
        {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert grpc_default.otlp.endpoint == f"http://localhost:{published[_port(grpc)][1]}"

    # Prometheus shares the host's network, so it reaches the collector where compose publishes
    # the collector's listeners on the host's loopback (a compose service name would not resolve).
    targets = scrape_targets()
    exporter_port = _port(config["exporters"]["prometheus"]["endpoint"])
    self_port = config["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"][
        "port"
    ]
    for job, container_port in (("openlora-collector", exporter_port), ("openlora-collector-self", self_port)):
        assert container_port in published, f"{job}: the collector's port {container_port} is not published"
        address, host_port = published[container_port]
        assert targets[job] == [f"{address}:{host_port}"], job
    assert next(j for j in prometheus_config()["scrape_configs"] if j["job_name"] == "openlora-collector")[
        "honor_labels"
    ]


LOOPBACK = {"127.0.0.1", "::1"}


def _addresses(host: str, port: int, **flags: int) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, **flags)}


def test_pull_target_is_where_the_default_endpoint_binds() -> None:
    """Prometheus, on the host's network, scrapes the address a process binds with nothing set."""
    services = compose()["services"]
    assert services["prometheus"].get("network_mode") == "host"
    default = TelemetryConfig()
    ((target,),) = [scrape_targets()["openlora"]]
    host, port = target.rsplit(":", 1)
    assert int(port) == default.prometheus_port
    # The endpoint binds the first address getaddrinfo gives for its host (prometheus_client's
    # _get_best_family); Prometheus tries every address its target name resolves to.
    bound = socket.getaddrinfo(
        default.prometheus_host, default.prometheus_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0][4][0]
    assert bound in LOOPBACK, f"the default bind {bound} is not loopback"
    assert bound in _addresses(host, default.prometheus_port), f"{target} never reaches {bound}"


def test_every_target_is_reachable_from_the_host_network_and_nothing_listens_beyond_loopback() -> None:
    services = compose()["services"]
    # What answers on the host's loopback: a container's published port, or a service on the host's
    # network (Prometheus, Alertmanager: the stack scrapes itself) where it is told to listen.
    on_loopback = {
        host_port
        for service in services.values()
        if service.get("network_mode") != "host"
        for address, host_port in _published(service).values()
        if address in LOOPBACK
    } | {
        int(argument.rsplit(":", 1)[1])
        for service in services.values()
        if service.get("network_mode") == "host"
        for argument in service.get("command", [])
        if argument.startswith("--web.listen-address=") and argument.split("=", 1)[1].rsplit(":", 1)[0] in LOOPBACK
    }
    for job, targets in scrape_targets().items():
        for target in targets:
            host, port = target.rsplit(":", 1)
            assert _addresses(host, int(port)) <= LOOPBACK, f"{job}: {target} is not on the host's loopback"
            if job != "openlora":  # the training process on the host; every other target is a server of compose
                assert int(port) in on_loopback, f"{job}: nothing answers on {port} on loopback"

    # Services on the host's network get no port mapping: each is told to listen on loopback.
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus.get("network_mode") == "host" and grafana.get("network_mode") == "host"
    assert "ports" not in prometheus and "ports" not in grafana  # ignored on the host's network
    (listen,) = [a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--web.listen-address=")]
    listen_host, listen_port = listen.rsplit(":", 1)
    assert listen_host in LOOPBACK
    assert grafana["environment"]["GF_SERVER_HTTP_ADDR"] in LOOPBACK
    # Grafana's datasource is where Prometheus listens.
    datasource = yaml.safe_load(
        (ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == f"http://{listen_host}:{listen_port}"


def _seconds(duration: str) -> float:
    """A Prometheus duration such as ``5s``, ``10m``, ``1h`` in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration).groups()
    return float(number) * units[unit]


def _alert(name: str) -> dict:
    (rule,) = [r for r in alerts() if r["alert"] == name]
    return rule


def test_rules_fit_the_shipped_timings() -> None:
    # A refused scrape takes milliseconds, a timed-out one the scrape timeout: the threshold
    # must sit between them, or a frozen process never alerts (or an exited one does).
    scrape_timeout = _seconds(prometheus_config()["global"]["scrape_timeout"])
    threshold = float(
        re.search(
            r'scrape_duration_seconds\{job="openlora"\} >= ([\d.]+)',
            _alert("OpenloraTrainingEndpointUnresponsive")["expr"],
        ).group(1)
    )
    assert 1 <= threshold < scrape_timeout
    # The collector holds a finished OTLP run's last values for metric_expiration; they must be
    # gone before the stall window could see them as flat, or every OTLP run would end in a stall.
    stall_window = re.search(
        r"increase\(openlora_training_steps_total\[(\w+)\]\) == 0", _alert("OpenloraTrainingStalled")["expr"]
    ).group(1)
    expiration = collector_config()["exporters"]["prometheus"]["metric_expiration"]
    assert _seconds(expiration) < _seconds(stall_window)


def test_dashboards_draw_the_input_bound_threshold_the_alert_uses() -> None:
    threshold = float(
        re.search(
            r"avg_over_time\(run:openlora_training_data_wait_fraction:by_run\[\w+\]\) > ([\d.]+)",
            _alert("OpenloraInputBound")["expr"],
        ).group(1)
    )
    boards = [json.loads(path.read_text()) for path in (ROOT / "grafana" / "dashboards").glob("*.json")]
    drawn = [
        step["value"]
        for board in boards
        for panel in board["panels"]
        if "data-wait fraction" in panel["title"].lower()
        for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        if step["value"] is not None
    ]
    assert len(drawn) == 2 and set(drawn) == {threshold}, drawn


@pytest.mark.e2e
def test_shipped_prometheus_config_scrapes_a_process_with_nothing_set(tmp_path) -> None:
    """A real Prometheus, with the shipped job's target host and timing, scrapes the default bind."""
    from openlora_otel import setup_telemetry
    from tests.support.prometheus_server import Prometheus, prometheus_binary

    prometheus_binary()
    settings = prometheus_config()["global"]
    assert settings["scrape_timeout"] == settings["scrape_interval"]  # the helper sets both to one value
    ((target,),) = [scrape_targets()["openlora"]]
    host = target.rsplit(":", 1)[0]
    # The default host; any free port, since 9464 may be taken on a shared machine.
    telemetry = setup_telemetry("deploy-check", config=TelemetryConfig(prometheus_port=0))
    prometheus = None
    try:
        assert telemetry.config.prometheus_host == TelemetryConfig().prometheus_host
        telemetry.training.record_step(loss=1.0, tokens=8)
        port = urllib.parse.urlparse(telemetry.prometheus_url).port
        prometheus = Prometheus(tmp_path, [f"{host}:{port}"], scrape_interval=settings["scrape_interval"])
        assert prometheus.wait_for('openlora_training_steps_total{job="openlora"} == 1', timeout=30)
        assert prometheus.query(f'up{{job="openlora", instance="{host}:{port}"}} == 1')
    finally:
        telemetry.shutdown()
        if prometheus is not None:
            prometheus.stop()


@pytest.mark.e2e
def test_unresponsive_alert_tells_a_frozen_endpoint_from_a_closed_port(tmp_path) -> None:
    """The premise of OpenloraTrainingEndpointUnresponsive, on a real Prometheus with the shipped timing."""
    from tests.support.processes import free_port
    from tests.support.prometheus_server import Prometheus, prometheus_binary

    prometheus_binary()
    settings = prometheus_config()["global"]
    host = scrape_targets()["openlora"][0].rsplit(":", 1)[0]
    expr = _alert("OpenloraTrainingEndpointUnresponsive")["expr"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)  # the kernel accepts connections; nothing ever answers
        frozen_target = f"{host}:{frozen.getsockname()[1]}"
        closed_target = f"{host}:{free_port()}"  # what an exited process leaves
        # The rules loaded: the alert's expression reads the record that names each target's run.
        prometheus = Prometheus(
            tmp_path,
            [frozen_target, closed_target],
            scrape_interval=settings["scrape_interval"],
            rule_files=[str(RULES)],
        )
        try:
            closed = prometheus.wait_for(f'scrape_duration_seconds{{instance="{closed_target}"}}', timeout=30)
            assert closed and float(closed[0]["value"][1]) < 0.5
            assert prometheus.query(f'up{{instance="{closed_target}"}} == 0')
            firing = prometheus.wait_for(expr, timeout=30)
            assert {series["metric"]["instance"] for series in firing} == {frozen_target}
        finally:
            prometheus.stop()


def test_collector_version_is_pinned_and_stated() -> None:
    image = next(
        s["image"] for s in compose()["services"].values() if "opentelemetry-collector" in s["image"]
    )
    version = image.rsplit(":", 1)[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert f"opentelemetry-collector-contrib:{version}" in (COLLECTOR / "otelcol.yaml").read_text()
    # The same contrib release as our distribution (collector/otelcol-openlora), which runs the tests.
    manifest = yaml.safe_load((COLLECTOR / "otelcol-openlora" / "manifest.yaml").read_text())
    contrib = {
        entry["gomod"].rsplit(" v", 1)[1]
        for kind in ("receivers", "processors", "exporters", "extensions")
        for entry in manifest[kind]
        if "opentelemetry-collector-contrib" in entry["gomod"]
    }
    assert contrib == {version}


def test_compose_is_safe_and_references_existing_files() -> None:
    text = (COLLECTOR / "docker-compose.yml").read_text()
    services = compose()["services"]
    assert set(services) >= {"otel-collector", "prometheus", "grafana"}
    for name, service in services.items():
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and tag != "latest", f"{name} image is not pinned"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (COLLECTOR / source).exists(), f"{name} mounts missing {source}"
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), (
        "Grafana's password must come from the environment"
    )
    assert "admin" not in password.split(":?")[0].lower().replace("grafana_admin_password", "")
    assert "GF_SECURITY_ADMIN_PASSWORD: admin" not in text


# -- the dashboard ----------------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_committed_dashboard_matches_its_generator() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", ROOT / "grafana" / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run: python grafana/build_dashboard.py"


def test_dashboard_structure() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert "${DS_" not in DASHBOARD.read_text() and "__inputs" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert set(variables) >= {"datasource", "job", "run", "instance", "gpu"}
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"no unit: {panel['title']}"
        assert panel.get("description"), f"no description: {panel['title']}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            if re.search(r"\b(rate|increase)\(", expr):
                assert "[$__rate_interval]" in expr, expr
            named = set(
                re.findall(
                    r"\b([a-z_]+(?:_total|_bytes|_seconds|_celsius|_watts|_joules|_hertz|_ratio|[a-z]))\{",
                    expr,
                )
            )
            for name in named - {"target_info"}:
                assert name.replace("_bucket", "") in panel["description"] or name in panel["description"], (
                    f"{panel['title']}: description does not name {name}"
                )
    provisioning = yaml.safe_load(
        (ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    assert provisioning["datasources"][0]["uid"] == variables["datasource"]["current"]["value"]


@pytest.mark.parametrize("name", ["training", "cluster", "inference"])
def test_a_query_over_the_whole_range_is_asked_once(name: str) -> None:
    """A target reading [$__range] is instant: as a range query every point of the panel would read the
    whole range again (over 30 days at a 30-minute step, 1,440 times: Thanos Query timed out on one,
    benchmarks/bench_long_term.py)."""
    board = json.loads((ROOT / "grafana" / "dashboards" / f"openlora-{name}.json").read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            if re.search(r"\[\$__range\]", target["expr"]):
                assert target.get("instant") is True, f"{panel['title']}: {target['expr'][:80]}"


KNOWN = {
    spec.prometheus
    for spec in (*RUN_METRICS, *TRAINING_METRICS, *ADAPTER_METRICS, *GPU_METRICS, *HOST_METRICS, *INFERENCE_METRICS)
} | {spec.prometheus_collector for spec in (*GPU_METRICS, *HOST_METRICS, *INFERENCE_METRICS)}


def _series_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr))
    names |= {m.replace("(_ratio)?", "") for m in re.findall(r'__name__=~"([a-z_()?]+)"', expr)}
    # target_info comes with every Resource; up and scrape_* are Prometheus's own per target.
    return names - {"target_info", "up", "scrape_duration_seconds"}


# The kube-state-metrics series the openlora-kubernetes rules read (v2.15 names).
KUBE_STATE_METRICS = {"kube_job_status_failed", "kube_job_failed", "kube_job_labels", "kube_pod_labels"}


def test_dashboard_and_rules_only_name_series_that_exist() -> None:
    exprs = [t["expr"] for p in panels() for t in p["targets"]] + [r["expr"] for r in rules()]
    recorded = {r["record"] for r in rules() if "record" in r}
    for expr in exprs:
        for name in _series_names(expr):
            if name.startswith(("otelcol_", "thanos_")):
                continue  # the collector's and Thanos's own metrics
            if name in KUBE_STATE_METRICS:
                continue  # read from a real kube-state-metrics in tests/deploy/test_kubernetes_cluster.py
            if name in recorded:
                continue  # a series the rules record themselves
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in KNOWN or base in KNOWN, f"{name} in {expr!r} is not a metric openlora-otel exports"


# -- every query against a real Prometheus that scraped a real demo run ----------------------------

# A second, short demo run whose loss goes NaN from step 5: the evaluation of step 5 sees the
# NaN weights (a non-finite eval loss and perplexity), and the divergence guard trips on the
# third NaN loss and stops the run. Its own process (one open Telemetry per process), which
# keeps serving its final values until the test closes its stdin. Small batches and one
# thread, so that it takes little from the main run on a machine of two cores.
DIVERGING_RUN = r"""
import sys
from openlora_otel import setup_telemetry
from openlora_otel.demo.options import DemoOptions
from openlora_otel.demo.train import run_demo

options = DemoOptions(
    steps=400, batch_size=2, seq_len=16, eval_every=5, nan_at_step=5, lr=1e-3, quiet=True
)
telemetry = setup_telemetry(
    "openlora-demo", run_name="diverged", hyperparameters=options.hyperparameters()
)
result = run_demo(options, telemetry, where="test")
print(result.interrupted, result.steps, flush=True)
sys.stdin.read()
telemetry.shutdown()
"""


def docs_promql(*blocks: tuple[str, str]) -> list[str]:
    """The expressions of the marked ```promql blocks, each ``(file, marker)``: the lines up to a
    comment line or the block's end are one expression."""
    exprs: list[str] = []
    for path, marker in blocks:
        current: list[str] = []
        for line in [*docs_text.fenced(path, marker, "promql").splitlines(), "#"]:
            if line.startswith("#"):
                exprs += [" ".join(current)] if current else []
                current = []
            elif line.strip():
                current.append(line.strip())
    return exprs


# The documentation's PromQL that compares runs by a hyperparameter (run names, the dashboards' runs).
COMPARE_RUNS_BLOCKS = (
    ("docs/concepts/run-identity.md", "run-names-promql"),
    ("docs/reference/dashboards.md", "dashboard-runs-promql"),
)


def test_the_documented_promql_to_compare_runs_is_found() -> None:
    """The blocks the end-to-end test runs (below) are there: each expression joins the run info."""
    compare = docs_promql(*COMPARE_RUNS_BLOCKS)
    assert len(compare) >= 3 and all("openlora_run_info" in expr for expr in compare), compare
# Both runs by name and learning rate (the main run keeps the demo's default, 3e-3).
RUN_NAMES = {"dash-run": "dash", "diverged-run": "diverged"}
LR = "openlora_hparam_learning_rate"

# The alerts whose condition holds on that run (their `for` aside), and where.
ALERTS_ON_THE_DIVERGED_RUN = {
    "OpenloraDivergenceGuardTripped": {"openlora_guard_reason": {"nonfinite_loss"}},
    "OpenloraEvalNonFinite": {"openlora_eval_metric": {"loss", "perplexity"}},
}
# The main run's fake Hopper GPU is busy and unwell: an XID 48 (double-bit ECC) during the run, a
# row remap pending, its PCIe link at x8 Gen4 of x16 Gen5. The GPU alerts whose condition holds on
# its series (their `for` aside), with their labels; the other GPU alerts hold nowhere (a failed
# GPU, a failed remap, XID 79, replays), and the degraded state is left to the pending remap's alert.
ALERTS_ON_THE_FAKE_GPU = {
    "OpenloraGpuHardwareXid": {"openlora_gpu_xid_code": {"48"}},
    "OpenloraGpuRowRemapPending": {},
    "OpenloraGpuPcieLinkNarrow": {},
    "OpenloraGpuPcieLinkGenerationLow": {},
}


DIVERGED_INSTANCE = "diverged-run-instance"  # its service.instance.id on the push paths


@pytest.mark.e2e
@METRIC_PATHS
def test_every_dashboard_and_rule_query_on_a_real_demo_run(
    tmp_path, monkeypatch: pytest.MonkeyPatch, path: str, major: int
) -> None:
    """On each path of tests/support/metrics_paths.py: pulled (Prometheus 2.42 and 3.16), through our Collector
    (2.42 and 3.16), straight into Prometheus 3's OTLP receiver."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from openlora_otel import setup_telemetry
    from openlora_otel.hardware import gpu, nvml
    from tests.support.fake_nvml import FakeNvml, h100s
    from tests.support.metrics_paths import MetricsPath

    # GPU series from a fake NVML and allocator, so the GPU panels have data on a machine without one.
    cards = h100s(1, processes={os.getpid(): 2 * 2**30})
    cards[0].utilization = 0.9
    cards[0].remap = (3, 1, 1, 0)  # correctable, uncorrectable, pending, failed
    cards[0].link, cards[0].link_max = (8, 4), (16, 5)
    fake = FakeNvml(cards)
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: fake)
    # Its energy counter rises at 300 W (from the clock, not a count of sleeps) while the test runs,
    # for the energy row: the run's share of it is all of it.
    base, started, stop_energy = cards[0].energy_j, time.monotonic(), threading.Event()

    def burn() -> None:
        while not stop_energy.wait(0.05):
            cards[0].energy_j = base + 300.0 * (time.monotonic() - started)

    threading.Thread(target=burn, daemon=True).start()
    stats = {
        "allocated_bytes.all.current": 10,
        "reserved_bytes.all.current": 20,
        "allocated_bytes.all.peak": 15,
    }
    monkeypatch.setattr(
        gpu, "torch_allocator_stats", lambda: [(0, cards[0].uuid.removeprefix("GPU-"), stats)]
    )
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    shutil.copy(RULES, rules_dir / "openlora.yml")
    telemetry = diverging = None
    with MetricsPath(path, major, tmp_path, rule_files=[str(rules_dir / "openlora.yml")]) as metrics:
        try:
            if metrics.push:
                diverging_instance = DIVERGED_INSTANCE
                exporter_env = metrics.push_env(instance=DIVERGED_INSTANCE)
                main_env = metrics.push_env()
            else:
                diverging_port = free_port()
                diverging_instance = f"127.0.0.1:{diverging_port}"
                exporter_env = {
                    "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                    "OTEL_EXPORTER_PROMETHEUS_PORT": str(diverging_port),
                    "OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": "0",
                }
                main_env = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": "0"}
            # A peak, as OPENLORA_PEAK_FLOPS gives it: on a CPU there is none, and no MFU without one.
            config = dataclasses.replace(
                TelemetryConfig.from_env(main_env), gpu_metrics="on", gpu_devices="all", peak_flops=1e12
            )
            diverging_log = tmp_path / "diverging-run.log"
            with diverging_log.open("wb") as log:
                diverging = subprocess.Popen(
                    [sys.executable, "-c", DIVERGING_RUN],
                    cwd=ROOT,
                    env=child_env(
                        OPENLORA_RUN_ID="diverged-run",
                        OPENLORA_QUIET="true",
                        OMP_NUM_THREADS="1",
                        PYTHONPATH=str(ROOT),
                        **exporter_env,
                    ),
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            from openlora_otel.demo.options import DemoOptions

            telemetry = setup_telemetry(
                "openlora-demo",
                run_id="dash-run",
                run_name=RUN_NAMES["dash-run"],
                hyperparameters=DemoOptions().hyperparameters(),
                config=config,
            )
            if metrics.push:
                main_instance = telemetry.resource.attributes["service.instance.id"]
            else:
                main_instance = telemetry.prometheus_url.split("//", 1)[1].split("/", 1)[0]
            prometheus = metrics.scrape([main_instance, diverging_instance])
            _check_every_query(
                telemetry, prometheus, main_instance, diverging_instance, diverging_log, fake, cards[0]
            )
            # The series names are the ones openlora_otel.names gives for the path (the docs' table is made
            # from them): checked here against what the real Collector and Prometheus 3's receiver made.
            observed = set(prometheus.get("/api/v1/label/__name__/values")["data"])
            assert_series_names_follow_the_path(observed, path, native=metrics.native)
        finally:
            if diverging is not None:
                diverging.stdin.close()  # the diverged run shuts down
                reap(diverging, 30)
            if telemetry is not None:
                telemetry.shutdown()
            stop_energy.set()


# Series that are no exported metric: Prometheus' own per scrape, recording rules (with a colon), alerts.
NOT_METRICS = {"up", "target_info", "ALERTS", "ALERTS_FOR_STATE"}


def assert_series_names_follow_the_path(observed: set[str], path: str, native: bool = False) -> None:
    """Every exported series name seen is a metric's name on ``path`` (``MetricSpec.prometheus`` pulled,
    ``prometheus_collector`` pushed), histograms as their _bucket/_sum/_count (``native``: a native
    histogram under the name alone, and the _sum and _count that deploy/prometheus/native-histograms.yml
    records from it; no _bucket)."""
    specs = (*RUN_METRICS, *TRAINING_METRICS, *ADAPTER_METRICS, *GPU_METRICS, *HOST_METRICS, *INFERENCE_METRICS)
    expected: dict[str, str] = {}
    for spec in specs:
        name = spec.prometheus if path == "pull" else spec.prometheus_collector
        suffixes = ("", "_sum", "_count") if native else ("_bucket", "_sum", "_count")
        for suffix in suffixes if spec.kind == "histogram" else ("",):
            expected[name + suffix] = spec.name
    if native:  # not vacuous: the step durations came as a native histogram
        assert "openlora_training_step_duration_seconds" in observed, sorted(observed)
        assert "openlora_training_step_duration_seconds_bucket" not in observed
    exported = {
        name for name in observed if name not in NOT_METRICS and ":" not in name and not name.startswith("scrape_")
    }
    assert exported - set(expected) == set(), f"{path}: series no metric is named so on this path"
    # Not vacuous: the unit-1 gauges, whose names differ between the paths, were seen under this path's.
    for spec in (*GPU_METRICS, *HOST_METRICS):
        if spec.unit == "1" and spec.kind == "gauge" and spec.name in {"hw.gpu.utilization", "system.cpu.utilization"}:
            name = spec.prometheus if path == "pull" else spec.prometheus_collector
            assert name in exported, (path, name, sorted(exported))


def _check_every_query(
    telemetry: Telemetry,
    prometheus: Prometheus,
    main_instance: str,
    diverging_instance: str,
    diverging_log: Path,
    fake: FakeNvml,
    card: FakeGpu,
) -> None:
    """Train the demo in a thread while every dashboard query, variable and rule runs on what it reports
    (the main run, ``instance`` ``main_instance``, has GPU ``card`` of the fake NVML ``fake``; the
    diverging run is ``diverging_instance``)."""
    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.demo.train import run_demo

    done, stop = threading.Event(), threading.Event()
    options = DemoOptions(steps=5000, eval_every=25, quiet=True)
    trainer = threading.Thread(
        target=lambda: (run_demo(options, telemetry, where="test", stop_event=stop), done.set())
    )
    trainer.start()
    try:
        assert prometheus.wait_for("openlora_training_steps_total > 30", timeout=120)
        tripped = prometheus.wait_for(
            f'openlora_training_guard_trips_total{{instance="{diverging_instance}"}} > 0', timeout=120
        )
        assert tripped, "the diverging run's guard did not trip:\n" + diverging_log.read_text()[-3000:]
        # The XID arrives while the run trains: its series appears, already at 1, at the next scrape.
        fake.inject_xid(card, 48)
        assert prometheus.wait_for("openlora_gpu_xid_errors_total > 0", timeout=60)
        time.sleep(8)  # enough samples for 15 s rate windows while training goes on
        assert not done.is_set(), "the run ended before the queries"
        # Bounded wait: the energy records are a chain of five (GPU power, token shares, rank power, per
        # token and per step); on VictoriaMetrics each link comes back through vmalert's remote write, an
        # evaluation or two behind the one before.
        wait_until(
            lambda: prometheus.query("run:openlora_training_energy_per_step_joules:2m")
            and prometheus.query("rank:openlora_training_energy_per_token_joules:2m")
            and prometheus.query("run:openlora_training_goodput:ratio1h")
            and prometheus.query("run:openlora_training_steps_lost:increase1h"),
            timeout=60,
        )
        # Both runs selected in the run variable, offered by their names; the legends' hyperparameter
        # is the learning rate. Every variable has values and every panel query returns data.
        problems = run_every_query(
            DASHBOARD,
            prometheus.query,
            http_variable_options(prometheus.url),
            list(RUN_NAMES),
            run_names=RUN_NAMES,
            hparam="learning_rate",
        )
        assert not problems, "\n".join(problems)
        # Energy: the main run is the only training process on its GPU, so its share is 1 and its
        # power and joules per token are above 0 (the counter rises); the diverged run has no GPU.
        # Bounded wait: on VictoriaMetrics the records come through vmalert, some seconds behind.
        run_power = 'run:openlora_training_energy_joules:rate2m{openlora_run_id="dash-run"}'
        wait_until(lambda: any(float(s["value"][1]) > 0 for s in prometheus.query(run_power)), timeout=30)
        shares = prometheus.query("rank_gpu:openlora_training_energy:share2m")
        assert [(s["metric"]["openlora_run_id"], s["metric"]["hw_id"], float(s["value"][1])) for s in shares] == [
            ("dash-run", card.uuid, 1.0)
        ], shares
        per_token = prometheus.query('run:openlora_training_energy_per_token_joules:2m{openlora_run_id="dash-run"}')
        assert per_token and float(per_token[0]["value"][1]) > 0, per_token
        # The legends' labels: each run's name and learning rate on the loss panel's series.
        (loss_panel,) = [p for p in panels() if p["title"].startswith("Loss:")]
        mean_loss = substitute(loss_panel["targets"][0]["expr"], run="(dash-run|diverged-run)")
        labelled = {
            tuple(s["metric"][label] for label in ("openlora_run_id", "openlora_run_name", LR))
            for s in prometheus.query(mean_loss)
        }
        assert labelled == {("dash-run", "dash", "0.003"), ("diverged-run", "diverged", "0.001")}, labelled
        # The documentation's PromQL to compare runs by a hyperparameter, on the same two runs.
        compare = docs_promql(*COMPARE_RUNS_BLOCKS)
        assert len(compare) >= 3, compare
        for expr in compare:
            found = prometheus.query(substitute(expr, run="(dash-run|diverged-run)"))
            assert {s["metric"][LR] for s in found} == {"0.003", "0.001"}, (expr, found)

        for rule in rules():
            prometheus.query(rule["expr"])  # evaluates without error (healthy run: mostly empty)
        # The alerts on a diverged run hold on the real series of one, there and only there.
        for name, labels in ALERTS_ON_THE_DIVERGED_RUN.items():
            (rule,) = [r for r in alerts() if r["alert"] == name]
            # Bounded wait: on VictoriaMetrics the recording rules the alerts join (instance:openlora_run:current)
            # go through vmalert's evaluation and its remote write, a few seconds behind the data.
            wait_until(
                lambda rule=rule: {s["metric"]["instance"] for s in prometheus.query(rule["expr"])}
                == {diverging_instance},
                timeout=30,
            )
            found = prometheus.query(rule["expr"])
            assert {s["metric"]["instance"] for s in found} == {diverging_instance}, (name, found)
            for label, values in labels.items():
                assert {s["metric"][label] for s in found} == values, (name, found)
        # The GPU alerts on the fake GPU's real series: there, with the main run's labels, and only those.
        main = main_instance
        assert set(ALERTS_ON_THE_FAKE_GPU) <= {rule["alert"] for rule in alerts()}
        for rule in alerts():
            if not rule["alert"].startswith("OpenloraGpu"):
                continue
            expected = ALERTS_ON_THE_FAKE_GPU.get(rule["alert"])
            if expected is not None:
                wait_until(
                    lambda rule=rule: {
                        (s["metric"]["instance"], s["metric"]["hw_id"]) for s in prometheus.query(rule["expr"])
                    }
                    == {(main, card.uuid)},
                    timeout=30,
                )
            found = prometheus.query(rule["expr"])
            if expected is None:
                assert not found, (rule["alert"], found)
                continue
            assert {(s["metric"]["instance"], s["metric"]["hw_id"]) for s in found} == {(main, card.uuid)}, (
                rule["alert"],
                found,
            )
            assert {s["metric"]["openlora_run_name"] for s in found} == {RUN_NAMES["dash-run"]}, found
            for label, values in expected.items():
                assert {s["metric"][label] for s in found} == values, (rule["alert"], found)
        with urllib.request.urlopen(f"{prometheus.rules_url}/api/v1/rules", timeout=5) as response:
            loaded = json.load(response)["data"]["groups"]
        # On the native paths deploy/prometheus/native-histograms.yml is loaded too, a group of its own.
        ours = [group for group in loaded if group["name"] != "openlora-native-histograms"]
        assert sum(len(group["rules"]) for group in ours) == len(rules())
        assert all(rule["health"] == "ok" for group in loaded for rule in group["rules"])
    finally:
        stop.set()
        trainer.join(timeout=120)

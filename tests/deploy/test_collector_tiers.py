"""deploy/collector/: the agent and gateway collector configs, held to this project's choices.

The agent takes OTLP from the ranks of one node and forwards it to the gateway; the gateway
remote-writes to a central store. That they are valid, and start without a warning, the real
Collector checks (tests/deploy/test_collector_binary.py). Here they are held to the policy of
collector/otelcol.yaml (see tests/support/collector_checks.py), to each other (the agent's exporter reaches
the gateway's receiver), to what setup_telemetry() sends by default, and to the series names of the
collector path.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from openlora_otel.config import TelemetryConfig
from openlora_otel.run.resource import build_resource
from tests.support import collector_checks as checks

DEPLOY = checks.ROOT / "deploy" / "collector"
AGENT = DEPLOY / "agent.yaml"
LOAD_BALANCING = DEPLOY / "agent-loadbalancing.yaml"
GATEWAY = DEPLOY / "gateway.yaml"
SINGLE = checks.ROOT / "collector" / "otelcol.yaml"
COMPOSE = checks.ROOT / "collector" / "docker-compose.yml"


def agent() -> dict:
    return checks.load(AGENT)


def gateway() -> dict:
    return checks.load(GATEWAY)


def load_balancing_agent() -> dict:
    """agent.yaml with the overlay agent-loadbalancing.yaml, as the Collector merges them."""
    return checks.merged(agent(), checks.load(LOAD_BALANCING))


@pytest.mark.parametrize("path", [AGENT, GATEWAY, SINGLE], ids=lambda p: p.name)
def test_components_are_used_and_memory_limiter_comes_first(path) -> None:
    config = checks.load(path)
    checks.check_components_used(config)
    checks.check_memory_limiter_first(config)
    assert list(config["service"]["pipelines"]) == ["metrics"]


def test_shared_checks_catch_what_they_claim_to() -> None:
    """The helpers fail on the mistakes they are there for (so a passing run means something)."""
    config = agent()
    unused = {**config, "processors": {**config["processors"], "resource": {"attributes": []}}}
    with pytest.raises(AssertionError, match="defined but unused"):
        checks.check_components_used(unused)
    pipelines = {"metrics": {**config["service"]["pipelines"]["metrics"], "processors": ["batch", "memory_limiter"]}}
    reordered = {**config, "service": {**config["service"], "pipelines": pipelines}}
    with pytest.raises(AssertionError, match="memory_limiter must come first"):
        checks.check_memory_limiter_first(reordered)


def test_every_tier_states_the_pinned_contrib_version() -> None:
    pinned = {
        image.rsplit(":", 1)[1]
        for image in re.findall(r"image:\s*(\S*opentelemetry-collector-contrib:\S+)", COMPOSE.read_text())
    }
    assert len(pinned) == 1
    for path in (AGENT, GATEWAY):
        assert checks.stated_contrib_version(path.read_text()) in pinned, path.name


def test_receivers_listen_where_the_sdk_sends_by_default() -> None:
    """Both tiers take OTLP on the ports of collector/otelcol.yaml, which are the SDK's defaults."""
    single = checks.receiver_ports(checks.load(SINGLE))
    default_http = TelemetryConfig.from_env({"OTEL_METRICS_EXPORTER": "otlp"}).otlp
    default_grpc = TelemetryConfig.from_env(
        {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    ).otlp
    for config in (agent(), gateway()):
        ports = checks.receiver_ports(config)
        assert ports == single
        assert urlsplit(default_http.endpoint).port == ports["http"]
        assert urlsplit(default_grpc.endpoint).port == ports["grpc"]
        for protocol in config["receivers"]["otlp"]["protocols"].values():
            # In a pod the receiver must listen beyond loopback: the ranks and agents come from outside.
            assert checks.endpoint_host(protocol["endpoint"]) == "0.0.0.0"


def test_agent_forwards_everything_to_the_gateway_receiver() -> None:
    config, target = agent(), gateway()
    assert set(config["exporters"]) == {"otlp_grpc"}  # the gRPC OTLP exporter, nothing else
    exporter = config["exporters"]["otlp_grpc"]
    assert checks.endpoint_port(exporter["endpoint"]) == checks.receiver_ports(target)["grpc"]
    assert "://" not in exporter["endpoint"]  # gRPC: host:port
    # Plaintext on both ends or TLS on both ends: an agent expecting TLS from a plaintext
    # receiver (the exporter's default) would fail every export.
    receiver_tls = "tls" in target["receivers"]["otlp"]["protocols"]["grpc"]
    assert exporter.get("tls", {}).get("insecure", False) is (not receiver_tls)
    # Outages of the gateway are ridden out by queueing and retrying, not by dropping.
    assert exporter["sending_queue"]["enabled"] and exporter["retry_on_failure"]["enabled"]


def test_gateway_remote_writes_with_no_credentials_in_the_file() -> None:
    config = gateway()
    assert set(config["exporters"]) == {"prometheus_remote_write"}
    exporter = config["exporters"]["prometheus_remote_write"]
    # The URL and every header come from the environment (the Deployment: a value and a Secret).
    assert re.fullmatch(r"\$\{env:[A-Z_]+\}", exporter["endpoint"])
    for name, value in exporter.get("headers", {}).items():
        assert re.fullmatch(r"\$\{env:[A-Z_]+\}", value), f"header {name} is written inline"
    text = GATEWAY.read_text()
    assert not re.search(r"(?i)(bearer|basic)\s+[A-Za-z0-9+/=._-]{8,}", text)
    assert "password:" not in text.lower() and "token:" not in text.lower()


def test_gateway_names_series_as_the_collector_path_does() -> None:
    """Same naming knobs as the single collector's prometheus exporter: the docs' collector column holds."""
    exporter = gateway()["exporters"]["prometheus_remote_write"]
    single = checks.load(SINGLE)["exporters"]["prometheus"]
    for key in ("namespace", "const_labels", "external_labels"):
        assert key not in exporter and key not in single, key  # a prefix or label on every series
    # Unit suffixes (_seconds, _total, _ratio for unit-1 gauges) as prometheus_name(path="collector").
    assert exporter.get("add_metric_suffixes", True) is True
    assert single.get("add_metric_suffixes", True) is True
    # Run identity on target_info only, joined on (job, instance); never copied onto each series.
    # (resource_to_telemetry_conversion, deprecated, and resource_constant_labels, which replaces it,
    # are both off unless set.)
    for key in ("resource_to_telemetry_conversion", "resource_constant_labels"):
        assert key not in exporter and key not in single, key
    assert exporter.get("target_info", {}).get("enabled", True) is True
    assert not exporter.get("export_created_metric", {}).get("enabled", False)


def test_gateway_keeps_each_series_in_order() -> None:
    exporter = gateway()["exporters"]["prometheus_remote_write"]
    queue = exporter["remote_write_queue"]
    # Parallel requests could deliver a later batch first; Prometheus refuses the older sample then.
    # One consumer is the default (num_consumers only sets the request parallelism, deprecated for it).
    assert queue["enabled"] and "num_consumers" not in queue and queue["queue_size"] > 0
    assert exporter["max_batch_request_parallelism"] == 1


def test_gateway_stamps_the_environment_as_the_single_collector_does() -> None:
    assert gateway()["processors"]["resource"] == checks.load(SINGLE)["processors"]["resource"]


def test_tiers_report_their_own_health_and_metrics_on_the_single_collectors_ports() -> None:
    single = checks.load(SINGLE)
    for config in (agent(), gateway()):
        assert checks.self_metrics_port(config) == checks.self_metrics_port(single)
        assert config["extensions"]["health_check"] == single["extensions"]["health_check"]


def test_env_references_are_named_and_the_required_ones_listed() -> None:
    """The variables a tier needs from its container; tests/deploy/test_kubernetes.py checks the manifests provide them."""
    assert checks.env_references(AGENT.read_text()) == {}
    assert checks.env_references(GATEWAY.read_text()) == {
        "OPENLORA_ENVIRONMENT": True,
        "OPENLORA_REMOTE_WRITE_URL": False,
        "OPENLORA_REMOTE_WRITE_AUTHORIZATION": False,
    }


def test_merged_is_the_collectors_merge() -> None:
    """Maps key by key, lists replaced: what the Collector does with several --config files."""
    assert checks.merged({"a": {"b": 1, "c": [1]}, "d": 1}, {"a": {"c": [2]}, "e": 2}) == {
        "a": {"b": 1, "c": [2]},
        "d": 1,
        "e": 2,
    }


def test_the_load_balancing_overlay_changes_only_where_the_agent_sends() -> None:
    config, plain = load_balancing_agent(), agent()
    # Everything of agent.yaml but the pipeline's exporter: receivers, processors, extensions, telemetry.
    for key in ("receivers", "processors", "extensions"):
        assert config[key] == plain[key], key
    assert config["service"]["telemetry"] == plain["service"]["telemetry"]
    pipeline = config["service"]["pipelines"]["metrics"]
    assert pipeline["exporters"] == ["load_balancing"]
    assert pipeline["processors"] == plain["service"]["pipelines"]["metrics"]["processors"]
    checks.check_memory_limiter_first(config)
    # agent.yaml's otlp_grpc stays defined, unused (the Collector builds only what a pipeline uses).
    unused = {**config, "exporters": {"load_balancing": config["exporters"]["load_balancing"]}}
    checks.check_components_used(unused)


def test_each_rank_goes_to_one_gateway_in_order_and_waits_out_an_outage() -> None:
    exporter = load_balancing_agent()["exporters"]["load_balancing"]
    # Keyed by the rank process's own identity: a resource attribute (no split per point), one that
    # setup_telemetry() always sets, different in every process.
    assert exporter["routing_key"] == "attributes"
    assert exporter["routing_attributes"] == ["service.instance.id"]
    config = TelemetryConfig.from_env({"OPENLORA_RUN_ID": "r"})
    first, second = (build_resource(config).attributes["service.instance.id"] for _ in range(2))
    assert first != second
    otlp = exporter["protocol"]["otlp"]
    assert "endpoint" not in otlp  # the exporter fills in each gateway's
    target = gateway()
    receiver_tls = "tls" in target["receivers"]["otlp"]["protocols"]["grpc"]
    assert otlp["tls"].get("insecure", False) is (not receiver_tls)
    # A queue per gateway with one consumer: queued batches leave in order after an outage.
    assert otlp["sending_queue"]["enabled"] and otlp["sending_queue"]["num_consumers"] == 1
    assert otlp["retry_on_failure"]["enabled"]
    (resolver,) = exporter["resolver"].items()
    assert resolver[0] == "dns"
    assert int(resolver[1]["port"]) == checks.receiver_ports(target)["grpc"]

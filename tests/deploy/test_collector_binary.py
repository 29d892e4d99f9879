"""Every shipped Collector config, run by a real Collector: our distribution, built from the Go module
proxy by tools/build.sh (collector/otelcol-openlora: core v0.165.0, contrib v0.165.1), and the
load-balancing agent's (collector/otelcol-openlora-lb, release 0.161.0) for agent.yaml with the overlay
agent-loadbalancing.yaml.

- the binary has exactly the components of its manifest, and they are the ones the configs use (and
  the debug exporter);
- ``validate`` accepts collector/otelcol.yaml, the agent and gateway tiers, and the copies of the tiers
  in the Kubernetes ConfigMaps, and refuses a key the component does not have (so its yes means
  something);
- each config starts, its ports moved to loopback, and reports healthy without logging a warning:
  a deprecated component name or key (``otlp`` for ``otlp_grpc``, ``prometheusremotewrite``,
  ``num_consumers``) is a warning at start, not a validation error.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.built import built
from tests.support.collector_server import Collector

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = ROOT / "collector" / "otelcol-openlora"
LB_DISTRIBUTION = ROOT / "collector" / "otelcol-openlora-lb"
SINGLE = ROOT / "collector" / "otelcol.yaml"
AGENT = ROOT / "deploy" / "collector" / "agent.yaml"
GATEWAY = ROOT / "deploy" / "collector" / "gateway.yaml"
LOAD_BALANCING = ROOT / "deploy" / "collector" / "agent-loadbalancing.yaml"
KINDS = ("receivers", "processors", "exporters", "extensions")
CONFIGMAPS = ROOT / "deploy" / "kubernetes" / "10-collector-config.yaml"
# What the gateway reads from its container's environment (the Deployment sets them).
GATEWAY_ENV = {
    "OPENLORA_REMOTE_WRITE_URL": "http://127.0.0.1:9/api/v1/write",
    "OPENLORA_REMOTE_WRITE_AUTHORIZATION": "",
    "OPENLORA_ENVIRONMENT": "test",
}


def configmap_configs(tmp_path: Path) -> dict[str, Path]:
    """The collector configs the ConfigMaps carry, each written to a file, by ConfigMap and key."""
    paths = {}
    for document in yaml.safe_load_all(CONFIGMAPS.read_text()):
        for key, text in document["data"].items():
            path = tmp_path / f"{document['metadata']['name']}-{key}"
            path.write_text(text)
            paths[f"{document['metadata']['name']}/{key}"] = path
    return paths


def otelcol(
    *args: str, env: dict[str, str] | None = None, binary: str = "otelcol-openlora"
) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [built(binary), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def component_types(config: dict) -> dict[str, set[str]]:
    return {kind: {name.split("/", 1)[0] for name in config.get(kind) or {}} for kind in KINDS}


def distribution_components(binary: str, distribution: Path) -> tuple[dict[str, set[str]], dict]:
    """The component types ``binary`` lists, by kind, and its manifest; asserting that its modules are
    exactly the manifest's and its version the manifest's."""
    result = otelcol("components", binary=binary)
    assert result.returncode == 0, result.stderr
    listed = yaml.safe_load(result.stdout)
    manifest = yaml.safe_load((distribution / "manifest.yaml").read_text())
    for kind in KINDS:
        modules = {entry["module"] for entry in listed[kind]}
        assert modules == {entry["gomod"] for entry in manifest[kind]}, kind
    version = otelcol("--version", binary=binary)
    assert version.stdout.strip() == f"{binary} version {manifest['dist']['version']}"
    return {kind: {entry["name"] for entry in listed[kind]} for kind in KINDS}, manifest


def test_the_binary_has_the_manifests_components_which_are_the_configs() -> None:
    has, _ = distribution_components("otelcol-openlora", DISTRIBUTION)
    used: dict[str, set[str]] = {kind: set() for kind in has}
    for path in (SINGLE, AGENT, GATEWAY):
        for kind, types in component_types(yaml.safe_load(path.read_text())).items():
            used[kind] |= types
    assert used["exporters"] | {"debug"} == has["exporters"]
    for kind in ("receivers", "processors", "extensions"):
        assert used[kind] == has[kind], kind


def test_every_shipped_config_validates(tmp_path: Path) -> None:
    copies = configmap_configs(tmp_path)
    overlay = copies.pop("openlora-collector-agent/agent-loadbalancing.yaml")  # validated with the lb agent
    configs = [SINGLE, AGENT, GATEWAY, *copies.values()]
    assert len(configs) == 5
    for path in configs:
        result = otelcol("validate", "--config", str(path), env=GATEWAY_ENV)
        assert result.returncode == 0, (path.name, result.stdout, result.stderr)
    agent = copies["openlora-collector-agent/agent.yaml"]
    result = otelcol("validate", "--config", str(agent), "--config", str(overlay), binary="otelcol-openlora-lb")
    assert result.returncode == 0, (result.stdout, result.stderr)


def test_validate_refuses_a_key_the_component_does_not_have(tmp_path: Path) -> None:
    config = yaml.safe_load(GATEWAY.read_text())
    config["exporters"]["prometheus_remote_write"]["remote_write_queue"]["num_consumer"] = 1
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    result = otelcol("validate", "--config", str(path), env=GATEWAY_ENV)
    assert result.returncode != 0
    assert "num_consumer" in result.stderr


@pytest.mark.parametrize("path", [SINGLE, GATEWAY], ids=lambda p: p.name)
def test_a_shipped_config_starts_healthy_without_a_warning(path: Path, tmp_path: Path) -> None:
    collector = Collector(tmp_path, path, env=GATEWAY_ENV)
    try:
        assert collector.log_lines("warn") == []
        assert collector.log_lines("error") == []
    finally:
        collector.stop()
    assert "Shutdown complete" in collector.log.read_text()


def test_the_agent_starts_healthy_without_a_warning_beside_its_gateway(tmp_path: Path) -> None:
    gateway = Collector(tmp_path, GATEWAY, env=GATEWAY_ENV, name="gateway")
    try:
        agent = Collector(
            tmp_path,
            AGENT,
            name="agent",
            overrides={"exporters": {"otlp_grpc": {"endpoint": f"127.0.0.1:{gateway.ports['grpc']}"}}},
        )
        try:
            assert agent.log_lines("warn") == [] and agent.log_lines("error") == []
        finally:
            agent.stop()
        assert gateway.log_lines("warn") == [] and gateway.log_lines("error") == []
    finally:
        gateway.stop()


def test_the_load_balancing_distribution_has_its_manifests_components_and_the_agents() -> None:
    has, manifest = distribution_components("otelcol-openlora-lb", LB_DISTRIBUTION)
    releases = {entry["gomod"].rsplit(" ", 1)[1] for kind in KINDS for entry in manifest[kind]}
    assert releases == {"v0.161.0"}  # one release for every module
    overlay = yaml.safe_load(LOAD_BALANCING.read_text())
    for kind, types in component_types(yaml.safe_load(AGENT.read_text())).items():
        assert types | component_types(overlay)[kind] <= has[kind], kind


@pytest.mark.parametrize(
    "resolver",
    [None, {"k8s": {"service": "openlora-collector-gateway-headless.openlora", "ports": [4317]}},
     {"static": {"hostnames": ["gateway-0:4317", "gateway-1:4317"]}}],
    ids=["dns", "k8s", "static"],
)  # fmt: skip
def test_the_load_balancing_agent_validates_with_each_resolver(resolver: dict | None, tmp_path: Path) -> None:
    """As shipped (dns), and with the k8s and static resolvers its comments offer instead."""
    configs = ["--config", str(AGENT), "--config", str(LOAD_BALANCING)]
    if resolver is not None:
        swapped = tmp_path / "resolver.yaml"
        swapped.write_text(yaml.safe_dump({"exporters": {"load_balancing": {"resolver": {"dns": None, **resolver}}}}))
        configs += ["--config", str(swapped)]
    result = otelcol("validate", *configs, binary="otelcol-openlora-lb")
    assert result.returncode == 0, (result.stdout, result.stderr)
    # And refuses a key the exporter does not have.
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"exporters": {"load_balancing": {"routing_attribute": ["x"]}}}))
    refused = otelcol("validate", *configs, "--config", str(typo), binary="otelcol-openlora-lb")
    assert refused.returncode != 0 and "routing_attribute" in refused.stderr

"""Every shipped Collector config, run by a real Collector: our distribution, built from the Go module
proxy by tools/build.sh (collector/otelcol-openlora: core v0.165.0, contrib v0.165.1).

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
SINGLE = ROOT / "collector" / "otelcol.yaml"
AGENT = ROOT / "deploy" / "collector" / "agent.yaml"
GATEWAY = ROOT / "deploy" / "collector" / "gateway.yaml"
CONFIGMAPS = ROOT / "deploy" / "kubernetes" / "10-collector-config.yaml"
# What the gateway reads from its container's environment (the Deployment sets them).
GATEWAY_ENV = {
    "OPENLORA_REMOTE_WRITE_URL": "http://127.0.0.1:9/api/v1/write",
    "OPENLORA_REMOTE_WRITE_AUTHORIZATION": "",
    "OPENLORA_ENVIRONMENT": "test",
}


def configmap_configs(tmp_path: Path) -> list[Path]:
    """The collector configs the ConfigMaps carry, each written to a file."""
    paths = []
    for document in yaml.safe_load_all(CONFIGMAPS.read_text()):
        for key, text in document["data"].items():
            path = tmp_path / f"{document['metadata']['name']}-{key}"
            path.write_text(text)
            paths.append(path)
    return paths


def otelcol(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [built("otelcol-openlora"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def component_types(config: dict) -> dict[str, set[str]]:
    return {
        kind: {name.split("/", 1)[0] for name in config.get(kind) or {}}
        for kind in ("receivers", "processors", "exporters", "extensions")
    }


def test_the_binary_has_the_manifests_components_which_are_the_configs() -> None:
    result = otelcol("components")
    assert result.returncode == 0, result.stderr
    listed = yaml.safe_load(result.stdout)
    manifest = yaml.safe_load((DISTRIBUTION / "manifest.yaml").read_text())
    for kind in ("receivers", "processors", "exporters", "extensions"):
        modules = {entry["module"] for entry in listed[kind]}
        assert modules == {entry["gomod"] for entry in manifest[kind]}, kind
    has = {
        kind: {entry["name"] for entry in listed[kind]}
        for kind in ("receivers", "processors", "exporters", "extensions")
    }
    used: dict[str, set[str]] = {kind: set() for kind in has}
    for path in (SINGLE, AGENT, GATEWAY):
        for kind, types in component_types(yaml.safe_load(path.read_text())).items():
            used[kind] |= types
    assert used["exporters"] | {"debug"} == has["exporters"]
    for kind in ("receivers", "processors", "extensions"):
        assert used[kind] == has[kind], kind
    version = otelcol("--version")
    assert version.stdout.strip() == f"otelcol-openlora version {manifest['dist']['version']}"


def test_every_shipped_config_validates(tmp_path: Path) -> None:
    configs = [SINGLE, AGENT, GATEWAY, *configmap_configs(tmp_path)]
    assert len(configs) == 5
    for path in configs:
        result = otelcol("validate", "--config", str(path), env=GATEWAY_ENV)
        assert result.returncode == 0, (path.name, result.stdout, result.stderr)


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

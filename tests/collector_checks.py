"""Consistency checks for OpenTelemetry Collector configs that no collector binary runs here.

The single-node config (collector/otelcol.yaml, checked in tests/test_deployment.py) and the agent
and gateway tiers (deploy/collector/) are held to the same rules: every component used is defined
and every one defined is used, memory_limiter comes first, and only components that exist in the
pinned contrib release appear. Each check takes a parsed config, so any config can be held to them.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

# The components these configs may use, by kind, each in otelcol-contrib 0.128.0: those
# collector/otelcol.yaml already uses with that image, plus `prometheusremotewrite` (contrib's
# exporter/prometheusremotewriteexporter; its keys endpoint, headers, resource_to_telemetry_conversion,
# target_info, remote_write_queue and retry_on_failure read from its config.go, before and after
# 0.128.0). Exporter names are the 0.128.0 ones: the gRPC OTLP exporter is `otlp`; the
# `otlp_grpc` / `otlp_http` names only arrived in core 0.144.0. A new component needs the same check.
KNOWN_COMPONENTS: dict[str, frozenset[str]] = {
    "receivers": frozenset({"otlp"}),
    "processors": frozenset({"memory_limiter", "batch", "resource"}),
    "exporters": frozenset({"otlp", "prometheus", "prometheusremotewrite"}),
    "extensions": frozenset({"health_check"}),
}
PIPELINE_KINDS = ("receivers", "processors", "exporters")
_ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def component_type(name: str) -> str:
    """``otlp/gateway`` -> ``otlp``: the collector's ``type[/name]`` component ids."""
    return name.split("/", 1)[0]


def check_components_defined_and_used(config: dict) -> None:
    """Every component a pipeline names is defined, and every one defined is used somewhere."""
    service = config["service"]
    used: dict[str, set[str]] = {kind: set() for kind in PIPELINE_KINDS}
    for pipeline_name, pipeline in service["pipelines"].items():
        for kind in PIPELINE_KINDS:
            for name in pipeline.get(kind, []):
                assert name in config.get(kind, {}), f"{pipeline_name}: {kind} {name} is used but not defined"
                used[kind].add(name)
    for kind, names in used.items():
        defined = set(config.get(kind) or {})
        assert defined == names, f"{kind} defined but unused: {defined - names}"
    assert set(config.get("extensions") or {}) == set(service.get("extensions", [])), "extensions"


def check_known_components(config: dict) -> None:
    """Only component types the pinned contrib release has."""
    for kind, known in KNOWN_COMPONENTS.items():
        for name in config.get(kind) or {}:
            assert component_type(name) in known, f"{kind} {name} is not one this project checked for 0.128.0"


def check_memory_limiter_first(config: dict) -> None:
    """memory_limiter first in every pipeline (refuse before anything buffers), batch last."""
    for name, pipeline in config["service"]["pipelines"].items():
        processors = [component_type(p) for p in pipeline.get("processors", [])]
        assert processors[0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert processors[-1] == "batch", f"{name}: batch must come last"
    for name, settings in config["processors"].items():
        if component_type(name) == "memory_limiter":
            assert settings.get("check_interval"), f"{name} does nothing without check_interval"


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def endpoint_host(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[0].split("://", 1)[-1]


def receiver_ports(config: dict) -> dict[str, int]:
    """The OTLP receiver's ports by protocol: ``{"grpc": 4317, "http": 4318}``."""
    protocols = config["receivers"]["otlp"]["protocols"]
    return {protocol: endpoint_port(settings["endpoint"]) for protocol, settings in protocols.items()}


def self_metrics_port(config: dict) -> int:
    """Where the collector serves its own metrics (service.telemetry.metrics.readers)."""
    (reader,) = config["service"]["telemetry"]["metrics"]["readers"]
    return int(reader["pull"]["exporter"]["prometheus"]["port"])


def env_references(text: str) -> dict[str, bool]:
    """``${env:VAR}`` references in a config's text: variable -> whether it has a ``:-`` default."""
    found: dict[str, bool] = {}
    for name, default in _ENV_REFERENCE.findall(text):
        found[name] = found.get(name, False) or bool(default)
    return found


def stated_contrib_version(text: str) -> str:
    """The contrib release a config says it is written for (its header names the image)."""
    (version,) = set(re.findall(r"opentelemetry-collector-contrib:(\d+\.\d+\.\d+)", text))
    return version

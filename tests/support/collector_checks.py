"""Checks of OpenTelemetry Collector configs that the Collector itself does not make.

Whether a config is valid (component types, keys, a pipeline naming a component that is not defined)
is the real Collector's job: tests/deploy/test_collector_binary.py runs ``validate`` and starts each shipped
config with our distribution. What stays here is this project's policy, which the Collector accepts
either way: the single-node config (collector/otelcol.yaml) and the agent and gateway tiers
(deploy/collector/) define no component they leave unused, and put memory_limiter first and batch
last. Each check takes a parsed config, so any config can be held to them.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent

PIPELINE_KINDS = ("receivers", "processors", "exporters")
_ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def merged(*configs: dict) -> dict:
    """``configs`` merged as the Collector merges its ``--config`` files, in order: maps key by key,
    anything else (lists included) replaced by the later value."""
    result: dict = {}
    for config in configs:
        for key, value in config.items():
            if isinstance(value, dict) and isinstance(result.get(key), dict):
                result[key] = merged(result[key], value)
            else:
                result[key] = value
    return result


def component_type(name: str) -> str:
    """``otlp/gateway`` -> ``otlp``: the collector's ``type[/name]`` component ids."""
    return name.split("/", 1)[0]


def check_components_used(config: dict) -> None:
    """Every component defined is used in a pipeline (the Collector ignores one that is not)."""
    service = config["service"]
    used: dict[str, set[str]] = {kind: set() for kind in PIPELINE_KINDS}
    for pipeline in service["pipelines"].values():
        for kind in PIPELINE_KINDS:
            used[kind].update(pipeline.get(kind, []))
    for kind, names in used.items():
        defined = set(config.get(kind) or {})
        assert not defined - names, f"{kind} defined but unused: {defined - names}"
    unused = set(config.get("extensions") or {}) - set(service.get("extensions", []))
    assert not unused, f"extensions defined but unused: {unused}"


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

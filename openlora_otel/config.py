"""Configuration: the one place that reads the environment.

Every variable openlora-otel understands is listed in :data:`VARIABLES` with its
default and meaning (the README's table is checked against it by a test).
:meth:`TelemetryConfig.from_env` turns an environment into one frozen
:class:`TelemetryConfig`; nothing else in the package reads ``os.environ``.

The standard ``OTEL_*`` variables are parsed as the OpenTelemetry specification
defines them, which differs from what the Python SDK does on its own in three
places that matter here: ``OTEL_EXPORTER_OTLP_TIMEOUT`` is milliseconds (the SDK
reads seconds), ``http/protobuf`` is the default OTLP protocol (the SDK picks
gRPC), and ``OTEL_METRICS_EXPORTER`` is honoured without
``opentelemetry-instrument``. Values are handed to the SDK explicitly so that its
own environment parsing never decides anything.

Invalid values raise :class:`ConfigError`, which names the variable, the value
and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import SplitResult, unquote, urlsplit

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "VARIABLES",
    "ConfigError",
    "OTLPConfig",
    "TelemetryConfig",
    "Variable",
]

DEFAULT_SERVICE_NAME = "openlora-training"

EXPORTERS = ("prometheus", "otlp", "console", "none")
PROTOCOLS = ("http/protobuf", "grpc")
COMPRESSIONS = ("none", "gzip")
TEMPORALITIES = ("cumulative", "delta", "lowmemory")
PORT_OFFSETS = ("local_rank", "none")
GPU_MODES = ("auto", "on", "off")
GPU_DEVICE_MODES = ("process", "all")

Protocol = Literal["http/protobuf", "grpc"]


class ConfigError(ValueError):
    """A configuration value that openlora-otel cannot use.

    ``variable`` is the environment variable (or argument) at fault, ``value``
    what it held and ``accepted`` a short description of valid values.
    """

    def __init__(self, variable: str, value: object, accepted: str, detail: str = "") -> None:
        self.variable = variable
        self.value = value
        self.accepted = accepted
        message = f"{variable}={value!r} is not valid: expected {accepted}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, default (as text) and meaning."""

    name: str
    default: str
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "OTEL_SDK_DISABLED",
        "false",
        "`true` gives a working no-op `Telemetry`: nothing is exported, no port is bound.",
    ),
    Variable(
        "OTEL_SERVICE_NAME",
        DEFAULT_SERVICE_NAME,
        "`service.name` of the Resource; wins over `service.name` in `OTEL_RESOURCE_ATTRIBUTES`.",
    ),
    Variable(
        "OTEL_RESOURCE_ATTRIBUTES",
        "(empty)",
        "Extra Resource attributes, `key=value,key2=value2`, values percent-encoded.",
    ),
    Variable(
        "OTEL_METRICS_EXPORTER",
        "prometheus",
        "Comma list of `prometheus`, `otlp`, `console`, or `none` alone.",
    ),
    Variable(
        "OTEL_EXPORTER_PROMETHEUS_HOST", "localhost", "Address the Prometheus `/metrics` endpoint binds to."
    ),
    Variable(
        "OTEL_EXPORTER_PROMETHEUS_PORT",
        "9464",
        "Port of the Prometheus endpoint (0 picks a free port); see `OPENLORA_PROMETHEUS_PORT_OFFSET`.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "http://localhost:4318 (http/protobuf), http://localhost:4317 (grpc)",
        "Base OTLP endpoint; `/v1/metrics` is appended for http/protobuf.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "(unset)",
        "Metrics endpoint, used as is (no path appended); wins over the base endpoint.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "http/protobuf",
        "`http/protobuf` or `grpc` (`http/json` has no Python exporter).",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        "(unset)",
        "Per-signal protocol; wins over `OTEL_EXPORTER_OTLP_PROTOCOL`.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_HEADERS",
        "(empty)",
        "Headers sent with every export, `key=value,...`, values percent-encoded.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
        "(unset)",
        "Per-signal headers; win over `OTEL_EXPORTER_OTLP_HEADERS`.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "10000",
        "Time limit of one OTLP export with its retries, in milliseconds (as the spec says; the Python SDK alone reads seconds); capped at `OTEL_METRIC_EXPORT_INTERVAL`.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "(unset)", "Per-signal export time limit in milliseconds."
    ),
    Variable("OTEL_EXPORTER_OTLP_COMPRESSION", "none", "`gzip` or `none`."),
    Variable("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "(unset)", "Per-signal compression."),
    Variable(
        "OTEL_EXPORTER_OTLP_INSECURE",
        "false",
        "gRPC only, for an endpoint without scheme: `true` for plaintext.",
    ),
    Variable("OTEL_EXPORTER_OTLP_METRICS_INSECURE", "(unset)", "Per-signal `INSECURE`."),
    Variable(
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        "(unset)",
        "PEM file of trusted CA certificates for TLS to the endpoint.",
    ),
    Variable("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "(unset)", "Per-signal CA certificate file."),
    Variable(
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        "(unset)",
        "PEM private key for mTLS (needs the client certificate too).",
    ),
    Variable("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", "(unset)", "Per-signal client key file."),
    Variable(
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        "(unset)",
        "PEM client certificate chain for mTLS (needs the client key too).",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE", "(unset)", "Per-signal client certificate file."
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
        "cumulative",
        "`cumulative`, `delta` or `lowmemory` (Prometheus needs cumulative).",
    ),
    Variable(
        "OTEL_METRIC_EXPORT_INTERVAL",
        "60000",
        "Milliseconds between pushes for `otlp` and `console` (pull is scrape-driven).",
    ),
    Variable("OTEL_METRIC_EXPORT_TIMEOUT", "30000", "Milliseconds allowed for one collect-and-export cycle."),
    Variable(
        "OPENLORA_RUN_ID",
        "`TORCHELASTIC_RUN_ID`, else a random id",
        "Run id in the Resource (`openlora.run.id`); set it to tie ranks or restarts together.",
    ),
    Variable(
        "OPENLORA_SHUTDOWN_TIMEOUT",
        "2000",
        "Milliseconds `shutdown()` may take, final export included; it returns after that even if the endpoint hangs.",
    ),
    Variable(
        "OPENLORA_PROMETHEUS_PORT_OFFSET",
        "local_rank",
        "`local_rank`: the port is `OTEL_EXPORTER_PROMETHEUS_PORT + LOCAL_RANK`, so torchrun ranks on one node do not collide; `none`: no offset.",
    ),
    Variable(
        "OPENLORA_GPU_METRICS",
        "auto",
        "`auto`: GPU gauges when NVML initializes, else one info line and none; `on`: NVML must work (else a setup error); `off`.",
    ),
    Variable(
        "OPENLORA_GPU_DEVICES",
        "process",
        "`process`: the GPUs this process uses (torch's devices once CUDA is up, else `CUDA_VISIBLE_DEVICES` narrowed by `LOCAL_RANK`); `all`: every GPU on the host.",
    ),
    Variable(
        "OPENLORA_GPU_TIMEOUT",
        "1000",
        "Milliseconds one NVML snapshot may take; past that the collection serves the last good one (up to 60 s old) and says how old.",
    ),
    Variable(
        "CUDA_VISIBLE_DEVICES",
        "(unset)",
        "Read to pick this process's GPUs (indices, `GPU-` or `MIG-` UUIDs).",
    ),
    Variable(
        "TORCHELASTIC_RUN_ID", "(set by torchrun)", "Read for the run id when `OPENLORA_RUN_ID` is unset."
    ),
    Variable(
        "RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK",
        "(set by torchrun)",
        "Copied into the Resource as `openlora.rank`, `openlora.local_rank`, `openlora.world_size`, `openlora.group_rank`.",
    ),
)

_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_RANK_VARIABLES = (
    ("RANK", "openlora.rank"),
    ("LOCAL_RANK", "openlora.local_rank"),
    ("WORLD_SIZE", "openlora.world_size"),
    ("GROUP_RANK", "openlora.group_rank"),
)


@dataclass(frozen=True)
class OTLPConfig:
    """Resolved OTLP exporter settings (per-signal variables already applied)."""

    endpoint: str = "http://localhost:4318/v1/metrics"
    protocol: Protocol = "http/protobuf"
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0
    compression: Literal["none", "gzip"] = "none"
    insecure: bool = False
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None
    temporality: Literal["cumulative", "delta", "lowmemory"] = "cumulative"
    endpoint_variable: str = "OTEL_EXPORTER_OTLP_ENDPOINT"

    def redacted_headers(self) -> tuple[tuple[str, str], ...]:
        """Headers with values hidden, for printing (header values are usually secrets)."""
        return tuple((k, "<redacted>") for k, _ in self.headers)

    def redacted_endpoint(self) -> str:
        """The endpoint with any ``user:password@`` part hidden."""
        parts = urlsplit(self.endpoint)
        if parts.username or parts.password:
            host = parts.hostname or ""
            if parts.port:
                host = f"{host}:{parts.port}"
            return parts._replace(netloc=f"<redacted>@{host}").geturl()
        return self.endpoint


@dataclass(frozen=True)
class TelemetryConfig:
    """Everything :func:`openlora_otel.setup_telemetry` needs, resolved and validated.

    Build it with :meth:`from_env`, or directly for tests and programmatic use
    (``dataclasses.replace(TelemetryConfig.from_env(), exporters=("none",))``).
    ``run_id=None`` means "generate one at setup".
    """

    sdk_disabled: bool = False
    service_name: str = DEFAULT_SERVICE_NAME
    resource_attributes: Mapping[str, str | int] = field(default_factory=dict)
    exporters: tuple[str, ...] = ("prometheus",)
    prometheus_host: str = "localhost"
    prometheus_port: int = 9464
    prometheus_port_variable: str = "OTEL_EXPORTER_PROMETHEUS_PORT"
    otlp: OTLPConfig = field(default_factory=OTLPConfig)
    export_interval_ms: float = 60000.0
    export_timeout_ms: float = 30000.0
    run_id: str | None = None
    shutdown_timeout_s: float = 2.0
    gpu_metrics: Literal["auto", "on", "off"] = "auto"
    gpu_devices: Literal["process", "all"] = "process"
    gpu_timeout_s: float = 1.0
    cuda_visible_devices: str | None = None

    def __post_init__(self) -> None:
        for name in self.exporters:
            if name not in EXPORTERS:
                raise ConfigError("exporters", self.exporters, _choices(EXPORTERS))
        if "none" in self.exporters and len(self.exporters) > 1:
            raise ConfigError("exporters", self.exporters, "`none` alone, or a list without `none`")
        if not 0 <= self.prometheus_port <= 65535:
            raise ConfigError("prometheus_port", self.prometheus_port, "an integer from 0 to 65535")
        if self.export_interval_ms <= 0:
            raise ConfigError("export_interval_ms", self.export_interval_ms, "a number > 0")
        if self.export_timeout_ms <= 0:
            raise ConfigError("export_timeout_ms", self.export_timeout_ms, "a number > 0")
        if self.shutdown_timeout_s <= 0:
            raise ConfigError("shutdown_timeout_s", self.shutdown_timeout_s, "a number of seconds > 0")
        if not self.service_name:
            raise ConfigError("service_name", self.service_name, "a non-empty string")
        if self.gpu_metrics not in GPU_MODES:
            raise ConfigError("gpu_metrics", self.gpu_metrics, _choices(GPU_MODES))
        if self.gpu_devices not in GPU_DEVICE_MODES:
            raise ConfigError("gpu_devices", self.gpu_devices, _choices(GPU_DEVICE_MODES))
        if self.gpu_timeout_s <= 0:
            raise ConfigError("gpu_timeout_s", self.gpu_timeout_s, "a number of seconds > 0")

    @property
    def enabled_exporters(self) -> tuple[str, ...]:
        """The exporters that build a reader (``none`` removed; empty when disabled)."""
        if self.sdk_disabled:
            return ()
        return tuple(e for e in self.exporters if e != "none")

    def replace(self, **changes: object) -> TelemetryConfig:
        """A copy with ``changes`` applied (and validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetryConfig:
        """Read and validate every variable in :data:`VARIABLES` from ``environ`` (default ``os.environ``)."""
        env = _Env(os.environ if environ is None else environ)

        sdk_disabled = env.boolean("OTEL_SDK_DISABLED")
        resource_attributes: dict[str, str | int] = dict(
            env.key_values("OTEL_RESOURCE_ATTRIBUTES", what="resource attributes")
        )
        service_name = env.get("OTEL_SERVICE_NAME") or str(
            resource_attributes.pop("service.name", "") or DEFAULT_SERVICE_NAME
        )
        resource_attributes.pop("service.name", None)

        for variable, attribute in _RANK_VARIABLES:
            value = env.integer(variable, minimum=0)
            if value is not None:
                resource_attributes.setdefault(attribute, value)

        exporters = env.exporters("OTEL_METRICS_EXPORTER")

        prometheus_host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost"
        prometheus_port = env.integer("OTEL_EXPORTER_PROMETHEUS_PORT", minimum=0, maximum=65535)
        if prometheus_port is None:
            prometheus_port = 9464
        offset_mode = env.choice("OPENLORA_PROMETHEUS_PORT_OFFSET", PORT_OFFSETS) or "local_rank"
        port_variable = "OTEL_EXPORTER_PROMETHEUS_PORT"
        local_rank = resource_attributes.get("openlora.local_rank")
        if (
            offset_mode == "local_rank"
            and prometheus_port != 0
            and isinstance(local_rank, int)
            and local_rank
        ):
            prometheus_port += local_rank
            port_variable = "OTEL_EXPORTER_PROMETHEUS_PORT (+ LOCAL_RANK)"
            if prometheus_port > 65535:
                raise ConfigError(
                    port_variable, prometheus_port, "a port of at most 65535 after adding LOCAL_RANK"
                )

        export_interval = env.milliseconds("OTEL_METRIC_EXPORT_INTERVAL")
        export_timeout = env.milliseconds("OTEL_METRIC_EXPORT_TIMEOUT")
        shutdown_timeout = env.milliseconds("OPENLORA_SHUTDOWN_TIMEOUT")

        run_id = env.get("OPENLORA_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or None
        # torchrun sets TORCHELASTIC_RUN_ID=none when no rendezvous id was given.
        if run_id == "none" and not env.get("OPENLORA_RUN_ID"):
            run_id = None

        gpu_timeout = env.milliseconds("OPENLORA_GPU_TIMEOUT")
        visible = env.get("CUDA_VISIBLE_DEVICES") if "CUDA_VISIBLE_DEVICES" in env else None

        # Validated whether or not `otlp` is selected: a bad value is caught now,
        # not when someone later adds `otlp` to the exporter list.
        otlp = _read_otlp(env)

        return cls(
            sdk_disabled=sdk_disabled,
            service_name=service_name,
            resource_attributes=resource_attributes,
            exporters=exporters,
            prometheus_host=prometheus_host,
            prometheus_port=prometheus_port,
            prometheus_port_variable=port_variable,
            otlp=otlp,
            export_interval_ms=60000.0 if export_interval is None else export_interval,
            export_timeout_ms=30000.0 if export_timeout is None else export_timeout,
            run_id=run_id,
            shutdown_timeout_s=2.0 if shutdown_timeout is None else shutdown_timeout / 1000.0,
            gpu_metrics=env.choice("OPENLORA_GPU_METRICS", GPU_MODES) or "auto",  # type: ignore[arg-type]
            gpu_devices=env.choice("OPENLORA_GPU_DEVICES", GPU_DEVICE_MODES) or "process",  # type: ignore[arg-type]
            gpu_timeout_s=1.0 if gpu_timeout is None else gpu_timeout / 1000.0,
            cuda_visible_devices=visible,
        )


def _choices(values: tuple[str, ...]) -> str:
    return "one of " + ", ".join(f"`{v}`" for v in values)


class _Env:
    """Typed readers over an environment mapping; each error names its variable."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def get(self, name: str) -> str:
        return self._environ.get(name, "").strip()

    def __contains__(self, name: str) -> bool:
        return name in self._environ

    def first(self, *names: str) -> tuple[str, str]:
        """The first of ``names`` that is set and non-empty, as (name, value); else (last name, "")."""
        for name in names:
            value = self.get(name)
            if value:
                return name, value
        return names[-1], ""

    def boolean(self, name: str, *names: str) -> bool:
        variable, raw = self.first(name, *names) if names else (name, self.get(name))
        lowered = raw.lower()
        if lowered in ("", "false"):
            return False
        if lowered == "true":
            return True
        # The spec reads anything but "true" as false; we refuse instead, because
        # OTEL_SDK_DISABLED=1 silently meaning "enabled" is the worse surprise.
        raise ConfigError(variable, raw, "`true` or `false` (case-insensitive)")

    def integer(self, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        raw = self.get(name)
        if not raw:
            return None
        accepted = "an integer"
        if minimum is not None and maximum is not None:
            accepted = f"an integer from {minimum} to {maximum}"
        elif minimum is not None:
            accepted = f"an integer >= {minimum}"
        try:
            value = int(raw, 10)
        except ValueError:
            raise ConfigError(name, raw, accepted) from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ConfigError(name, raw, accepted)
        return value

    def milliseconds(self, *names: str) -> float | None:
        """A positive duration in milliseconds (integers per the spec; decimals tolerated)."""
        variable, raw = self.first(*names)
        if not raw:
            return None
        accepted = "a number of milliseconds > 0"
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(variable, raw, accepted) from None
        if not value > 0 or value == float("inf"):
            raise ConfigError(variable, raw, accepted)
        return value

    def choice(self, name: str, choices: tuple[str, ...], *names: str) -> str | None:
        variable, raw = self.first(name, *names) if names else (name, self.get(name))
        if not raw:
            return None
        lowered = raw.lower()
        if lowered not in choices:
            raise ConfigError(variable, raw, _choices(choices))
        return lowered

    def exporters(self, name: str) -> tuple[str, ...]:
        raw = self.get(name)
        if not raw:
            return ("prometheus",)
        names: list[str] = []
        for part in raw.split(","):
            item = part.strip().lower()
            if item not in EXPORTERS:
                detail = f"unknown exporter {part.strip()!r}"
                raise ConfigError(
                    name, raw, "a comma list of " + ", ".join(f"`{e}`" for e in EXPORTERS), detail
                )
            if item not in names:
                names.append(item)
        if "none" in names and len(names) > 1:
            raise ConfigError(name, raw, "`none` alone, or a list without `none`")
        return tuple(names)

    def key_values(self, *names: str, what: str) -> list[tuple[str, str]]:
        """Parse the W3C-baggage-like ``k=v,k2=v2`` list used for headers and resource attributes."""
        variable, raw = self.first(*names)
        pairs: list[tuple[str, str]] = []
        if not raw:
            return pairs
        accepted = f"{what} as `key=value` pairs separated by commas, values percent-encoded"
        # Header values are usually credentials: never echo them in an error.
        shown = _redact_key_values(raw) if what == "headers" else raw
        for item in raw.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                entry = "an entry" if what == "headers" else f"entry {item.strip()!r}"
                raise ConfigError(variable, shown, accepted, f"{entry} has no `key=`")
            if what == "headers" and not _TOKEN_RE.match(key):
                raise ConfigError(variable, shown, accepted, f"{key!r} is not a valid header name")
            try:
                decoded = unquote(value.strip(), errors="strict")
            except UnicodeDecodeError:
                raise ConfigError(
                    variable, shown, accepted, f"value of {key!r} is not valid percent-encoding"
                ) from None
            pairs.append((unquote(key), decoded))
        return pairs


def _redact_key_values(raw: str) -> str:
    return ",".join(
        f"{item.partition('=')[0].strip()}=<redacted>" if "=" in item else "<redacted>"
        for item in raw.split(",")
    )


def _read_otlp(env: _Env) -> OTLPConfig:
    protocol = env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") and "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
    protocol_variable = protocol or "OTEL_EXPORTER_OTLP_PROTOCOL"
    raw_protocol = env.get(protocol_variable)
    if raw_protocol and raw_protocol.lower() not in PROTOCOLS:
        detail = "the Python SDK has no http/json exporter" if raw_protocol.lower() == "http/json" else ""
        raise ConfigError(protocol_variable, raw_protocol, _choices(PROTOCOLS), detail)
    resolved_protocol: Protocol = "grpc" if raw_protocol.lower() == "grpc" else "http/protobuf"

    endpoint_variable, endpoint = env.first(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    per_signal = endpoint_variable == "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" and bool(endpoint)
    insecure = env.boolean("OTEL_EXPORTER_OTLP_METRICS_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")

    if resolved_protocol == "http/protobuf":
        if not endpoint:
            endpoint = "http://localhost:4318"
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                endpoint_variable,
                endpoint,
                "an http:// or https:// URL for protocol http/protobuf, e.g. http://localhost:4318",
            )
        _check_port(endpoint_variable, endpoint, parts)
        if not per_signal:
            # The spec: the signal path is appended to the base endpoint only.
            endpoint = endpoint.rstrip("/") + "/v1/metrics"
    else:
        if not endpoint:
            endpoint = "http://localhost:4317"
        parts = urlsplit(endpoint if "://" in endpoint else "//" + endpoint)
        if parts.scheme not in ("", "http", "https") or not parts.hostname:
            raise ConfigError(
                endpoint_variable,
                endpoint,
                "for grpc, http://host:port, https://host:port, or host:port with OTEL_EXPORTER_OTLP_INSECURE",
            )
        _check_port(endpoint_variable, endpoint, parts)
        if parts.scheme:
            insecure = parts.scheme == "http"

    headers = tuple(
        env.key_values("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS", what="headers")
    )
    timeout = env.milliseconds("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    compression = (
        env.choice("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", COMPRESSIONS, "OTEL_EXPORTER_OTLP_COMPRESSION")
        or "none"
    )
    temporality = (
        env.choice("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", TEMPORALITIES) or "cumulative"
    )

    files: dict[str, str | None] = {}
    for key, suffix in (
        ("certificate", "CERTIFICATE"),
        ("client_key", "CLIENT_KEY"),
        ("client_certificate", "CLIENT_CERTIFICATE"),
    ):
        variable, path = env.first(f"OTEL_EXPORTER_OTLP_METRICS_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}")
        if path and not os.path.isfile(path):
            raise ConfigError(variable, path, "the path of a readable PEM file", "no such file")
        files[key] = path or None
    if bool(files["client_key"]) != bool(files["client_certificate"]):
        missing = (
            "OTEL_EXPORTER_OTLP_CLIENT_KEY"
            if not files["client_key"]
            else "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
        )
        raise ConfigError(
            missing, "", "a PEM file: mTLS needs both the client key and the client certificate"
        )

    return OTLPConfig(
        endpoint=endpoint,
        protocol=resolved_protocol,
        headers=headers,
        timeout_s=10.0 if timeout is None else timeout / 1000.0,
        compression=compression,  # type: ignore[arg-type]
        insecure=insecure,
        certificate=files["certificate"],
        client_key=files["client_key"],
        client_certificate=files["client_certificate"],
        temporality=temporality,  # type: ignore[arg-type]
        endpoint_variable=endpoint_variable,
    )


def _check_port(variable: str, endpoint: str, parts: SplitResult) -> None:
    try:
        _ = parts.port  # raises ValueError when out of range / not a number
    except ValueError:
        raise ConfigError(variable, endpoint, "a URL whose port is an integer from 1 to 65535") from None

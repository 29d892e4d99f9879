"""Configuration: the one place that reads openlora-otel's settings from the environment.

Every variable is a row of :data:`VARIABLES` (:mod:`.variables`); :meth:`TelemetryConfig.from_env`
reads them into one frozen :class:`TelemetryConfig`, and the Configuration page and
``openlora-otel env`` are printed from the same rows. ``OTEL_*`` values follow the specification
where the Python SDK departs from it, and are handed to the SDK explicitly. Invalid values raise
:class:`ConfigError` (:mod:`.checks`), never showing credentials. See docs/reference/setup.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from openlora_otel.config.checks import (
    ANY_SCHEME,
    COMPRESSIONS,
    DIRECTORY_ACCEPTED,
    EXPORT_INTERVAL_RANGE_MS,
    EXPORT_TIMEOUT_RANGE_MS,
    EXPORTERS,
    FILE_SD_ACCEPTED,
    FINAL_SCRAPE_TIMEOUT_RANGE_MS,
    GLOB_RE,
    GLOBS_ACCEPTED,
    GPU_DEVICE_MODES,
    GPU_MODES,
    GPU_TIMEOUT_RANGE_MS,
    HEADERS_ACCEPTED,
    HISTOGRAM_AGGREGATIONS,
    HISTORY_INTERVAL_RANGE_MS,
    HISTORY_MAX_BYTES_ACCEPTED,
    HOST_ACCEPTED,
    HTTP_SCHEMES,
    INFERENCE_MAX_ADAPTERS_RANGE,
    MAX_RANK,
    MAX_RUN_ATTEMPT,
    MAX_RUN_ID_LENGTH,
    MAX_RUN_NAME_LENGTH,
    MIN_HISTORY_MAX_BYTES,
    OTLP_TIMEOUT_RANGE_MS,
    PEAK_FLOPS_ACCEPTED,
    PEAK_FLOPS_RANGE,
    PORT_OFFSETS,
    PROTOCOLS,
    RUN_ID_ACCEPTED,
    RUN_NAME_ACCEPTED,
    SHUTDOWN_TIMEOUT_RANGE_MS,
    TEMPORALITIES,
    ConfigError,
    brackets_closed,
    check_certificate_file,
    check_client_key_pair,
    check_endpoint,
    check_private_key_file,
    choices_accepted,
    header_problem,
    host_problem,
    in_range,
    in_seconds,
    ms_accepted,
    run_id_problem,
    run_name_problem,
    s_accepted,
    utf8_problem,
)
from openlora_otel.config.env import Env, secrets_in_env
from openlora_otel.config.variables import GROUPS, OTLP_DEFAULT_ENDPOINTS, VARIABLES, Variable, default
from openlora_otel.names.resource import (
    GROUP_RANK_ATTRIBUTE,
    LOCAL_RANK_ATTRIBUTE,
    RANK_ATTRIBUTE,
    WORLD_SIZE_ATTRIBUTE,
)
from openlora_otel.redaction import REDACTED, redact_url, secret_forms, url_secrets

__all__ = [
    "DEFAULT_PROMETHEUS_PORT",
    "DEFAULT_SERVICE_NAME",
    "GROUPS",
    "VARIABLES",
    "ConfigError",
    "OTLPConfig",
    "PortOffset",
    "TelemetryConfig",
    "Variable",
    "secrets_in_env",
]

# Re-exported for the modules that check values set in code the way the environment's are checked.
__all__ += [
    "DIRECTORY_ACCEPTED",
    "FILE_SD_ACCEPTED",
    "MAX_RUN_ATTEMPT",
    "MAX_RUN_ID_LENGTH",
    "MAX_RUN_NAME_LENGTH",
    "MIN_HISTORY_MAX_BYTES",
    "RUN_ID_ACCEPTED",
    "RUN_NAME_ACCEPTED",
    "SHUTDOWN_TIMEOUT_RANGE_MS",
    "run_id_problem",
    "run_name_problem",
]



def _default(name: str) -> Any:
    """A field default, from the table."""
    return default(name)


DEFAULT_SERVICE_NAME: str = _default("OTEL_SERVICE_NAME")
DEFAULT_PROMETHEUS_PORT: int = _default("OTEL_EXPORTER_PROMETHEUS_PORT")
PROMETHEUS_PORT_VARIABLE = "OTEL_EXPORTER_PROMETHEUS_PORT"

Protocol = Literal["http/protobuf", "grpc"]

# The launcher's rank variables, and the Resource attributes (openlora_otel.names) they are copied into.
_RANK_VARIABLES = (
    ("RANK", RANK_ATTRIBUTE),
    ("LOCAL_RANK", LOCAL_RANK_ATTRIBUTE),
    ("WORLD_SIZE", WORLD_SIZE_ATTRIBUTE),
    ("GROUP_RANK", GROUP_RANK_ATTRIBUTE),
)
# OPENLORA_PROMETHEUS_PORT_OFFSET's choices and the attribute each adds to the port.
_OFFSET_ATTRIBUTES = {"rank": RANK_ATTRIBUTE, "local_rank": LOCAL_RANK_ATTRIBUTE}


@dataclass(frozen=True)
class PortOffset:
    """The rank added to the Prometheus port (``OPENLORA_PROMETHEUS_PORT_OFFSET``): which launcher
    variable it came from and its value."""

    variable: Literal["LOCAL_RANK", "RANK"]
    value: int

    @property
    def setting(self) -> str:
        """How messages name the port's setting: ``OTEL_EXPORTER_PROMETHEUS_PORT (+ RANK)``."""
        return f"{PROMETHEUS_PORT_VARIABLE} (+ {self.variable})"


@dataclass(frozen=True)
class OTLPConfig:
    """Resolved OTLP exporter settings (per-signal variables already applied)."""

    endpoint: str = OTLP_DEFAULT_ENDPOINTS["http/protobuf"] + "/v1/metrics"
    protocol: Protocol = _default("OTEL_EXPORTER_OTLP_PROTOCOL")  # noqa: RUF009 (an immutable value from the table)
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = _default("OTEL_EXPORTER_OTLP_TIMEOUT")
    compression: Literal["none", "gzip"] = _default("OTEL_EXPORTER_OTLP_COMPRESSION")
    insecure: bool = _default("OTEL_EXPORTER_OTLP_INSECURE")
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None
    temporality: Literal["cumulative", "delta", "lowmemory"] = _default(
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
    )
    endpoint_variable: str = "OTEL_EXPORTER_OTLP_ENDPOINT"
    # False when neither endpoint variable was set and the protocol's default is used.
    endpoint_set: bool = True
    histogram_aggregation: Literal["explicit_bucket_histogram", "base2_exponential_bucket_histogram"] = _default(
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    )

    def __post_init__(self) -> None:
        # The same rules as from_env, for configs built in code: a bad value fails
        # here, not as an export error (that could echo it) on every interval.
        if self.protocol not in PROTOCOLS:
            raise ConfigError("otlp.protocol", self.protocol, choices_accepted(PROTOCOLS))
        check_endpoint(
            "otlp.endpoint", self.endpoint, schemes=HTTP_SCHEMES if self.protocol != "grpc" else ANY_SCHEME
        )
        for name, value in self.headers:
            problem = header_problem(name, value)
            if problem:
                raise ConfigError("otlp.headers", dict(self.redacted_headers()), HEADERS_ACCEPTED, problem)
        if not in_range(self.timeout_s, in_seconds(OTLP_TIMEOUT_RANGE_MS)):
            raise ConfigError("otlp.timeout_s", self.timeout_s, s_accepted(OTLP_TIMEOUT_RANGE_MS))
        if self.compression not in COMPRESSIONS:
            raise ConfigError("otlp.compression", self.compression, choices_accepted(COMPRESSIONS))
        if self.temporality not in TEMPORALITIES:
            raise ConfigError("otlp.temporality", self.temporality, choices_accepted(TEMPORALITIES))
        if self.histogram_aggregation not in HISTOGRAM_AGGREGATIONS:
            raise ConfigError(
                "otlp.histogram_aggregation", self.histogram_aggregation, choices_accepted(HISTOGRAM_AGGREGATIONS)
            )
        for name in ("certificate", "client_certificate"):
            if getattr(self, name):
                check_certificate_file(f"otlp.{name}", getattr(self, name))
        if self.client_key:
            check_private_key_file("otlp.client_key", self.client_key)
        if bool(self.client_key) != bool(self.client_certificate):
            missing = "otlp.client_key" if not self.client_key else "otlp.client_certificate"
            raise ConfigError(missing, None, "a PEM file: mTLS needs both the client key and the client certificate")
        if self.client_key and self.client_certificate:
            check_client_key_pair("otlp.client_key", self.client_key, "otlp.client_certificate", self.client_certificate)

    def __repr__(self) -> str:
        # print(config) must not show credentials: endpoint and headers redacted.
        shown = {"endpoint": self.redacted_endpoint(), "headers": self.redacted_headers()}
        fields = (f"{f.name}={shown.get(f.name, getattr(self, f.name))!r}" for f in dataclasses.fields(self))
        return f"OTLPConfig({', '.join(fields)})"

    def redacted_headers(self) -> tuple[tuple[str, str], ...]:
        """Headers with values hidden, for printing (header values are usually secrets)."""
        return tuple((k, REDACTED) for k, _ in self.headers)

    def redacted_endpoint(self) -> str:
        """The endpoint with its ``user:password@`` part, query values and fragment hidden."""
        return redact_url(self.endpoint)

    def secrets(self) -> frozenset[str]:
        """This config's credentials (URL user info, query values and fragment, header values) in every
        form redaction scrubs."""
        found = set(url_secrets(self.endpoint))
        for _, value in self.headers:
            found |= secret_forms(value)
        return frozenset(found)


@dataclass(frozen=True)
class TelemetryConfig:
    """Everything :func:`openlora_otel.setup_telemetry` needs, resolved and validated.

    Build it with :meth:`from_env`, or directly for tests and programmatic use
    (``dataclasses.replace(TelemetryConfig.from_env(), exporters=("none",))``).
    ``run_id=None`` means "generate one at setup".
    """

    sdk_disabled: bool = _default("OTEL_SDK_DISABLED")
    service_name: str = DEFAULT_SERVICE_NAME
    resource_attributes: Mapping[str, str | int] = field(default_factory=dict)
    exporters: tuple[str, ...] = _default("OTEL_METRICS_EXPORTER")
    prometheus_host: str = _default("OTEL_EXPORTER_PROMETHEUS_HOST")
    prometheus_port: int = DEFAULT_PROMETHEUS_PORT
    # The rank added to the port by OPENLORA_PROMETHEUS_PORT_OFFSET (already in prometheus_port), if any.
    prometheus_port_offset: PortOffset | None = None
    otlp: OTLPConfig = field(default_factory=OTLPConfig)
    export_interval_ms: float = _default("OTEL_METRIC_EXPORT_INTERVAL")
    export_timeout_ms: float = _default("OTEL_METRIC_EXPORT_TIMEOUT")
    run_id: str | None = None
    run_attempt: int = _default("OPENLORA_RUN_ATTEMPT")
    shutdown_timeout_s: float = _default("OPENLORA_SHUTDOWN_TIMEOUT")
    gpu_metrics: Literal["auto", "on", "off"] = _default("OPENLORA_GPU_METRICS")
    gpu_devices: Literal["process", "all"] = _default("OPENLORA_GPU_DEVICES")
    gpu_timeout_s: float = _default("OPENLORA_GPU_TIMEOUT")
    cuda_visible_devices: str | None = _default("CUDA_VISIBLE_DEVICES")
    host_metrics: bool = _default("OPENLORA_HOST_METRICS")
    host_metrics_excluded: tuple[str, ...] = _default("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS")
    # False when OTEL_EXPORTER_PROMETHEUS_PORT was not set and the default port (plus any offset) is used.
    prometheus_port_explicit: bool = True
    final_scrape_timeout_s: float = _default("OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT")
    expect_scrape: bool = _default("OPENLORA_PROMETHEUS_EXPECT_SCRAPE")
    handle_sigterm: bool = _default("OPENLORA_HANDLE_SIGTERM")
    quiet: bool = _default("OPENLORA_QUIET")
    file_sd_dir: str | None = _default("OPENLORA_PROMETHEUS_FILE_SD_DIR")
    peak_flops: float | None = _default("OPENLORA_PEAK_FLOPS")
    run_name: str | None = _default("OPENLORA_RUN_NAME")
    history_dir: str | None = _default("OPENLORA_HISTORY_DIR")
    history_interval_ms: float = _default("OPENLORA_HISTORY_INTERVAL")
    history_max_bytes: int = _default("OPENLORA_HISTORY_MAX_BYTES")
    inference_max_adapters: int = _default("OPENLORA_INFERENCE_MAX_ADAPTERS")

    def __post_init__(self) -> None:
        for name in self.exporters:
            if name not in EXPORTERS:
                raise ConfigError("exporters", self.exporters, choices_accepted(EXPORTERS))
        if "none" in self.exporters and len(self.exporters) > 1:
            raise ConfigError("exporters", self.exporters, "`none` alone, or a list without `none`")
        if not (isinstance(self.prometheus_port, int) and in_range(self.prometheus_port, (0, 65535))):
            raise ConfigError("prometheus_port", self.prometheus_port, "an integer from 0 to 65535")
        problem = host_problem(self.prometheus_host)
        if problem:
            raise ConfigError("prometheus_host", self.prometheus_host, HOST_ACCEPTED, problem)
        # nan, inf and huge values pass a "> 0" test and then stall or kill a thread.
        if not in_range(self.export_interval_ms, EXPORT_INTERVAL_RANGE_MS):
            raise ConfigError(
                "export_interval_ms", self.export_interval_ms, ms_accepted(EXPORT_INTERVAL_RANGE_MS)
            )
        if not in_range(self.export_timeout_ms, EXPORT_TIMEOUT_RANGE_MS):
            raise ConfigError(
                "export_timeout_ms", self.export_timeout_ms, ms_accepted(EXPORT_TIMEOUT_RANGE_MS)
            )
        if not in_range(self.shutdown_timeout_s, in_seconds(SHUTDOWN_TIMEOUT_RANGE_MS)):
            raise ConfigError(
                "shutdown_timeout_s", self.shutdown_timeout_s, s_accepted(SHUTDOWN_TIMEOUT_RANGE_MS)
            )
        if not self.service_name:
            raise ConfigError("service_name", self.service_name, "a non-empty string")
        # Sent with every export: a lone surrogate would fail each one and every scrape.
        attributes = [str(part) for item in self.resource_attributes.items() for part in item]
        for name, value, texts in (
            ("service_name", self.service_name, [self.service_name]),
            ("resource_attributes", dict(self.resource_attributes), attributes),
        ):
            problem = next(filter(None, map(utf8_problem, texts)), None)
            if problem:
                raise ConfigError(name, value, "text in UTF-8", problem)
        if self.gpu_metrics not in GPU_MODES:
            raise ConfigError("gpu_metrics", self.gpu_metrics, choices_accepted(GPU_MODES))
        if self.gpu_devices not in GPU_DEVICE_MODES:
            raise ConfigError("gpu_devices", self.gpu_devices, choices_accepted(GPU_DEVICE_MODES))
        if not in_range(self.gpu_timeout_s, in_seconds(GPU_TIMEOUT_RANGE_MS)):
            raise ConfigError("gpu_timeout_s", self.gpu_timeout_s, s_accepted(GPU_TIMEOUT_RANGE_MS))
        if self.peak_flops is not None and not in_range(self.peak_flops, PEAK_FLOPS_RANGE):
            raise ConfigError("peak_flops", self.peak_flops, PEAK_FLOPS_ACCEPTED)
        if not isinstance(self.host_metrics, bool):
            raise ConfigError("host_metrics", self.host_metrics, "`True` or `False`")
        if isinstance(self.host_metrics_excluded, str) or not all(
            isinstance(p, str) and GLOB_RE.fullmatch(p) and brackets_closed(p) for p in self.host_metrics_excluded
        ):
            raise ConfigError("host_metrics_excluded", self.host_metrics_excluded, "a tuple of " + GLOBS_ACCEPTED)
        if self.run_name is not None:
            problem = run_name_problem(self.run_name)
            if problem:
                raise ConfigError("run_name", self.run_name, RUN_NAME_ACCEPTED, problem)
        if self.run_id is not None:
            problem = run_id_problem(self.run_id)
            if problem:
                raise ConfigError("run_id", self.run_id, RUN_ID_ACCEPTED, problem)
        if isinstance(self.run_attempt, bool) or not (
            isinstance(self.run_attempt, int) and 1 <= self.run_attempt <= MAX_RUN_ATTEMPT
        ):
            raise ConfigError("run_attempt", self.run_attempt, f"an integer from 1 to {MAX_RUN_ATTEMPT}")
        if not in_range(self.history_interval_ms, HISTORY_INTERVAL_RANGE_MS):
            raise ConfigError(
                "history_interval_ms", self.history_interval_ms, ms_accepted(HISTORY_INTERVAL_RANGE_MS)
            )
        if isinstance(self.history_max_bytes, bool) or not (
            isinstance(self.history_max_bytes, int) and self.history_max_bytes >= MIN_HISTORY_MAX_BYTES
        ):
            raise ConfigError("history_max_bytes", self.history_max_bytes, HISTORY_MAX_BYTES_ACCEPTED)
        low, high = INFERENCE_MAX_ADAPTERS_RANGE
        if isinstance(self.inference_max_adapters, bool) or not (
            isinstance(self.inference_max_adapters, int) and low <= self.inference_max_adapters <= high
        ):
            raise ConfigError(
                "inference_max_adapters", self.inference_max_adapters, f"an integer from {low} to {high}"
            )
        if self.exponential_histograms and "prometheus" in self.exporters:
            raise ConfigError(
                "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
                self.otlp.histogram_aggregation,
                "`explicit_bucket_histogram` while OTEL_METRICS_EXPORTER has `prometheus`",
                "the pull endpoint's text formats have no exponential histograms: use OTEL_METRICS_EXPORTER=otlp, "
                "or unset it",
            )
        if not in_range(self.final_scrape_timeout_s, in_seconds(FINAL_SCRAPE_TIMEOUT_RANGE_MS)):
            raise ConfigError(
                "final_scrape_timeout_s",
                self.final_scrape_timeout_s,
                s_accepted(FINAL_SCRAPE_TIMEOUT_RANGE_MS),
            )

    @property
    def exponential_histograms(self) -> bool:
        """Every histogram openlora-otel emits is base-2 exponential
        (``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram``)."""
        return self.otlp.histogram_aggregation == "base2_exponential_bucket_histogram"

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
        env = Env(os.environ if environ is None else environ)

        # The variables that fill one field each, in the table's order; unset ones keep the default.
        values: dict[str, Any] = {}
        for variable in VARIABLES:
            if variable.read is not None:
                value = variable.read(env, variable.name)
                if value is not None:
                    values[variable.field] = variable.field_value(value)

        resource_attributes: dict[str, str | int] = dict(
            env.key_values("OTEL_RESOURCE_ATTRIBUTES", what="resource attributes")
        )
        service_name = env.text("OTEL_SERVICE_NAME") or str(
            resource_attributes.pop("service.name", "") or DEFAULT_SERVICE_NAME
        )
        resource_attributes.pop("service.name", None)
        for name, attribute in _RANK_VARIABLES:
            rank = env.integer(name, minimum=0, maximum=MAX_RANK)
            if rank is not None:
                resource_attributes.setdefault(attribute, rank)

        # Validated whether or not `otlp` is selected: a bad value is caught now,
        # not when someone later adds `otlp` to the exporter list.
        otlp = _read_otlp(env)

        return cls(
            service_name=service_name,
            resource_attributes=resource_attributes,
            otlp=otlp,
            run_id=_run_id(env),
            **_prometheus_port(env, resource_attributes),
            **values,
        )


def _prometheus_port(env: Env, resource_attributes: Mapping[str, str | int]) -> dict[str, Any]:
    """``OTEL_EXPORTER_PROMETHEUS_PORT`` plus the rank ``OPENLORA_PROMETHEUS_PORT_OFFSET`` names: the
    config's port, its offset and whether the port was set."""
    port = env.integer(PROMETHEUS_PORT_VARIABLE, minimum=0, maximum=65535)
    explicit = port is not None
    if port is None:
        port = DEFAULT_PROMETHEUS_PORT
    mode = env.choice("OPENLORA_PROMETHEUS_PORT_OFFSET", PORT_OFFSETS) or _default(
        "OPENLORA_PROMETHEUS_PORT_OFFSET"
    )
    offset = None
    rank = resource_attributes.get(_OFFSET_ATTRIBUTES[mode]) if mode != "none" else None
    if port != 0 and isinstance(rank, int) and rank:
        offset = PortOffset("LOCAL_RANK" if mode == "local_rank" else "RANK", rank)
        port += rank
        if port > 65535:
            raise ConfigError(
                offset.setting,
                port,
                f"a port of at most 65535 after adding {offset.variable}",
                f"lower {PROMETHEUS_PORT_VARIABLE} or set OPENLORA_PROMETHEUS_PORT_OFFSET",
            )
    return {"prometheus_port": port, "prometheus_port_offset": offset, "prometheus_port_explicit": explicit}


def _run_id(env: Env) -> str | None:
    """``OPENLORA_RUN_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``; None: one is made at setup."""
    run_id = env.get("OPENLORA_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or None
    # torchrun sets TORCHELASTIC_RUN_ID=none when no rendezvous id was given.
    if run_id == "none" and not env.get("OPENLORA_RUN_ID"):
        run_id = None
    if run_id is not None and run_id_problem(run_id):
        source = "OPENLORA_RUN_ID" if env.get("OPENLORA_RUN_ID") else "TORCHELASTIC_RUN_ID"
        raise ConfigError(source, run_id, RUN_ID_ACCEPTED, run_id_problem(run_id) or "")
    return run_id




def _read_otlp(env: Env) -> OTLPConfig:
    def read_protocol(variable: str) -> str:
        raw = env.get(variable)
        if raw.lower() not in PROTOCOLS:
            detail = "the Python SDK has no http/json exporter" if raw.lower() == "http/json" else ""
            raise ConfigError(variable, raw, choices_accepted(PROTOCOLS), detail)
        return raw.lower()

    _, raw_protocol = env.winner(
        read_protocol, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    resolved_protocol: Protocol = raw_protocol or _default("OTEL_EXPORTER_OTLP_PROTOCOL")

    # The base endpoint is checked even when the per-signal one wins; as the loser
    # it may serve other signals over another protocol, so only its form is checked.
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base and env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        check_endpoint("OTEL_EXPORTER_OTLP_ENDPOINT", base, schemes=ANY_SCHEME)
    endpoint_variable, endpoint = env.first(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    per_signal = endpoint_variable == "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" and bool(endpoint)
    endpoint_set = bool(endpoint)
    insecure = env.boolean(
        "OTEL_EXPORTER_OTLP_METRICS_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE", default=_default("OTEL_EXPORTER_OTLP_INSECURE")
    )

    if resolved_protocol == "http/protobuf":
        if not endpoint:
            endpoint = OTLP_DEFAULT_ENDPOINTS["http/protobuf"]
        check_endpoint(
            endpoint_variable,
            endpoint,
            schemes=HTTP_SCHEMES,
            accepted="an http:// or https:// URL for protocol http/protobuf, e.g. " + OTLP_DEFAULT_ENDPOINTS["http/protobuf"],
        )
        if not per_signal:
            # The spec: the signal path is appended to the base endpoint's path only, before any query
            # (a token in `?api_key=`) or fragment, which would otherwise swallow it. The first `?` or `#`
            # starts them: one in the user info would have an `@` after it, which check_endpoint refused.
            cut = min((i for i in (endpoint.find("?"), endpoint.find("#")) if i >= 0), default=len(endpoint))
            endpoint = endpoint[:cut].rstrip("/") + "/v1/metrics" + endpoint[cut:]
    else:
        if not endpoint:
            endpoint = OTLP_DEFAULT_ENDPOINTS["grpc"]
        parts = check_endpoint(
            endpoint_variable,
            endpoint,
            schemes=ANY_SCHEME,
            accepted="for grpc, http://host:port, https://host:port, or host:port with OTEL_EXPORTER_OTLP_INSECURE",
        )
        if parts.scheme:
            insecure = parts.scheme == "http"

    headers = tuple(
        env.key_values("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS", what="headers")
    )
    timeout = env.milliseconds(
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT", bounds=OTLP_TIMEOUT_RANGE_MS
    )
    compression = (
        env.choice("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", COMPRESSIONS, "OTEL_EXPORTER_OTLP_COMPRESSION")
        or _default("OTEL_EXPORTER_OTLP_COMPRESSION")
    )
    temporality = (
        env.choice("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", TEMPORALITIES)
        or _default("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE")
    )
    histogram_aggregation = (
        env.choice("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", HISTOGRAM_AGGREGATIONS)
        or _default("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION")
    )

    # Read and checked now, whatever the protocol and even when `otlp` is not selected: an unreadable
    # or non-PEM file would otherwise fail every export (or, for gRPC, setup with a bare OSError).
    def pem_file(variable: str) -> str:
        path = env.get(variable)
        if variable.endswith("CLIENT_KEY"):
            check_private_key_file(variable, path)
        else:
            check_certificate_file(variable, path)
        return path

    files: dict[str, tuple[str, str | None]] = {}
    for key, suffix in (
        ("certificate", "CERTIFICATE"),
        ("client_key", "CLIENT_KEY"),
        ("client_certificate", "CLIENT_CERTIFICATE"),
    ):
        files[key] = env.winner(pem_file, f"OTEL_EXPORTER_OTLP_METRICS_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}")
    (key_variable, client_key), (certificate_variable, client_certificate) = (
        files["client_key"],
        files["client_certificate"],
    )
    if bool(client_key) != bool(client_certificate):
        missing = (
            "OTEL_EXPORTER_OTLP_CLIENT_KEY"
            if not client_key
            else "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
        )
        raise ConfigError(
            missing, "", "a PEM file: mTLS needs both the client key and the client certificate"
        )
    if client_key and client_certificate:
        check_client_key_pair(key_variable, client_key, certificate_variable, client_certificate)

    return OTLPConfig(
        endpoint=endpoint,
        protocol=resolved_protocol,
        headers=headers,
        timeout_s=_default("OTEL_EXPORTER_OTLP_TIMEOUT") if timeout is None else timeout / 1000.0,
        compression=compression,  # type: ignore[arg-type]
        histogram_aggregation=histogram_aggregation,  # type: ignore[arg-type]
        insecure=insecure,
        certificate=files["certificate"][1],
        client_key=client_key,
        client_certificate=client_certificate,
        temporality=temporality,  # type: ignore[arg-type]
        endpoint_variable=endpoint_variable,
        endpoint_set=endpoint_set,
    )



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
and what is accepted. Durations and numbers are read as ASCII decimal digits
only (no underscore, sign or ``nan``; no exponent but in ``OPENLORA_PEAK_FLOPS``,
whose values are like ``989e12``), within documented ranges, so a
value that would stall or kill a thread later is refused here. Credentials (URL
``user:password@`` and header values) never appear in an error or a repr.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar
from urllib.parse import SplitResult, unquote, urlsplit

from openlora_otel.redaction import REDACTED, redact, redact_url, secret_forms, url_secrets

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
PORT_OFFSETS = ("local_rank", "rank", "none")
GPU_MODES = ("auto", "on", "off")
GPU_DEVICE_MODES = ("process", "all")

Protocol = Literal["http/protobuf", "grpc"]

# Accepted ranges, in milliseconds. Below the minimum an interval spins a core or
# an export cannot finish; above the maximum the SDK's waits overflow or the
# value cannot be meant (a day between pushes, ten minutes to shut down).
EXPORT_INTERVAL_RANGE_MS = (100.0, 86_400_000.0)
EXPORT_TIMEOUT_RANGE_MS = (100.0, 86_400_000.0)
OTLP_TIMEOUT_RANGE_MS = (100.0, 86_400_000.0)
SHUTDOWN_TIMEOUT_RANGE_MS = (1.0, 600_000.0)
GPU_TIMEOUT_RANGE_MS = (1.0, 60_000.0)
FINAL_SCRAPE_TIMEOUT_RANGE_MS = (0.0, 600_000.0)
HISTORY_INTERVAL_RANGE_MS = (100.0, 86_400_000.0)
DEFAULT_HISTORY_MAX_BYTES = 64 * 1024 * 1024
MIN_HISTORY_MAX_BYTES = 1024 * 1024
INFERENCE_MAX_ADAPTERS_RANGE = (1, 1000)
MAX_RUN_NAME_LENGTH = 100
# A run id names the history file (with a rank suffix, under the 255-byte limit of a file name) and
# labels every series of the run.
MAX_RUN_ID_LENGTH = 128
RUN_ID_ACCEPTED = f"a run id of 1 to {MAX_RUN_ID_LENGTH} printable characters"
# Ranks are exported as integers: keep them far inside int64.
MAX_RANK = 2**31 - 1


def _ms_range(bounds: tuple[float, float], scale: float = 1.0) -> str:
    """``100 to 86400000 (1 day)``: an accepted range as the README table and errors say it."""
    low, high = bounds
    human = {86_400_000: "1 day", 600_000: "10 min", 60_000: "1 min"}.get(int(high), f"{high / 1000:g} s")
    return f"{low * scale:.15g} to {high * scale:.15g} ({human})"


def _ms_accepted(bounds: tuple[float, float]) -> str:
    return f"a number of milliseconds from {_ms_range(bounds)}, in ASCII digits"


_MAX_SHOWN = 200


class ConfigError(ValueError):
    """A configuration value that openlora-otel cannot use.

    ``variable`` is the environment variable (or argument) at fault, ``value``
    what it held and ``accepted`` a short description of valid values.
    ``scheme://user:password@`` credentials are redacted, in the message and in
    ``value`` alike; callers pass header values and scheme-less endpoints
    already redacted (only they know which part is secret).
    """

    def __init__(self, variable: str, value: object, accepted: str, detail: str = "") -> None:
        if isinstance(value, str):
            value = redact(value)
        self.variable = variable
        self.value = value
        self.accepted = accepted
        shown = repr(value)
        if len(shown) > _MAX_SHOWN:  # a 100k-character host should not make a 100k-character error
            shown = f"{shown[: _MAX_SHOWN // 2]}...{shown[-16:]} ({len(str(value))} characters)"
        message = f"{variable}={shown} is not valid: expected {accepted}"
        if detail:
            detail = redact(detail)  # before cutting, so a cut never splits a credential out of view
            message += f" ({detail if len(detail) <= _MAX_SHOWN else detail[:_MAX_SHOWN] + '...'})"
        super().__init__(redact(message))


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
        "OTEL_EXPORTER_PROMETHEUS_HOST",
        "localhost",
        "Address the Prometheus `/metrics` endpoint binds to: a host name (at most 253 characters) or an IP address.",
    ),
    Variable(
        "OTEL_EXPORTER_PROMETHEUS_PORT",
        "9464",
        "Port of the Prometheus endpoint (0 picks a free port); see `OPENLORA_PROMETHEUS_PORT_OFFSET`.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "http://localhost:4318 (http/protobuf), http://localhost:4317 (grpc)",
        "Base OTLP endpoint; `/v1/metrics` is appended for http/protobuf. Validated even when the per-signal one wins.",
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
        "Headers sent with every export, `key=value,...`, values percent-encoded; names are HTTP tokens, decoded values printable ASCII (a control character such as an encoded CR/LF is refused). Values are never printed.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
        "(unset)",
        "Per-signal headers; win over `OTEL_EXPORTER_OTLP_HEADERS`.",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "10000",
        "Time limit of one OTLP export with its retries, in milliseconds (as the spec says; the Python SDK alone reads seconds), "
        + _ms_range(OTLP_TIMEOUT_RANGE_MS)
        + "; capped at `OTEL_METRIC_EXPORT_INTERVAL`.",
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
        "Milliseconds between pushes for `otlp` and `console` (pull is scrape-driven), "
        + _ms_range(EXPORT_INTERVAL_RANGE_MS)
        + ".",
    ),
    Variable(
        "OTEL_METRIC_EXPORT_TIMEOUT",
        "30000",
        "Milliseconds allowed for one collect-and-export cycle, " + _ms_range(EXPORT_TIMEOUT_RANGE_MS) + ".",
    ),
    Variable(
        "OPENLORA_RUN_ID",
        "shared by the launcher, else random",
        "Run id in the Resource (`openlora.run.id`), 1 to 128 printable characters (it names the history file). Unset, every rank of one job gets the same id anyway: torchrun's `TORCHELASTIC_RUN_ID`, torchrun's store (static rendezvous), the initialized process group's store, or Slurm's job and step ids (see Distributed training).",
    ),
    Variable(
        "OPENLORA_RUN_NAME",
        "(unset: the run id)",
        "A name for the run, at most 100 characters: the Resource attribute `openlora.run.name` and the name on `openlora_run_info` (legends, alerts, reports). `setup_telemetry(run_name=...)` wins over it.",
    ),
    Variable(
        "OPENLORA_HISTORY_DIR",
        "(unset: no file)",
        "A directory (created if missing) where the run's history is written as OTLP JSON Lines, one line per collection: `<run id>.jsonl`, or `<run id>.rank<RANK>.jsonl` under a launcher. Read by `openlora-otel report`. Works next to any exporter.",
    ),
    Variable(
        "OPENLORA_HISTORY_INTERVAL",
        "5000",
        "Milliseconds between two lines of the history file, "
        + _ms_range(HISTORY_INTERVAL_RANGE_MS)
        + "; the final values are written at shutdown and on SIGTERM.",
    ),
    Variable(
        "OPENLORA_HISTORY_MAX_BYTES",
        str(DEFAULT_HISTORY_MAX_BYTES),
        f"Size bound of one history file, from {MIN_HISTORY_MAX_BYTES} bytes (1 MiB): when a line would pass it, every other line is dropped and from then on every other collection is written (then every 4th, ...), so the whole run stays at a lower resolution.",
    ),
    Variable(
        "OPENLORA_INFERENCE_MAX_ADAPTERS",
        "32",
        f"Distinct adapter names the serving metrics (`telemetry.inference`) record per process, {INFERENCE_MAX_ADAPTERS_RANGE[0]} to {INFERENCE_MAX_ADAPTERS_RANGE[1]}; names take slots in the order they are first seen, loaded or requested (load adapters before serving, and record names you do not serve as `other`, so the slots go to loaded adapters); later names are recorded as `other`. Each adapter adds about 90 series.",
    ),
    Variable(
        "OPENLORA_SHUTDOWN_TIMEOUT",
        "2000",
        "Milliseconds `shutdown()` may take, final export included, "
        + _ms_range(SHUTDOWN_TIMEOUT_RANGE_MS)
        + "; it returns after that even if the endpoint hangs (plus the final-scrape wait, `OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT`).",
    ),
    Variable(
        "OPENLORA_PROMETHEUS_PORT_OFFSET",
        "local_rank",
        "`local_rank`: the port is `OTEL_EXPORTER_PROMETHEUS_PORT + LOCAL_RANK`, so torchrun ranks on one node do not collide; `rank`: `+ RANK` (global rank: several torchrun nodes on one host); `none`: no offset.",
    ),
    Variable(
        "OPENLORA_PROMETHEUS_FILE_SD_DIR",
        "(unset)",
        "A directory (created if missing) where each process registers its pull endpoint for Prometheus `file_sd_configs` while it runs: `openlora-<host>-<port>.json`, removed at shutdown and on SIGTERM; unset: no file.",
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
        "Milliseconds one NVML snapshot may take, "
        + _ms_range(GPU_TIMEOUT_RANGE_MS)
        + "; past that the collection serves the last good one (up to 60 s old) and says how old.",
    ),
    Variable(
        "OPENLORA_HOST_METRICS",
        "true",
        "`true`: host and process metrics (CPU, memory, disk and network I/O) through `opentelemetry-instrumentation-system-metrics`, the system-wide ones only from `LOCAL_RANK` 0 (or a process without `LOCAL_RANK`); `false`: none.",
    ),
    Variable(
        "OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS",
        "(empty)",
        "The instrumentation package's own variable: comma list of glob patterns (`system.network.*`, `process.disk.io`) of host metrics to leave out.",
    ),
    Variable(
        "OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT",
        "15000",
        "Milliseconds `shutdown()` keeps the Prometheus endpoint open for one more scrape, so the run's final values are collected; only when the endpoint was scraped before, and no longer than about 1.5 observed scrape intervals; "
        + _ms_range(FINAL_SCRAPE_TIMEOUT_RANGE_MS)
        + "; 0 turns the wait off.",
    ),
    Variable(
        "OPENLORA_PROMETHEUS_EXPECT_SCRAPE",
        "false",
        "`true`: a Prometheus is known to scrape this endpoint, so `shutdown()` also waits (up to `OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT`) for a scrape when none came yet: a run shorter than one scrape interval still reaches Prometheus. `false`: a run never scraped ends at once (nothing may be watching).",
    ),
    Variable(
        "OPENLORA_HANDLE_SIGTERM",
        "true",
        "`true`: on SIGTERM (when the application has no SIGTERM handler of its own) do the bounded final export, then exit with status 143; `false`: leave SIGTERM alone.",
    ),
    Variable(
        "OPENLORA_PEAK_FLOPS",
        "(unset)",
        "Peak FLOP/s of one device of this process (for example `989e12`), used for model FLOPs utilization instead of the datasheet table; a number from 1 to 1e21 in ASCII digits, an exponent allowed. Set it on CPUs or GPUs the table does not know.",
    ),
    Variable(
        "OPENLORA_QUIET",
        "false",
        "`true` silences the one line on standard error that says where the metrics go (shown when logging does not show INFO).",
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
        f"Integers from 0 to {MAX_RANK}, copied into the Resource as `openlora.rank`, `openlora.local_rank`, `openlora.world_size`, `openlora.group_rank`.",
    ),
)

_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_DIGITS_RE = re.compile(r"[0-9]+")
_DECIMAL_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_HEADERS_ACCEPTED = (
    "headers as `key=value` pairs separated by commas, values percent-encoded; "
    "names are HTTP tokens, decoded values printable ASCII"
)
_HOST_ACCEPTED = "a host name (at most 253 characters, labels of letters, digits, `-`, `_`) or an IP address"
_HTTP_SCHEMES = ("http", "https")
_ANY_SCHEME = ("", "http", "https")
_T = TypeVar("_T")
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
    # False when neither endpoint variable was set and the protocol's default is used.
    endpoint_set: bool = True

    def __post_init__(self) -> None:
        # The same rules as from_env, for configs built in code: a bad value fails
        # here, not as an export error (that could echo it) on every interval.
        if self.protocol not in PROTOCOLS:
            raise ConfigError("otlp.protocol", self.protocol, _choices(PROTOCOLS))
        _check_endpoint(
            "otlp.endpoint", self.endpoint, schemes=_HTTP_SCHEMES if self.protocol != "grpc" else _ANY_SCHEME
        )
        for name, value in self.headers:
            problem = _header_problem(name, value)
            if problem:
                raise ConfigError("otlp.headers", dict(self.redacted_headers()), _HEADERS_ACCEPTED, problem)
        if not _in_range(self.timeout_s, _seconds(OTLP_TIMEOUT_RANGE_MS)):
            raise ConfigError("otlp.timeout_s", self.timeout_s, _s_accepted(OTLP_TIMEOUT_RANGE_MS))
        if self.compression not in COMPRESSIONS:
            raise ConfigError("otlp.compression", self.compression, _choices(COMPRESSIONS))
        if self.temporality not in TEMPORALITIES:
            raise ConfigError("otlp.temporality", self.temporality, _choices(TEMPORALITIES))

    def __repr__(self) -> str:
        # print(config) must not show credentials: endpoint and headers redacted.
        shown = {"endpoint": self.redacted_endpoint(), "headers": self.redacted_headers()}
        fields = (f"{f.name}={shown.get(f.name, getattr(self, f.name))!r}" for f in dataclasses.fields(self))
        return f"OTLPConfig({', '.join(fields)})"

    def redacted_headers(self) -> tuple[tuple[str, str], ...]:
        """Headers with values hidden, for printing (header values are usually secrets)."""
        return tuple((k, REDACTED) for k, _ in self.headers)

    def redacted_endpoint(self) -> str:
        """The endpoint with any ``user:password@`` part hidden."""
        return redact_url(self.endpoint)

    def secrets(self) -> frozenset[str]:
        """This config's credentials (URL user info, header values) in every form redaction scrubs."""
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
    host_metrics: bool = True
    host_metrics_excluded: tuple[str, ...] = ()
    prometheus_port_explicit: bool = True
    final_scrape_timeout_s: float = 15.0
    expect_scrape: bool = False
    handle_sigterm: bool = True
    quiet: bool = False
    file_sd_dir: str | None = None
    peak_flops: float | None = None
    run_name: str | None = None
    history_dir: str | None = None
    history_interval_ms: float = 5000.0
    history_max_bytes: int = DEFAULT_HISTORY_MAX_BYTES
    inference_max_adapters: int = 32

    def __post_init__(self) -> None:
        for name in self.exporters:
            if name not in EXPORTERS:
                raise ConfigError("exporters", self.exporters, _choices(EXPORTERS))
        if "none" in self.exporters and len(self.exporters) > 1:
            raise ConfigError("exporters", self.exporters, "`none` alone, or a list without `none`")
        if not (isinstance(self.prometheus_port, int) and _in_range(self.prometheus_port, (0, 65535))):
            raise ConfigError("prometheus_port", self.prometheus_port, "an integer from 0 to 65535")
        host_problem = _host_problem(self.prometheus_host)
        if host_problem:
            raise ConfigError("prometheus_host", self.prometheus_host, _HOST_ACCEPTED, host_problem)
        # nan, inf and huge values pass a "> 0" test and then stall or kill a thread.
        if not _in_range(self.export_interval_ms, EXPORT_INTERVAL_RANGE_MS):
            raise ConfigError(
                "export_interval_ms", self.export_interval_ms, _ms_accepted(EXPORT_INTERVAL_RANGE_MS)
            )
        if not _in_range(self.export_timeout_ms, EXPORT_TIMEOUT_RANGE_MS):
            raise ConfigError(
                "export_timeout_ms", self.export_timeout_ms, _ms_accepted(EXPORT_TIMEOUT_RANGE_MS)
            )
        if not _in_range(self.shutdown_timeout_s, _seconds(SHUTDOWN_TIMEOUT_RANGE_MS)):
            raise ConfigError(
                "shutdown_timeout_s", self.shutdown_timeout_s, _s_accepted(SHUTDOWN_TIMEOUT_RANGE_MS)
            )
        if not self.service_name:
            raise ConfigError("service_name", self.service_name, "a non-empty string")
        if self.gpu_metrics not in GPU_MODES:
            raise ConfigError("gpu_metrics", self.gpu_metrics, _choices(GPU_MODES))
        if self.gpu_devices not in GPU_DEVICE_MODES:
            raise ConfigError("gpu_devices", self.gpu_devices, _choices(GPU_DEVICE_MODES))
        if not _in_range(self.gpu_timeout_s, _seconds(GPU_TIMEOUT_RANGE_MS)):
            raise ConfigError("gpu_timeout_s", self.gpu_timeout_s, _s_accepted(GPU_TIMEOUT_RANGE_MS))
        if self.peak_flops is not None and not _in_range(self.peak_flops, PEAK_FLOPS_RANGE):
            raise ConfigError("peak_flops", self.peak_flops, PEAK_FLOPS_ACCEPTED)
        if not isinstance(self.host_metrics, bool):
            raise ConfigError("host_metrics", self.host_metrics, "`True` or `False`")
        if isinstance(self.host_metrics_excluded, str) or not all(
            isinstance(p, str) and _GLOB_RE.fullmatch(p) and _brackets_closed(p) for p in self.host_metrics_excluded
        ):
            raise ConfigError("host_metrics_excluded", self.host_metrics_excluded, "a tuple of " + _GLOBS_ACCEPTED)
        if self.run_name is not None:
            problem = run_name_problem(self.run_name)
            if problem:
                raise ConfigError("run_name", self.run_name, RUN_NAME_ACCEPTED, problem)
        if self.run_id is not None:
            problem = run_id_problem(self.run_id)
            if problem:
                raise ConfigError("run_id", self.run_id, RUN_ID_ACCEPTED, problem)
        if not _in_range(self.history_interval_ms, HISTORY_INTERVAL_RANGE_MS):
            raise ConfigError(
                "history_interval_ms", self.history_interval_ms, _ms_accepted(HISTORY_INTERVAL_RANGE_MS)
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
        if not _in_range(self.final_scrape_timeout_s, _seconds(FINAL_SCRAPE_TIMEOUT_RANGE_MS)):
            raise ConfigError(
                "final_scrape_timeout_s",
                self.final_scrape_timeout_s,
                _s_accepted(FINAL_SCRAPE_TIMEOUT_RANGE_MS),
            )

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
            value = env.integer(variable, minimum=0, maximum=MAX_RANK)
            if value is not None:
                resource_attributes.setdefault(attribute, value)

        exporters = env.exporters("OTEL_METRICS_EXPORTER")

        prometheus_host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost"
        host_problem = _host_problem(prometheus_host)
        if host_problem:
            raise ConfigError("OTEL_EXPORTER_PROMETHEUS_HOST", prometheus_host, _HOST_ACCEPTED, host_problem)
        prometheus_port = env.integer("OTEL_EXPORTER_PROMETHEUS_PORT", minimum=0, maximum=65535)
        if prometheus_port is None:
            prometheus_port = 9464
        offset_mode = env.choice("OPENLORA_PROMETHEUS_PORT_OFFSET", PORT_OFFSETS) or "local_rank"
        port_variable = "OTEL_EXPORTER_PROMETHEUS_PORT"
        offset_variable = {"local_rank": "LOCAL_RANK", "rank": "RANK"}.get(offset_mode)
        offset = resource_attributes.get(f"openlora.{offset_mode}") if offset_variable else None
        if prometheus_port != 0 and isinstance(offset, int) and offset:
            prometheus_port += offset
            port_variable = f"OTEL_EXPORTER_PROMETHEUS_PORT (+ {offset_variable})"
            if prometheus_port > 65535:
                raise ConfigError(
                    port_variable,
                    prometheus_port,
                    f"a port of at most 65535 after adding {offset_variable}",
                    "lower OTEL_EXPORTER_PROMETHEUS_PORT or set OPENLORA_PROMETHEUS_PORT_OFFSET",
                )

        export_interval = env.milliseconds("OTEL_METRIC_EXPORT_INTERVAL", bounds=EXPORT_INTERVAL_RANGE_MS)
        export_timeout = env.milliseconds("OTEL_METRIC_EXPORT_TIMEOUT", bounds=EXPORT_TIMEOUT_RANGE_MS)
        shutdown_timeout = env.milliseconds("OPENLORA_SHUTDOWN_TIMEOUT", bounds=SHUTDOWN_TIMEOUT_RANGE_MS)

        run_id = env.get("OPENLORA_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or None
        # torchrun sets TORCHELASTIC_RUN_ID=none when no rendezvous id was given.
        if run_id == "none" and not env.get("OPENLORA_RUN_ID"):
            run_id = None
        if run_id is not None and run_id_problem(run_id):
            source = "OPENLORA_RUN_ID" if env.get("OPENLORA_RUN_ID") else "TORCHELASTIC_RUN_ID"
            raise ConfigError(source, run_id, RUN_ID_ACCEPTED, run_id_problem(run_id) or "")

        gpu_timeout = env.milliseconds("OPENLORA_GPU_TIMEOUT", bounds=GPU_TIMEOUT_RANGE_MS)
        final_scrape = env.milliseconds(
            "OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", bounds=FINAL_SCRAPE_TIMEOUT_RANGE_MS
        )
        visible = env.get("CUDA_VISIBLE_DEVICES") if "CUDA_VISIBLE_DEVICES" in env else None
        history_interval = env.milliseconds("OPENLORA_HISTORY_INTERVAL", bounds=HISTORY_INTERVAL_RANGE_MS)

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
            host_metrics=env.boolean("OPENLORA_HOST_METRICS", default=True),
            host_metrics_excluded=_excluded_metrics(env),
            prometheus_port_explicit=bool(env.get("OTEL_EXPORTER_PROMETHEUS_PORT")),
            final_scrape_timeout_s=15.0 if final_scrape is None else final_scrape / 1000.0,
            expect_scrape=env.boolean("OPENLORA_PROMETHEUS_EXPECT_SCRAPE"),
            handle_sigterm=env.boolean("OPENLORA_HANDLE_SIGTERM", default=True),
            quiet=env.boolean("OPENLORA_QUIET"),
            file_sd_dir=_file_sd_dir(env),
            peak_flops=_peak_flops(env),
            run_name=_run_name(env),
            history_dir=_directory(env, "OPENLORA_HISTORY_DIR"),
            history_interval_ms=5000.0 if history_interval is None else history_interval,
            history_max_bytes=_history_max_bytes(env),
            inference_max_adapters=_inference_max_adapters(env),
        )


PEAK_FLOPS_RANGE = (1.0, 1e21)
PEAK_FLOPS_ACCEPTED = "a number of FLOP/s from 1 to 1e21 in ASCII digits, with an optional exponent, such as 989e12"
# A decimal with an optional exponent, ASCII only: float() would also take "1_000", a sign,
# "nan", "infinity" and non-ASCII (fullwidth) digits.
_EXPONENT_DECIMAL_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _peak_flops(env: _Env) -> float | None:
    """``OPENLORA_PEAK_FLOPS``: unset, or a plain positive decimal (the one number here with an exponent)."""
    raw = env.get("OPENLORA_PEAK_FLOPS")
    if not raw:
        return None
    if not _EXPONENT_DECIMAL_RE.fullmatch(raw) or len(raw) > 32:
        raise ConfigError("OPENLORA_PEAK_FLOPS", raw, PEAK_FLOPS_ACCEPTED)
    number = float(raw)
    if not _in_range(number, PEAK_FLOPS_RANGE):
        raise ConfigError("OPENLORA_PEAK_FLOPS", raw, PEAK_FLOPS_ACCEPTED)
    return number


# The instrumentation matches these with fnmatch against metric names: a pattern with
# any other character (a space, a slash) can never match, so it is a typo to report.
_GLOB_RE = re.compile(r"[A-Za-z0-9_.*?\[\]!-]+")
_GLOBS_ACCEPTED = "glob patterns over metric names (letters, digits, `.`, `_`, `-`, `*`, `?`, `[...]`), e.g. `system.network.*`"


def _excluded_metrics(env: _Env) -> tuple[str, ...]:
    """``OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS`` split as the instrumentation splits it (commas, blanks dropped)."""
    raw = env.get("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS")
    patterns = tuple(part.strip() for part in raw.split(",") if part.strip())
    for pattern in patterns:
        # fnmatch reads a `[` without its `]` as a literal character, which no metric name has.
        if not _GLOB_RE.fullmatch(pattern) or not _brackets_closed(pattern):
            raise ConfigError(
                "OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS",
                raw,
                "a comma list of " + _GLOBS_ACCEPTED,
                f"{pattern!r} can match no metric name",
            )
    return patterns


def _brackets_closed(pattern: str) -> bool:
    """Every `[` of a glob opens a set that a later `]` closes (fnmatch's reading)."""
    index = 0
    while (index := pattern.find("[", index)) >= 0:
        start = index + 1
        start += pattern[start : start + 1] == "!"  # a negated set
        start += pattern[start : start + 1] == "]"  # a `]` first in the set is one of its characters
        close = pattern.find("]", start)
        if close < 0:
            return False
        index = close + 1
    return True


DIRECTORY_ACCEPTED = "a directory, or a path where one can be created"
FILE_SD_ACCEPTED = DIRECTORY_ACCEPTED


def _directory(env: _Env, variable: str) -> str | None:
    """A directory variable: unset, or a path that is (or can become) a directory, made absolute."""
    value = env.get(variable)
    if not value:
        return None
    if "\0" in value:
        raise ConfigError(variable, value, DIRECTORY_ACCEPTED, "it contains a NUL character")
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(variable, value, DIRECTORY_ACCEPTED, "it is not a directory")
    return path


def _file_sd_dir(env: _Env) -> str | None:
    """``OPENLORA_PROMETHEUS_FILE_SD_DIR``."""
    return _directory(env, "OPENLORA_PROMETHEUS_FILE_SD_DIR")


RUN_NAME_ACCEPTED = f"a name of 1 to {MAX_RUN_NAME_LENGTH} printable characters"


def run_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name.strip():
        return "it is empty"
    return _label_text_problem(name, MAX_RUN_NAME_LENGTH)


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` cannot be a run id, if it cannot."""
    if not isinstance(run_id, str):
        return f"it is a {type(run_id).__name__}, not a string"
    if not run_id:
        return "it is empty"
    return _label_text_problem(run_id, MAX_RUN_ID_LENGTH)


def _label_text_problem(text: str, max_length: int) -> str | None:
    """What rules a non-empty run name or id out as a label value: its length, a control character."""
    if len(text) > max_length:
        return f"it has {len(text)} characters"
    if not text.isprintable():
        return "it contains a control character"
    return None


def _run_name(env: _Env) -> str | None:
    value = env.get("OPENLORA_RUN_NAME")
    if not value:
        return None
    problem = run_name_problem(value)
    if problem:
        raise ConfigError("OPENLORA_RUN_NAME", value, RUN_NAME_ACCEPTED, problem)
    return value.strip()


HISTORY_MAX_BYTES_ACCEPTED = f"an integer number of bytes of at least {MIN_HISTORY_MAX_BYTES} (1 MiB)"


def _history_max_bytes(env: _Env) -> int:
    value = env.integer("OPENLORA_HISTORY_MAX_BYTES", minimum=MIN_HISTORY_MAX_BYTES)
    return DEFAULT_HISTORY_MAX_BYTES if value is None else value


def _inference_max_adapters(env: _Env) -> int:
    low, high = INFERENCE_MAX_ADAPTERS_RANGE
    value = env.integer("OPENLORA_INFERENCE_MAX_ADAPTERS", minimum=low, maximum=high)
    return 32 if value is None else value


def _choices(values: tuple[str, ...]) -> str:
    return "one of " + ", ".join(f"`{v}`" for v in values)


def _in_range(value: object, bounds: tuple[float, float]) -> bool:
    """A real number (not a bool), finite, within ``bounds`` inclusive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return bounds[0] <= value <= bounds[1]


def _seconds(bounds_ms: tuple[float, float]) -> tuple[float, float]:
    return bounds_ms[0] / 1000.0, bounds_ms[1] / 1000.0


def _s_accepted(bounds_ms: tuple[float, float]) -> str:
    return f"a number of seconds from {_ms_range(bounds_ms, scale=0.001)}"


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

    def winner(self, read: Callable[[str], _T], *names: str) -> tuple[str, _T | None]:
        """``read`` every one of ``names`` (so each set one is validated); the first set one wins.

        The per-signal variable overrides the base one, but the base one is still
        checked: the README promises that every variable is validated.
        """
        results = [(name, read(name)) for name in names if self.get(name)]
        if results:
            return results[0]
        return names[-1], None

    def boolean(self, name: str, *names: str, default: bool = False) -> bool:
        _, value = self.winner(self._boolean, name, *names)
        return default if value is None else value

    def _boolean(self, name: str) -> bool:
        raw = self.get(name)
        lowered = raw.lower()
        if lowered in ("", "false"):
            return False
        if lowered == "true":
            return True
        # The spec reads anything but "true" as false; we refuse instead, because
        # OTEL_SDK_DISABLED=1 silently meaning "enabled" is the worse surprise.
        raise ConfigError(name, raw, "`true` or `false` (case-insensitive)")

    def integer(self, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        raw = self.get(name)
        if not raw:
            return None
        accepted = "an integer"
        if minimum is not None and maximum is not None:
            accepted = f"an integer from {minimum} to {maximum}"
        elif minimum is not None:
            accepted = f"an integer >= {minimum}"
        # int() also takes "1_000", "+5" and non-ASCII digits (fullwidth ones): refuse
        # them, so the value means what it looks like to every other tool.
        if not _DIGITS_RE.fullmatch(raw) or len(raw) > 20:
            raise ConfigError(name, raw, accepted + ", in ASCII digits")
        value = int(raw, 10)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ConfigError(name, raw, accepted)
        return value

    def milliseconds(self, *names: str, bounds: tuple[float, float] = (1.0, 86_400_000.0)) -> float | None:
        """A duration in milliseconds within ``bounds`` (integers per the spec; decimals tolerated).

        Only plain ASCII decimals: float() would also take "1e308", "nan",
        "infinity", "1_000" and non-ASCII digits, which either overflow a wait
        later or do not mean what they look like.
        """

        def read(name: str) -> float:
            raw = self.get(name)
            accepted = _ms_accepted(bounds)
            if not _DECIMAL_RE.fullmatch(raw) or len(raw) > 32:
                raise ConfigError(name, raw, accepted)
            value = float(raw)
            if not bounds[0] <= value <= bounds[1]:
                raise ConfigError(name, raw, accepted)
            return value

        return self.winner(read, *names)[1]

    def choice(self, name: str, choices: tuple[str, ...], *names: str) -> str | None:
        def read(variable: str) -> str:
            raw = self.get(variable)
            lowered = raw.lower()
            if lowered not in choices:
                raise ConfigError(variable, raw, _choices(choices))
            return lowered

        return self.winner(read, name, *names)[1]

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
        return self.winner(lambda name: self._key_values(name, what), *names)[1] or []

    def _key_values(self, variable: str, what: str) -> list[tuple[str, str]]:
        raw = self.get(variable)
        pairs: list[tuple[str, str]] = []
        headers = what == "headers"
        accepted = (
            _HEADERS_ACCEPTED
            if headers
            else f"{what} as `key=value` pairs separated by commas, values percent-encoded"
        )
        # Header values are usually credentials: never echo them in an error.
        shown = _redact_key_values(raw) if headers else raw
        for item in raw.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                entry = "an entry" if headers else f"entry {item.strip()!r}"
                raise ConfigError(variable, shown, accepted, f"{entry} has no `key=`")
            try:
                decoded = unquote(value.strip(), errors="strict")
            except UnicodeDecodeError:
                raise ConfigError(
                    variable, shown, accepted, f"value of {key!r} is not valid percent-encoding"
                ) from None
            name = unquote(key)
            if headers:
                # HTTP drops leading/trailing spaces of a field value; requests refuses them.
                decoded = decoded.strip(" ")
                problem = _header_problem(name, decoded)
                if problem:
                    raise ConfigError(variable, shown, accepted, problem)
            pairs.append((name, decoded))
        return pairs


def secrets_in_env(environ: Mapping[str, str]) -> frozenset[str]:
    """Every credential in ``environ`` (OTLP header values, endpoint user info), for redaction.

    Read leniently, without validation: it must also work on the environment
    that just failed to parse, so that the error about it can be scrubbed.
    """
    found: set[str] = set()
    for name in ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        for item in environ.get(name, "").split(","):
            key, sep, value = item.partition("=")
            raw = (value if sep else key).strip()  # an entry without "=" may be a pasted token
            found |= secret_forms(raw) | secret_forms(unquote(raw).strip())
    for name in ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        found |= url_secrets(environ.get(name, "").strip())
    return frozenset(found)


def _redact_key_values(raw: str) -> str:
    return ",".join(
        f"{item.partition('=')[0].strip()}=<redacted>" if "=" in item else "<redacted>"
        for item in raw.split(",")
    )


def _read_otlp(env: _Env) -> OTLPConfig:
    def read_protocol(variable: str) -> str:
        raw = env.get(variable)
        if raw.lower() not in PROTOCOLS:
            detail = "the Python SDK has no http/json exporter" if raw.lower() == "http/json" else ""
            raise ConfigError(variable, raw, _choices(PROTOCOLS), detail)
        return raw.lower()

    _, raw_protocol = env.winner(
        read_protocol, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    resolved_protocol: Protocol = "grpc" if raw_protocol == "grpc" else "http/protobuf"

    # The base endpoint is checked even when the per-signal one wins; as the loser
    # it may serve other signals over another protocol, so only its form is checked.
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base and env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        _check_endpoint("OTEL_EXPORTER_OTLP_ENDPOINT", base, schemes=_ANY_SCHEME)
    endpoint_variable, endpoint = env.first(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    per_signal = endpoint_variable == "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" and bool(endpoint)
    endpoint_set = bool(endpoint)
    insecure = env.boolean("OTEL_EXPORTER_OTLP_METRICS_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")

    if resolved_protocol == "http/protobuf":
        if not endpoint:
            endpoint = "http://localhost:4318"
        _check_endpoint(
            endpoint_variable,
            endpoint,
            schemes=_HTTP_SCHEMES,
            accepted="an http:// or https:// URL for protocol http/protobuf, e.g. http://localhost:4318",
        )
        if not per_signal:
            # The spec: the signal path is appended to the base endpoint only.
            endpoint = endpoint.rstrip("/") + "/v1/metrics"
    else:
        if not endpoint:
            endpoint = "http://localhost:4317"
        parts = _check_endpoint(
            endpoint_variable,
            endpoint,
            schemes=_ANY_SCHEME,
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
        or "none"
    )
    temporality = (
        env.choice("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", TEMPORALITIES) or "cumulative"
    )

    def pem_file(variable: str) -> str:
        path = env.get(variable)
        if not os.path.isfile(path):
            raise ConfigError(variable, path, "the path of a readable PEM file", "no such file")
        return path

    files: dict[str, str | None] = {}
    for key, suffix in (
        ("certificate", "CERTIFICATE"),
        ("client_key", "CLIENT_KEY"),
        ("client_certificate", "CLIENT_CERTIFICATE"),
    ):
        _, path = env.winner(pem_file, f"OTEL_EXPORTER_OTLP_METRICS_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}")
        files[key] = path
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
        endpoint_set=endpoint_set,
    )


def _check_endpoint(
    variable: str, endpoint: str, *, schemes: tuple[str, ...], accepted: str = ""
) -> SplitResult:
    """Parse ``endpoint`` or raise a ConfigError that shows it with credentials redacted.

    ``schemes`` containing ``""`` allows gRPC's scheme-less ``host:port``.
    """
    shown = redact_url(endpoint)
    accepted = accepted or ("an http:// or https:// URL" + (", or host:port" if "" in schemes else ""))
    # urlsplit silently drops tabs and newlines, so what it parses is not what would be sent.
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in endpoint):
        raise ConfigError(variable, shown, accepted, "it contains a space or a control character")
    text = endpoint if "://" in endpoint or "" not in schemes else "//" + endpoint
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ConfigError(variable, shown, accepted, str(exc)) from None
    if parts.scheme not in schemes:
        raise ConfigError(variable, shown, accepted)
    hostport = parts.netloc.rpartition("@")[2]
    match = _HOSTPORT_RE.fullmatch(hostport)
    if not match or not match["host"]:
        raise ConfigError(variable, shown, accepted, "no host")
    host = match["host"]
    problem = _ip_problem(host[1:-1]) if host.startswith("[") else _host_problem(host)
    if problem:
        raise ConfigError(variable, shown, accepted, problem)
    port = match["port"]
    if (
        port is not None
        and port != ""
        and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)
    ):
        raise ConfigError(variable, shown, "a URL whose port is an integer from 1 to 65535")
    return parts


# host, then an optional ":port" (empty allowed, as in "http://h:/"); IPv6 in brackets.
_HOSTPORT_RE = re.compile(r"(?P<host>\[[^\[\]]*\]|[^:\[\]]*)(?::(?P<port>[^:]*))?")
_LABEL_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?")


def _ip_problem(text: str) -> str | None:
    try:
        ipaddress.ip_address(unquote(text))  # a zone id may be percent-encoded: fe80::1%25eth0
    except ValueError:
        return "not a valid IP address in brackets"
    return None


def _host_problem(host: str) -> str | None:
    """Why ``host`` is not a usable host name or IP address, or None.

    Checked here because the resolver fails late and with the wrong error type:
    a label over 63 characters raises UnicodeError from the idna codec.
    """
    if not isinstance(host, str) or not host:
        return "empty"
    if len(host) > 253:
        return f"{len(host)} characters, at most 253"
    if any(ord(c) < 0x20 or ord(c) == 0x7F or c.isspace() for c in host):
        return "it contains a space or a control character"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return "not a valid host name"
    labels = ascii_host.removesuffix(".").split(".")
    if len(ascii_host) > 253 or not all(len(label) <= 63 and _LABEL_RE.fullmatch(label) for label in labels):
        return "not a valid host name"
    return None


def _header_problem(name: str, value: str) -> str | None:
    """Why a header cannot be sent as is, or None; never quotes the value."""
    if not _TOKEN_RE.fullmatch(name):
        if name.isascii() and name.isprintable():
            return f"{name!r} is not a valid header name"
        return "a header name contains a control or non-ASCII character"
    # An encoded CR/LF would let a value inject headers; other control bytes
    # make requests or gRPC refuse every export and print the value while doing so.
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return f"the value of {name!r} contains a control character (such as CR, LF or NUL)"
    if not value.isascii():
        return f"the value of {name!r} is not ASCII (gRPC metadata and HTTP headers need ASCII)"
    return None

"""The table of every environment variable openlora-otel reads: its name, group, meaning, default,
the :class:`~openlora_otel.config.TelemetryConfig` field it sets and the reader that parses it.

Each default is written here once: the config's field defaults, :meth:`TelemetryConfig.from_env`,
the docs' Configuration page and ``openlora-otel env`` all take it from this table. Most variables set one field
and are read by a loop over the table; those read together (the OTLP ones with their per-signal
twins, the port with its rank offset, the run id with the launcher's, the Resource's attributes) have
no ``read`` and are resolved by ``from_env`` itself, with their defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from openlora_otel.config.checks import (
    EXPORT_INTERVAL_RANGE_MS,
    EXPORT_TIMEOUT_RANGE_MS,
    FINAL_SCRAPE_TIMEOUT_RANGE_MS,
    GPU_DEVICE_MODES,
    GPU_MODES,
    GPU_TIMEOUT_RANGE_MS,
    HISTORY_INTERVAL_RANGE_MS,
    INFERENCE_MAX_ADAPTERS_RANGE,
    MAX_RANK,
    MAX_RUN_ATTEMPT,
    MIN_HISTORY_MAX_BYTES,
    OTLP_TIMEOUT_RANGE_MS,
    SHUTDOWN_TIMEOUT_RANGE_MS,
    ms_range,
)
from openlora_otel.config.env import (
    Reader,
    boolean,
    directory,
    exporters,
    host,
    integer_within,
    metric_globs,
    milliseconds_within,
    one_of,
    peak_flops,
    present_text,
    run_attempt,
    run_name,
)

# The groups, in the order the docs show them.
EXPORT = "Where the metrics go"
PROMETHEUS = "Prometheus endpoint (pull)"
OTLP = "OTLP (push)"
RUN = "Run identity"
HISTORY = "History file"
HARDWARE = "GPU and host metrics"
SERVING = "Serving"
PROCESS = "Process and shutdown"
GROUPS = (EXPORT, PROMETHEUS, OTLP, RUN, HISTORY, HARDWARE, SERVING, PROCESS)

# The OTLP endpoint when neither endpoint variable is set, by protocol (http/protobuf appends /v1/metrics).
OTLP_DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}
_OTLP_ENDPOINTS_SHOWN = ", ".join(f"{url} ({protocol})" for protocol, url in OTLP_DEFAULT_ENDPOINTS.items())


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    ``default`` is the value when it is unset, in the variable's own unit (milliseconds for
    durations); ``shown`` is how the docs say the default when the value alone would not (``(unset:
    no file)``). ``field`` and ``read`` are set together for a variable that fills one config field on
    its own: ``read(env, name)`` returns its value or None when it is unset, and ``seconds`` says the
    field holds the milliseconds as seconds.
    """

    name: str
    group: str
    meaning: str
    default: object = None
    shown: str = ""
    field: str = ""
    read: Reader | None = None
    seconds: bool = False

    @property
    def default_text(self) -> str:
        """The default as the docs show it."""
        if self.shown:
            return self.shown
        value = self.default
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        if isinstance(value, tuple):
            return ",".join(str(item) for item in value)
        return str(value)

    def field_value(self, value: object) -> object:
        """``value`` as the config field holds it (milliseconds turned to seconds where ``seconds``)."""
        if self.seconds and isinstance(value, (int, float)):
            return value / 1000.0
        return value


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "OTEL_SDK_DISABLED",
        EXPORT,
        "`true` gives a working no-op `Telemetry`: nothing is exported, no port is bound.",
        default=False,
        field="sdk_disabled",
        read=boolean,
    ),
    Variable(
        "OTEL_METRICS_EXPORTER",
        EXPORT,
        "Comma list of `prometheus`, `otlp`, `console`, or `none` alone.",
        default=("prometheus",),
        field="exporters",
        read=exporters,
    ),
    Variable(
        "OTEL_METRIC_EXPORT_INTERVAL",
        EXPORT,
        "Milliseconds between pushes for `otlp` and `console` (pull is scrape-driven), "
        + ms_range(EXPORT_INTERVAL_RANGE_MS)
        + ".",
        default=60000.0,
        field="export_interval_ms",
        read=milliseconds_within(EXPORT_INTERVAL_RANGE_MS),
    ),
    Variable(
        "OTEL_METRIC_EXPORT_TIMEOUT",
        EXPORT,
        "Milliseconds allowed for one collect-and-export cycle, " + ms_range(EXPORT_TIMEOUT_RANGE_MS) + ".",
        default=30000.0,
        field="export_timeout_ms",
        read=milliseconds_within(EXPORT_TIMEOUT_RANGE_MS),
    ),
    Variable(
        "OTEL_EXPORTER_PROMETHEUS_HOST",
        PROMETHEUS,
        "Address the Prometheus `/metrics` endpoint binds to: a host name (at most 253 characters) or an IP address.",
        default="localhost",
        field="prometheus_host",
        read=host,
    ),
    Variable(
        "OTEL_EXPORTER_PROMETHEUS_PORT",
        PROMETHEUS,
        "Port of the Prometheus endpoint (0 picks a free port); see `OPENLORA_PROMETHEUS_PORT_OFFSET`.",
        default=9464,
    ),
    Variable(
        "OPENLORA_PROMETHEUS_PORT_OFFSET",
        PROMETHEUS,
        "`local_rank`: the port is `OTEL_EXPORTER_PROMETHEUS_PORT + LOCAL_RANK`, so torchrun ranks on one node do not collide; `rank`: `+ RANK` (global rank: several torchrun nodes on one host); `none`: no offset.",
        default="local_rank",
    ),
    Variable(
        "OPENLORA_PROMETHEUS_FILE_SD_DIR",
        PROMETHEUS,
        "A directory (created if missing) where each process registers its pull endpoint for Prometheus `file_sd_configs` while it runs: `openlora-<host>-<port>.json`, removed at shutdown and on SIGTERM; unset: no file.",
        shown="(unset)",
        field="file_sd_dir",
        read=directory,
    ),
    Variable(
        "OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT",
        PROMETHEUS,
        "Milliseconds `shutdown()` keeps the Prometheus endpoint open for one more scrape, so the run's final values are collected; only when the endpoint was scraped before, and no longer than about 1.5 observed scrape intervals; "
        + ms_range(FINAL_SCRAPE_TIMEOUT_RANGE_MS)
        + "; 0 turns the wait off.",
        default=15000.0,
        field="final_scrape_timeout_s",
        read=milliseconds_within(FINAL_SCRAPE_TIMEOUT_RANGE_MS),
        seconds=True,
    ),
    Variable(
        "OPENLORA_PROMETHEUS_EXPECT_SCRAPE",
        PROMETHEUS,
        "`true`: a Prometheus is known to scrape this endpoint, so `shutdown()` also waits (up to `OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT`) for a scrape when none came yet: a run shorter than one scrape interval still reaches Prometheus. `false`: a run never scraped ends at once (nothing may be watching).",
        default=False,
        field="expect_scrape",
        read=boolean,
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        OTLP,
        "Base OTLP endpoint; `/v1/metrics` is appended to its path (before any query) for http/protobuf. Validated even when the per-signal one wins. A user name or password in it must percent-encode `/`, `?`, `#` and `@` (an `@` after the host is refused); its user info, every query value and the fragment are never printed.",
        shown=_OTLP_ENDPOINTS_SHOWN,
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        OTLP,
        "Metrics endpoint, used as is (no path appended); wins over the base endpoint. Checked and redacted as the base one is.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        OTLP,
        "`http/protobuf` or `grpc` (`http/json` has no Python exporter).",
        default="http/protobuf",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        OTLP,
        "Per-signal protocol; wins over `OTEL_EXPORTER_OTLP_PROTOCOL`.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_HEADERS",
        OTLP,
        "Headers sent with every export, `key=value,...`, values percent-encoded; names are HTTP tokens, decoded values printable ASCII (a control character such as an encoded CR/LF is refused). Values are never printed.",
        shown="(empty)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
        OTLP,
        "Per-signal headers; win over `OTEL_EXPORTER_OTLP_HEADERS`.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        OTLP,
        "Time limit of one OTLP export with its retries, in milliseconds (as the spec says; the Python SDK alone reads seconds), "
        + ms_range(OTLP_TIMEOUT_RANGE_MS)
        + "; capped at `OTEL_METRIC_EXPORT_INTERVAL`.",
        default=10000.0,
        seconds=True,
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
        OTLP,
        "Per-signal export time limit in milliseconds.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        OTLP,
        "`gzip` or `none`.",
        default="none",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
        OTLP,
        "Per-signal compression.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_INSECURE",
        OTLP,
        "gRPC only, for an endpoint without scheme: `true` for plaintext.",
        default=False,
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_INSECURE",
        OTLP,
        "Per-signal `INSECURE`.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        OTLP,
        "PEM file of trusted CA certificates for TLS to the endpoint, read at setup on either protocol: a file that cannot be read, or holds no certificate OpenSSL can load, is refused there rather than failing every export.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
        OTLP,
        "Per-signal CA certificate file.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        OTLP,
        "Unencrypted PEM private key for mTLS (needs the client certificate too); refused at setup unless OpenSSL can load it with that certificate (a key of another certificate, an encrypted key).",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
        OTLP,
        "Per-signal client key file.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        OTLP,
        "PEM client certificate chain for mTLS (needs the client key too); checked at setup as the CA file is.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
        OTLP,
        "Per-signal client certificate file.",
        shown="(unset)",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
        OTLP,
        "`cumulative`, `delta` or `lowmemory` (Prometheus needs cumulative).",
        default="cumulative",
    ),
    Variable(
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
        OTLP,
        "`explicit_bucket_histogram` or `base2_exponential_bucket_histogram`: the buckets of every histogram openlora-otel emits (step duration, request duration, time to first token, time per output token, token usage, adapter load). Exponential ones become native histograms in Prometheus 3 (over OTLP or the Collector's remote write), which the dashboards and rules read with deploy/prometheus/native-histograms.yml loaded; refused with the `prometheus` pull exporter, whose text formats have none.",
        default="explicit_bucket_histogram",
    ),
    Variable(
        "OTEL_SERVICE_NAME",
        RUN,
        "`service.name` of the Resource; wins over `service.name` in `OTEL_RESOURCE_ATTRIBUTES`.",
        default="openlora-training",
    ),
    Variable(
        "OTEL_RESOURCE_ATTRIBUTES",
        RUN,
        "Extra Resource attributes, `key=value,key2=value2`, values percent-encoded.",
        shown="(empty)",
    ),
    Variable(
        "OPENLORA_RUN_ID",
        RUN,
        "Run id in the Resource (`openlora.run.id`), 1 to 128 printable characters (it names the history file). Unset, every rank of one job gets the same id anyway: torchrun's `TORCHELASTIC_RUN_ID`, torchrun's store (static rendezvous), the initialized process group's store, or Slurm's job and step ids (see Distributed training).",
        shown="shared by the launcher, else random",
    ),
    Variable(
        "OPENLORA_RUN_NAME",
        RUN,
        "A name for the run, at most 100 characters: the Resource attribute `openlora.run.name` and the name on `openlora_run_info` (legends, alerts, reports). `setup_telemetry(run_name=...)` wins over it.",
        shown="(unset: the run id)",
        field="run_name",
        read=run_name,
    ),
    Variable(
        "OPENLORA_RUN_ATTEMPT",
        RUN,
        f"Which attempt of the run this process is, 1 to {MAX_RUN_ATTEMPT}: the Resource attribute `openlora.run.attempt`. Restarts of one run keep its run id (set `OPENLORA_RUN_ID`, or let torchrun or Slurm give it) and count attempts, so that goodput adds up across them. Unset: torchrun's `TORCHELASTIC_RESTART_COUNT` + 1, or Slurm's `SLURM_RESTART_COUNT` + 1, or under `srun torchrun` both (`SLURM_RESTART_COUNT` * (`TORCHELASTIC_MAX_RESTARTS` + 1) + `TORCHELASTIC_RESTART_COUNT` + 1, since a requeue starts torchrun's count again), else 1.",
        default=1,
        shown="from the launcher, else 1",
        field="run_attempt",
        read=run_attempt,
    ),
    Variable(
        "TORCHELASTIC_RUN_ID",
        RUN,
        "Read for the run id when `OPENLORA_RUN_ID` is unset.",
        shown="(set by torchrun)",
    ),
    Variable(
        "RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK",
        RUN,
        f"Integers from 0 to {MAX_RANK}, copied into the Resource as `openlora.rank`, `openlora.local_rank`, `openlora.world_size`, `openlora.group_rank`.",
        shown="(set by torchrun)",
    ),
    Variable(
        "OPENLORA_HISTORY_DIR",
        HISTORY,
        "A directory (created if missing) where the run's history is written as OTLP JSON Lines, one line per collection: `<run id>.jsonl`, or `<run id>.rank<RANK>.jsonl` under a launcher. Read by `openlora-otel report`. Works next to any exporter.",
        shown="(unset: no file)",
        field="history_dir",
        read=directory,
    ),
    Variable(
        "OPENLORA_HISTORY_INTERVAL",
        HISTORY,
        "Milliseconds between two lines of the history file, "
        + ms_range(HISTORY_INTERVAL_RANGE_MS)
        + "; the final values are written at shutdown and on SIGTERM.",
        default=5000.0,
        field="history_interval_ms",
        read=milliseconds_within(HISTORY_INTERVAL_RANGE_MS),
    ),
    Variable(
        "OPENLORA_HISTORY_MAX_BYTES",
        HISTORY,
        f"Size bound of one history file, from {MIN_HISTORY_MAX_BYTES} bytes (1 MiB): when a line would pass it, every other line is dropped and from then on every other collection is written (then every 4th, ...), so the whole run stays at a lower resolution.",
        default=64 * 1024 * 1024,
        field="history_max_bytes",
        read=integer_within(MIN_HISTORY_MAX_BYTES),
    ),
    Variable(
        "OPENLORA_GPU_METRICS",
        HARDWARE,
        "`auto`: GPU gauges when NVML initializes, else one info line and none; `on`: NVML must work (else a setup error); `off`.",
        default="auto",
        field="gpu_metrics",
        read=one_of(GPU_MODES),
    ),
    Variable(
        "OPENLORA_GPU_DEVICES",
        HARDWARE,
        "`process`: the GPUs this process uses (torch's devices once CUDA is up, else `CUDA_VISIBLE_DEVICES` narrowed by `LOCAL_RANK`); `all`: every GPU on the host.",
        default="process",
        field="gpu_devices",
        read=one_of(GPU_DEVICE_MODES),
    ),
    Variable(
        "OPENLORA_GPU_TIMEOUT",
        HARDWARE,
        "Milliseconds one NVML snapshot may take, "
        + ms_range(GPU_TIMEOUT_RANGE_MS)
        + "; past that the collection serves the last good one (up to 60 s old) and says how old.",
        default=1000.0,
        field="gpu_timeout_s",
        read=milliseconds_within(GPU_TIMEOUT_RANGE_MS),
        seconds=True,
    ),
    Variable(
        "OPENLORA_HOST_METRICS",
        HARDWARE,
        "`true`: host and process metrics (CPU, memory, disk and network I/O) read from `/proc` on Linux (psutil elsewhere) and named by the semantic conventions, the system-wide ones only from `LOCAL_RANK` 0 (or a process without `LOCAL_RANK`); `false`: none.",
        default=True,
        field="host_metrics",
        read=boolean,
    ),
    Variable(
        "OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS",
        HARDWARE,
        "The variable of `opentelemetry-instrumentation-system-metrics`, kept with its rule: comma list of glob patterns (`system.network.*`, `process.disk.io`) of host metrics to leave out.",
        default=(),
        shown="(empty)",
        field="host_metrics_excluded",
        read=metric_globs,
    ),
    Variable(
        "OPENLORA_PEAK_FLOPS",
        HARDWARE,
        "Peak FLOP/s of one device of this process (for example `989e12`), used for model FLOPs utilization instead of the datasheet table; a number from 1 to 1e21 in ASCII digits, an exponent allowed. Set it on CPUs or GPUs the table does not know.",
        shown="(unset)",
        field="peak_flops",
        read=peak_flops,
    ),
    Variable(
        "CUDA_VISIBLE_DEVICES",
        HARDWARE,
        "Read to pick this process's GPUs (indices, `GPU-` or `MIG-` UUIDs).",
        shown="(unset)",
        field="cuda_visible_devices",
        read=present_text,
    ),
    Variable(
        "OPENLORA_INFERENCE_MAX_ADAPTERS",
        SERVING,
        f"Distinct adapter names the serving metrics (`telemetry.inference`) record per process, {INFERENCE_MAX_ADAPTERS_RANGE[0]} to {INFERENCE_MAX_ADAPTERS_RANGE[1]}; names take slots in the order they are first seen, loaded or requested (load adapters before serving, and record names you do not serve as `other`, so the slots go to loaded adapters); later names are recorded as `other`. Each adapter adds about 90 series.",
        default=32,
        field="inference_max_adapters",
        read=integer_within(*INFERENCE_MAX_ADAPTERS_RANGE),
    ),
    Variable(
        "OPENLORA_SHUTDOWN_TIMEOUT",
        PROCESS,
        "Milliseconds `shutdown()` may take, final export included, "
        + ms_range(SHUTDOWN_TIMEOUT_RANGE_MS)
        + "; it returns after that even if the endpoint hangs (plus the final-scrape wait, `OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT`).",
        default=2000.0,
        field="shutdown_timeout_s",
        read=milliseconds_within(SHUTDOWN_TIMEOUT_RANGE_MS),
        seconds=True,
    ),
    Variable(
        "OPENLORA_HANDLE_SIGTERM",
        PROCESS,
        "`true`: on SIGTERM (when the application has no SIGTERM handler of its own) do the bounded final export, then exit with status 143; `false`: leave SIGTERM alone.",
        default=True,
        field="handle_sigterm",
        read=boolean,
    ),
    Variable(
        "OPENLORA_QUIET",
        PROCESS,
        "`true` silences the one line on standard error that says where the metrics go (shown when logging does not show INFO).",
        default=False,
        field="quiet",
        read=boolean,
    ),
)

BY_NAME: dict[str, Variable] = {variable.name: variable for variable in VARIABLES}


def default(name: str) -> object:
    """The default of variable ``name`` in its config field's unit (seconds where the field holds seconds)."""
    variable = BY_NAME[name]
    return variable.field_value(variable.default)

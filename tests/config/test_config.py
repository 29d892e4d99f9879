"""TelemetryConfig.from_env: spec semantics, precedence, and one clear error per bad value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from openlora_otel.config import GROUPS, VARIABLES, ConfigError, PortOffset, TelemetryConfig
from tests.support.pem_files import pem, write_tls_files


def cfg(**env: str) -> TelemetryConfig:
    return TelemetryConfig.from_env(env)


def test_defaults_follow_the_spec() -> None:
    config = cfg()
    assert config.exporters == ("prometheus",)
    assert (config.prometheus_host, config.prometheus_port) == ("localhost", 9464)
    assert config.otlp.protocol == "http/protobuf"  # the spec's default, not the Python SDK's gRPC
    assert config.otlp.endpoint == "http://localhost:4318/v1/metrics"
    assert config.otlp.timeout_s == 10.0
    assert config.export_interval_ms == 60000 and config.export_timeout_ms == 30000
    assert config.shutdown_timeout_s == 2.0
    assert config.run_id is None
    assert config.sdk_disabled is False
    assert config.service_name == "openlora-training"


def test_otlp_timeout_is_milliseconds() -> None:
    assert cfg(OTEL_EXPORTER_OTLP_TIMEOUT="2500").otlp.timeout_s == 2.5
    both = cfg(OTEL_EXPORTER_OTLP_TIMEOUT="2500", OTEL_EXPORTER_OTLP_METRICS_TIMEOUT="700")
    assert both.otlp.timeout_s == 0.7


@pytest.mark.parametrize(
    ("env", "endpoint"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "http://collector:4318/v1/metrics"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/metrics"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c.example/otlp"}, "https://c.example/otlp/v1/metrics"),
        # The signal path goes onto the path, before a query (a token) or a fragment, not into them.
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c.example/?api_key=k"}, "https://c.example/v1/metrics?api_key=k"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318#f"}, "http://c:4318/v1/metrics#f"),
        # The per-signal endpoint is used as is: no path appended.
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:9999/custom"}, "http://c:9999/custom"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://b:1/x",
            },
            "http://b:1/x",
        ),
    ],
)
def test_http_endpoint_resolution(env: dict[str, str], endpoint: str) -> None:
    assert cfg(**env).otlp.endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["http://user:pa#ss@c:4318", "http://user:p/ss@c:4318", "http://user:4318/ss@c", "https://c/tenant@x/v1"],
)
def test_an_at_sign_after_the_host_is_refused(endpoint: str) -> None:
    """Read by RFC 3986, a password with an unescaped `#`, `/` or `?` makes the URL name another host,
    with the password's end in the path, query or fragment: refused, saying what to encode."""
    with pytest.raises(ConfigError, match="percent-encode") as info:
        cfg(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
    assert info.value.variable == "OTEL_EXPORTER_OTLP_ENDPOINT"
    assert cfg(OTEL_EXPORTER_OTLP_ENDPOINT="http://user:pa%23ss@c:4318").otlp.endpoint.startswith("http://user:pa%23ss@c:4318")


def test_grpc_endpoint_and_insecure() -> None:
    default = cfg(OTEL_EXPORTER_OTLP_PROTOCOL="grpc").otlp
    assert default.endpoint == "http://localhost:4317" and default.insecure is True
    tls = cfg(OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_ENDPOINT="https://c:4317").otlp
    assert tls.insecure is False
    bare = cfg(
        OTEL_EXPORTER_OTLP_METRICS_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT="c:4317",
        OTEL_EXPORTER_OTLP_INSECURE="true",
    ).otlp
    assert (bare.protocol, bare.endpoint, bare.insecure) == ("grpc", "c:4317", True)


def test_headers_are_percent_decoded_and_per_signal_wins() -> None:
    config = cfg(OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer%20abc,x-team=ml")
    assert config.otlp.headers == (("Authorization", "Bearer abc"), ("x-team", "ml"))
    assert config.otlp.redacted_headers() == (("Authorization", "<redacted>"), ("x-team", "<redacted>"))
    per_signal = cfg(OTEL_EXPORTER_OTLP_HEADERS="a=1", OTEL_EXPORTER_OTLP_METRICS_HEADERS="b=2")
    assert per_signal.otlp.headers == (("b", "2"),)


def test_resource_attributes_service_name_and_ranks() -> None:
    config = cfg(
        OTEL_RESOURCE_ATTRIBUTES="team=nlp,service.name=from-attrs,note=a%2Cb",
        RANK="3",
        LOCAL_RANK="1",
        WORLD_SIZE="8",
        GROUP_RANK="0",
    )
    assert config.service_name == "from-attrs"
    assert config.resource_attributes == {
        "team": "nlp",
        "note": "a,b",
        "openlora.rank": 3,
        "openlora.local_rank": 1,
        "openlora.world_size": 8,
        "openlora.group_rank": 0,
    }
    assert cfg(OTEL_SERVICE_NAME="svc", OTEL_RESOURCE_ATTRIBUTES="service.name=x").service_name == "svc"


def test_run_id_sources() -> None:
    assert cfg(TORCHELASTIC_RUN_ID="job-7").run_id == "job-7"
    assert cfg(TORCHELASTIC_RUN_ID="job-7", OPENLORA_RUN_ID="mine").run_id == "mine"
    # torchrun without --rdzv-id sets "none": that is not an id.
    assert cfg(TORCHELASTIC_RUN_ID="none").run_id is None


@pytest.mark.parametrize("variable", ["OPENLORA_RUN_ID", "TORCHELASTIC_RUN_ID"])
@pytest.mark.parametrize(("value", "problem"), [("x" * 300, "300 characters"), ("a\nb", "control character")])
def test_a_run_id_too_long_for_a_file_name_or_with_a_control_character_names_its_variable(
    variable: str, value: str, problem: str
) -> None:
    # (It names the history file: 300 characters would fail there, naming OPENLORA_HISTORY_DIR.)
    with pytest.raises(ConfigError) as raised:
        cfg(**{variable: value})
    assert raised.value.variable == variable
    assert problem in str(raised.value) and "1 to 128 printable characters" in str(raised.value)
    assert cfg(**{variable: "x" * 128}).run_id == "x" * 128


def test_a_run_id_given_in_code_is_held_to_the_same_rules() -> None:
    from openlora_otel import setup_telemetry

    with pytest.raises(ConfigError) as raised:
        setup_telemetry(config=TelemetryConfig(exporters=("none",)), run_id="x" * 129)
    assert raised.value.variable == "run_id" and "129 characters" in str(raised.value)
    with pytest.raises(ConfigError, match="it is a int, not a string"):
        TelemetryConfig(run_id=7)  # type: ignore[arg-type]


def test_prometheus_port_offset_by_local_rank() -> None:
    assert cfg(LOCAL_RANK="3").prometheus_port == 9467
    assert cfg(LOCAL_RANK="3", OPENLORA_PROMETHEUS_PORT_OFFSET="none").prometheus_port == 9464
    assert cfg(LOCAL_RANK="3", OTEL_EXPORTER_PROMETHEUS_PORT="0").prometheus_port == 0


def test_prometheus_port_offset_by_global_rank() -> None:
    # Two torchrun "nodes" on one host: LOCAL_RANK repeats, RANK does not.
    node1 = {"RANK": "5", "LOCAL_RANK": "1", "OPENLORA_PROMETHEUS_PORT_OFFSET": "rank"}
    assert cfg(**node1).prometheus_port == 9469
    assert cfg(**node1).prometheus_port_offset == PortOffset("RANK", 5)
    assert cfg(**node1).prometheus_port_offset.setting == "OTEL_EXPORTER_PROMETHEUS_PORT (+ RANK)"
    assert cfg(**node1, OTEL_EXPORTER_PROMETHEUS_PORT="10000").prometheus_port == 10005
    with pytest.raises(ConfigError, match=r"after adding RANK"):
        cfg(**node1, OTEL_EXPORTER_PROMETHEUS_PORT="65534")


def test_exporter_lists() -> None:
    assert cfg(OTEL_METRICS_EXPORTER="otlp, Prometheus,otlp").exporters == ("otlp", "prometheus")
    assert cfg(OTEL_METRICS_EXPORTER="none").enabled_exporters == ()
    assert cfg(OTEL_SDK_DISABLED="TRUE").enabled_exporters == ()


def test_temporality_and_compression() -> None:
    config = cfg(
        OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE="Delta", OTEL_EXPORTER_OTLP_COMPRESSION="gzip"
    )
    assert (config.otlp.temporality, config.otlp.compression) == ("delta", "gzip")


def test_tls_files(tmp_path) -> None:
    files = write_tls_files(tmp_path)
    assert cfg(OTEL_EXPORTER_OTLP_CERTIFICATE=str(files.certificate)).otlp.certificate == str(files.certificate)
    mtls = cfg(
        OTEL_EXPORTER_OTLP_CLIENT_KEY=str(files.key), OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=str(files.certificate)
    ).otlp
    assert (mtls.client_key, mtls.client_certificate) == (str(files.key), str(files.certificate))


INVALID = [
    ("OTEL_SDK_DISABLED", "1", "`true` or `false`"),
    ("OTEL_METRICS_EXPORTER", "prometheus,jaeger", "comma list"),
    ("OTEL_METRICS_EXPORTER", "none,otlp", "`none` alone"),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "abc", "integer from 0 to 65535"),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "70000", "integer from 0 to 65535"),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "-1", "integer from 0 to 65535"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318", "http:// or https:// URL"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://c:4318", "http:// or https:// URL"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:99999", "port is an integer"),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "c:4318/v1/metrics", "http:// or https:// URL"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift", "`http/protobuf`, `grpc`"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "no http/json exporter"),
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "udp", "`http/protobuf`, `grpc`"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "novalue", "`key=value` pairs"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "bad key=v", "not a valid header name"),
    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "=v", "`key=value` pairs"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten", "milliseconds from 100 to 86400000"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "-5", "milliseconds from 100 to 86400000"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "0", "milliseconds from 100 to 86400000"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", "`none`, `gzip`"),
    ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "br", "`none`, `gzip`"),
    ("OTEL_EXPORTER_OTLP_INSECURE", "yes", "`true` or `false`"),
    ("OTEL_EXPORTER_OTLP_METRICS_INSECURE", "0", "`true` or `false`"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", "readable PEM file"),
    ("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "/nonexistent/ca.pem", "readable PEM file"),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/nonexistent/key.pem", "readable PEM file"),
    ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", "/nonexistent/key.pem", "readable PEM file"),
    ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/nonexistent/c.pem", "readable PEM file"),
    ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE", "/nonexistent/c.pem", "readable PEM file"),
    ("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "sometimes", "`cumulative`, `delta`, `lowmemory`"),
    # Exponential histograms with the default pull exporter, whose text formats have none.
    ("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "base2_exponential_bucket_histogram", "`explicit_bucket_histogram` while OTEL_METRICS_EXPORTER has `prometheus`"),
    ("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "native", "`explicit_bucket_histogram`, `base2_exponential_bucket_histogram`"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "-1000", "milliseconds from 100 to 86400000"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "0", "milliseconds from 100 to 86400000"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "soon", "milliseconds from 100 to 86400000"),
    ("OTEL_RESOURCE_ATTRIBUTES", "team", "`key=value` pairs"),
    ("OTEL_RESOURCE_ATTRIBUTES", "a=%ff", "percent-encoding"),
    ("OPENLORA_SHUTDOWN_TIMEOUT", "inf", "milliseconds from 1 to 600000 (10 min)"),
    ("OPENLORA_PROMETHEUS_PORT_OFFSET", "node", "`local_rank`, `rank`, `none`"),
    ("OPENLORA_GPU_METRICS", "yes", "`auto`, `on`, `off`"),
    ("OPENLORA_GPU_DEVICES", "mine", "`process`, `all`"),
    ("OPENLORA_GPU_TIMEOUT", "-1", "milliseconds from 1 to 60000 (1 min)"),
    ("OPENLORA_HOST_METRICS", "yes", "`true` or `false`"),
    ("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", "system.cpu.*,system network", "glob patterns over metric names"),
    ("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", "system.cpu.[", "glob patterns over metric names"),
    ("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", "process.[!]", "glob patterns over metric names"),
    ("OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "-1", "milliseconds from 0 to 600000 (10 min)"),
    ("OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "1e9", "milliseconds from 0 to 600000 (10 min)"),
    ("OPENLORA_HANDLE_SIGTERM", "no", "`true` or `false`"),
    ("OPENLORA_PROMETHEUS_EXPECT_SCRAPE", "yes please", "`true` or `false`"),
    ("OPENLORA_PROMETHEUS_FILE_SD_DIR", "/dev/null", "a directory, or a path where one can be created"),
    ("OPENLORA_PEAK_FLOPS", "fast", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "0", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "inf", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "nan", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "1_000", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "\uff11e12", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "+1e12", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "0x10", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_PEAK_FLOPS", "1e400", "a number of FLOP/s from 1 to 1e21"),
    ("OPENLORA_QUIET", "1", "`true` or `false`"),
    ("OPENLORA_RUN_NAME", "a\x07b", "a name of 1 to 100 printable characters"),
    ("OPENLORA_RUN_NAME", "n" * 101, "a name of 1 to 100 printable characters"),
    ("OPENLORA_RUN_ATTEMPT", "0", "an integer from 1 to 1000000"),
    ("OPENLORA_RUN_ATTEMPT", "second", "an integer from 1 to 1000000"),
    ("TORCHELASTIC_RESTART_COUNT", "-1", "an integer from 0 to 999999"),
    ("SLURM_RESTART_COUNT", "x", "an integer from 0 to 999999"),
    ("OPENLORA_HISTORY_DIR", "/dev/null", "a directory, or a path where one can be created"),
    ("OPENLORA_HISTORY_INTERVAL", "50", "milliseconds from 100 to 86400000"),
    ("OPENLORA_HISTORY_MAX_BYTES", "1000", "an integer >= 1048576"),
    ("OPENLORA_HISTORY_MAX_BYTES", "64MiB", "an integer >= 1048576"),
    ("OPENLORA_INFERENCE_MAX_ADAPTERS", "0", "an integer from 1 to 1000"),
    ("OPENLORA_INFERENCE_MAX_ADAPTERS", "many", "an integer from 1 to 1000"),
    ("RANK", "first", "integer from 0 to 2147483647"),
    ("LOCAL_RANK", "-1", "integer from 0 to 2147483647"),
    ("WORLD_SIZE", "8.0", "integer from 0 to 2147483647"),
    ("GROUP_RANK", "x", "integer from 0 to 2147483647"),
]


@pytest.mark.parametrize(("variable", "value", "accepted"), INVALID)
def test_invalid_value_names_variable_value_and_accepted(variable: str, value: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(**{variable: value})
    error = info.value
    assert error.variable == variable
    message = str(error)
    assert message.startswith(f"{variable}=")
    if "HEADERS" in variable:
        # Header values are secrets: the message shows the keys only.
        assert value.partition("=")[2] not in message.split(" is not valid")[0] or not value.partition("=")[2]
    else:
        assert repr(value) in message
    assert accepted in message


def test_every_documented_otel_variable_has_an_invalid_case() -> None:
    tested = {variable for variable, _, _ in INVALID}
    documented = {
        v.name
        for v in VARIABLES
        if v.name.startswith(("OTEL_", "OPENLORA_"))
        and v.name not in ("OTEL_SERVICE_NAME", "OTEL_EXPORTER_PROMETHEUS_HOST", "OPENLORA_RUN_ID")
    }
    # Free-form strings (service name, host, run id) have no invalid value at parse time;
    # an unresolvable host is caught when binding (test_setup).
    assert documented <= tested


@pytest.mark.parametrize(
    ("environ", "attempt"),
    [
        ({}, 1),
        ({"OPENLORA_RUN_ATTEMPT": "3"}, 3),
        ({"TORCHELASTIC_RESTART_COUNT": "0"}, 1),
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, 3),
        ({"SLURM_RESTART_COUNT": "4"}, 5),
        # The explicit setting wins.
        ({"OPENLORA_RUN_ATTEMPT": "7", "TORCHELASTIC_RESTART_COUNT": "2"}, 7),
        # srun torchrun: a requeue starts torchrun's count at 0 again; its attempts follow all that
        # torchrun may have made before (max restarts + 1 per requeue).
        ({"TORCHELASTIC_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "5"}, 7),
        ({"TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}, 5),
        ({"TORCHELASTIC_RESTART_COUNT": "3", "SLURM_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3"}, 4),
    ],
)
def test_run_attempt_from_the_setting_or_the_launcher(environ: dict[str, str], attempt: int) -> None:
    assert cfg(**environ).run_attempt == attempt


def test_run_attempt_set_in_code_is_checked() -> None:
    with pytest.raises(ConfigError, match="run_attempt"):
        TelemetryConfig(run_attempt=0)
    with pytest.raises(ConfigError, match="run_attempt"):
        TelemetryConfig(run_attempt=True)  # type: ignore[arg-type]


def test_header_values_never_appear_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        cfg(OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20s3cr3t,oops")
    assert "s3cr3t" not in str(info.value)
    assert "oops" not in str(info.value)
    assert "authorization=<redacted>" in str(info.value)


def test_client_key_without_certificate(tmp_path) -> None:
    key = write_tls_files(tmp_path).key
    with pytest.raises(ConfigError) as info:
        cfg(OTEL_EXPORTER_OTLP_CLIENT_KEY=str(key))
    assert info.value.variable == "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"


def test_port_offset_overflow() -> None:
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        cfg(OTEL_EXPORTER_PROMETHEUS_PORT="65535", LOCAL_RANK="1")


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="prometheus_port"):
        TelemetryConfig(prometheus_port=70000)
    with pytest.raises(ConfigError, match="exporters"):
        TelemetryConfig(exporters=("zipkin",))
    with pytest.raises(ConfigError, match="shutdown_timeout_s"):
        cfg().replace(shutdown_timeout_s=0)


def test_config_is_frozen() -> None:
    config = cfg()
    with pytest.raises(AttributeError):
        config.service_name = "x"  # type: ignore[misc]


# Ranges and number formats: every duration refuses what would stall or kill a thread
# later (1e-300 spins a core, 1e308 overflows a wait), and numbers are ASCII decimals.
FULLWIDTH_39464 = "\uff13\uff19\uff14\uff16\uff14"  # int() reads it as 39464
DURATIONS = [
    ("OTEL_METRIC_EXPORT_INTERVAL", "100", "86400000"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "100", "86400000"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "100", "86400000"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "100", "86400000"),
    ("OPENLORA_SHUTDOWN_TIMEOUT", "1", "600000"),
    ("OPENLORA_GPU_TIMEOUT", "1", "60000"),
]
ODD_NUMBERS = [
    "1e308",
    "1e-300",
    "0.001",
    "nan",
    "NaN",
    "infinity",
    "-inf",
    "1_000",
    "1e3",
    "+500",
    "0x10",
    FULLWIDTH_39464,
    "\u0663\u0660\u0660\u0660",
    "5 000",
    "1,5",
    "99999999999999999999999999999",
    "9" * 5000,
]


@pytest.mark.parametrize(("variable", "low", "high"), DURATIONS)
def test_durations_accept_their_documented_range_only(variable: str, low: str, high: str) -> None:
    cfg(**{variable: low})
    cfg(**{variable: high})
    cfg(**{variable: high + ".0"})  # decimals are tolerated
    for value in (str(float(low) - 0.5), str(int(high) + 1), *ODD_NUMBERS):
        with pytest.raises(ConfigError) as info:
            cfg(**{variable: value})
        assert info.value.variable == variable
        assert f"from {low} to {high}" in str(info.value)
    documented = next(
        v.meaning for v in VARIABLES if v.name == variable.replace("_METRICS_TIMEOUT", "_TIMEOUT")
    )
    assert f"{low} to {high}" in documented


def test_the_issue_extremes_are_refused() -> None:
    for env in (
        {"OPENLORA_SHUTDOWN_TIMEOUT": "1e308"},
        {"OTEL_METRIC_EXPORT_INTERVAL": "1e-300"},
        {"OTEL_METRIC_EXPORT_INTERVAL": "1e308"},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "0.001"},
    ):
        with pytest.raises(ConfigError, match="milliseconds from"):
            cfg(**env)


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_PROMETHEUS_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK"]
)
def test_integers_are_ascii_digits_in_range(variable: str) -> None:
    assert cfg(**{variable: "0042"}) is not None
    for value in [*ODD_NUMBERS, "-0", "42.0", "2147483648"]:
        with pytest.raises(ConfigError) as info:
            cfg(**{variable: value})
        assert info.value.variable == variable


def test_fullwidth_port_is_refused_not_read_as_39464() -> None:
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_PROMETHEUS_PORT"):
        cfg(OTEL_EXPORTER_PROMETHEUS_PORT=FULLWIDTH_39464)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"])
@pytest.mark.parametrize(
    "endpoint",
    [
        "http://[::1",
        "http://[::1]x:4318",
        "http://[not-an-ip]:4318",
        "http://" + "a" * 100_000 + ":4318",
        "http://" + "a" * 64 + ".example:4318",
        "http://h..x:4318",
        "http://-h:4318",
        "http://h%41:4318",
        "http://h\n:4318",
        "http://h:4318/v1/\x00",
        "http://a b:4318",
        "http://h:0",
        "http://h:\uff14\uff13\uff11\uff18",
        "http://h:1:2",
        "http://:4318",
    ],
)
def test_malformed_endpoints_are_config_errors(protocol: str, variable: str, endpoint: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(**{"OTEL_EXPORTER_OTLP_PROTOCOL": protocol, variable: endpoint})
    assert info.value.variable == variable
    assert len(str(info.value)) < 600  # a 100k-character host does not make a 100k-character error


@pytest.mark.parametrize(
    "endpoint",
    ["http://[::1]:4318", "https://[fe80::1%25eth0]:4318", "http://b\u00fccher.example:4318", "http://h:/"],
)
def test_unusual_but_valid_endpoints_are_accepted(endpoint: str) -> None:
    assert cfg(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint).otlp.endpoint.startswith(endpoint.rstrip("/"))


@pytest.mark.parametrize(
    "host", ["a" * 100_000, "a" * 64, "h\nx", "h x", "h\x00", "h\x7f", "bad*host", "-h", "h..x", "[::1]"]
)
def test_prometheus_host_junk_is_refused(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(OTEL_EXPORTER_PROMETHEUS_HOST=host)
    assert info.value.variable == "OTEL_EXPORTER_PROMETHEUS_HOST"
    assert len(str(info.value)) < 600


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "::1", "0.0.0.0", "my_host.local", "b\u00fccher.example"]
)
def test_prometheus_host_forms_accepted(host: str) -> None:
    assert cfg(OTEL_EXPORTER_PROMETHEUS_HOST=host).prometheus_host == host


# Every base variable is validated even when its per-signal twin wins.
BASE_WHILE_PER_SIGNAL_WINS = [
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "http://[::1",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "http://c:4318/v1/metrics",
    ),
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "ftp://c:4318",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "http://c:4318/v1/metrics",
    ),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "novalue", "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "a=1"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "a=b%0Ac", "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "a=1"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "1e308", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1000"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "gzip"),
    ("OTEL_EXPORTER_OTLP_INSECURE", "yes", "OTEL_EXPORTER_OTLP_METRICS_INSECURE", "true"),
    (
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        "/nonexistent/ca.pem",
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
        "{cert}",
    ),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/nonexistent/k.pem", "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", "{key}"),
    (
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        "/nonexistent/c.pem",
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
        "{cert}",
    ),
]


@pytest.mark.parametrize(("base", "bad", "per_signal", "good"), BASE_WHILE_PER_SIGNAL_WINS)
def test_base_variable_is_validated_when_the_per_signal_one_wins(
    base: str, bad: str, per_signal: str, good: str, tmp_path
) -> None:
    files = write_tls_files(tmp_path)
    good = good.format(cert=files.certificate, key=files.key)
    env = {per_signal: good}
    if "CLIENT_" in per_signal:  # mTLS needs both halves
        other, path = ("CLIENT_CERTIFICATE", files.certificate) if "CLIENT_KEY" in per_signal else ("CLIENT_KEY", files.key)
        env[f"OTEL_EXPORTER_OTLP_METRICS_{other}"] = str(path)
    cfg(**env)  # the per-signal value alone is fine
    with pytest.raises(ConfigError) as info:
        cfg(**env, **{base: bad})
    assert info.value.variable == base


def test_a_valid_base_endpoint_for_another_protocol_is_not_refused() -> None:
    # With a per-signal endpoint the base one may serve other signals over gRPC (host:port).
    config = cfg(
        OTEL_EXPORTER_OTLP_ENDPOINT="collector:4317",
        OTEL_EXPORTER_OTLP_METRICS_ENDPOINT="http://collector:4318/v1/metrics",
    )
    assert config.otlp.endpoint == "http://collector:4318/v1/metrics"


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        ("authorization=Bearer%20abcdef%0D%0AX-Evil:%201", "control character"),
        ("authorization=Bearer%20abcdef%0AX-Evil:%201", "control character"),
        ("authorization=Bearer%20abcdef%00", "control character"),
        ("authorization=Bearer%20abcdef%7F", "control character"),
        ("authorization=Bearer%09abcdef", "control character"),
        ("authorization=Bearer%20abcd%C3%A9f", "not ASCII"),
        ("x%0D%0AEvil=abcdef", "header name"),
        ("x%00=abcdef", "header name"),
        ("x-a\u00e9=abcdef", "header name"),
    ],
)
def test_header_control_characters_are_refused_without_echoing_the_value(headers: str, detail: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(OTEL_EXPORTER_OTLP_HEADERS=headers)
    message = str(info.value)
    assert detail in message
    assert "abcd" not in message
    assert "\r" not in message and "\n" not in message and "\x00" not in message


def test_header_value_surrounding_spaces_are_dropped() -> None:
    # requests refuses a value with leading whitespace at every export (and prints it).
    assert cfg(OTEL_EXPORTER_OTLP_HEADERS="a=%20%20x%20").otlp.headers == (("a", "x"),)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("export_interval_ms", float("nan")),
        ("export_interval_ms", float("inf")),
        ("export_interval_ms", 1e-300),
        ("export_interval_ms", 1e308),
        ("export_timeout_ms", float("nan")),
        ("export_timeout_ms", 1e308),
        ("shutdown_timeout_s", float("nan")),
        ("shutdown_timeout_s", float("inf")),
        ("shutdown_timeout_s", 1e308),
        ("shutdown_timeout_s", 601.0),
        ("shutdown_timeout_s", True),
        ("gpu_timeout_s", float("nan")),
        ("gpu_timeout_s", 1e308),
        ("gpu_timeout_s", 0.0),
        ("prometheus_port", 9464.5),
        ("prometheus_port", True),
        ("prometheus_port", 10**400),
        ("prometheus_host", "a" * 300),
        ("prometheus_host", "h\nx"),
    ],
)
def test_programmatic_configs_get_the_same_ranges(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        TelemetryConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.variable == field


@pytest.mark.parametrize(
    "changes",
    [
        {"timeout_s": float("nan")},
        {"timeout_s": 1e308},
        {"timeout_s": 0.00001},
        {"headers": (("authorization", "Bearer abcdef\r\nX-Evil: 1"),)},
        {"headers": (("bad name", "v"),)},
        {"endpoint": "http://[::1"},
        {"endpoint": "localhost:4318"},  # http/protobuf needs a scheme
        {"protocol": "http/json"},
        {"compression": "zstd"},
    ],
)
def test_programmatic_otlp_configs_are_validated(changes: dict[str, object]) -> None:
    from openlora_otel.config import OTLPConfig

    with pytest.raises(ConfigError) as info:
        OTLPConfig(**changes)  # type: ignore[arg-type]
    assert "abcdef" not in str(info.value)


# A hostile pass: every variable, many odd values. Each either gives a config or a
# ConfigError naming a variable; nothing else (ValueError, UnicodeError, OverflowError).
HOSTILE = [
    "",
    " ",
    "\x00",
    "a\nb",
    "\r\n",
    "\x7f",
    "\u00e9",
    "\ud800",
    FULLWIDTH_39464,
    "1e308",
    "-1e308",
    "1e-300",
    "nan",
    "-inf",
    "1_000",
    " 1e3 ",
    "9" * 5000,
    "%",
    "%ff",
    "%0D%0A",
    "=",
    ",",
    "=,=",
    "a=%",
    "a=b=c",
    "http://[::1",
    "http://[::1]:99999",
    "http://" + "a" * 100_000 + ":1",
    "a" * 100_000,
    "user:pw@h:1",
    "grpc",
    "true",
    "none",
]


@pytest.mark.parametrize("variable", [n.strip() for v in VARIABLES for n in v.name.split(",")])
def test_hostile_values_give_a_config_or_a_config_error(variable: str) -> None:
    for value in HOSTILE:
        for protocol in ("http/protobuf", "grpc"):
            env = {"OTEL_EXPORTER_OTLP_PROTOCOL": protocol, variable: value}
            try:
                TelemetryConfig.from_env(env)
            except ConfigError as error:
                assert error.variable.startswith(
                    ("OTEL_", "OPENLORA_", "RANK", "LOCAL_RANK", "WORLD_", "GROUP_", "TORCHELASTIC_")
                )
                assert len(str(error)) < 1000


@pytest.mark.parametrize(
    ("raw", "expected"), [("989e12", 989e12), ("1.5E+14", 1.5e14), (".5e3", 500.0), ("1000", 1000.0), (" 2e15 ", 2e15)]
)
def test_peak_flops_takes_decimals_with_an_exponent(raw: str, expected: float) -> None:
    assert TelemetryConfig.from_env({"OPENLORA_PEAK_FLOPS": raw}).peak_flops == expected


@pytest.mark.parametrize("patterns", ["system.[cd]*", "process.[!c]*", "system.*", "[]]x,system.network.io"])
def test_excluded_metrics_with_closed_sets_are_accepted(patterns: str) -> None:
    config = TelemetryConfig.from_env({"OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS": patterns})
    assert ",".join(config.host_metrics_excluded) == patterns


# -- the table of variables ------------------------------------------------------------------------


def test_every_field_default_is_the_tables_default() -> None:
    """Each default is written once, in the table: the config's field defaults are its values."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(TelemetryConfig)}
    filled = [v for v in VARIABLES if v.field]
    assert len(filled) >= 20, filled
    for variable in filled:
        assert variable.read is not None, variable.name
        assert fields[variable.field].default == variable.field_value(variable.default), variable.name
    # ... and from_env of an empty environment gives exactly the defaults of a config built in code,
    # but for the port's provenance (not set) and the OTLP endpoint's (not set).
    assert TelemetryConfig.from_env({}) == TelemetryConfig(
        prometheus_port_explicit=False, otlp=TelemetryConfig().otlp.__class__(endpoint_set=False)
    )


# A valid value other than the default for each variable that fills a field, and what the field holds.
NON_DEFAULT = {
    "OPENLORA_RUN_ATTEMPT": ("2", 2),
    "OTEL_SDK_DISABLED": ("true", True),
    "OTEL_METRICS_EXPORTER": ("otlp,console", ("otlp", "console")),
    "OTEL_METRIC_EXPORT_INTERVAL": ("1500", 1500.0),
    "OTEL_METRIC_EXPORT_TIMEOUT": ("2500", 2500.0),
    "OTEL_EXPORTER_PROMETHEUS_HOST": ("127.0.0.1", "127.0.0.1"),
    "OPENLORA_PROMETHEUS_FILE_SD_DIR": ("/tmp/sd", "/tmp/sd"),
    "OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": ("0", 0.0),
    "OPENLORA_PROMETHEUS_EXPECT_SCRAPE": ("true", True),
    "OPENLORA_RUN_NAME": (" lr sweep ", "lr sweep"),
    "OPENLORA_HISTORY_DIR": ("/tmp/history", "/tmp/history"),
    "OPENLORA_HISTORY_INTERVAL": ("250", 250.0),
    "OPENLORA_HISTORY_MAX_BYTES": ("2097152", 2097152),
    "OPENLORA_GPU_METRICS": ("OFF", "off"),
    "OPENLORA_GPU_DEVICES": ("all", "all"),
    "OPENLORA_GPU_TIMEOUT": ("250", 0.25),
    "OPENLORA_HOST_METRICS": ("false", False),
    "OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS": ("system.network.*, process.*", ("system.network.*", "process.*")),
    "OPENLORA_PEAK_FLOPS": ("989e12", 989e12),
    "CUDA_VISIBLE_DEVICES": ("", ""),
    "OPENLORA_INFERENCE_MAX_ADAPTERS": ("4", 4),
    "OPENLORA_SHUTDOWN_TIMEOUT": ("500", 0.5),
    "OPENLORA_HANDLE_SIGTERM": ("false", False),
    "OPENLORA_QUIET": ("true", True),
}


def test_each_variable_that_fills_a_field_is_read_by_the_table_loop() -> None:
    """A value in the environment reaches its field through the table's reader, in the field's unit."""
    filled = {v.name: v for v in VARIABLES if v.field}
    assert set(filled) == set(NON_DEFAULT), set(filled) ^ set(NON_DEFAULT)
    for name, (raw, expected) in NON_DEFAULT.items():
        variable = filled[name]
        got = getattr(TelemetryConfig.from_env({name: raw}), variable.field)
        assert got == expected != variable.field_value(variable.default), (name, got)


def test_every_variable_is_in_one_known_group_and_the_groups_in_order() -> None:
    assert {v.group for v in VARIABLES} == set(GROUPS)
    seen = [v.group for v in VARIABLES]
    assert [g for i, g in enumerate(seen) if i == 0 or seen[i - 1] != g] == list(GROUPS)


def test_the_port_comes_with_its_origin_as_data() -> None:
    assert cfg().prometheus_port_offset is None and not cfg().prometheus_port_explicit
    assert cfg(LOCAL_RANK="2").prometheus_port_offset == PortOffset("LOCAL_RANK", 2)
    assert cfg(LOCAL_RANK="0").prometheus_port_offset is None  # nothing added
    assert cfg(LOCAL_RANK="2", OTEL_EXPORTER_PROMETHEUS_PORT="0").prometheus_port_offset is None
    assert cfg(OTEL_EXPORTER_PROMETHEUS_PORT="9500").prometheus_port_explicit


# ---- TLS files: read and checked at setup, on both protocols -------------------------------------
# An unreadable file made gRPC's setup raise a bare OSError; a file that is not PEM was accepted and
# failed every export. Both are ConfigErrors naming the variable, the path and what is accepted.

CERTIFICATE_ACCEPTED = "a readable PEM file with at least one certificate"
KEY_ACCEPTED = "a readable PEM file with an unencrypted private key"
PROTOCOL_ENV = {
    "http/protobuf": {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4318"},
    "grpc": {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4317"},
}


def _bad_file(kind: str, tmp_path, files) -> tuple[str, str]:
    """A path that is no usable PEM file of its ``kind``, and the words the error must say about it."""
    if kind == "directory":
        return str(tmp_path), "not a regular file"
    if kind == "unreadable":  # fails for root too: the file exists, reading it is an I/O error
        if not os.path.isfile("/proc/self/mem"):
            pytest.skip("no /proc/self/mem here")
        return "/proc/self/mem", "cannot read it"
    if kind == "mode 000":
        if os.geteuid() == 0:
            pytest.skip("root reads a file of mode 000 (the `unreadable` case covers root)")
        path = tmp_path / "locked.pem"
        path.write_text(files.certificate.read_text())
        path.chmod(0)
        return str(path), "cannot read it: Permission denied"
    path = tmp_path / f"{kind.replace(' ', '-')}.pem"
    content, words = {
        "empty": ("", "no `-----BEGIN"),
        "not pem": ("this is not a certificate\n", "no `-----BEGIN"),
        "junk in a block": (pem("CERTIFICATE", os.urandom(300)) + pem("PRIVATE KEY", os.urandom(48)), "not a valid"),
        "a key for a certificate": (files.key.read_text(), "no `-----BEGIN CERTIFICATE-----` block"),
        "a certificate for a key": (files.certificate.read_text(), "no `-----BEGIN ... PRIVATE KEY-----` block"),
        "an encrypted key": (pem("ENCRYPTED PRIVATE KEY", os.urandom(64)), "encrypted"),
        "a key not of the certificate": (files.other_key.read_text(), "cannot use them together"),
    }[kind]
    path.write_text(content)
    return str(path), words


TLS_CASES = [
    *(
        (variable, kind)
        for variable in (
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        )
        for kind in ("directory", "unreadable", "mode 000", "empty", "not pem")
    ),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "junk in a block"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "a key for a certificate"),
    ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "junk in a block"),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "a certificate for a key"),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "an encrypted key"),
    ("OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY", "an encrypted key"),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "a key not of the certificate"),
]


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize(("variable", "kind"), TLS_CASES)
def test_a_tls_file_that_cannot_be_used_is_a_config_error(
    variable: str, kind: str, protocol: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if protocol == "grpc":
        pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    files = write_tls_files(tmp_path)
    path, words = _bad_file(kind, tmp_path, files)
    env = {"OTEL_METRICS_EXPORTER": "otlp", **PROTOCOL_ENV[protocol], variable: path}
    prefix = variable.rpartition("_CLIENT_")[0] or None
    if prefix:  # mTLS: the other half, valid
        env.setdefault(f"{prefix}_CLIENT_CERTIFICATE", str(files.certificate))
        env.setdefault(f"{prefix}_CLIENT_KEY", str(files.key))
    accepted = KEY_ACCEPTED if variable.endswith("CLIENT_KEY") else CERTIFICATE_ACCEPTED
    if kind == "a key not of the certificate":
        accepted = f"the private key of the certificate in {prefix}_CLIENT_CERTIFICATE"
    with pytest.raises(ConfigError) as info:
        TelemetryConfig.from_env(env)
    error = info.value
    assert (error.variable, error.value) == (variable, path), error
    assert accepted in str(error) and words in str(error), error
    # The same from setup_telemetry() with the variables in the environment: a ConfigError, not an
    # OSError from gRPC's credentials or an exporter that fails every export.
    from openlora_otel import setup_telemetry

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as again:
        setup_telemetry()
    assert again.value.variable == variable


def test_a_real_ca_bundle_is_accepted(tmp_path) -> None:
    """Over a hundred certificates with comments between them, as distributions and certifi ship them;
    a bundle with one broken certificate among good ones names that one."""
    certifi = pytest.importorskip("certifi")
    bundle = certifi.where()
    assert cfg(OTEL_EXPORTER_OTLP_CERTIFICATE=bundle).otlp.certificate == bundle
    broken = tmp_path / "broken-bundle.pem"
    broken.write_text(Path(bundle).read_text(encoding="utf-8") + pem("CERTIFICATE", b"\x30\x03\x02\x01\x01"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"certificate \d+ is not a valid X.509 certificate"):
        cfg(OTEL_EXPORTER_OTLP_CERTIFICATE=str(broken))


def test_a_tls_file_that_cannot_be_used_is_refused_in_code_too(tmp_path) -> None:
    from openlora_otel.config import OTLPConfig

    files = write_tls_files(tmp_path)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate")
    with pytest.raises(ConfigError, match=CERTIFICATE_ACCEPTED) as info:
        OTLPConfig(certificate=str(not_pem))
    assert info.value.variable == "otlp.certificate"
    with pytest.raises(ConfigError, match="cannot use them together") as info:
        OTLPConfig(client_key=str(files.other_key), client_certificate=str(files.certificate))
    assert info.value.variable == "otlp.client_key"
    with pytest.raises(ConfigError, match="needs both"):
        OTLPConfig(client_key=str(files.key))
    good = OTLPConfig(certificate=str(files.certificate), client_key=str(files.key), client_certificate=str(files.certificate))
    assert good.client_key == str(files.key)


@pytest.mark.process
def test_tls_files_made_by_openssl_are_accepted_and_a_mismatch_refused(tmp_path) -> None:
    """The pure-Python test files are Ed25519; what users have is mostly RSA and EC from openssl."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl is needed under CI to check real TLS files")
        pytest.skip("no openssl binary")

    def make(name: str, algorithm: list[str]) -> tuple[str, str]:
        key, cert = str(tmp_path / f"{name}-key.pem"), str(tmp_path / f"{name}-cert.pem")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", *algorithm, "-nodes", "-keyout", key, "-out", cert,
             "-days", "1", "-subj", f"/CN={name}"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        return key, cert

    rsa_key, rsa_cert = make("rsa", ["rsa:2048"])
    ec_key, ec_cert = make("ec", ["ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"])
    for key, cert in ((rsa_key, rsa_cert), (ec_key, ec_cert)):
        otlp = cfg(
            OTEL_EXPORTER_OTLP_CERTIFICATE=cert, OTEL_EXPORTER_OTLP_CLIENT_KEY=key, OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=cert
        ).otlp
        assert otlp.client_key == key
    bundle = tmp_path / "bundle.pem"  # a CA bundle: several certificates, comments between them
    rsa, ec = Path(rsa_cert).read_text(), Path(ec_cert).read_text()
    bundle.write_text(f"# RSA\n{rsa}\n# EC, non-ASCII comment: é\n{ec}", encoding="utf-8")
    assert cfg(OTEL_EXPORTER_OTLP_CERTIFICATE=str(bundle)).otlp.certificate == str(bundle)
    with pytest.raises(ConfigError, match="cannot use them together"):
        cfg(OTEL_EXPORTER_OTLP_CLIENT_KEY=ec_key, OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=rsa_cert)
    encrypted = str(tmp_path / "encrypted.pem")
    subprocess.run(
        ["openssl", "pkey", "-in", rsa_key, "-aes256", "-passout", "pass:pw", "-out", encrypted],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="encrypted"):
        cfg(OTEL_EXPORTER_OTLP_CLIENT_KEY=encrypted, OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=rsa_cert)


# Found by tests/config/test_env_fuzz.py (issue 29): a byte of the environment that is not UTF-8 reaches Python
# as a lone surrogate; taken into the Resource or the endpoint, it failed every scrape and export.
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_SERVICE_NAME", "trainer\udcff"),
        ("OTEL_RESOURCE_ATTRIBUTES", "team=ml\udcff"),
        ("OTEL_RESOURCE_ATTRIBUTES", "te\udcffam=ml"),
        ("OTEL_RESOURCE_ATTRIBUTES", "service.name=trainer\udcff"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/otlp\udcff"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://alice:pw\udcff@collector:4318"),
    ],
)
def test_text_that_is_not_utf8_is_refused_naming_its_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match="not valid UTF-8") as info:
        TelemetryConfig.from_env({variable: value})
    assert info.value.variable == variable
    str(info.value).encode("utf-8")


@pytest.mark.parametrize(
    "changes", [{"service_name": "trainer\udcff"}, {"resource_attributes": {"team": "ml\udcff"}}]
)
def test_text_that_is_not_utf8_is_refused_in_code_too(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        TelemetryConfig(**changes)  # type: ignore[arg-type]


def test_the_histogram_aggregation_is_either_and_exponential_needs_a_push_exporter() -> None:
    from openlora_otel.config import OTLPConfig

    name = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    for value in ("explicit_bucket_histogram", "Explicit_Bucket_Histogram", ""):
        assert not TelemetryConfig.from_env({name: value}).exponential_histograms
    for exporters in ("otlp", "console", "otlp,console", "none"):
        config = TelemetryConfig.from_env({name: "BASE2_exponential_bucket_histogram", "OTEL_METRICS_EXPORTER": exporters})
        assert config.exponential_histograms and config.otlp.histogram_aggregation == "base2_exponential_bucket_histogram"
    for exporters in ("prometheus", "prometheus,otlp", ""):
        with pytest.raises(ConfigError) as caught:
            TelemetryConfig.from_env({name: "base2_exponential_bucket_histogram", "OTEL_METRICS_EXPORTER": exporters})
        assert caught.value.variable == name
        assert "the pull endpoint's text formats have no exponential histograms" in str(caught.value)
    # The same checks for a config built in code.
    exponential = OTLPConfig(histogram_aggregation="base2_exponential_bucket_histogram")
    with pytest.raises(ConfigError):
        TelemetryConfig(otlp=exponential)  # the default exporter is the pull endpoint
    assert TelemetryConfig(otlp=exponential, exporters=("otlp",)).exponential_histograms
    with pytest.raises(ConfigError) as caught:
        OTLPConfig(histogram_aggregation="native")  # type: ignore[arg-type]
    assert caught.value.variable == "otlp.histogram_aggregation"

"""TelemetryConfig.from_env: spec semantics, precedence, and one clear error per bad value."""

from __future__ import annotations

import pytest

from openlora_otel.config import VARIABLES, ConfigError, TelemetryConfig


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


def test_prometheus_port_offset_by_local_rank() -> None:
    assert cfg(LOCAL_RANK="3").prometheus_port == 9467
    assert cfg(LOCAL_RANK="3", OPENLORA_PROMETHEUS_PORT_OFFSET="none").prometheus_port == 9464
    assert cfg(LOCAL_RANK="3", OTEL_EXPORTER_PROMETHEUS_PORT="0").prometheus_port == 0


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
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert cfg(OTEL_EXPORTER_OTLP_CERTIFICATE=str(ca)).otlp.certificate == str(ca)


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
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten", "milliseconds > 0"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "-5", "milliseconds > 0"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "0", "milliseconds > 0"),
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
    ("OTEL_METRIC_EXPORT_INTERVAL", "-1000", "milliseconds > 0"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "0", "milliseconds > 0"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "soon", "milliseconds > 0"),
    ("OTEL_RESOURCE_ATTRIBUTES", "team", "`key=value` pairs"),
    ("OTEL_RESOURCE_ATTRIBUTES", "a=%ff", "percent-encoding"),
    ("OPENLORA_SHUTDOWN_TIMEOUT", "inf", "milliseconds > 0"),
    ("OPENLORA_PROMETHEUS_PORT_OFFSET", "rank", "`local_rank`, `none`"),
    ("OPENLORA_GPU_METRICS", "yes", "`auto`, `on`, `off`"),
    ("OPENLORA_GPU_DEVICES", "mine", "`process`, `all`"),
    ("OPENLORA_GPU_TIMEOUT", "-1", "milliseconds > 0"),
    ("RANK", "first", "integer >= 0"),
    ("LOCAL_RANK", "-1", "integer >= 0"),
    ("WORLD_SIZE", "8.0", "integer >= 0"),
    ("GROUP_RANK", "x", "integer >= 0"),
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


def test_header_values_never_appear_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        cfg(OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20s3cr3t,oops")
    assert "s3cr3t" not in str(info.value)
    assert "oops" not in str(info.value)
    assert "authorization=<redacted>" in str(info.value)


def test_client_key_without_certificate(tmp_path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
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

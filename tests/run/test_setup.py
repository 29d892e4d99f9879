"""setup_telemetry(): resource, precedence, globals, lifecycle and clean failure (read in memory)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import openlora_otel
from openlora_otel import ConfigError, MissingDependencyError, TelemetryConfig, _deps, setup_telemetry
from tests.support.processes import free_port
from tests.support.readings import points

NO_EXPORT = {"OTEL_METRICS_EXPORTER": "none"}


def test_records_reach_reader_and_resource_carries_identity(
    monkeypatch: pytest.MonkeyPatch, memory_reader: InMemoryMetricReader
) -> None:
    for key, value in {
        **NO_EXPORT,
        "OTEL_SERVICE_NAME": "env-service",
        "OTEL_RESOURCE_ATTRIBUTES": "team=nlp,deployment.environment=dev",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "elastic-42",
    }.items():
        monkeypatch.setenv(key, value)
    with setup_telemetry(metric_readers=[memory_reader], resource_attributes={"team": "vision"}) as telemetry:
        telemetry.meter.create_counter("openlora.test.steps", unit="{step}").add(7)
        data = memory_reader.get_metrics_data()
    attributes = dict(data.resource_metrics[0].resource.attributes)
    assert attributes["service.name"] == "env-service"
    assert attributes["openlora.run.id"] == "elastic-42" == telemetry.run_id
    assert attributes["team"] == "vision"  # the argument wins over OTEL_RESOURCE_ATTRIBUTES
    assert attributes["deployment.environment"] == "dev"
    assert (attributes["openlora.rank"], attributes["openlora.local_rank"]) == (5, 1)
    assert (attributes["openlora.world_size"], attributes["openlora.group_rank"]) == (8, 0)
    assert attributes["host.name"] == socket.gethostname()
    assert attributes["service.instance.id"]
    assert attributes["telemetry.distro.name"] == "openlora-otel"
    [point] = points(data, "openlora.test.steps")
    assert point.value == 7
    # Run identity is in the Resource, never on the data points.
    assert dict(point.attributes) == {}


def test_explicit_arguments_win_over_environment(
    monkeypatch: pytest.MonkeyPatch, memory_reader: InMemoryMetricReader
) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "env-service")
    monkeypatch.setenv("OPENLORA_RUN_ID", "env-run")
    telemetry = setup_telemetry("arg-service", run_id="arg-run", metric_readers=[memory_reader])
    attributes = telemetry.resource.attributes
    assert (attributes["service.name"], attributes["openlora.run.id"]) == ("arg-service", "arg-run")
    telemetry.shutdown()


def test_explicit_config_wins_and_env_is_not_read(
    monkeypatch: pytest.MonkeyPatch, memory_reader: InMemoryMetricReader
) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "bogus")  # would raise if it were read
    config = TelemetryConfig(exporters=("none",), service_name="cfg")
    telemetry = setup_telemetry(config=config, metric_readers=[memory_reader])
    assert telemetry.resource.attributes["service.name"] == "cfg"
    assert len(telemetry.run_id) == 16  # generated
    telemetry.shutdown()


def test_sets_global_provider_and_other_code_records_into_it(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    assert metrics.get_meter_provider() is telemetry.meter_provider
    metrics.get_meter("some.library").create_counter("lib.calls").add(2)
    assert points(memory_reader.get_metrics_data(), "lib.calls")[0].value == 2
    telemetry.shutdown()


def test_second_setup_while_open_is_refused_and_allowed_after_shutdown() -> None:
    config = TelemetryConfig(exporters=("none",))
    first = setup_telemetry(config=config)
    with pytest.raises(RuntimeError, match="already called"):
        setup_telemetry(config=config)
    first.shutdown()
    reader = InMemoryMetricReader()
    second = setup_telemetry(config=config, metric_readers=[reader])
    second.meter.create_counter("c").add(1)
    assert points(reader.get_metrics_data(), "c")[0].value == 1
    second.shutdown()


def test_existing_global_provider_is_reused_not_doubled(memory_reader: InMemoryMetricReader) -> None:
    # What opentelemetry-instrument leaves behind: a configured global SDK provider.
    foreign = MeterProvider(metric_readers=[memory_reader])
    metrics.set_meter_provider(foreign)
    telemetry = setup_telemetry(config=TelemetryConfig(prometheus_port=0))
    assert telemetry.owns_provider is False
    assert telemetry.meter_provider is foreign
    assert telemetry.prometheus_url is None  # no second set of exporters
    telemetry.meter.create_counter("openlora.reused").add(3)
    telemetry.shutdown()
    # Our shutdown flushed but did not shut the foreign provider down.
    foreign.get_meter("after").create_counter("still.alive").add(1)
    data = memory_reader.get_metrics_data()
    assert points(data, "openlora.reused")[0].value == 3
    assert points(data, "still.alive")[0].value == 1
    foreign.shutdown()


def test_a_history_dir_on_a_reused_provider_is_said_not_silently_dropped(
    memory_reader: InMemoryMetricReader, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = MeterProvider(metric_readers=[memory_reader])
    metrics.set_meter_provider(foreign)
    caplog.set_level(logging.WARNING)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), history_dir=str(tmp_path)))
    try:
        assert telemetry.history_path is None
        assert any("no history file is written" in r.getMessage() for r in caplog.records)
        assert list(tmp_path.iterdir()) == []
    finally:
        telemetry.shutdown()
        foreign.shutdown()


def test_sdk_disabled_gives_working_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    threads_before = threading.active_count()
    with setup_telemetry() as telemetry:
        assert telemetry.enabled is False
        telemetry.meter.create_counter("x").add(1)
        telemetry.meter.create_histogram("h").record(0.5)
        telemetry.meter.create_observable_gauge("g", callbacks=[lambda options: []])
        assert telemetry.prometheus_url is None
        assert telemetry.force_flush() is True
        assert threading.active_count() == threads_before
        _assert_port_free(port)
    assert telemetry.is_shutdown


def test_shutdown_is_idempotent_and_calls_after_it_are_safe(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    counter = telemetry.meter.create_counter("c")
    assert telemetry.shutdown() is True
    assert telemetry.shutdown() is True
    counter.add(1)  # recording after shutdown is a silent no-op, not an error
    assert telemetry.force_flush() is False
    assert "shut down" in repr(telemetry)


def test_prometheus_endpoint_is_served_and_released() -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0))
    url = telemetry.prometheus_url
    assert url is not None and url.startswith("http://127.0.0.1:")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    telemetry.meter.create_counter("openlora.served").add(1)
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read().decode()
    assert "openlora_served_total" in body
    assert 'openlora_run_id="' + telemetry.run_id + '"' in body  # target_info carries the Resource
    telemetry.shutdown()
    _assert_port_free(port)


def test_port_in_use_is_a_clear_error_and_nothing_is_left_running() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        threads_before = {t.ident for t in threading.enumerate()}
        config = TelemetryConfig(
            exporters=("otlp", "prometheus"), prometheus_host="127.0.0.1", prometheus_port=port
        )
        with pytest.raises(ConfigError) as info:
            setup_telemetry(config=config)
        assert info.value.variable == "OTEL_EXPORTER_PROMETHEUS_PORT"
        assert str(port) in str(info.value)
        assert "in use" in str(info.value)
        assert {t.ident for t in threading.enumerate()} == threads_before
        assert openlora_otel.telemetry._global_owner is None


def test_unresolvable_prometheus_host_names_the_variable() -> None:
    config = TelemetryConfig(prometheus_host="no-such-host.invalid", prometheus_port=0)
    with pytest.raises(ConfigError) as info:
        setup_telemetry(config=config)
    assert info.value.variable == "OTEL_EXPORTER_PROMETHEUS_HOST"


def test_invalid_environment_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus,otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT"):
        setup_telemetry()
    assert {t.ident for t in threading.enumerate()} == threads_before
    _assert_port_free(port)


@pytest.mark.parametrize(
    ("protocol", "module", "package"),
    [
        ("http/protobuf", "opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http"),
        ("grpc", "opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
    ],
)
def test_missing_optional_package_names_package_and_extra(
    monkeypatch: pytest.MonkeyPatch, protocol: str, module: str, package: str
) -> None:
    real = _deps.is_installed
    monkeypatch.setattr(_deps, "is_installed", lambda name: False if name == module else real(name))
    port = free_port()
    env = {
        "OTEL_METRICS_EXPORTER": "prometheus,otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
    }
    with pytest.raises(MissingDependencyError) as info:
        setup_telemetry(config=TelemetryConfig.from_env(env))
    assert package in str(info.value)
    assert "openlora-otel[otlp]" in str(info.value)
    _assert_port_free(port)


@pytest.mark.process
def test_import_loads_no_optional_framework() -> None:
    # A meta-path finder that refuses the heavy packages: importing ours must not touch them.
    code = """
import sys
BLOCKED = ("torch", "transformers", "peft", "lightning", "pytorch_lightning", "pynvml", "grpc")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked " + name)
        return None
sys.meta_path.insert(0, Block())
import openlora_otel
from openlora_otel import setup_telemetry, Telemetry, TelemetryConfig
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
print("ok", openlora_otel.__version__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


def test_public_api() -> None:
    assert set(openlora_otel.__all__) >= {"setup_telemetry", "Telemetry", "TelemetryConfig", "__version__"}


def _assert_port_free(port: int) -> None:
    """Nothing listens there any more, and a server (SO_REUSEADDR, as HTTPServer uses) could bind it."""
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_console_exporter_prints_on_shutdown(capsys: pytest.CaptureFixture[str]) -> None:
    config = TelemetryConfig.from_env(
        {"OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "600000"}
    )
    telemetry = setup_telemetry(config=config)
    telemetry.meter.create_counter("openlora.console.steps").add(3)
    assert telemetry.shutdown() is True
    out = capsys.readouterr().out
    assert '"name": "openlora.console.steps"' in out
    assert telemetry.run_id in out


def test_where_metrics_go_is_one_phrase_for_every_exporter(tmp_path) -> None:
    """The one answer the setup line, the demo and the server's ready line print; credentials redacted."""
    cases = [
        (TelemetryConfig(exporters=("none",)), "not exported (OTEL_METRICS_EXPORTER=none)"),
        (TelemetryConfig(sdk_disabled=True), "off (OTEL_SDK_DISABLED=true)"),
        (TelemetryConfig(exporters=("console",), export_interval_ms=600000), "printed every 600 s"),
        (
            TelemetryConfig.from_env(
                {
                    "OTEL_METRICS_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://user:s3cret@127.0.0.1:1",
                    "OTEL_METRIC_EXPORT_INTERVAL": "600000",
                }
            ),
            "pushed to http://<redacted>@127.0.0.1:1/v1/metrics (OTLP http/protobuf) every 600 s",
        ),
    ]
    for config, expected in cases:
        telemetry = setup_telemetry(config=config.replace(quiet=True, gpu_metrics="off", host_metrics=False))
        try:
            assert telemetry.where_metrics_go() == expected
        finally:
            telemetry.shutdown(timeout_s=1)
    both = TelemetryConfig(
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        history_dir=str(tmp_path),
        history_interval_ms=600000,
        quiet=True,
        gpu_metrics="off",
        host_metrics=False,
    )
    telemetry = setup_telemetry(config=both, run_id="where")
    try:
        assert telemetry.where_metrics_go() == (
            f"served at {telemetry.prometheus_url} and written to {tmp_path / 'where.jsonl'} every 600 s"
        )
    finally:
        telemetry.shutdown(timeout_s=1)


def test_timeouts_accept_numpy_integers_and_floats_and_refuse_bools() -> None:
    np = pytest.importorskip("numpy")
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), host_metrics=False, quiet=True))
    try:
        assert telemetry.force_flush(timeout_s=np.int64(2)) is True
        assert telemetry.force_flush(timeout_s=np.float32(2.5)) is True
        for bad, error in ((np.bool_(True), TypeError), (np.array(2.0), TypeError), (np.int64(0), ValueError),
                           (np.float64("nan"), ValueError), (np.int64(10**6), ValueError)):
            with pytest.raises(error, match="timeout_s must be"):
                telemetry.force_flush(timeout_s=bad)
            with pytest.raises(error, match="timeout_s must be"):
                telemetry.shutdown(timeout_s=bad)
        assert not telemetry.is_shutdown
        assert telemetry.shutdown(timeout_s=np.int64(2)) is True
    finally:
        telemetry.shutdown()

"""Host and process metrics: the selection, the torchrun rule, the variables, the lifecycle, and the documented queries."""

from __future__ import annotations

import enum
import inspect
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.semconv._incubating.attributes import (
    cpu_attributes,
    disk_attributes,
    network_attributes,
    system_attributes,
)
from opentelemetry.semconv._incubating.metrics import process_metrics, system_metrics

from openlora_otel import ConfigError, TelemetryConfig, setup_telemetry
from openlora_otel.hardware import host
from openlora_otel.hardware.host import (
    NOT_LINK,
    NOT_STORAGE,
    PROCESS_SELECTION,
    SCOPE_NAME,
    SYSTEM_SELECTION,
    start_host_metrics,
)
from openlora_otel.hardware.procfs import open_procfs
from openlora_otel.names import HOST_ATTRIBUTES, HOST_METRICS
from tests.support import docs_text
from tests.support.host_sources import Recorded
from tests.support.processes import child_env, free_port
from tests.support.readings import points

ROOT = Path(__file__).resolve().parents[2]
HOST_PAGE = "docs/reference/host-metrics.md"  # the page that describes the host metrics
SYSTEM_NAMES = {spec.name for spec in HOST_METRICS if spec.name.startswith("system.")}
PROCESS_NAMES = {spec.name for spec in HOST_METRICS if spec.name.startswith("process.")}


def host_metrics(data: MetricsData | None) -> dict[str, object]:
    """name -> metric of the host metrics' scope in ``data``."""
    found = {}
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            if scope_metrics.scope.name == SCOPE_NAME:
                for metric in scope_metrics.metrics:
                    found[metric.name] = metric
    return found


def collect(env: dict[str, str] | None = None) -> tuple[dict[str, object], object]:
    """Set up with ``env`` and an in-memory reader; the host metrics of one collection, and the handle (shut down)."""
    reader = InMemoryMetricReader()
    config = TelemetryConfig.from_env(
        {"OTEL_METRICS_EXPORTER": "none", "OPENLORA_QUIET": "true", **(env or {})}
    )
    telemetry = setup_telemetry(config=config, metric_readers=[reader])
    # CPU shares need the CPU counters (10 ms ticks) to move past the reading taken at setup.
    time.sleep(0.05)
    try:
        return host_metrics(reader.get_metrics_data()), telemetry.host
    finally:
        telemetry.shutdown()


def real_source() -> object:
    """What setup_telemetry() reads here: /proc on Linux, psutil elsewhere."""
    return host._source()


@pytest.fixture(params=["procfs", "psutil"])
def source(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each source in turn, as setup_telemetry() would have chosen it (procfs on Linux only)."""
    if request.param == "procfs":
        if not sys.platform.startswith("linux"):
            pytest.skip("/proc is Linux's")
        monkeypatch.setattr(host, "_source", open_procfs)
    else:
        monkeypatch.setattr(host, "_source", lambda: host.PsutilSource(psutil))
    return request.param


def _links() -> list[str]:
    return [nic for nic in psutil.net_io_counters(pernic=True) if not NOT_LINK.match(nic)]


def test_setup_reads_proc_on_linux_and_psutil_elsewhere() -> None:
    _, handle = collect()
    assert handle.source == ("procfs" if sys.platform.startswith("linux") else "psutil")
    assert "source=" + handle.source in repr(handle)


def test_default_selection_reports_the_documented_names_kinds_and_units(source: str) -> None:
    found, handle = collect()
    assert handle.source == source
    assert set(found) == SYSTEM_NAMES | PROCESS_NAMES
    assert handle is not None and handle.system
    for spec in HOST_METRICS:
        metric = found[spec.name]
        kind = type(metric.data).__name__
        if spec.kind == "gauge":
            assert kind == "Gauge", spec.name
        else:
            assert kind == "Sum" and metric.data.is_monotonic == (spec.kind == "counter"), spec.name
        assert metric.unit == spec.unit, spec.name
    cpus = found["system.cpu.utilization"].data.data_points
    assert {p.attributes["cpu.mode"] for p in cpus} == {"idle"}
    # Numbered from 0 (the package numbered them from 1): cpuN of /proc/stat, psutil's position in its list.
    numbers = sorted(p.attributes["cpu.logical_number"] for p in cpus)
    assert len(set(numbers)) == len(numbers) == len(psutil.cpu_times(percpu=True)) and numbers[0] >= 0
    assert [p.attributes for p in found["system.memory.usage"].data.data_points] == [{"system.memory.state": "used"}]
    assert [p.attributes for p in found["system.memory.linux.available"].data.data_points] == [{}]
    assert {p.attributes["cpu.mode"] for p in found["process.cpu.time"].data.data_points} == {"user", "system"}
    assert {
        (p.attributes["system.device"], p.attributes["disk.io.direction"])
        for p in found["system.disk.io"].data.data_points
    } == {(disk, direction) for disk in _storage_devices() for direction in ("read", "write")}
    assert {
        (p.attributes["network.interface.name"], p.attributes["network.io.direction"])
        for p in found["system.network.io"].data.data_points
    } == {(nic, direction) for nic in _links() for direction in ("receive", "transmit")}
    assert {p.attributes["disk.io.direction"] for p in found["process.disk.io"].data.data_points} == {"read", "write"}
    assert [p.attributes for p in found["process.memory.usage"].data.data_points] == [{}]


# What the semantic conventions allow on each metric we emit: its attribute keys (the constants of
# opentelemetry.semconv._incubating.attributes) and, for the enumerated ones, the enum of their values.
SEMCONV_ATTRIBUTES: dict[str, dict[str, type[enum.Enum] | None]] = {
    system_metrics.SYSTEM_CPU_UTILIZATION: {
        cpu_attributes.CPU_LOGICAL_NUMBER: None,
        cpu_attributes.CPU_MODE: cpu_attributes.CpuModeValues,
    },
    system_metrics.SYSTEM_MEMORY_USAGE: {system_attributes.SYSTEM_MEMORY_STATE: system_attributes.SystemMemoryStateValues},
    system_metrics.SYSTEM_MEMORY_LINUX_AVAILABLE: {},
    system_metrics.SYSTEM_DISK_IO: {
        system_attributes.SYSTEM_DEVICE: None,
        disk_attributes.DISK_IO_DIRECTION: disk_attributes.DiskIoDirectionValues,
    },
    system_metrics.SYSTEM_NETWORK_IO: {
        network_attributes.NETWORK_INTERFACE_NAME: None,
        network_attributes.NETWORK_IO_DIRECTION: network_attributes.NetworkIoDirectionValues,
    },
    process_metrics.PROCESS_CPU_TIME: {cpu_attributes.CPU_MODE: cpu_attributes.CpuModeValues},
    process_metrics.PROCESS_MEMORY_USAGE: {},
    process_metrics.PROCESS_DISK_IO: {disk_attributes.DISK_IO_DIRECTION: disk_attributes.DiskIoDirectionValues},
}


def semconv_instrument(name: str) -> tuple[str, str]:
    """(kind, unit) of metric ``name`` as the semconv package's ``create_*`` function creates it on a test meter."""
    module = system_metrics if name.startswith("system.") else process_metrics
    create = getattr(module, "create_" + name.replace(".", "_"))
    meter = MeterProvider().get_meter("semconv-check")
    instrument = create(meter, None) if "callbacks" in inspect.signature(create).parameters else create(meter)
    kinds = [
        ((metrics.Counter, metrics.ObservableCounter), "counter"),
        ((metrics.UpDownCounter, metrics.ObservableUpDownCounter), "updowncounter"),
        ((metrics.ObservableGauge, metrics._Gauge), "gauge"),
        ((metrics.Histogram,), "histogram"),
    ]
    kind = next(kind for classes, kind in kinds if isinstance(instrument, classes))
    assert instrument.name == name
    return kind, instrument.unit


def test_every_metric_has_the_name_kind_unit_and_attributes_of_the_semantic_conventions() -> None:
    found, _ = collect()
    assert set(found) == {spec.name for spec in HOST_METRICS} == set(SEMCONV_ATTRIBUTES) == set(HOST_ATTRIBUTES)
    for spec in HOST_METRICS:
        kind, unit = semconv_instrument(spec.name)
        assert (spec.kind, spec.unit) == (kind, unit), spec.name
        metric = found[spec.name]
        assert metric.unit == unit, spec.name
        data = type(metric.data).__name__
        assert (data, getattr(metric.data, "is_monotonic", None)) == {
            "gauge": ("Gauge", None),
            "counter": ("Sum", True),
            "updowncounter": ("Sum", False),
        }[kind], spec.name
        allowed = SEMCONV_ATTRIBUTES[spec.name]
        assert set(HOST_ATTRIBUTES[spec.name]) <= set(allowed), spec.name
        for point in metric.data.data_points:
            assert set(point.attributes) == set(HOST_ATTRIBUTES[spec.name]), spec.name
            for key, value in point.attributes.items():
                values = allowed[key]
                assert values is None or value in {member.value for member in values}, (spec.name, key, value)
    assert all(isinstance(p.attributes["cpu.logical_number"], int) for p in found["system.cpu.utilization"].data.data_points)


def test_the_pull_endpoint_writes_the_dotted_keys_as_labels_with_underscores() -> None:
    """opentelemetry-exporter-prometheus: `cpu.mode` -> `cpu_mode`; UpDownCounters are gauges there."""
    import urllib.request

    telemetry = setup_telemetry(
        config=TelemetryConfig.from_env(
            {
                "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(free_port()),
                "OPENLORA_PROMETHEUS_PORT_OFFSET": "none",
                "OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT": "0",
                "OPENLORA_GPU_METRICS": "off",
                "OPENLORA_QUIET": "true",
            }
        )
    )
    try:
        time.sleep(0.05)  # past the CPU reading setup took (see collect)
        with urllib.request.urlopen(telemetry.prometheus_url, timeout=10) as response:
            body = response.read().decode()
    finally:
        telemetry.shutdown()
    assert re.search(r'^system_cpu_utilization\{.*cpu_logical_number="0".*cpu_mode="idle"', body, re.M)
    assert re.search(r'^system_memory_usage_bytes\{.*system_memory_state="used"', body, re.M)
    assert re.search(r'^system_disk_io_bytes_total\{.*disk_io_direction="read".*system_device="', body, re.M)
    assert re.search(r'^system_network_io_bytes_total\{.*network_interface_name="lo".*network_io_direction=', body, re.M)
    assert re.search(r'^process_cpu_time_seconds_total\{.*cpu_mode="user"', body, re.M)
    for name in ("system_memory_usage_bytes", "system_memory_linux_available_bytes", "process_memory_usage_bytes"):
        assert f"# TYPE {name} gauge" in body, name
    for spec in HOST_METRICS:
        assert f"# TYPE {spec.prometheus} " in body, spec.name


def _storage_devices() -> list[str]:
    return [disk for disk in psutil.disk_io_counters(perdisk=True) if not NOT_STORAGE.match(disk)]


def test_disks_are_the_storage_devices_node_exporter_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # node_exporter's default device-exclude: RAM, compressed-RAM, loop and floppy devices, and the
    # partitions of whole disks (counted again on the disk); device-mapper and md devices stay.
    names = ["loop0", "loop12", "ram0", "zram0", "fd0", "sda", "sda1", "sdab", "sdab3", "vda", "vda15", "xvda",
             "xvda1", "hda", "hda2", "nvme0n1", "nvme0n1p1", "nvme12n1", "nvme12n1p15", "dm-0", "md127", "sr0"]  # fmt: skip
    scripted = Recorded(real_source(), disks=lambda: dict.fromkeys(names, (3, 4)))
    monkeypatch.setattr(host, "_source", lambda: scripted)
    found, _ = collect()
    devices = {p.attributes["system.device"] for p in found["system.disk.io"].data.data_points}
    assert devices == {"sda", "sdab", "vda", "xvda", "hda", "nvme0n1", "nvme12n1", "dm-0", "md127", "sr0"}


def test_interfaces_are_the_nodes_own_links(monkeypatch: pytest.MonkeyPatch) -> None:
    # Containers' veth pairs (Calico's cali*, Cilium's lxc*) and docker bridges (their traffic is counted
    # again on the node's own interface) and ifb mirrors are left out, as the dashboards' queries leave
    # them out; loopback stays.
    names = ["lo", "eth0", "ens5", "ib0", "bond0", "veth1a2b3c", "cali12ab34cd56e", "lxc9f8e7d", "docker0",
             "br-0f1e2d", "ifb0", "cni0", "tailscale0"]  # fmt: skip
    scripted = Recorded(real_source(), interfaces=lambda: dict.fromkeys(names, (5, 6)))
    monkeypatch.setattr(host, "_source", lambda: scripted)
    found, _ = collect()
    interfaces = {p.attributes["network.interface.name"] for p in found["system.network.io"].data.data_points}
    assert interfaces == {"lo", "eth0", "ens5", "ib0", "bond0", "cni0", "tailscale0"}


def test_memory_is_read_once_a_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = Recorded(real_source())
    monkeypatch.setattr(host, "_source", lambda: recorded)
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader])
    try:
        for collection in range(1, 4):
            data = reader.get_metrics_data()
            assert [method for method, _ in recorded.reads].count("memory") == collection
            (available,) = points(data, "system.memory.linux.available")
            (used,) = points(data, "system.memory.usage")
            assert abs(available.value + used.value - psutil.virtual_memory().total) < 0.001 * psutil.virtual_memory().total
    finally:
        telemetry.shutdown()


def test_series_count_is_the_documented_formula(source: str) -> None:
    found, _ = collect()
    cpus = psutil.cpu_count()
    disks = len(_storage_devices())
    nics = len(_links())
    counted = {name: len(metric.data.data_points) for name, metric in found.items()}
    assert counted == {
        "system.cpu.utilization": cpus,
        "system.memory.usage": 1,
        "system.memory.linux.available": 1,
        "system.disk.io": 2 * disks,
        "system.network.io": 2 * nics,
        "process.cpu.time": 2,
        "process.memory.usage": 1,
        "process.disk.io": 2,
    }
    section = docs_text.marked(HOST_PAGE, "host-metrics")
    assert "`C + 2 + 2D + 2N` system series" in section and "and 5 per process" in section


def test_values_are_this_process_and_this_node(source: str) -> None:
    found, _ = collect()
    used = found["system.memory.usage"].data.data_points[0].value
    available = found["system.memory.linux.available"].data.data_points[0].value
    total = psutil.virtual_memory().total
    assert abs(used + available - total) < 0.02 * total
    rss = found["process.memory.usage"].data.data_points[0].value
    assert 0.5 < rss / psutil.Process().memory_info().rss < 2.0
    for point in found["system.cpu.utilization"].data.data_points:
        assert 0.0 <= point.value <= 1.0
    cpu_user = {p.attributes["cpu.mode"]: p.value for p in found["process.cpu.time"].data.data_points}["user"]
    assert 0 < cpu_user <= psutil.Process().cpu_times().user + 0.5


@pytest.mark.parametrize("value", ["false", "FALSE", "False"])
def test_the_variable_turns_them_off(value: str) -> None:
    found, handle = collect({"OPENLORA_HOST_METRICS": value})
    assert found == {} and handle is None


@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [
        ("OPENLORA_HOST_METRICS", "off", "`true` or `false`"),
        ("OPENLORA_HOST_METRICS", "1", "`true` or `false`"),
        ("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", "system.network.io process.*", "glob patterns"),
    ],
)
def test_a_bad_value_fails_at_setup(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, accepted: str
) -> None:
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    with pytest.raises(ConfigError) as info:
        setup_telemetry()
    assert info.value.variable == variable
    assert str(info.value).startswith(f"{variable}={value!r} is not valid")
    assert accepted in str(info.value)


def test_local_rank_1_reports_process_series_only() -> None:
    found, handle = collect({"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"})
    assert set(found) == PROCESS_NAMES
    assert handle is not None and not handle.system


def test_local_rank_0_reports_both() -> None:
    found, handle = collect({"LOCAL_RANK": "0", "RANK": "8", "WORLD_SIZE": "16"})
    assert set(found) == SYSTEM_NAMES | PROCESS_NAMES and handle.system


def test_the_packages_exclusion_variable_is_honoured() -> None:
    found, handle = collect(
        {"OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS": " system.network.* ,process.disk.io,"}
    )
    assert set(found) == (SYSTEM_NAMES | PROCESS_NAMES) - {"system.network.io", "process.disk.io"}
    assert "system.network.io" not in handle.metrics
    everything, handle = collect({"OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS": "*"})
    assert everything == {} and handle is None


@pytest.mark.parametrize(
    ("patterns", "left_out"),
    [
        ("system.*", set(SYSTEM_SELECTION)),
        ("*.io", {"system.disk.io", "system.network.io", "process.disk.io"}),
        ("process.memory.*,system.cpu.?tilization", {"process.memory.usage", "system.cpu.utilization"}),
        ("[ps]*.disk.io", {"system.disk.io", "process.disk.io"}),
        ("system.memory.*", {"system.memory.usage", "system.memory.linux.available"}),
        ("system.memory.usage", {"system.memory.usage"}),
    ],
)
def test_exclusion_matches_as_the_package_matched(patterns: str, left_out: set[str]) -> None:
    # The rule opentelemetry-instrumentation-system-metrics gave its variable: fnmatch globs over the
    # metric names, a comma list; a glob matches whole names only (system.memory.usage is not .*available).
    ours = {**SYSTEM_SELECTION, **PROCESS_SELECTION}
    config = TelemetryConfig.from_env({"OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS": patterns})
    kept_by_us = set(host.selection(system=True, excluded=config.host_metrics_excluded))
    assert kept_by_us == set(ours) - left_out


def test_a_second_setup_in_the_process_reports_on_its_own_provider() -> None:
    first, first_handle = collect()
    assert set(first) == SYSTEM_NAMES | PROCESS_NAMES and not first_handle.running
    first_provider = metrics.get_meter_provider()
    reader = InMemoryMetricReader()
    second = setup_telemetry(config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader])
    try:
        # The API sets the global provider once: the first, shut down, stays global. The
        # instruments must go on the second one, passed explicitly.
        assert metrics.get_meter_provider() is first_provider is not second.meter_provider
        time.sleep(0.05)  # past the CPU reading setup took (see collect)
        assert set(host_metrics(reader.get_metrics_data())) == SYSTEM_NAMES | PROCESS_NAMES
    finally:
        second.shutdown()
    third, third_handle = collect({"LOCAL_RANK": "3"})
    assert set(third) == PROCESS_NAMES and not third_handle.system


def test_shutdown_stops_the_host_metrics() -> None:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
    )
    assert telemetry.host is not None and telemetry.host.running
    telemetry.shutdown()
    assert not telemetry.host.running
    telemetry.shutdown()  # idempotent


def test_stop_leaves_the_instruments_observing_nothing() -> None:
    """The SDK cannot take an observable instrument off a provider: a stopped handle's callbacks read nothing."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        handle = start_host_metrics(provider, excluded=["system.cpu.*"])
        assert set(host_metrics(reader.get_metrics_data())) == (SYSTEM_NAMES | PROCESS_NAMES) - {
            "system.cpu.utilization"
        }
        handle.stop()
        handle.stop()  # idempotent
        assert not handle.running and host_metrics(reader.get_metrics_data()) == {}
    finally:
        provider.shutdown()


def test_a_provider_we_do_not_own_gets_none(caplog: pytest.LogCaptureFixture) -> None:
    theirs = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[theirs])
    metrics.set_meter_provider(provider)
    with caplog.at_level(logging.INFO, logger="openlora_otel"):
        telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), quiet=True))
    try:
        assert not telemetry.owns_provider and telemetry.host is None
        assert host_metrics(theirs.get_metrics_data()) == {}
        assert "host metrics are not added to a MeterProvider openlora-otel does not own" in caplog.text
    finally:
        telemetry.shutdown()
        provider.shutdown()


def test_an_instrumentor_someone_else_started_is_left_alone() -> None:
    """opentelemetry-instrumentation-system-metrics, no longer ours, may still run (the application, on its
    provider): both report, each on its own provider under its own scope, neither touching the other."""
    package = pytest.importorskip("opentelemetry.instrumentation.system_metrics")
    theirs = InMemoryMetricReader()
    their_provider = MeterProvider(metric_readers=[theirs])
    their_config = {"process.memory.usage": None}
    instrumentor = package.SystemMetricsInstrumentor(config=their_config)
    instrumentor.instrument(meter_provider=their_provider)
    try:
        found, handle = collect()
        assert set(found) == SYSTEM_NAMES | PROCESS_NAMES and handle is not None
        assert instrumentor._config is their_config and instrumentor.is_instrumented_by_opentelemetry
        their_scopes = {
            (scope_metrics.scope.name, metric.name)
            for resource_metrics in theirs.get_metrics_data().resource_metrics
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
        }
        assert their_scopes == {("opentelemetry.instrumentation.system_metrics", "process.memory.usage")}
    finally:
        instrumentor.uninstrument()
        their_provider.shutdown()


def test_without_psutil_one_warning_and_no_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setattr(host, "_LINUX", False)  # where psutil is the only source
    monkeypatch.setattr(host, "_missing_warned", False)
    with caplog.at_level(logging.WARNING, logger="openlora_otel"):
        for _ in range(2):
            reader = InMemoryMetricReader()
            telemetry = setup_telemetry(
                config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
            )
            telemetry.training.record_step(loss=1.0, tokens=4)
            data = reader.get_metrics_data()
            assert telemetry.host is None and host_metrics(data) == {}
            assert points(data, "openlora.training.tokens")
            telemetry.shutdown()
    warnings = [r for r in caplog.records if "host metrics off" in r.getMessage()]
    assert len(warnings) == 1 and "pip install psutil" in warnings[0].getMessage()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_on_linux_they_need_no_psutil(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)
    with caplog.at_level(logging.WARNING, logger="openlora_otel"):
        found, handle = collect()
    assert set(found) == SYSTEM_NAMES | PROCESS_NAMES and handle.source == "procfs"
    assert "host metrics off" not in caplog.text


def test_a_failing_start_leaves_telemetry_working(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise OSError("cannot read /proc/stat")

    broken_source = Recorded(real_source(), cpu_times=broken)  # the first CPU reading is taken at start
    monkeypatch.setattr(host, "_source", lambda: broken_source)
    reader = InMemoryMetricReader()
    with caplog.at_level(logging.WARNING, logger="openlora_otel"):
        telemetry = setup_telemetry(
            config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
        )
    telemetry.training.record_step(loss=1.0)
    assert telemetry.host is None and points(reader.get_metrics_data(), "openlora.training.loss")
    assert "host metrics off: starting them failed" in caplog.text
    telemetry.shutdown()


def test_every_read_is_on_the_collecting_thread_only(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = Recorded(host._source())
    monkeypatch.setattr(host, "_source", lambda: recorded)
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
    )
    # Setup took the first CPU-times reading, the base of the first collection's shares.
    assert recorded.reads == [("cpu_times", threading.current_thread().name)]
    recorded.reads.clear()
    try:
        for _ in range(200):
            telemetry.training.record_step(loss=1.0, tokens=4, step_time_s=0.01)
        assert recorded.reads == []
        collector = threading.Thread(target=reader.get_metrics_data, name="collector")
        collector.start()
        collector.join(30)
        assert {method for method, _ in recorded.reads} == {
            "cpu_times", "memory", "disks", "interfaces", "process_memory", "process_io"
        }  # fmt: skip
        assert {thread for _, thread in recorded.reads} == {"collector"}
    finally:
        telemetry.shutdown()


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")


def _cpu(user: float, idle: float, guest: float = 0.0) -> tuple[float, ...]:
    return (user, 0.0, 0.0, idle, 0.0, 0.0, 0.0, 0.0, guest, 0.0)


def _cpus(*times: tuple[float, ...]) -> tuple[tuple[str, ...], dict[int, tuple[float, ...]]]:
    return CPU_FIELDS, dict(enumerate(times))


def test_cpu_utilization_covers_the_time_since_the_previous_collection_whichever_thread_collects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil 7's cpu_times_percent keeps its previous reading per thread: a scrape on a new thread
    (every scrape of the pull endpoint) read every CPU 0 % idle. The shares come from one reading
    to the next, whichever thread takes them; the first from the reading taken at setup."""
    readings = [
        _cpus(_cpu(100, 100, guest=5), _cpu(50, 50)),  # at setup
        _cpus(_cpu(140, 160, guest=15), _cpu(150, 50)),  # cpu 0: 60 idle of 100 (guest is in user); cpu 1: busy
        _cpus(_cpu(140, 160, guest=15), _cpu(150, 150)),  # cpu 0 did not move: repeats; cpu 1: all idle
    ]
    calls: list[str] = []

    def cpu_times() -> tuple[tuple[str, ...], dict[int, tuple[float, ...]]]:
        calls.append(threading.current_thread().name)
        return readings[min(len(calls), len(readings)) - 1]

    scripted = Recorded(real_source(), cpu_times=cpu_times)
    monkeypatch.setattr(host, "_source", lambda: scripted)
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader])
    try:
        seen = []
        for name in ("scrape-1", "scrape-2"):  # a new thread each time, as the pull endpoint's scrapes
            result: list[MetricsData] = []
            thread = threading.Thread(target=lambda out=result: out.append(reader.get_metrics_data()), name=name)
            thread.start()
            thread.join(30)
            points = host_metrics(result[0])["system.cpu.utilization"].data.data_points
            seen.append({(p.attributes["cpu.logical_number"], p.attributes["cpu.mode"]): p.value for p in points})
    finally:
        telemetry.shutdown()
    assert calls == [threading.current_thread().name, "scrape-1", "scrape-2"]
    assert seen[0] == {(0, "idle"): pytest.approx(0.6), (1, "idle"): 0.0}
    assert seen[1] == {(0, "idle"): pytest.approx(0.6), (1, "idle"): 1.0}


def test_cpu_idle_has_no_value_before_a_cpu_moved() -> None:
    readings = iter([_cpus(_cpu(10, 10)), _cpus(_cpu(10, 10)), _cpus(_cpu(10, 30))])
    idle = host.CpuIdle(["idle", "user"], lambda: next(readings))
    assert list(idle()) == []  # within one clock tick of the first reading: nothing measured yet
    assert {(o.attributes["cpu.mode"], o.value) for o in idle()} == {("idle", 1.0), ("user", 0.0)}


def test_cpu_idle_reports_nothing_for_the_interval_in_which_a_cpu_went_offline() -> None:
    readings = iter([_cpus(_cpu(10, 10), _cpu(10, 10)), _cpus(_cpu(20, 30)), _cpus(_cpu(30, 30))])
    idle = host.CpuIdle(["idle"], lambda: next(readings))
    assert list(idle()) == []  # two CPUs, then one: that interval is not measured
    assert [(o.attributes["cpu.logical_number"], o.value) for o in idle()] == [(0, 0.0)]


def test_cpu_idle_numbers_cpus_as_the_source_does() -> None:
    # /proc/stat names each online CPU (cpu0, cpu2 with cpu1 offline): the number is the CPU's, not a position.
    readings = iter([(CPU_FIELDS, {0: _cpu(10, 10), 2: _cpu(10, 10)}), (CPU_FIELDS, {0: _cpu(20, 10), 2: _cpu(10, 30)})])
    idle = host.CpuIdle(["idle"], lambda: next(readings))
    assert {o.attributes["cpu.logical_number"]: o.value for o in idle()} == {0: 0.0, 2: 1.0}


def test_cpu_idle_takes_the_fields_an_older_kernel_has() -> None:
    # Before guest_nice (Linux 2.6.33) /proc/stat has nine columns; before steal, seven.
    fields = CPU_FIELDS[:7]
    readings = iter([(fields, {0: (10, 0, 0, 10, 0, 0, 0)}), (fields, {0: (20, 0, 0, 40, 0, 0, 0)})])
    idle = host.CpuIdle(["idle", "steal"], lambda: next(readings))
    assert [(o.attributes["cpu.mode"], o.value) for o in idle()] == [("idle", 0.75)]


@pytest.mark.process
def test_import_does_not_load_the_host_module_and_setup_never_loads_the_package() -> None:
    # psutil itself is not ours to keep out: opentelemetry.sdk.resources imports it when installed.
    code = """
import sys
import openlora_otel
from openlora_otel import TelemetryConfig, setup_telemetry
loaded = lambda: sorted(m for m in sys.modules if m.startswith(("opentelemetry.instrumentation", "wrapt")))
assert loaded() == [] and "openlora_otel.hardware.host" not in sys.modules, loaded()
t = setup_telemetry(config=TelemetryConfig(exporters=("none",), host_metrics=False, quiet=True))
t.shutdown()
assert loaded() == [] and "openlora_otel.hardware.host" not in sys.modules, loaded()
t = setup_telemetry(config=TelemetryConfig(exporters=("none",), quiet=True))
assert t.host is not None and t.host.running
t.shutdown()
assert loaded() == [] and "openlora_otel.hardware.host" in sys.modules, loaded()
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- the documentation ---------------------------------------------------------


def docs_queries() -> list[str]:
    block = docs_text.fenced(HOST_PAGE, "host-queries", "promql")
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_docs_section_names_both_paths() -> None:
    section = docs_text.marked(HOST_PAGE, "host-metrics")
    for spec in HOST_METRICS:
        row = next(line for line in section.splitlines() if line.startswith(f"| `{spec.name}` |"))
        assert f"`{spec.prometheus}`" in row, spec.name
        collector = spec.prometheus_collector
        assert (f"`{collector}`" in row) if collector != spec.prometheus else ("| same |" in row), spec.name
    for variable in ("OPENLORA_HOST_METRICS", "OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", "LOCAL_RANK"):
        assert variable in section
    assert len(docs_queries()) >= 9


# -- a real Prometheus ---------------------------------------------------------

CHILD = """
import sys, threading, os
from openlora_otel import setup_telemetry
telemetry = setup_telemetry()
telemetry.training.record_step(loss=1.0, tokens=8, step_time_s=0.1)
print(telemetry.prometheus_url, flush=True)
threading.Timer(120, lambda: os._exit(3)).start()  # bounded even if the test dies
sys.stdin.read()
telemetry.shutdown()
os._exit(0)
"""


@pytest.mark.e2e
def test_prometheus_scrapes_the_documented_names_and_queries_return_data(tmp_path: Path) -> None:
    from tests.support.prometheus_server import Prometheus, prometheus_binary

    prometheus_binary()
    ports = {0: free_port(), 1: free_port()}
    children = []
    prometheus = None
    try:
        for local_rank, port in ports.items():
            env = child_env(
                OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
                OPENLORA_PROMETHEUS_PORT_OFFSET="none",
                OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
                OPENLORA_QUIET="true",
                OPENLORA_GPU_METRICS="off",
                LOCAL_RANK=str(local_rank),
                RANK=str(local_rank),
                WORLD_SIZE="2",
                OPENLORA_RUN_ID="host-e2e",
            )
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(child)
            assert child.stdout.readline().startswith(f"http://127.0.0.1:{port}/")
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}" for port in ports.values()])
        node, other = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"

        def instances_of(expr: str, expected: set[str], deadline: float) -> tuple[set[str], list[dict]]:
            """Poll (bounded) until ``expr`` has series from every expected instance; what it had last."""
            while True:
                result = prometheus.query(expr)
                found = {s["metric"].get("instance") for s in result}
                if found >= expected or time.monotonic() > deadline:
                    return found, result
                time.sleep(0.25)

        deadline = time.monotonic() + 30
        # Process series first, from both ranks: then both targets have been scraped, and the node's
        # series having only local rank 0's instance is the torchrun rule, not a scrape not yet made.
        for spec in sorted(HOST_METRICS, key=lambda spec: spec.name.startswith("system.")):
            expected = {node} if spec.name.startswith("system.") else {node, other}
            found, _ = instances_of(f"count by (instance) ({spec.prometheus})", expected, deadline)
            assert found == expected, spec.name
        # The exporter writes the conventions' dotted keys with underscores.
        labels = prometheus.query('system_cpu_utilization{cpu_mode="idle", cpu_logical_number="0"}')[0]["metric"]
        assert labels["otel_scope_name"] == SCOPE_NAME
        labels = prometheus.query("system_memory_usage_bytes")[0]["metric"]
        assert labels["system_memory_state"] == "used"
        labels = prometheus.query('system_network_io_bytes_total{network_interface_name="lo"}')[0]["metric"]
        assert labels["network_io_direction"] in {"receive", "transmit"}

        deadline = time.monotonic() + 30
        for query in docs_queries():
            expected = {node} if "system_" in query else {node, other}
            found, result = instances_of(query.replace("$__rate_interval", "5s"), expected, deadline)
            assert found == expected, f"documented query answered for {found}, not {expected}: {query}"
            if "host_name" in query:
                assert all(s["metric"].get("host_name") for s in result)
    finally:
        for child in children:
            try:
                child.stdin.close()
                child.wait(timeout=15)
            except Exception:
                child.kill()
                child.wait(timeout=5)
        if prometheus is not None:
            prometheus.stop()

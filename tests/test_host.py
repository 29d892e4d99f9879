"""Host and process metrics: the selection, the torchrun rule, the variables, the lifecycle, and the README's queries."""

from __future__ import annotations

import collections
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
from opentelemetry.instrumentation.system_metrics import SystemMetricsInstrumentor, _build_default_config
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData

from openlora_otel import ConfigError, TelemetryConfig, setup_telemetry
from openlora_otel.hardware import host
from openlora_otel.hardware.host import HOST_METRICS, PROCESS_SELECTION, SCOPE_NAME, SYSTEM_SELECTION
from tests.support.processes import child_env, free_port
from tests.support.readings import points

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SYSTEM_NAMES = {spec.name for spec in HOST_METRICS if spec.name.startswith("system.")}
PROCESS_NAMES = {spec.name for spec in HOST_METRICS if spec.name.startswith("process.")}


@pytest.fixture(autouse=True)
def instrumentor_released():
    """No test leaves the package's process-wide instrumentor marked as running."""
    yield
    running = getattr(SystemMetricsInstrumentor, "_instance", None)
    if running is not None and running.is_instrumented_by_opentelemetry:
        running.uninstrument()
        pytest.fail("SystemMetricsInstrumentor left instrumented")


def host_metrics(data: MetricsData | None) -> dict[str, object]:
    """name -> metric of the package's scope in ``data``."""
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


def test_default_selection_reports_the_documented_names_kinds_and_units() -> None:
    found, handle = collect()
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
    assert {p.attributes["state"] for p in found["system.cpu.utilization"].data.data_points} == {"idle"}
    assert {p.attributes["state"] for p in found["system.memory.usage"].data.data_points} == {
        "used",
        "available",
    }
    assert {p.attributes["type"] for p in found["process.cpu.time"].data.data_points} == {"user", "system"}


def test_series_count_is_the_documented_formula() -> None:
    found, _ = collect()
    cpus = psutil.cpu_count()
    disks = len(psutil.disk_io_counters(perdisk=True))
    nics = len(psutil.net_io_counters(pernic=True))
    counted = {name: len(metric.data.data_points) for name, metric in found.items()}
    assert counted == {
        "system.cpu.utilization": cpus,
        "system.memory.usage": 2,
        "system.disk.io": 2 * disks,
        "system.network.io": 2 * nics,
        "process.cpu.time": 2,
        "process.memory.usage": 1,
        "process.disk.io": 2,
    }
    assert "`C + 2 + 2D + 2N` system series" in README and "and 5 per\n  process" in README


def test_values_are_this_process_and_this_node() -> None:
    found, _ = collect()
    memory = {p.attributes["state"]: p.value for p in found["system.memory.usage"].data.data_points}
    total = psutil.virtual_memory().total
    assert abs(memory["used"] + memory["available"] - total) < 0.02 * total
    rss = found["process.memory.usage"].data.data_points[0].value
    assert 0.5 < rss / psutil.Process().memory_info().rss < 2.0
    for point in found["system.cpu.utilization"].data.data_points:
        assert 0.0 <= point.value <= 1.0
    cpu_user = {p.attributes["type"]: p.value for p in found["process.cpu.time"].data.data_points}["user"]
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
    "patterns", ["system.*", "*.io", "process.memory.*,system.cpu.?tilization", "[ps]*.disk.io"]
)
def test_exclusion_matches_as_the_package_matches(monkeypatch: pytest.MonkeyPatch, patterns: str) -> None:
    # The package's own reading of its variable, over its default set, decides each of our keys the same way.
    monkeypatch.setenv("OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", patterns)
    kept_by_package = set(_build_default_config())
    ours = {**SYSTEM_SELECTION, **PROCESS_SELECTION}
    config = TelemetryConfig.from_env({"OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS": patterns})
    kept_by_us = set(host.selection(system=True, excluded=config.host_metrics_excluded))
    assert kept_by_us == {name for name in ours if name in kept_by_package}
    assert kept_by_us != set(ours)


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


def test_shutdown_releases_the_instrumentor() -> None:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
    )
    assert SystemMetricsInstrumentor._instance.is_instrumented_by_opentelemetry
    telemetry.shutdown()
    assert not SystemMetricsInstrumentor._instance.is_instrumented_by_opentelemetry
    assert telemetry.host is not None and not telemetry.host.running
    telemetry.shutdown()  # idempotent


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


def test_an_instrumentor_someone_else_started_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    theirs = InMemoryMetricReader()
    their_provider = MeterProvider(metric_readers=[theirs])
    their_config = {"process.memory.usage": None}
    instrumentor = SystemMetricsInstrumentor(config=their_config)
    instrumentor.instrument(meter_provider=their_provider)
    try:
        reader = InMemoryMetricReader()
        with caplog.at_level(logging.INFO, logger="openlora_otel"):
            telemetry = setup_telemetry(
                config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
            )
        assert telemetry.host is None
        assert host_metrics(reader.get_metrics_data()) == {}
        assert "SystemMetricsInstrumentor already runs in this process" in caplog.text
        telemetry.shutdown()
        # Their configuration and their instrumentation are untouched by our setup and shutdown.
        assert instrumentor._config is their_config and instrumentor.is_instrumented_by_opentelemetry
        assert set(host_metrics(theirs.get_metrics_data())) == {"process.memory.usage"}
    finally:
        instrumentor.uninstrument()
        their_provider.shutdown()


def test_without_the_package_one_warning_and_no_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.instrumentation.system_metrics", None)
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
    assert len(warnings) == 1 and "opentelemetry-instrumentation-system-metrics" in warnings[0].getMessage()


def test_a_failing_start_leaves_telemetry_working(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self, **kwargs):
        raise OSError("psutil cannot read /proc")

    monkeypatch.setattr(SystemMetricsInstrumentor, "_instrument", broken)
    reader = InMemoryMetricReader()
    with caplog.at_level(logging.WARNING, logger="openlora_otel"):
        telemetry = setup_telemetry(
            config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
        )
    telemetry.training.record_step(loss=1.0)
    assert telemetry.host is None and points(reader.get_metrics_data(), "openlora.training.loss")
    assert "host metrics off: starting them failed" in caplog.text
    telemetry.shutdown()


def test_psutil_is_read_on_the_collecting_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    readers: list[str] = []
    for name in ("virtual_memory", "cpu_times", "disk_io_counters", "net_io_counters"):
        original = getattr(psutil, name)
        monkeypatch.setattr(
            psutil,
            name,
            lambda *a, _o=original, **k: (readers.append(threading.current_thread().name), _o(*a, **k))[1],
        )
    original_memory_info = psutil.Process.memory_info
    monkeypatch.setattr(
        psutil.Process,
        "memory_info",
        lambda self: (readers.append(threading.current_thread().name), original_memory_info(self))[1],
    )
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("none",), quiet=True), metric_readers=[reader]
    )
    readers.clear()  # setup took the first CPU-times reading, the base of the first collection's shares
    try:
        for _ in range(200):
            telemetry.training.record_step(loss=1.0, tokens=4, step_time_s=0.01)
        assert readers == []
        collector = threading.Thread(target=reader.get_metrics_data, name="collector")
        collector.start()
        collector.join(30)
        assert readers and set(readers) == {"collector"}
    finally:
        telemetry.shutdown()


CpuTimes = collections.namedtuple(
    "CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice"
)


def _cpu(user: float, idle: float, guest: float = 0.0) -> CpuTimes:
    return CpuTimes(user, 0.0, 0.0, idle, 0.0, 0.0, 0.0, 0.0, guest, 0.0)


def test_cpu_utilization_covers_the_time_since_the_previous_collection_whichever_thread_collects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil 7's cpu_times_percent keeps its previous reading per thread: a scrape on a new thread
    (every scrape of the pull endpoint) read every CPU 0 % idle. The shares come from one reading
    to the next, whichever thread takes them; the first from the reading taken at setup."""
    readings = [
        [_cpu(100, 100, guest=5), _cpu(50, 50)],  # at setup
        [_cpu(140, 160, guest=15), _cpu(150, 50)],  # cpu 1: 60 idle of 100 (guest is in user); cpu 2: busy
        [_cpu(140, 160, guest=15), _cpu(150, 150)],  # cpu 1 did not move: repeats; cpu 2: all idle
    ]
    calls: list[str] = []

    def cpu_times(percpu: bool = False) -> list[CpuTimes]:
        assert percpu
        calls.append(threading.current_thread().name)
        return readings[min(len(calls), len(readings)) - 1]

    monkeypatch.setattr(psutil, "cpu_times", cpu_times)
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
            seen.append({(p.attributes["cpu"], p.attributes["state"]): p.value for p in points})
    finally:
        telemetry.shutdown()
    assert calls == [threading.current_thread().name, "scrape-1", "scrape-2"]
    assert seen[0] == {(1, "idle"): pytest.approx(0.6), (2, "idle"): 0.0}
    assert seen[1] == {(1, "idle"): pytest.approx(0.6), (2, "idle"): 1.0}


def test_cpu_idle_has_no_value_before_a_cpu_moved() -> None:
    readings = iter([[_cpu(10, 10)], [_cpu(10, 10)], [_cpu(10, 30)]])
    idle = host.CpuIdle(["idle", "user"], lambda percpu: next(readings))
    assert list(idle()) == []  # within one clock tick of the first reading: nothing measured yet
    assert {(o.attributes["state"], o.value) for o in idle()} == {("idle", 1.0), ("user", 0.0)}


def test_cpu_idle_reports_nothing_for_the_interval_in_which_a_cpu_went_offline() -> None:
    readings = iter([[_cpu(10, 10), _cpu(10, 10)], [_cpu(20, 30)], [_cpu(30, 30)]])
    idle = host.CpuIdle(["idle"], lambda percpu: next(readings))
    assert list(idle()) == []  # two CPUs, then one: positions no longer pair the same CPUs
    assert [(o.attributes["cpu"], o.value) for o in idle()] == [(1, 0.0)]


def test_shutdown_hands_the_instrumentor_back_with_its_own_cpu_callback() -> None:
    _, handle = collect()
    instrumentor = SystemMetricsInstrumentor()
    assert handle is not None and not handle.running
    assert "_get_system_cpu_utilization" not in vars(instrumentor)


@pytest.mark.process
def test_import_does_not_load_the_package() -> None:
    # psutil itself is not ours to keep out: opentelemetry.sdk.resources imports it when installed.
    code = """
import sys
import openlora_otel
from openlora_otel import TelemetryConfig, setup_telemetry
loaded = lambda: sorted(m for m in sys.modules if m.startswith(("opentelemetry.instrumentation", "wrapt")))
assert loaded() == [], loaded()
t = setup_telemetry(config=TelemetryConfig(exporters=("none",), host_metrics=False, quiet=True))
t.shutdown()
assert loaded() == [], loaded()
t = setup_telemetry(config=TelemetryConfig(exporters=("none",), quiet=True))
t.shutdown()
assert "opentelemetry.instrumentation.system_metrics" in sys.modules
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- README ------------------------------------------------------------------


def readme_section() -> str:
    start = README.index("## Host and process metrics\n")
    return README[start : README.index("\n## ", start + 1)]


def readme_queries() -> list[str]:
    match = re.search(
        r"<!-- host-queries:start -->\n```promql\n(.*?)\n```\n<!-- host-queries:end -->", README, re.S
    )
    assert match, "README has no host-queries block"
    return [line for line in match.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_section_follows_gpu_metrics_and_names_both_paths() -> None:
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[headings.index("GPU metrics") + 1] == "Host and process metrics"
    section = readme_section()
    for spec in HOST_METRICS:
        row = next(line for line in section.splitlines() if line.startswith(f"| `{spec.name}` |"))
        assert f"`{spec.prometheus}`" in row, spec.name
        collector = spec.prometheus_collector
        assert (f"`{collector}`" in row) if collector != spec.prometheus else ("| same |" in row), spec.name
    for variable in ("OPENLORA_HOST_METRICS", "OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS", "LOCAL_RANK"):
        assert variable in section
    assert len(readme_queries()) >= 9


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
def test_prometheus_scrapes_the_documented_names_and_the_readme_queries_return_data(tmp_path: Path) -> None:
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
        labels = prometheus.query('system_cpu_utilization{state="idle"}')[0]["metric"]
        assert labels["otel_scope_name"] == SCOPE_NAME and labels["cpu"] == "1"

        deadline = time.monotonic() + 30
        for query in readme_queries():
            expected = {node} if "system_" in query else {node, other}
            found, result = instances_of(query.replace("$__rate_interval", "5s"), expected, deadline)
            assert found == expected, f"README query answered for {found}, not {expected}: {query}"
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

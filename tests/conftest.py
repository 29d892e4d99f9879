"""Shared fixtures: a clean environment and OpenTelemetry globals per test, the tiers' check; the
helpers they share with the tests are in tests/support/."""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Iterator

import pytest
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel import telemetry as telemetry_module
from openlora_otel.training import arguments as arguments_module
from openlora_otel.training import collection as collection_module
from openlora_otel.training import goodput as goodput_module
from openlora_otel.training import metrics as training_module
from tests.support import (
    aiperf,  # noqa: F401 (reads OPENLORA_AIPERF before clean_env hides it)
    built,  # noqa: F401 (reads OPENLORA_BIN_DIR before clean_env hides it)
    real_parts,
)
from tests.support.clock import FakeClock
from tests.support.gpu import CLOCKED, SteppedTime
from tests.support.order import slow_first_rank
from tests.support.processes import LAUNCHER_VARIABLES, OWN_PREFIXES

# One OpenMP thread for torch here and in every child: on a loaded 2-core machine two spinning
# OpenMP threads made the demo about 100 times slower (141 tokens/s) and tests ran past their bounds.
# Set before any test imports torch; child_env() copies it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- tiers -------------------------------------------------------------------------------------
# `e2e`: the test starts a real server binary (Prometheus, Alertmanager, VictoriaMetrics, our
# Collectors, Thanos, Cortex, Chromium, the Kubernetes control plane and what runs against it).
# `process`: it starts any other child process (the demo, serve, torchrun, a fresh interpreter,
# promtool, amtool, a forked child, DataLoader workers). What is left is the fast tier, in-process
# only: pytest -m "not e2e and not process".
# The marks hold: a test (or a fixture it uses) that starts a process without the mark it needs fails,
# naming the mark. Counted: every subprocess.Popen whose caller is our code (this package's or the
# tests'), every os.fork, and every multiprocessing child (forked or spawned), whoever asks for it.
# Not counted: programs a library runs for itself through subprocess (a compiler probe, say).
_SERVERS = frozenset(
    {
        "prometheus",
        "prometheus-alertmanager",
        "alertmanager",
        "victoria-metrics",
        "vmalert",
        "otelcol-openlora",
        "otelcol-openlora-lb",
        "thanos",
        "cortex",
        "chromium",
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
        "prometheus-operator",
        "kube-state-metrics",
    }
)
_OURS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), part) + os.sep
    for part in ("tests", "benchmarks", "openlora_otel")
)
_running: list[pytest.Item | None] = [None]
_popen_init = subprocess.Popen.__init__
_fork = os.fork
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _launcher() -> str | None:
    """The file of the first frame outside subprocess.py that asked for a process, if it is ours."""
    import sys

    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == subprocess.__file__:
        frame = frame.f_back
    filename = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return filename if filename.startswith(_OURS) else None


def _require_mark(program: str) -> None:
    """Fail the running test if starting ``program`` needs a mark it does not have."""
    item = _running[0]
    if item is None:
        return
    marks = {mark.name for mark in item.iter_markers()}
    needed = "e2e" if program in _SERVERS else "process"
    if needed not in marks and not (needed == "process" and "e2e" in marks):
        raise RuntimeError(
            f"{item.nodeid} starts {program!r} without the `{needed}` mark (tests/conftest.py, tiers)"
        )


def _checked_popen_init(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
    if _running[0] is not None and _launcher() is not None:
        first = args[0] if isinstance(args, (list, tuple)) and args else args
        _require_mark(os.path.basename(os.fspath(first)).split()[0] if first else "")
    _popen_init(self, args, *rest, **kwargs)


def _checked_fork() -> int:
    _require_mark("a forked child")
    return _fork()


def _checked_spawnv_passfds(path, args, passfds):  # type: ignore[no-untyped-def]
    _require_mark("a multiprocessing child")
    return _spawnv_passfds(path, args, passfds)


subprocess.Popen.__init__ = _checked_popen_init  # type: ignore[method-assign]
os.fork = _checked_fork
multiprocessing.util.spawnv_passfds = _checked_spawnv_passfds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running[0] = item
    try:
        yield
    finally:
        _running[0] = None


# -- the real parts a machine lacks ------------------------------------------------------------
# A test that skips because a real part is missing (tests/support/real_parts.py: a Debian package,
# build/bin, .venv-aiperf) is counted by part after the run, with the one command that sets them all up.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    part = real_parts.part_of(call.excinfo)
    if report.skipped and part is not None:
        report.openlora_real_part = part  # a plain attribute: it travels with the report


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Iterator[None]:
    yield  # after the rest of the summary (the short test summary too), just above the counts' line
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        part = getattr(report, "openlora_real_part", None)
        if part is not None:
            counts[part] = counts.get(part, 0) + 1
    if not counts:
        return
    total = sum(counts.values())
    terminalreporter.write_sep("-", f"{total} skipped: real parts missing on this machine")
    width = len(str(max(counts.values())))
    for part in real_parts.PARTS:  # in the registry's order
        if part in counts:
            terminalreporter.write_line(f"{counts[part]:>{width}} need {real_parts.PARTS[part]}")
    terminalreporter.write_line(f"Set them all up with one command, then run the tests again: {real_parts.SETUP}")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with no OTEL_*/OPENLORA_*/torchrun variable set."""
    for name in list(os.environ):
        if name.startswith(OWN_PREFIXES) or name in LAUNCHER_VARIABLES:
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_sigterm_guard_in_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests never install the SIGTERM guard: a SIGTERM to pytest (CI's timeout) must stop
    pytest, not run a test's telemetry shutdown and exit 143. The guard is tested in subprocesses."""
    from openlora_otel.run.sigterm import SigtermGuard

    monkeypatch.setattr(SigtermGuard, "install", classmethod(lambda cls, *args, **kwargs: None))


@pytest.fixture(autouse=True)
def reset_otel_globals() -> Iterator[None]:
    """Give each test an unset global MeterProvider, and shut down what it left open."""
    _reset()
    yield
    owner = telemetry_module._global_owner
    if owner is not None:
        owner.shutdown(timeout_s=1.0)
    _reset()


def _reset() -> None:
    # The same reset the OpenTelemetry test utilities do: the API allows one set per process.
    metrics_internal._METER_PROVIDER_SET_ONCE = metrics_internal.Once()
    metrics_internal._METER_PROVIDER = None
    metrics_internal._PROXY_METER_PROVIDER = metrics_internal._ProxyMeterProvider()
    telemetry_module._global_owner = None


@pytest.fixture
def memory_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


# -- shared by the TrainingMetrics tests --------------------------------------------
@pytest.fixture
def setup(memory_reader: InMemoryMetricReader):
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    yield telemetry.training, memory_reader
    telemetry.shutdown()


@pytest.fixture
def defer_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors kept, folded and read back at collection as CUDA tensors are (the path of a GPU run,
    run where there is none): for the tests of that path and of its promise never to read on the step."""
    monkeypatch.setattr(arguments_module, "DEFER_CPU_TENSORS", True)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """One fake clock for the training metrics, their collection and their goodput clock (built after this fixture)."""
    fake = FakeClock()
    monkeypatch.setattr(training_module, "time", fake)
    monkeypatch.setattr(collection_module, "time", fake)
    monkeypatch.setattr(goodput_module, "time", fake)
    return fake


@pytest.fixture(params=["http/protobuf", "grpc"])
def receiver(request: pytest.FixtureRequest) -> Iterator[object]:
    """A real OTLP receiver on loopback, once per protocol (``receiver.protocol`` says which)."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from tests.support.otlp_receiver import GrpcReceiver, HttpReceiver

    server = HttpReceiver() if request.param == "http/protobuf" else GrpcReceiver()
    server.protocol = request.param  # type: ignore[attr-defined]
    yield server
    server.close()


# -- shared by the GPU tests ------------------------------------------------------------
@pytest.fixture
def stepped_time(monkeypatch: pytest.MonkeyPatch) -> SteppedTime:
    """The GPU snapshots' clock, stepped by ``collect`` (test_gpu and test_gpu_depth use it in every test)."""
    clock = SteppedTime()
    for module in CLOCKED:
        monkeypatch.setattr(module, "time", clock)
    return clock


@pytest.fixture
def collect(stepped_time: SteppedTime):
    """Collect as a reader would a scrape interval later (so a new snapshot is due)."""

    def run(reader: InMemoryMetricReader):
        stepped_time.offset += 1.0
        return reader.get_metrics_data()

    return run



# -- order -------------------------------------------------------------------------------------
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first (tests/support/order.py), the order kept within a file and among the rest."""
    items.sort(key=lambda item: slow_first_rank(item.nodeid))  # stable


"""Shared fixtures: a clean environment and OpenTelemetry globals per test, free ports, helpers."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel import telemetry as telemetry_module
from openlora_otel.training import metrics as training_module

# One OpenMP thread for torch here and in every child: on a loaded 2-core machine two spinning
# OpenMP threads made the demo about 100 times slower (141 tokens/s) and tests ran past their bounds.
# Set before any test imports torch; child_env() copies it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_OWN_PREFIXES = ("OTEL_", "OPENLORA_")
# Launcher variables (torchrun, torch.distributed's env://, Slurm) that decide ranks, ports and the run id.
_TORCHRUN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
)


# -- tiers -------------------------------------------------------------------------------------
# `e2e`: the test starts a real server binary (Prometheus, Alertmanager, VictoriaMetrics, Chromium).
# `process`: it starts any other child process (the demo, serve, torchrun, a fresh interpreter,
# promtool, amtool). What is left is the fast tier, in-process only: pytest -m "not e2e and not process".
# The marks hold: a test (or a fixture it uses) whose own code, or this package's, starts a process
# without the mark it needs fails, naming the mark. Processes libraries start for themselves are not
# counted.
_SERVERS = frozenset(
    {"prometheus", "prometheus-alertmanager", "alertmanager", "victoria-metrics", "vmalert", "chromium"}
)
_OURS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), part) + os.sep
    for part in ("tests", "benchmarks", "openlora_otel")
)
_running: list[pytest.Item | None] = [None]
_popen_init = subprocess.Popen.__init__


def _launcher() -> str | None:
    """The file of the first frame outside subprocess.py that asked for a process, if it is ours."""
    import sys

    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == subprocess.__file__:
        frame = frame.f_back
    filename = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return filename if filename.startswith(_OURS) else None


def _checked_popen_init(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
    item = _running[0]
    if item is not None and _launcher() is not None:
        first = args[0] if isinstance(args, (list, tuple)) and args else args
        program = os.path.basename(os.fspath(first)).split()[0] if first else ""
        marks = {mark.name for mark in item.iter_markers()}
        needed = "e2e" if program in _SERVERS else "process"
        if needed not in marks and not (needed == "process" and "e2e" in marks):
            raise RuntimeError(
                f"{item.nodeid} starts {program!r} without the `{needed}` mark (tests/conftest.py, tiers)"
            )
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _checked_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running[0] = item
    try:
        yield
    finally:
        _running[0] = None


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with no OTEL_*/OPENLORA_*/torchrun variable set."""
    for name in list(os.environ):
        if name.startswith(_OWN_PREFIXES) or name in _TORCHRUN:
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_sigterm_guard_in_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests never install the SIGTERM guard: a SIGTERM to pytest (CI's timeout) must stop
    pytest, not run a test's telemetry shutdown and exit 143. The guard is tested in subprocesses."""
    from openlora_otel.sigterm import SigtermGuard

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


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without our variables, plus ``extra``: for subprocesses under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OWN_PREFIXES) and k not in _TORCHRUN}
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def points(data: MetricsData | None, name: str) -> list:
    """All data points of the metric called ``name`` in ``data``."""
    found = []
    if data is None:
        return found
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


def value(data: MetricsData | None, name: str, **attributes: object) -> float | None:
    """The value of the one point of ``name`` whose attributes are exactly ``attributes`` (None if absent)."""
    found = [p for p in points(data, name) if dict(p.attributes) == attributes]
    return found[0].value if found else None


def served_series(url: str) -> set[str]:
    """Names of the series a Prometheus /metrics endpoint serves right now."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read().decode()
    return {
        line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")
    }


@pytest.fixture
def memory_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


# -- shared by the TrainingMetrics tests --------------------------------------------
@pytest.fixture
def setup(memory_reader: InMemoryMetricReader):
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    yield telemetry.training, memory_reader
    telemetry.shutdown()


WALL_OFFSET = 1_700_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:  # the wall clock: the same clock, some epoch seconds ahead
        return self.now + WALL_OFFSET

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(training_module, "time", fake)
    return fake


class SlowOnce:
    """An observable gauge whose first callback is slow, registered after the instruments under test.

    The SDK checks its collect deadline before each instrument's callback, so the
    instrument after it raises MetricsTimeoutError: the collection is aborted after
    the earlier callbacks ran, as a slow NVML call or a user's slow callback would do.
    """

    def __init__(self, meter, seconds: float = 0.3) -> None:
        self.left = 1
        self.seconds = seconds
        meter.create_observable_gauge("test.slow", callbacks=[self])
        meter.create_observable_gauge("test.after", callbacks=[lambda options: []])

    def __call__(self, options):
        if self.left:
            self.left -= 1
            time.sleep(self.seconds)
        return []


def reap(process: subprocess.Popen, timeout: float) -> None:
    """Wait up to ``timeout`` for a child to end, then kill it (bounded either way)."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


def wait_for_child(pid: int, timeout: float, what: str) -> int:
    """The exit code of forked child ``pid``; kills it and fails the test with ``what`` if it is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(what)


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

"""Host and process metrics (CPU, memory, disk and network I/O) through ``opentelemetry-instrumentation-system-metrics``.

The package measures (with psutil) and names the instruments under the
semantic conventions; this module only decides which of its metrics are on,
on which provider, and when they stop. Why it is built this way:

- **A bounded selection.** The package's default set has about thirty metrics,
  some per logical CPU and per state, some deprecated duplicates
  (``process.runtime.*``), one that walks every socket of the host
  (``system.network.connections``). :data:`SYSTEM_SELECTION` and
  :data:`PROCESS_SELECTION` keep what a training run needs; the README counts
  the series. ``OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS``, the package's
  own variable, is applied to this selection with the package's rule (fnmatch
  globs over the configuration keys): the package itself applies it only to its
  default set, never to a set handed in.
- **One node, one set of system series.** Every rank of a node sees the same
  CPUs, memory, disks and NICs: only the process with ``LOCAL_RANK`` 0 (or
  without ``LOCAL_RANK``) reports ``system.*``, every process its own ``process.*``.
- **Our provider.** The instruments go on the provider ``setup_telemetry()``
  built, passed explicitly: after a first setup was shut down, an earlier
  provider stays the global one, and the global one may be somebody else's.
- **Stopping.** The package's instrumentor is a process-wide singleton whose
  ``uninstrument()`` only clears its "instrumented" flag (the instruments stay
  on the meter and end with the provider's shutdown). :meth:`HostMetrics.stop`
  clears it, so that the next ``setup_telemetry()`` in the process can
  instrument its own provider. An instrumentor already started by someone else
  (``opentelemetry-instrument``, the application) is left alone and used as is.
- **CPU utilization from one previous reading.** The package's callback calls
  ``psutil.cpu_times_percent(percpu=True)``, which in psutil 7 keeps its previous
  reading per calling thread. The pull endpoint serves each scrape on a new
  thread, so each scrape measured an empty interval and reported every CPU 0 %
  idle: the node read 100 % busy. :class:`CpuIdle` replaces that one callback on
  the instrumentor with the same name, unit and attributes, computed from one
  process-wide previous ``psutil.cpu_times(percpu=True)`` reading taken first at
  start; the package keeps everything else.
- **Off the step path.** Every value is read by an observable callback, on the
  thread that collects: the scrape thread of the pull endpoint or the export
  thread of a push reader (``benchmarks/bench_host_metrics.py`` measures one
  collection).
- **Lazy and optional.** The package (and wrapt, which it brings) is imported
  by :func:`start_host_metrics` only (psutil is not ours to defer: the SDK's
  resource module imports it when installed); when the package or psutil is
  missing (an install with ``--no-deps``), host metrics are skipped with one warning.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from openlora_otel.names import MetricSpec

__all__ = [
    "HOST_METRICS",
    "PROCESS_SELECTION",
    "SCOPE_NAME",
    "SYSTEM_SELECTION",
    "HostMetrics",
    "reports_system",
    "selection",
    "start_host_metrics",
]

_logger = logging.getLogger(__name__)

# The meter (instrumentation scope) the package creates its instruments under.
SCOPE_NAME = "opentelemetry.instrumentation.system_metrics"

# Package configuration keys -> the states, directions or types observed (None: no breakdown).
# system.cpu.utilization is reported per logical CPU and state (224 CPUs on a large 8-GPU node):
# `idle` alone keeps it at one series a CPU, enough for busy (1 - idle) per node and per core.
# system.memory.usage: psutil's `used` is total - available (as `free` says), so the two add up to the total.
SYSTEM_SELECTION: Mapping[str, tuple[str, ...] | None] = {
    "system.cpu.utilization": ("idle",),
    "system.memory.usage": ("used", "available"),
    "system.disk.io": ("read", "write"),
    "system.network.io": ("transmit", "receive"),
}
PROCESS_SELECTION: Mapping[str, tuple[str, ...] | None] = {
    "process.cpu.time": ("user", "system"),
    "process.memory.usage": None,
    "process.disk.io": ("read", "write"),
}

# The instruments that selection creates, as the package names them (names.py's form, so the
# Prometheus names on both paths come from names.prometheus_name).
HOST_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "system.cpu.utilization",
        "gauge",
        "1",
        "Share of time each logical CPU (`cpu`, numbered from 1) spent idle (`state=idle`) since the "
        "previous collection, 0 to 1; busy is 1 minus it (iowait counts as busy). Node only (`LOCAL_RANK` 0).",
    ),
    MetricSpec(
        "system.memory.usage",
        "gauge",
        "By",
        "Node memory by `state`: `used` (total minus available) and `available`. Node only.",
    ),
    MetricSpec(
        "system.disk.io",
        "counter",
        "By",
        "Bytes read and written (`direction`) per block device (`device`, every line of "
        "/proc/diskstats: partitions and loop devices too). Node only.",
    ),
    MetricSpec(
        "system.network.io",
        "counter",
        "By",
        "Bytes received and transmitted (`direction`) per network interface (`device`, `lo` included). "
        "Node only.",
    ),
    MetricSpec(
        "process.cpu.time", "counter", "s", "CPU seconds of this process by `type` (`user`, `system`)."
    ),
    MetricSpec("process.memory.usage", "updowncounter", "By", "Resident set size (RSS) of this process."),
    MetricSpec(
        "process.disk.io",
        "counter",
        "By",
        "Bytes this process read from and wrote to storage (`direction`; page-cache hits not included).",
    ),
)

_missing_warned = False
_missing_lock = threading.Lock()


def reports_system(local_rank: object) -> bool:
    """Whether this process reports the node-wide ``system.*`` series: ``LOCAL_RANK`` 0 or none."""
    return not (isinstance(local_rank, int) and not isinstance(local_rank, bool) and local_rank != 0)


def selection(*, system: bool, excluded: Sequence[str] = ()) -> dict[str, list[str] | None]:
    """The package configuration to instrument with: our selection minus what ``excluded`` globs match."""
    chosen = {**(SYSTEM_SELECTION if system else {}), **PROCESS_SELECTION}
    return {
        name: list(states) if states is not None else None
        for name, states in chosen.items()
        if not any(fnmatch.fnmatch(name, pattern) for pattern in excluded)
    }


class CpuIdle:
    """``system.cpu.utilization`` from one process-wide previous reading, whichever thread collects.

    Each call measures the share of time per logical CPU (``cpu`` numbered from 1) in each of
    ``states`` since the previous call, in any thread (two readers, pull and push: each covers
    the time since the other one), or since construction for the first. The total is psutil's:
    every field of ``cpu_times``, less ``guest`` and ``guest_nice`` (Linux counts them in
    ``user`` and ``nice`` already). A CPU whose counters did not move (two calls within one
    clock tick) repeats its previous shares, or has none yet. psutil lists online CPUs only:
    when their number changed between two readings (a CPU taken off or on line), positions no
    longer pair the same CPUs, and that one collection reports nothing.
    """

    def __init__(self, states: Sequence[str], cpu_times: Any) -> None:
        self._states = tuple(states)
        self._cpu_times = cpu_times  # psutil.cpu_times, handed in so tests can script it
        self._lock = threading.Lock()
        self._previous = cpu_times(percpu=True)
        self._shares: dict[tuple[int, str], float] = {}

    def __call__(self, options: Any = None) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        observations = []
        with self._lock:
            current = self._cpu_times(percpu=True)
            previous, self._previous = self._previous, current
            if len(previous) != len(current):
                self._shares.clear()
                return observations
            for cpu, (before, after) in enumerate(zip(previous, current, strict=True), start=1):
                deltas = {field: max(getattr(after, field) - getattr(before, field), 0.0) for field in after._fields}
                total = sum(deltas.values()) - deltas.get("guest", 0.0) - deltas.get("guest_nice", 0.0)
                for state in self._states:
                    if state not in deltas:
                        continue
                    if total > 0:
                        self._shares[cpu, state] = min(deltas[state] / total, 1.0)
                    share = self._shares.get((cpu, state))
                    if share is not None:
                        observations.append(Observation(share, {"state": state, "cpu": cpu}))
        return observations


class HostMetrics:
    """What :func:`start_host_metrics` turned on; :meth:`stop` hands the package's instrumentor back."""

    def __init__(self, instrumentor: Any, metrics: tuple[str, ...], system: bool) -> None:
        self._instrumentor = instrumentor
        self._metrics = metrics
        self._system = system
        self._lock = threading.Lock()

    @property
    def metrics(self) -> tuple[str, ...]:
        """The package configuration keys instrumented (``system.cpu.utilization``, ``process.cpu.time``, ...)."""
        return self._metrics

    @property
    def system(self) -> bool:
        """True when this process reports the node-wide ``system.*`` series."""
        return self._system

    @property
    def running(self) -> bool:
        return self._instrumentor is not None

    def stop(self) -> None:
        """Mark the instrumentor uninstrumented so a later setup can start it again; idempotent, never raises."""
        with self._lock:
            instrumentor, self._instrumentor = self._instrumentor, None
        if instrumentor is None:
            return
        # The instrumentor is a process-wide singleton: hand it back with its own callback.
        instrumentor.__dict__.pop("_get_system_cpu_utilization", None)
        try:
            instrumentor.uninstrument()
        except Exception:  # pragma: no cover - the package's uninstrument only clears a flag
            _logger.debug("SystemMetricsInstrumentor.uninstrument failed", exc_info=True)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<HostMetrics {state} system={self._system} metrics={list(self._metrics)}>"


def start_host_metrics(
    meter_provider: Any, *, local_rank: object = None, excluded: Sequence[str] = ()
) -> HostMetrics | None:
    """Instrument ``meter_provider`` with the host and process selection; None when nothing was started.

    Nothing is started when every metric is excluded, when the package (or
    psutil) is not installed (one warning per process), or when its
    instrumentor is already running in this process (one info line: that one
    reports, with its own selection).
    """
    system = reports_system(local_rank)
    chosen = selection(system=system, excluded=excluded)
    if not chosen:
        _logger.info("host metrics: every metric is excluded by OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS")
        return None
    try:
        from opentelemetry.instrumentation.system_metrics import SystemMetricsInstrumentor
    except ImportError as exc:
        _warn_missing(exc)
        return None
    # The instrumentor is a singleton and its constructor resets the running one's
    # configuration: look before constructing, so that someone else's is never touched.
    running = getattr(SystemMetricsInstrumentor, "_instance", None)
    if running is not None and running.is_instrumented_by_opentelemetry:
        _logger.info(
            "host metrics: SystemMetricsInstrumentor already runs in this process (opentelemetry-instrument "
            "or the application started it); it reports with its own selection and openlora-otel adds none"
        )
        return None
    instrumentor = SystemMetricsInstrumentor(config=chosen)
    states = chosen.get("system.cpu.utilization")
    if states:
        import psutil

        # An instance attribute: instrument() registers self._get_system_cpu_utilization.
        instrumentor._get_system_cpu_utilization = CpuIdle(states, psutil.cpu_times)
    else:
        instrumentor.__dict__.pop("_get_system_cpu_utilization", None)
    instrumentor.instrument(meter_provider=meter_provider)
    if not instrumentor.is_instrumented_by_opentelemetry:
        # instrument() logs a dependency conflict (psutil too old) and returns without raising.
        _logger.warning(
            "host metrics off: SystemMetricsInstrumentor did not start (see the error before this)"
        )
        return None
    _logger.debug("host metrics on: %s", ", ".join(chosen))
    return HostMetrics(instrumentor, tuple(chosen), system)


def _warn_missing(exc: ImportError) -> None:
    global _missing_warned
    with _missing_lock:
        if _missing_warned:
            return
        _missing_warned = True
    _logger.warning(
        "host metrics off: %s (pip install opentelemetry-instrumentation-system-metrics, "
        "a dependency of openlora-otel that this installation lacks)",
        exc,
    )

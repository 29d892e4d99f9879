"""Host and process metrics (CPU, memory, disk and network I/O), named by the semantic conventions.

A bounded selection (:data:`SYSTEM_SELECTION`, :data:`PROCESS_SELECTION`; specs in
:data:`openlora_otel.names.host.HOST_METRICS`) of observable instruments on the provider
``setup_telemetry()`` built, under :data:`SCOPE_NAME`: ``system.*`` from local rank 0 only,
``process.*`` from every process, every value read on the collecting thread, never on the step path.
The values come from one source: ``/proc`` read directly on Linux
(:class:`~openlora_otel.hardware.procfs.ProcfsSource`), psutil elsewhere (:class:`PsutilSource`,
imported by :func:`start_host_metrics` alone); the process's CPU time from ``os.times()`` on both.
Not through opentelemetry-instrumentation-system-metrics, whose keys are the old ones. See
docs/reference/host-metrics.md.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from openlora_otel.names.host import HOST_METRICS

__all__ = [
    "NOT_LINK",
    "NOT_STORAGE",
    "PROCESS_SELECTION",
    "SCOPE_NAME",
    "SYSTEM_SELECTION",
    "CpuIdle",
    "HostMetrics",
    "PsutilSource",
    "reports_system",
    "selection",
    "start_host_metrics",
]

_logger = logging.getLogger(__name__)

# The meter (instrumentation scope) the instruments are created under: `otel_scope_name` when pulled.
SCOPE_NAME = "openlora_otel.host"

# system.memory.linux.available is Linux's MemAvailable: the conventions define it on Linux only.
_LINUX = sys.platform.startswith("linux")

# Metric -> the values of its breakdown that are observed (None: no breakdown).
# system.cpu.utilization is reported per logical CPU and mode (224 CPUs on a large 8-GPU node):
# `idle` alone keeps it at one series a CPU, enough for busy (1 - idle) per node and per core.
# system.memory.usage: psutil's `used` is total - available (as `free` shows it), so `used` and
# system.memory.linux.available add up to the total; the other states (free, buffers, cached) would
# not add up with that `used` and are left out.
SYSTEM_SELECTION: Mapping[str, tuple[str, ...] | None] = {
    "system.cpu.utilization": ("idle",),
    "system.memory.usage": ("used",),
    "system.memory.linux.available": None,
    "system.disk.io": ("read", "write"),
    "system.network.io": ("transmit", "receive"),
}
PROCESS_SELECTION: Mapping[str, tuple[str, ...] | None] = {
    "process.cpu.time": ("user", "system"),
    "process.memory.usage": None,
    "process.disk.io": ("read", "write"),
}

# Block devices that are not storage of their own, left out as node_exporter's diskstats collector leaves
# them out by default: RAM and compressed-RAM disks, loop and floppy devices, and the partitions of
# sd/vd/xvd/hd/nvme disks (their bytes are counted again on the whole disk); unlike its default, also
# the partitions of the disks named past sdz (sdaa1), as the dashboards' whole-disk selector reads them.
NOT_STORAGE = re.compile(r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]+|nvme\d+n\d+p)\d+$")

# Network interfaces that are not the node's own links, left out as the dashboards' queries leave them out:
# containers' veth pairs (`veth*`; Calico names the host end `cali*`, Cilium `lxc*`) and docker bridges
# (a container's traffic is counted again on the node's own interface), and traffic-shaping ifb devices (a
# mirror of another interface's traffic). On a Kubernetes node the veth pairs come and go with the pods,
# two series each. Loopback stays.
NOT_LINK = re.compile(r"^(veth|cali|lxc|docker|br-|ifb)")

_missing_warned = False
_missing_lock = threading.Lock()


def reports_system(local_rank: object) -> bool:
    """Whether this process reports the node-wide ``system.*`` series: ``LOCAL_RANK`` 0 or none."""
    return not (isinstance(local_rank, int) and not isinstance(local_rank, bool) and local_rank != 0)


def selection(*, system: bool, excluded: Sequence[str] = ()) -> dict[str, list[str] | None]:
    """The metrics to start, with the values of their breakdown: our selection minus what ``excluded`` globs match."""
    chosen = {**(SYSTEM_SELECTION if system else {}), **PROCESS_SELECTION}
    return {
        name: list(values) if values is not None else None
        for name, values in chosen.items()
        if not any(fnmatch.fnmatch(name, pattern) for pattern in excluded)
        and (_LINUX or name != "system.memory.linux.available")
    }


class CpuIdle:
    """``system.cpu.utilization`` from one process-wide previous reading, whichever thread collects.

    ``cpu_times()`` returns (field names, logical CPU number -> times in those fields, any one unit)
    for the online CPUs. Each call measures the share of time per logical CPU
    (``cpu.logical_number``) in each of ``modes`` (``cpu.mode``) since the previous call, in any
    thread (two readers, pull and push: each covers the time since the other one), or since
    construction for the first. The total is every field less ``guest`` and ``guest_nice`` (Linux
    counts them in ``user`` and ``nice`` already). A CPU whose counters did not move (two calls
    within one clock tick) repeats its previous shares, or has none yet. When the set of CPUs changed
    between two readings (a CPU taken off or on line), that one collection reports nothing.
    """

    def __init__(self, modes: Sequence[str], cpu_times: Callable[[], tuple[Sequence[str], Mapping[int, Sequence[float]]]]) -> None:
        self._modes = tuple(modes)
        self._cpu_times = cpu_times
        self._lock = threading.Lock()
        self._previous = cpu_times()[1]
        self._shares: dict[tuple[int, str], float] = {}
        self._attributes: dict[tuple[int, str], dict[str, Any]] = {}

    def __call__(self, options: Any = None) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        observations = []
        with self._lock:
            fields, current = self._cpu_times()
            previous, self._previous = self._previous, current
            if previous.keys() != current.keys():
                self._shares.clear()
                return observations
            positions = [(mode, fields.index(mode)) for mode in self._modes if mode in fields]
            guests = [fields.index(field) for field in ("guest", "guest_nice") if field in fields]
            for cpu, after in current.items():
                before = previous[cpu]
                deltas = [max(a - b, 0) for a, b in zip(after, before, strict=False)]
                total = sum(deltas) - sum(deltas[i] for i in guests if i < len(deltas))
                for mode, index in positions:
                    if index >= len(deltas):
                        continue
                    key = (cpu, mode)
                    if total > 0:
                        self._shares[key] = min(deltas[index] / total, 1.0)
                    share = self._shares.get(key)
                    if share is not None:
                        attributes = self._attributes.get(key)
                        if attributes is None:
                            attributes = self._attributes[key] = {"cpu.logical_number": cpu, "cpu.mode": mode}
                        observations.append(Observation(share, attributes))
        return observations


class PsutilSource:
    """The host metrics' readings from psutil: where :func:`~openlora_otel.hardware.procfs.open_procfs` has no ``/proc``.

    The same interface as :class:`~openlora_otel.hardware.procfs.ProcfsSource`; CPUs are numbered by
    their position in psutil's list of online CPUs.
    """

    name = "psutil"

    def __init__(self, psutil: Any) -> None:
        self._psutil = psutil
        self._process: Any = None

    def cpu_times(self) -> tuple[tuple[str, ...], Mapping[int, Sequence[float]]]:
        times = self._psutil.cpu_times(percpu=True)
        return (tuple(times[0]._fields) if times else ()), dict(enumerate(times))

    def memory(self) -> tuple[int, int]:
        memory = self._psutil.virtual_memory()
        return memory.used, memory.available

    def disks(self) -> Mapping[str, tuple[int, int]]:
        counters = self._psutil.disk_io_counters(perdisk=True) or {}
        return {name: (c.read_bytes, c.write_bytes) for name, c in counters.items()}

    def interfaces(self) -> Mapping[str, tuple[int, int]]:
        counters = self._psutil.net_io_counters(pernic=True) or {}
        return {name: (c.bytes_recv, c.bytes_sent) for name, c in counters.items()}

    def _own_process(self) -> Any:
        # psutil.Process keeps the pid it was made for: a forked child reads its own.
        pid = os.getpid()
        if self._process is None or self._process.pid != pid:
            self._process = self._psutil.Process(pid)
        return self._process

    def process_memory(self) -> int | None:
        return self._own_process().memory_info().rss

    def process_io(self) -> tuple[int, int] | None:
        try:
            counters = self._own_process().io_counters()
        except (AttributeError, NotImplementedError, PermissionError, self._psutil.AccessDenied):
            return None  # io_counters() is not on every platform (macOS) nor always readable
        return counters.read_bytes, counters.write_bytes


class _Readings:
    """The reads behind each instrument, one callback per metric, from one source; all observe nothing once stopped."""

    # The position of each direction in a source's (read, write) and (receive, transmit) pairs.
    _DISK = {"read": 0, "write": 1}
    _NETWORK = {"receive": 0, "transmit": 1}
    _PROCESS_CPU = {"user": 0, "system": 1}

    def __init__(self, source: Any, chosen: Mapping[str, list[str] | None]) -> None:
        self._source = source
        self._chosen = chosen
        # Each counter's chosen values with their position in what the source returns, worked out once.
        self._positions = {
            name: [(value, table[value]) for value in chosen.get(name) or ()]
            for name, table in (
                ("system.disk.io", self._DISK),
                ("system.network.io", self._NETWORK),
                ("process.cpu.time", self._PROCESS_CPU),
                ("process.disk.io", self._DISK),
            )
        }
        self._stopped = False
        # system.memory.usage's reading of memory, left for system.memory.linux.available, whose
        # callback runs next in the same collection (instruments are called in the order they were made).
        self._available: int | None = None
        # Attribute sets, made once per device, interface or value (the SDK copies what it keeps).
        self._attributes: dict[tuple[str, ...], dict[str, str]] = {}
        modes = chosen.get("system.cpu.utilization")
        # The first CPU-times reading, the base of the first collection's shares, is taken now.
        self._cpu_idle = CpuIdle(modes, source.cpu_times) if modes else None

    def stop(self) -> None:
        self._stopped = True

    def callback(self, name: str) -> Callable[[Any], Iterable[Any]]:
        """The observable callback of metric ``name``: nothing once stopped."""
        read = self._cpu_idle if name == "system.cpu.utilization" else getattr(self, "_" + name.replace(".", "_"))

        def observe(options: Any) -> Iterable[Any]:
            if self._stopped:
                return []
            return list(read(options))

        return observe

    def _attributes_of(self, *pairs: str) -> dict[str, str]:
        attributes = self._attributes.get(pairs)
        if attributes is None:
            if len(self._attributes) > 4096:  # devices and interfaces come and go (containers' veths)
                self._attributes.clear()
            attributes = self._attributes[pairs] = dict(zip(pairs[::2], pairs[1::2], strict=True))
        return attributes

    def _system_memory_usage(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        memory = self._source.memory()
        if memory is None:  # nothing usable to report (see ProcfsSource.memory)
            return
        used, self._available = memory
        if "used" in (self._chosen["system.memory.usage"] or ()):
            yield Observation(used, self._attributes_of("system.memory.state", "used"))

    def _system_memory_linux_available(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        available, self._available = self._available, None
        if available is None:
            memory = self._source.memory()
            if memory is None:
                return
            available = memory[1]
        yield Observation(available)

    def _per_device(
        self, name: str, table: Mapping[str, Sequence[int]], left_out: re.Pattern[str], device_key: str, direction_key: str
    ) -> Iterable[Any]:
        """A (first, second) counter pair per device or interface, less those ``left_out`` matches."""
        from opentelemetry.metrics import Observation

        positions = self._positions[name]
        for device, values in table.items():
            if left_out.match(device):
                continue
            for direction, index in positions:
                yield Observation(values[index], self._attributes_of(device_key, device, direction_key, direction))

    def _system_disk_io(self, options: Any) -> Iterable[Any]:
        return self._per_device("system.disk.io", self._source.disks(), NOT_STORAGE, "system.device", "disk.io.direction")

    def _system_network_io(self, options: Any) -> Iterable[Any]:
        return self._per_device(
            "system.network.io", self._source.interfaces(), NOT_LINK, "network.interface.name", "network.io.direction"
        )

    def _process_cpu_time(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        # os.times(): this process's user and system CPU seconds, what psutil's Process.cpu_times reads
        # from /proc/<pid>/stat, from one system call; always the calling process, so right after a fork.
        times = os.times()
        for mode, index in self._positions["process.cpu.time"]:
            yield Observation(times[index], self._attributes_of("cpu.mode", mode))

    def _process_memory_usage(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        rss = self._source.process_memory()
        if rss is not None:
            yield Observation(rss)

    def _process_disk_io(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        counters = self._source.process_io()
        if counters is None:
            return
        for direction, index in self._positions["process.disk.io"]:
            yield Observation(counters[index], self._attributes_of("disk.io.direction", direction))


class HostMetrics:
    """What :func:`start_host_metrics` turned on; :meth:`stop` makes its instruments observe nothing."""

    def __init__(self, readings: _Readings, metrics: tuple[str, ...], system: bool, source: str) -> None:
        self._readings: _Readings | None = readings
        self._metrics = metrics
        self._system = system
        self._source = source
        self._lock = threading.Lock()

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics started (``system.cpu.utilization``, ``process.cpu.time``, ...)."""
        return self._metrics

    @property
    def system(self) -> bool:
        """True when this process reports the node-wide ``system.*`` series."""
        return self._system

    @property
    def source(self) -> str:
        """Where the values are read: ``procfs`` (``/proc`` directly, on Linux) or ``psutil``."""
        return self._source

    @property
    def running(self) -> bool:
        return self._readings is not None

    def stop(self) -> None:
        """Stop observing (the instruments end with their provider); idempotent, never raises."""
        with self._lock:
            readings, self._readings = self._readings, None
        if readings is not None:
            readings.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<HostMetrics {state} source={self._source} system={self._system} metrics={list(self._metrics)}>"


_CREATE = {
    "gauge": "create_observable_gauge",
    "counter": "create_observable_counter",
    "updowncounter": "create_observable_up_down_counter",
}


def _source() -> Any:
    """Where the values come from: ``/proc`` read directly on Linux (see :mod:`~openlora_otel.hardware.procfs`),
    psutil elsewhere or where ``/proc`` is not as expected; None (one warning per process) when that needs
    psutil and it is not installed."""
    if _LINUX:
        from openlora_otel.hardware.procfs import open_procfs

        source = open_procfs()
        if source is not None:
            return source
    try:
        import psutil
    except ImportError as exc:
        _warn_missing(exc)
        return None
    return PsutilSource(psutil)


def start_host_metrics(
    meter_provider: Any, *, local_rank: object = None, excluded: Sequence[str] = ()
) -> HostMetrics | None:
    """Start the host and process selection on ``meter_provider``; None when nothing was started.

    Nothing is started when every metric is excluded, or when there is no ``/proc`` to read
    and psutil is not installed (one warning per process).
    """
    system = reports_system(local_rank)
    chosen = selection(system=system, excluded=excluded)
    if not chosen:
        _logger.info("host metrics: every metric is excluded by OTEL_PYTHON_SYSTEM_METRICS_EXCLUDED_METRICS")
        return None
    source = _source()
    if source is None:
        return None
    from openlora_otel._version import __version__

    readings = _Readings(source, chosen)
    meter = meter_provider.get_meter(SCOPE_NAME, __version__)
    for spec in HOST_METRICS:
        if spec.name in chosen:
            create = getattr(meter, _CREATE[spec.kind])
            create(spec.name, callbacks=[readings.callback(spec.name)], unit=spec.unit, description=spec.description)
    _logger.debug("host metrics on (%s): %s", source.name, ", ".join(chosen))
    return HostMetrics(readings, tuple(chosen), system, source.name)


def _warn_missing(exc: ImportError) -> None:
    global _missing_warned
    with _missing_lock:
        if _missing_warned:
            return
        _missing_warned = True
    _logger.warning(
        "host metrics off: %s (pip install psutil, a dependency of openlora-otel that this installation lacks)", exc
    )

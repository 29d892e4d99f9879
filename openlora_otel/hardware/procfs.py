"""Linux's ``/proc`` read directly for the host metrics: the few numbers they use, at half psutil's cost.

psutil reads the same files, but parses every field of each, makes a named tuple per CPU, device and
interface, and keeps its wrap-around cache in a process-wide dictionary: 0.24 ms of CPU for one
collection's reads on the 2-CPU test machine, against 0.12 ms here (``benchmarks/bench_host_metrics.py``,
section 5), where the kernel's own share (opening and reading six files) is most of what is left.
node_exporter and prometheus_client's ``ProcessCollector`` read ``/proc`` directly too.

Each parser is a pure function of a file's bytes; a line that does not parse is skipped, never
raised on (``tests/hardware/test_procfs.py`` holds the parsers to psutil's on generated files, and
to never raising on any bytes). :func:`open_procfs` returns a :class:`ProcfsSource` only when every
file reads and parses as expected, so a ``/proc`` that differs (an old kernel without MemAvailable,
a sandbox without ``/proc/diskstats``) falls back to psutil as a whole. Counters follow psutil's
``nowrap`` rule: a value read below the previous one is taken as a wrap or reset, and the previous
value is added from then on, so the reported totals never go down within the process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping

__all__ = [
    "CPU_FIELDS",
    "SECTOR_BYTES",
    "ProcfsSource",
    "open_procfs",
    "parse_cpus",
    "parse_diskstats",
    "parse_io",
    "parse_meminfo",
    "parse_net_dev",
    "parse_statm",
]

_logger = logging.getLogger(__name__)

# The columns of a `cpuN` line of /proc/stat, in order (older kernels have fewer; every one is in ticks).
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")
# /proc/diskstats counts sectors of 512 bytes whatever the device's own sector size (as psutil multiplies).
SECTOR_BYTES = 512


def parse_cpus(data: bytes) -> dict[int, tuple[int, ...]]:
    """``/proc/stat``: logical CPU number (the N of ``cpuN``) -> its times in ticks, in :data:`CPU_FIELDS` order."""
    cpus: dict[int, tuple[int, ...]] = {}
    for line in data.split(b"\n"):
        if not line.startswith(b"cpu"):
            if cpus:
                break  # the per-CPU lines come together, before the long `intr` line
            continue
        fields = line.split()
        number = fields[0][3:]
        if not number.isdigit():
            continue  # the `cpu` line: every CPU together
        try:
            cpus[int(number)] = tuple(int(value) for value in fields[1 : 1 + len(CPU_FIELDS)])
        except ValueError:
            continue
    return cpus


def parse_meminfo(data: bytes) -> tuple[int, int] | None:
    """``/proc/meminfo``: (MemTotal, MemAvailable) in bytes, or None without a usable MemAvailable.

    None also where psutil would not take MemAvailable as it is (zero, as some containers show it, or
    above the total): the caller then asks psutil, which works a value out from the other fields.
    """
    total = available = None
    for line in data.split(b"\n"):
        key, _, rest = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable"):
            parts = rest.split()
            try:
                value = int(parts[0]) * 1024  # in kB, as psutil reads it
            except (IndexError, ValueError):
                return None
            if key == b"MemTotal":
                total = value
            else:
                available = value
            if total is not None and available is not None:
                break
    if total is None or available is None or not 0 < available <= total:
        return None
    return total, available


def parse_diskstats(data: bytes) -> dict[str, tuple[int, int]]:
    """``/proc/diskstats``: device -> (bytes read, bytes written), every device the kernel lists."""
    disks: dict[str, tuple[int, int]] = {}
    for line in data.split(b"\n"):
        fields = line.split()
        count = len(fields)
        try:
            if count == 14 or count >= 18:  # a disk (Linux 2.6+; 4.18 and 5.5 added columns)
                name, read, written = fields[2], int(fields[5]), int(fields[9])
            elif count == 7:  # a partition (Linux 2.6)
                name, read, written = fields[2], int(fields[4]), int(fields[6])
            elif count == 15:  # Linux 2.4
                name, read, written = fields[3], int(fields[5]), int(fields[9])
            else:
                continue
        except ValueError:
            continue
        disks[name.decode("utf-8", "surrogateescape")] = (read * SECTOR_BYTES, written * SECTOR_BYTES)
    return disks


def parse_net_dev(data: bytes) -> dict[str, tuple[int, int]]:
    """``/proc/net/dev``: interface -> (bytes received, bytes transmitted)."""
    interfaces: dict[str, tuple[int, int]] = {}
    for line in data.split(b"\n")[2:]:  # two header lines
        colon = line.rfind(b":")
        if colon <= 0:
            continue
        fields = line[colon + 1 :].split()
        try:
            received, transmitted = int(fields[0]), int(fields[8])
        except (IndexError, ValueError):
            continue
        name = line[:colon].strip()
        if name:
            interfaces[name.decode("utf-8", "surrogateescape")] = (received, transmitted)
    return interfaces


def parse_statm(data: bytes, page_size: int) -> int | None:
    """``/proc/<pid>/statm``: the resident set size in bytes (its second column, in pages)."""
    fields = data.split()
    try:
        return int(fields[1]) * page_size
    except (IndexError, ValueError):
        return None


def parse_io(data: bytes) -> tuple[int, int] | None:
    """``/proc/<pid>/io``: (read_bytes, write_bytes), what reached storage; None without both."""
    read = written = None
    for line in data.split(b"\n"):
        key, _, value = line.partition(b":")
        try:
            if key == b"read_bytes":
                read = int(value)
            elif key == b"write_bytes":
                written = int(value)
        except ValueError:
            return None
    if read is None or written is None:
        return None
    return read, written


def _read(path: str) -> bytes:
    """The whole file, with plain system calls (``open()``'s buffered file object costs about 4 µs more a file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class _NoWrap:
    """psutil's ``nowrap`` rule for a table of counters: a value below the previous one adds the previous one from then on.

    Names not in a reading are forgotten (interfaces and devices come and go), so it holds what one
    reading holds, and a name that comes back starts again from its own value, as with psutil.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[int, int]] = {}
        self._offset: dict[str, tuple[int, int]] = {}

    def read(self, read: Callable[[], Mapping[str, tuple[int, int]]]) -> dict[str, tuple[int, int]]:
        """``read()`` and the rule applied to it, under one lock: readings are judged in the order they were taken."""
        with self._lock:
            reading = read()
            last, offsets = self._last, self._offset
            out: dict[str, tuple[int, int]] = {}
            kept: dict[str, tuple[int, int]] = {}
            for name, (first, second) in reading.items():
                offset = offsets.get(name, (0, 0))
                before = last.get(name)
                if before is not None and (first < before[0] or second < before[1]):
                    offset = (
                        offset[0] + (before[0] if first < before[0] else 0),
                        offset[1] + (before[1] if second < before[1] else 0),
                    )
                if offset != (0, 0):
                    kept[name] = offset
                out[name] = (first + offset[0], second + offset[1])
            self._last = dict(reading)
            self._offset = kept
            return out


class ProcfsSource:
    """The host metrics' readings from ``/proc`` (see the module); the interface :class:`~openlora_otel.hardware.host.PsutilSource` has too."""

    name = "procfs"

    def __init__(self, root: str = "/proc") -> None:
        self._root = root
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        self._disks = _NoWrap()
        self._interfaces = _NoWrap()
        self._psutil = None  # imported only if /proc/meminfo ever lacks a usable MemAvailable

    def cpu_times(self) -> tuple[tuple[str, ...], Mapping[int, tuple[int, ...]]]:
        """(field names, logical CPU number -> times in those fields): online CPUs, in ticks."""
        return CPU_FIELDS, parse_cpus(_read(f"{self._root}/stat"))

    def memory(self) -> tuple[int, int] | None:
        """(used, available) bytes: used is total minus available, as ``free`` and psutil 7 have it; None
        when MemAvailable is not usable and psutil, which works it out from the other fields, is not installed."""
        parsed = parse_meminfo(_read(f"{self._root}/meminfo"))
        if parsed is None:
            if self._psutil is None:
                try:
                    import psutil
                except ImportError:
                    return None
                self._psutil = psutil
            memory = self._psutil.virtual_memory()
            return memory.used, memory.available
        total, available = parsed
        return total - available, available

    def disks(self) -> Mapping[str, tuple[int, int]]:
        """Block device -> (bytes read, bytes written), every device of ``/proc/diskstats``."""
        return self._disks.read(lambda: parse_diskstats(_read(f"{self._root}/diskstats")))

    def interfaces(self) -> Mapping[str, tuple[int, int]]:
        """Network interface -> (bytes received, bytes transmitted)."""
        return self._interfaces.read(lambda: parse_net_dev(_read(f"{self._root}/net/dev")))

    def process_memory(self) -> int | None:
        """This process's resident set size in bytes."""
        return parse_statm(_read(f"{self._root}/self/statm"), self._page_size)

    def process_io(self) -> tuple[int, int] | None:
        """This process's (bytes read, bytes written) from and to storage; None where ``io`` cannot be read:
        a kernel without task I/O accounting has no such file, hidepid or a sandbox may refuse it (psutil
        has no ``io_counters`` then)."""
        try:
            return parse_io(_read(f"{self._root}/self/io"))
        except OSError:
            return None


def open_procfs(root: str = "/proc") -> ProcfsSource | None:
    """A :class:`ProcfsSource` when every file it reads is there and parses as expected; None otherwise."""
    source = ProcfsSource(root)
    try:
        _, cpus = source.cpu_times()
        usable = {
            f"{root}/stat": bool(cpus),
            f"{root}/meminfo": parse_meminfo(_read(f"{root}/meminfo")) is not None,
            f"{root}/diskstats": source.disks() is not None,  # read: any table, empty in a sandbox
            f"{root}/net/dev": bool(source.interfaces()),
            f"{root}/self/statm": source.process_memory() is not None,
        }
    except (OSError, ValueError) as exc:
        _logger.debug("host metrics: %s cannot be read (%s); using psutil", root, exc)
        return None
    failed = [path for path, ok in usable.items() if not ok]
    if failed:
        _logger.debug("host metrics: %s not as expected; using psutil", ", ".join(failed))
        return None
    return source

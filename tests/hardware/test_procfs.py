"""/proc read directly: the parsers held to psutil's on generated files, never raising on any bytes, the
wrap rule, the fallback to psutil, and the live machine's values beside psutil's."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from openlora_otel.hardware import procfs
from openlora_otel.hardware.host import PsutilSource
from openlora_otel.hardware.procfs import (
    CPU_FIELDS,
    ProcfsSource,
    open_procfs,
    parse_cpus,
    parse_diskstats,
    parse_io,
    parse_meminfo,
    parse_net_dev,
    parse_statm,
)
from tests.support.fuzz import fuzz

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
COUNTER = st.integers(min_value=0, max_value=2**64 - 1)
NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12)


def with_psutil_reading(files: dict[str, str], read: Callable[[], object]) -> object:
    """``read()`` with psutil's ``/proc`` pointed at a directory holding ``files`` (path -> text)."""
    with tempfile.TemporaryDirectory() as root:
        for path, text in files.items():
            target = Path(root, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        saved = psutil.PROCFS_PATH
        psutil.PROCFS_PATH = root
        try:
            return read()
        finally:
            psutil.PROCFS_PATH = saved


# -- the parsers against psutil's, on generated files ----------------------------------------------


@st.composite
def stat_files(draw: st.DrawFn) -> str:
    # psutil's named tuple has the fields of this machine's /proc/stat; our parser takes as many.
    width = len(psutil.cpu_times()._fields)
    numbers = sorted(draw(st.sets(st.integers(min_value=0, max_value=511), min_size=1, max_size=8)))
    lines = ["cpu  " + " ".join(["0"] * width)]
    for number in numbers:
        values = draw(st.lists(st.integers(min_value=0, max_value=2**53), min_size=width, max_size=width))
        lines.append(f"cpu{number} " + " ".join(map(str, values)))
    lines += ["intr 12 3 4 5", "ctxt 99", "btime 1700000000", "processes 5", "procs_running 1"]
    return "\n".join(lines) + "\n"


@fuzz
@given(stat_files())
def test_fuzz_cpu_times_are_psutils(text: str) -> None:
    ours = parse_cpus(text.encode())
    theirs = with_psutil_reading({"stat": text}, lambda: psutil.cpu_times(percpu=True))
    # psutil lists the online CPUs in order; /proc/stat names each one (cpuN).
    assert list(ours) == [int(line.split()[0][3:]) for line in text.splitlines() if line[:3] == "cpu" and line[3] != " "]
    assert [tuple(value / CLOCK_TICKS for value in times) for times in ours.values()] == [tuple(t) for t in theirs]


MEMINFO_KEYS = (
    "MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "SwapCached", "Active", "Inactive",
    "Active(file)", "Inactive(file)", "SwapTotal", "SwapFree", "Shmem", "Slab", "SReclaimable", "SUnreclaim",
)  # fmt: skip


@st.composite
def meminfo_files(draw: st.DrawFn) -> str:
    values = {key: draw(st.integers(min_value=0, max_value=2**40)) for key in MEMINFO_KEYS}
    values["MemAvailable"] = draw(st.integers(min_value=0, max_value=values["MemTotal"] * 2 + 1))
    keys = [key for key in MEMINFO_KEYS if key in ("MemTotal", "MemFree") or draw(st.booleans())]
    return "".join(f"{key + ':':<16}{values[key]:>12} kB\n" for key in keys)


@fuzz
@given(meminfo_files())
def test_fuzz_memory_is_psutils_where_memavailable_is_usable(text: str) -> None:
    import warnings

    ours = parse_meminfo(text.encode())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # psutil warns of the fields a generated file leaves out
        theirs = with_psutil_reading({"meminfo": text}, psutil.virtual_memory)
    if ours is None:
        # No MemAvailable, zero, or above the total: psutil works one out, and the source asks psutil.
        return
    total, available = ours
    assert (total, available, total - available) == (theirs.total, theirs.available, theirs.used)


@st.composite
def diskstats_files(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        width = draw(st.sampled_from([7, 14, 15, 18, 20]))
        name = draw(NAME)
        values = draw(st.lists(COUNTER, min_size=width - 3, max_size=width - 3))
        if width == 15:  # Linux 2.4: major, minor, a count, then the name
            lines.append(f"   8 0 {values[0]} {name} " + " ".join(map(str, values[1:])))
        else:
            lines.append(f" 259       0 {name} " + " ".join(map(str, values)))
    return "".join(line + "\n" for line in lines)  # no blank line: the kernel writes none


@fuzz
@given(diskstats_files())
def test_fuzz_disks_are_psutils(text: str) -> None:
    ours = parse_diskstats(text.encode())
    theirs = with_psutil_reading({"diskstats": text}, lambda: psutil.disk_io_counters(perdisk=True, nowrap=False))
    assert ours == {name: (c.read_bytes, c.write_bytes) for name, c in (theirs or {}).items()}


@st.composite
def net_dev_files(draw: st.DrawFn) -> str:
    lines = [
        "Inter-|   Receive                                                |  Transmit",
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed",
    ]
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        values = draw(st.lists(COUNTER, min_size=16, max_size=16))
        lines.append(f"{draw(NAME):>6}: " + " ".join(map(str, values)))
    return "\n".join(lines) + "\n"


@fuzz
@given(net_dev_files())
def test_fuzz_interfaces_are_psutils(text: str) -> None:
    ours = parse_net_dev(text.encode())
    theirs = with_psutil_reading({"net/dev": text}, lambda: psutil.net_io_counters(pernic=True, nowrap=False))
    assert ours == {name: (c.bytes_recv, c.bytes_sent) for name, c in (theirs or {}).items()}


# -- any bytes -------------------------------------------------------------------------------------

# Bytes as /proc's files are made of (lines of words and numbers), and any bytes at all.
WORDS = st.lists(
    st.one_of(
        st.sampled_from(["cpu", "cpu0", "cpu12", "MemTotal:", "MemAvailable:", "kB", "read_bytes:", "write_bytes:", ":"]),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.text(max_size=6),
    ),
    max_size=24,
).map(" ".join)
PROC_BYTES = st.one_of(st.binary(max_size=2000), st.lists(WORDS, max_size=30).map(lambda lines: "\n".join(lines).encode()))


@fuzz
@given(PROC_BYTES)
def test_fuzz_no_parser_raises_on_any_bytes(data: bytes) -> None:
    cpus = parse_cpus(data)
    assert all(isinstance(n, int) and n >= 0 and all(isinstance(v, int) for v in t) for n, t in cpus.items())
    memory = parse_meminfo(data)
    assert memory is None or 0 < memory[1] <= memory[0]
    for table in (parse_diskstats(data), parse_net_dev(data)):
        assert all(isinstance(name, str) and name and len(pair) == 2 for name, pair in table.items())
    assert parse_statm(data, 4096) is None or isinstance(parse_statm(data, 4096), int)
    io = parse_io(data)
    assert io is None or all(isinstance(v, int) for v in io)


def test_older_kernels_have_fewer_cpu_columns() -> None:
    text = b"cpu  1 2 3 4 5 6 7\ncpu0 1 2 3 4 5 6 7\ncpu1 8 9 10 11 12 13 14\nintr 1\n"
    assert parse_cpus(text) == {0: (1, 2, 3, 4, 5, 6, 7), 1: (8, 9, 10, 11, 12, 13, 14)}


def test_process_files() -> None:
    assert parse_statm(b"1000 250 30 1 0 200 0\n", 4096) == 250 * 4096
    io = b"rchar: 10\nwchar: 20\nsyscr: 1\nsyscw: 2\nread_bytes: 4096\nwrite_bytes: 8192\ncancelled_write_bytes: 0\n"
    assert parse_io(io) == (4096, 8192)
    assert parse_io(b"rchar: 10\n") is None


# -- the wrap rule and the fallback ----------------------------------------------------------------


def test_a_counter_read_below_its_previous_value_keeps_counting_up() -> None:
    # psutil's nowrap rule: a wrap or a reset adds what the counter had, so totals never go down.
    rule = procfs._NoWrap()

    def nowrap(reading: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        return rule.read(lambda: reading)

    assert nowrap({"eth0": (100, 50)}) == {"eth0": (100, 50)}
    assert nowrap({"eth0": (10, 60)}) == {"eth0": (110, 60)}  # received wrapped at 100
    assert nowrap({"eth0": (30, 5)}) == {"eth0": (130, 65)}  # then transmitted at 60
    assert nowrap({"eth1": (1, 1)}) == {"eth1": (1, 1)}  # eth0 gone: forgotten
    assert nowrap({"eth0": (2, 2)}) == {"eth0": (2, 2)}  # back: from the kernel's value, as with psutil
    assert rule.read(lambda: {"eth0": (1, 3)}) == {"eth0": (3, 3)}  # read under the same lock


def _fake_proc(root: Path, **replaced: str | None) -> None:
    files = {
        "stat": "cpu  1 1 1 1\ncpu0 1 1 1 1\nintr 0\n",
        "meminfo": "MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 400 kB\n",
        "diskstats": " 8 0 sda 1 2 3 4 5 6 7 8 9 10 11\n",
        "net/dev": "h1\nh2\n    lo: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16\n",
        "self/statm": "100 50 0 0 0 0 0\n",
        "self/io": "read_bytes: 1\nwrite_bytes: 2\n",
    }
    files.update(replaced)
    for path, text in files.items():
        if text is not None:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)


def test_a_proc_that_reads_as_expected_is_used(tmp_path: Path) -> None:
    _fake_proc(tmp_path)
    source = open_procfs(str(tmp_path))
    assert isinstance(source, ProcfsSource)
    assert source.cpu_times() == (CPU_FIELDS, {0: (1, 1, 1, 1)})
    assert source.memory() == (600 * 1024, 400 * 1024)
    assert source.disks() == {"sda": (3 * 512, 7 * 512)}
    assert source.interfaces() == {"lo": (1, 9)}
    assert source.process_memory() == 50 * os.sysconf("SC_PAGE_SIZE")
    assert source.process_io() == (1, 2)


@pytest.mark.parametrize(
    "replaced",
    [
        {"stat": None},
        {"stat": "intr 0\n"},
        {"meminfo": "MemTotal: 1000 kB\nMemFree: 100 kB\n"},  # before Linux 3.14
        {"diskstats": None},
        {"net/dev": None},
        {"self/statm": "garbage\n"},
    ],
)
def test_otherwise_psutil_is(tmp_path: Path, replaced: dict[str, str | None]) -> None:
    _fake_proc(tmp_path, **replaced)
    assert open_procfs(str(tmp_path)) is None


def test_a_later_meminfo_without_memavailable_is_psutils(tmp_path: Path) -> None:
    # A container's /proc/meminfo showing MemAvailable 0: psutil works it out from the other fields.
    _fake_proc(tmp_path)
    source = open_procfs(str(tmp_path))
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 0 kB\n")
    memory = psutil.virtual_memory()
    used, available = source.memory()
    assert abs(available - memory.available) < 0.05 * memory.total and used + available == pytest.approx(memory.total, rel=0.05)


def test_an_unreadable_io_file_is_no_process_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_proc(tmp_path)
    source = open_procfs(str(tmp_path))

    def denied(path: str) -> bytes:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(procfs, "_read", denied)
    assert source.process_io() is None


def test_a_kernel_without_io_accounting_has_no_process_io(tmp_path: Path) -> None:
    _fake_proc(tmp_path, **{"self/io": None})
    source = open_procfs(str(tmp_path))
    assert source is not None and source.process_io() is None


def test_memavailable_unusable_without_psutil_is_no_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_proc(tmp_path)
    source = open_procfs(str(tmp_path))
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 0 kB\n")
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert source.memory() is None


# -- this machine, beside psutil -------------------------------------------------------------------


def test_this_machine_reads_as_psutil_reads_it() -> None:
    ours = open_procfs()
    assert ours is not None
    theirs = PsutilSource(psutil)
    before_disks, before_nics = theirs.disks(), theirs.interfaces()
    fields, cpus = ours.cpu_times()
    _, their_cpus = theirs.cpu_times()
    # The same online CPUs: numbered as /proc/stat names them here, by position in psutil's list there.
    assert len(cpus) == len(their_cpus) and list(cpus) == sorted(cpus)
    assert fields[: len(their_cpus[0])] == tuple(their_cpus[0]._fields)
    used, available = ours.memory()
    _, their_available = theirs.memory()
    total = psutil.virtual_memory().total
    assert used + available == total
    assert abs(available - their_available) < 0.02 * total
    disks, nics = ours.disks(), ours.interfaces()
    after_disks, after_nics = theirs.disks(), theirs.interfaces()
    assert set(disks) == set(before_disks) and set(nics) == set(before_nics)
    for table, before, after in ((disks, before_disks, after_disks), (nics, before_nics, after_nics)):
        for name, pair in table.items():  # read between psutil's two readings
            assert all(b <= value <= a for value, b, a in zip(pair, before[name], after[name], strict=True)), name
    rss = ours.process_memory()
    assert 0.8 < rss / theirs.process_memory() < 1.25
    io, their_io = ours.process_io(), theirs.process_io()
    assert io is not None and their_io is not None and io[0] <= their_io[0] and io[1] <= their_io[1]
    times = os.times()
    process = psutil.Process().cpu_times()
    assert abs(times.user - process.user) < 0.05 and abs(times.system - process.system) < 0.05


def test_each_file_is_opened_once_a_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = os.open

    def counting(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    source = open_procfs()
    assert source is not None
    monkeypatch.setattr(os, "open", counting)
    source.cpu_times(), source.memory(), source.disks(), source.interfaces()
    source.process_memory(), source.process_io()
    monkeypatch.undo()
    assert sorted(opened) == sorted(
        ["/proc/stat", "/proc/meminfo", "/proc/diskstats", "/proc/net/dev", "/proc/self/statm", "/proc/self/io"]
    )

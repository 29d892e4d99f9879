"""The loopback ports tests/support hands to servers under test (tests/support/processes.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import processes
from tests.support.processes import PORT_BAND, free_port, free_port_range


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """The kernel gives outgoing connections ports of its ephemeral range as their local ports; a server
    told to listen on one of those can find it taken (a Collector did, in a fresh-clone .ci/run)."""
    low, _ = _ephemeral_range()
    assert PORT_BAND[1] <= low
    ports = [free_port() for _ in range(50)]
    assert all(PORT_BAND[0] <= port < PORT_BAND[1] for port in ports)


def test_no_port_is_handed_out_twice() -> None:
    ports = [free_port() for _ in range(200)]
    base = free_port_range(8)
    assert len(set(ports)) == len(ports)
    assert not set(ports) & set(range(base, base + 8))


def test_a_port_something_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_handed_out", set())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        held = holder.getsockname()[1]
        holder.listen()
        # A slice that starts at the held port: the search begins there (offset 0).
        monkeypatch.setattr(processes, "_worker_slice", lambda: range(held, held + 3))
        monkeypatch.setattr(processes.os, "getpid", lambda: 0)
        assert free_port() in (held + 1, held + 2)


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_each_xdist_worker_has_a_slice_of_its_own(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    slices = []
    for index in range(workers):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        slices.append(set(processes._worker_slice()))
    assert all(len(part) >= 1000 for part in slices)
    for index, part in enumerate(slices):
        assert all(part.isdisjoint(other) for other in slices[index + 1 :])
        assert min(part) >= PORT_BAND[0] and max(part) < PORT_BAND[1]


def test_a_worn_out_slice_starts_over_with_the_ports_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_handed_out", set())
    monkeypatch.setattr(processes, "_worker_slice", lambda: range(PORT_BAND[0], PORT_BAND[0] + 4))
    first = {free_port() for _ in range(4)}
    again = free_port()
    assert again in first

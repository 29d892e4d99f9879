"""Child processes and ports: the environment a child under test gets, a free loopback port, bounded
waits for a child to end."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

# Our own variables: no test inherits them (tests/conftest.py's clean_env), no child either.
OWN_PREFIXES = ("OTEL_", "OPENLORA_")
# Launcher variables (torchrun, torch.distributed's env://, Slurm) that decide ranks, ports and the run id.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_RESTART_COUNT",
)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without our variables, plus ``extra``: for subprocesses under test."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES) and k not in LAUNCHER_VARIABLES
    }
    env.update(extra)
    return env


# The ports handed to servers under test come from a band below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default). A port the kernel picks for ``bind(0)`` is an
# ephemeral one, which the same kernel may give, a moment later, to any process's outgoing connection as
# its local port: a Collector then failed with "address already in use" in a fresh-clone .ci/run. Nothing
# takes a port of this band unasked. Each pytest-xdist worker has a slice of its own, and a process never
# hands out the same port twice, so two servers of one run never get the same port either.
PORT_BAND = (12000, 32000)
_handed_out: set[int] = set()


def _worker_slice() -> range:
    low, high = PORT_BAND
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (high - low) // max(count, 1)
    start = low + (index % max(count, 1)) * width
    return range(start, start + width)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(count: int = 1) -> int:
    """A base port such that base .. base + count - 1 are free on 127.0.0.1 now and handed to no one else
    in this test run; from this worker's slice of PORT_BAND, where the kernel never picks a port unasked."""
    ports = _worker_slice()
    offset = (os.getpid() * 7919) % len(ports)
    for _ in range(2):
        for tries in range(len(ports)):
            base = ports[(offset + tries) % len(ports)]
            block = range(base, base + count)
            if block[-1] >= ports.stop or _handed_out.intersection(block):
                continue
            if all(_bindable(port) for port in block):
                _handed_out.update(block)
                return base
        # Every port of the slice handed out once: the servers of tests long finished have let theirs go.
        _handed_out.clear()
    raise RuntimeError(f"no {count} consecutive free ports in {ports.start}-{ports.stop - 1}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that no other server of this test run gets
    (see PORT_BAND)."""
    return free_port_range(1)


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

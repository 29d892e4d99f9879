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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

"""``openlora-otel stack --start`` as a child process (Prometheus and Alertmanager under it), and the
Debian tools its tests need."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from openlora_otel.stack import servers
from tests.support.processes import child_env, reap
from tests.support.real_parts import debian, missing

ROOT = Path(__file__).resolve().parent.parent.parent


def tool(name: str) -> str:
    binary = shutil.which(name)
    if binary is None:
        package = "prometheus-alertmanager" if name == "amtool" else "prometheus"
        missing(debian(package), f"{name} is not installed (Debian package `{package}`)")
    return binary


def wait_for_line(process: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    """Lines of ``process``'s stdout up to the one containing ``needle`` (bounded)."""
    import selectors

    lines: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buffer = b""
    while time.monotonic() < deadline:
        if not selector.select(timeout=0.5):
            if process.poll() is not None:
                break
            continue
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        buffer += chunk
        *done, buffer = buffer.split(b"\n")
        lines += [line.decode() for line in done]
        if any(needle in line for line in lines):
            return lines
    raise AssertionError(f"no {needle!r} from the stack in {timeout} s: {lines} {buffer!r}")


def start_stack(directory: Path, *argv: str) -> tuple[subprocess.Popen, list[str]]:
    """The stack with ``--start``, as ``python -m openlora_otel stack``; returns the process and its lines
    up to the one saying it runs."""
    tool("prometheus")
    servers.find_binary(servers.ALERTMANAGER_BINARIES) or tool("prometheus-alertmanager")
    command = ["-m", "openlora_otel", "stack"]
    process = subprocess.Popen(
        [sys.executable, *command, "--dir", str(directory), "--start", *argv],
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        lines = wait_for_line(process, "Ctrl-C stops both", 90)
    except BaseException:
        process.kill()
        reap(process, 10)
        raise
    return process, lines

"""The demo (``python -m openlora_otel demo``) as a child process, and reading its output."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support.processes import child_env


def needs_the_demo() -> None:
    """Skip unless torch, transformers and peft are installed."""
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module)


def demo_process(*args: str, env: dict[str, str]) -> subprocess.Popen:
    """``openlora-otel demo ARGS`` with ``env`` added to the child's environment; text pipes."""
    # One torch thread: two OpenMP threads on a loaded 2-core machine ran the demo 100 times slower
    # (and two demos at once get one core each).
    return subprocess.Popen(
        [sys.executable, "-m", "openlora_otel", "demo", *args],
        env=child_env(**{"OMP_NUM_THREADS": "1", **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(stream, needle: str, timeout: float) -> str:
    """Read lines (bounded in time) until one contains ``needle``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not seen in: {''.join(seen)[-2000:]}")

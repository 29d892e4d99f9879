"""A fresh interpreter that runs a script, says READY, and is sent SIGTERM: SIGTERM, exit status and
atexit only mean something for a whole process (tests/run/test_end_of_run.py, tests/exporters/test_push_paths.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parent.parent.parent

CHILD_PRELUDE = """
import os, signal, sys, time
# Ctrl-C is KeyboardInterrupt, as in a terminal: a test run started in the background of a
# non-interactive shell ignores SIGINT, every child inherits that, and Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
from openlora_otel import setup_telemetry
"""


def run_child(
    body: str, env: dict[str, str], *, sigterms: int = 1, timeout: float = 60.0
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Start ``body``; once it prints READY send ``sigterms`` SIGTERMs; return the result and the seconds it took to end."""
    script = CHILD_PRELUDE + textwrap.dedent(body)
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    line = ""
    before: list[str] = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line or line.strip() == "READY":
            break
        before.append(line)
    assert line.strip() == "READY", process.communicate(timeout=30)
    sent = time.monotonic()
    for _ in range(sigterms):
        process.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate(timeout=10)
        pytest.fail(f"child did not end after SIGTERM: {stderr[-2000:]}")
    took = time.monotonic() - sent
    return subprocess.CompletedProcess(process.args, process.returncode, "".join(before) + stdout, stderr), took


RECORD_5000 = """
telemetry = setup_telemetry()
for _ in range(5000):
    telemetry.training.record_step(loss=1.0, tokens=7)
print("READY", flush=True)
time.sleep(60)
print("NOT KILLED", flush=True)
"""


# An application's SIGTERM handler installed after ours that calls ours (Lightning's signal connector
# does), then a bounded wait in the main thread until it ran: the script goes on with the application's
# own stop. Scripts take it after ``telemetry = setup_telemetry()``.
CHAINED_HANDLER = """
previous = signal.getsignal(signal.SIGTERM)
stop = []
def on_term(signum, frame):
    stop.append(signum)
    previous(signum, frame)
signal.signal(signal.SIGTERM, on_term)
"""
WAIT_FOR_STOP = """
deadline = time.monotonic() + 30
while not stop and time.monotonic() < deadline:
    time.sleep(0.01)
"""


def otlp_child_env(endpoint: str, **extra: str) -> dict[str, str]:
    """A child's environment that pushes OTLP to ``endpoint`` (a test's receiver) at a 60 s interval, so
    that what arrives is the final export; ``extra`` on top."""
    return child_env(
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_METRIC_EXPORT_INTERVAL="60000",
        PYTHONPATH=str(ROOT),
        **extra,
    )

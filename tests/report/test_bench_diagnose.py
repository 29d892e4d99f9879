"""benchmarks/bench_diagnose.py at a small scale (4 ranks, a quarter of an hour), so that it keeps
working between its real 64-rank, 2-hour runs: the backfilled run is read both ways, the query counts
are the ones docs/how-to/diagnose.md states, and the synthetic healthy run, its GPUs' series included, has
no finding."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from openlora_otel.report.model import QUANTITIES

pytestmark = [pytest.mark.e2e, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_diagnose.py"


def test_the_diagnose_benchmark_runs_at_a_small_scale() -> None:
    from tests.support.prometheus_server import prometheus_binary

    prometheus_binary(2)  # skips (fails under CI) where Debian's prometheus is not installed
    bench = subprocess.run(
        [sys.executable, str(BENCH), "--ranks", "4", "--hours", "0.25", "--repeat", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    counts = dict(re.findall(r"^(report|diagnose)\s+(\d+)\s+[\d.]+$", bench.stdout, re.M))
    # diagnose: one range query per quantity and the goodput phases, the span and identity (the docs' 45).
    assert counts == {"report": counts["report"], "diagnose": str(len(QUANTITIES) + 6)}, bench.stdout
    assert "ratio diagnose/report:" in bench.stdout and "findings: 0 []" in bench.stdout, bench.stdout
    # With a GPU's series (the fake NVML's H100 and the torch allocator's), healthy: no GPU finding either.
    gpu = re.search(r"\((\d+) of each rank's (\d+) series its GPU's\)", bench.stdout)
    assert gpu and int(gpu[1]) >= 30, bench.stdout

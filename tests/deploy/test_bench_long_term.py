"""benchmarks/bench_long_term.py at a small scale (6 hours of 2 ranks), so that it keeps working between
its real runs: blockgen writes blocks Thanos takes, the compactor runs, every panel query is asked at
each resolution and answers with data. And blockgen refuses a spec it cannot use, saying which line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.built import built

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_long_term.py"
BLOCKGEN = ROOT / "benchmarks" / "blockgen"


def test_the_long_term_benchmark_runs_at_a_small_scale(tmp_path: Path) -> None:
    # Skips (fails under CI) when they are not built.
    built("thanos")
    built("prometheus")
    result = subprocess.run(
        [sys.executable, str(BENCH), "--days", "0.25", "--ranks", "2", "--interval", "5", "--repeats", "1",
         "--keep", str(tmp_path / "work"), "--json", str(tmp_path / "rows.json")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resolution 0 s:" in result.stdout and "108 panel queries" in result.stdout, result.stdout
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == 108
    for row in rows:
        for resolution in ("0s", "5m", "1h", "auto"):
            assert "error" not in row[resolution] and "warnings" not in row[resolution], (row["panel"], row)
    # Every panel has data but the one whose series only a non-finite evaluation makes at a later point.
    empty = {row["panel"] for row in rows if row["0s"]["points"] == 0}
    assert empty <= {"Evaluation metrics"}, empty
    # Six hours make no block long enough to downsample: every resolution answers the raw samples.
    assert all(row["5m"].get("missing", 0) == 0 and row["5m"].get("max_rel_diff", 0) == 0 for row in rows)


def test_blockgen_names_the_line_and_what_it_accepts(tmp_path: Path) -> None:
    binary = tmp_path / "blockgen"
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
    subprocess.run(["go", "build", "-o", str(binary), "."], cwd=BLOCKGEN, check=True, env=env, timeout=600)
    spec = tmp_path / "spec.jsonl"
    spec.write_text('{"labels": {"__name__": "a"}, "model": "const", "p": [1]}\n'
                    '{"labels": {"__name__": "b"}, "model": "sine", "p": [1, 2]}\n')  # fmt: skip
    args = ["-spec", str(spec), "-out", str(tmp_path / "out"), "-start", "0", "-end", "60"]
    refused = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert f"{spec}:2: model \"sine\" with 2 parameters (accepted: const 1" in refused.stderr
    spec.write_text('{"labels": {"__name__": "a"}, "model": "linear", "p": [0, 1]}\n')
    made = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and made.stdout.startswith("1 series, 4 samples"), made
    assert len(list((tmp_path / "out").glob("*/meta.json"))) == 1

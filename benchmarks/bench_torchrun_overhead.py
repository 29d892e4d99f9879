"""Steps per second per rank of the demo under torchrun (2 DDP ranks), telemetry on vs OTEL_SDK_DISABLED=true.

Each pair launches ``torchrun --standalone --nproc_per_node=2`` twice with the
same seed and steps: once with telemetry on (each rank's Prometheus pull
endpoint scraped every second by a separate process, as Prometheus would), once
with the SDK disabled. Each rank times its own training loop (the demo's
``DemoResult.seconds``; startup and shutdown are not counted) and reports it.
Pairs alternate which side goes first; the median of the per-pair ratios is the
figure.

    python benchmarks/bench_torchrun_overhead.py [--pairs 5] [--steps 60] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One rank: the demo's own run_demo, its result as one JSON line.
RANK = """
import json, os, sys
from openlora_otel import setup_telemetry
from openlora_otel.demo.options import DemoOptions
from openlora_otel.demo.train import run_demo

telemetry = setup_telemetry("bench-torchrun")
options = DemoOptions(steps=int(sys.argv[1]), batch_size=int(sys.argv[2]), eval_every=0, quiet=True, distributed=True)
try:
    result = run_demo(options, telemetry, where="bench")
finally:
    telemetry.shutdown()
print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "steps": result.steps, "seconds": result.seconds}),
      flush=True)
"""

# Prometheus's part, in its own process: GET both ranks' /metrics every second (bounded: 10 minutes).
SCRAPER = """
import sys, time, urllib.request
for _ in range(600):
    for url in sys.argv[1:]:
        try:
            urllib.request.urlopen(url, timeout=5).read()
        except OSError:
            pass
    time.sleep(1.0)
"""


def two_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    raise RuntimeError("no two consecutive free ports")


def one_launch(enabled: bool, steps: int, batch_size: int, script: Path) -> list[dict]:
    base = two_free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENLORA_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(base),
        OPENLORA_QUIET="true",
        OPENLORA_GPU_METRICS="off",
    )
    if not enabled:
        env["OTEL_SDK_DISABLED"] = "true"
    scraper = None
    if enabled:
        urls = [f"http://127.0.0.1:{base + rank}/metrics" for rank in (0, 1)]
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, *urls])
    try:
        launch = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(script),
                str(steps),
                str(batch_size),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        if scraper:
            scraper.terminate()
            scraper.wait(timeout=10)
    # Both ranks write to the same pipe: their lines can run into each other.
    results = sorted(
        (json.loads(found) for found in re.findall(r"RESULT (\{[^}]*\})", launch.stdout)),
        key=lambda r: r["rank"],
    )
    if launch.returncode != 0 or len(results) != 2:
        raise RuntimeError(f"launch failed ({launch.returncode}):\n{launch.stderr[-3000:]}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        rates: dict[bool, dict[int, list[float]]] = {True: {0: [], 1: []}, False: {0: [], 1: []}}
        ratios: dict[int, list[float]] = {0: [], 1: []}
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            runs = {enabled: one_launch(enabled, args.steps, args.batch_size, script) for enabled in order}
            line = [f"pair {pair + 1}:"]
            for rank in (0, 1):
                on, off = (runs[e][rank]["steps"] / runs[e][rank]["seconds"] for e in (True, False))
                rates[True][rank].append(on)
                rates[False][rank].append(off)
                ratios[rank].append(on / off)
                line.append(f"rank {rank} on {on:.2f} / off {off:.2f} steps/s = {on / off:.3f}")
            print("  ".join(line), flush=True)
    print()
    print("| rank | telemetry on (steps/s) | OTEL_SDK_DISABLED (steps/s) | median ratio on/off |")
    print("| --- | --- | --- | --- |")
    for rank in (0, 1):
        print(
            f"| {rank} | {statistics.median(rates[True][rank]):.2f} | {statistics.median(rates[False][rank]):.2f} "
            f"| {statistics.median(ratios[rank]):.3f} |"
        )

if __name__ == "__main__":
    main()

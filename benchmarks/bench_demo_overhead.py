"""Steps per second of the demo fine-tune with telemetry on vs OTEL_SDK_DISABLED=true, paired in one run.

Each pair runs the same training loop (same seed, same steps) twice in this
process: once with telemetry on (the Prometheus pull endpoint, scraped every
second by a separate process, as Prometheus would; every training metric
recorded), once with the SDK disabled. Only the training loop is timed. Pairs
alternate which side goes first; the median of the per-pair ratios is the
figure (target >= 0.99). With ``--device cuda`` the demo trains on the GPU and the
telemetry side also collects the GPU metrics (NVML and the torch allocator), as a
run on a GPU machine does; on the CPU GPU metrics are off (there is no GPU to read).

    python benchmarks/bench_demo_overhead.py [--pairs 10] [--steps 120] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.demo.options import DemoOptions
from openlora_otel.demo.train import run_demo

# Prometheus's part, in its own process: GET /metrics every second (bounded: at most 10 minutes).
SCRAPER = """
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=5).read()
    except OSError:
        pass
    time.sleep(1.0)
"""


def one_run(enabled: bool, steps: int, device: str = "cpu") -> float:
    """Steps per second of one demo run (the training loop only)."""
    config = TelemetryConfig(
        sdk_disabled=not enabled,
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        gpu_metrics="off" if device == "cpu" else "auto",
    )
    telemetry = setup_telemetry("bench", config=config)
    scraper = None
    if telemetry.prometheus_url:
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, telemetry.prometheus_url])
    try:
        options = DemoOptions(steps=steps, eval_every=0, quiet=True, device=device)
        result = run_demo(options, telemetry, where="bench")
    finally:
        if scraper:
            scraper.terminate()
            scraper.wait(timeout=10)
        telemetry.shutdown()
    return result.steps / result.seconds


def measure(pairs: int, steps: int, device: str = "cpu", report=print) -> list[tuple[float, float]]:
    """(steps/s on, steps/s off) per pair, the sides alternating which goes first; ``report`` gets a line per pair."""
    one_run(True, 10, device)  # warm up imports and allocator
    results = []
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        rates = {enabled: one_run(enabled, steps, device) for enabled in order}
        results.append((rates[True], rates[False]))
        report(
            f"pair {pair + 1}: on {rates[True]:.2f} steps/s, off {rates[False]:.2f} steps/s, "
            f"ratio {rates[True] / rates[False]:.3f}"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default cpu)")
    args = parser.parse_args()
    results = measure(args.pairs, args.steps, args.device)
    on_rates = [on for on, _ in results]
    off_rates = [off for _, off in results]
    ratios = [on / off for on, off in results]
    print(
        f"median steps/s: telemetry on {statistics.median(on_rates):.2f}, "
        f"OTEL_SDK_DISABLED {statistics.median(off_rates):.2f}"
    )
    print(f"median ratio on/off: {statistics.median(ratios):.3f} (target >= 0.99)")


if __name__ == "__main__":
    main()

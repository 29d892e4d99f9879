"""Steps per second of the demo fine-tune with telemetry on vs OTEL_SDK_DISABLED=true, paired in one run.

Each pair runs the same training loop (same seed, same steps) twice in this
process: once with telemetry on (the Prometheus pull endpoint, scraped every
second by a separate process, as Prometheus would; every training metric
recorded), once with the SDK disabled. Only the training loop is timed. Pairs
alternate which side goes first; the median of the per-pair ratios is the
figure (target >= 0.99).

    python benchmarks/bench_demo_overhead.py [--pairs 10] [--steps 120]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.demo.train import DemoOptions, run_demo

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


def one_run(enabled: bool, steps: int) -> float:
    config = TelemetryConfig(
        sdk_disabled=not enabled, prometheus_host="127.0.0.1", prometheus_port=0, gpu_metrics="off"
    )
    telemetry = setup_telemetry("bench", config=config)
    scraper = None
    if telemetry.prometheus_url:
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, telemetry.prometheus_url])
    try:
        result = run_demo(DemoOptions(steps=steps, eval_every=0, quiet=True), telemetry, where="bench")
    finally:
        if scraper:
            scraper.terminate()
            scraper.wait(timeout=10)
        telemetry.shutdown()
    return result.steps / result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    one_run(True, 10)  # warm up imports and allocator
    ratios, on_rates, off_rates = [], [], []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        rates = {enabled: one_run(enabled, args.steps) for enabled in order}
        on_rates.append(rates[True])
        off_rates.append(rates[False])
        ratios.append(rates[True] / rates[False])
        print(
            f"pair {pair + 1}: on {rates[True]:.2f} steps/s, off {rates[False]:.2f} steps/s, ratio {ratios[-1]:.3f}"
        )
    print(
        f"median steps/s: telemetry on {statistics.median(on_rates):.2f}, "
        f"OTEL_SDK_DISABLED {statistics.median(off_rates):.2f}"
    )
    print(f"median ratio on/off: {statistics.median(ratios):.3f} (target >= 0.99)")


if __name__ == "__main__":
    main()

"""Quickstart: record a few training-style values and serve them on /metrics.

This is the smallest useful program built on openlora-otel: setup_telemetry()
with whatever OTEL_* variables are set (by default a Prometheus endpoint on
localhost:9464), a handful of instruments, and a loop that records into them.
The values are synthetic (a decaying loss curve); the real LoRA fine-tune is
`openlora-otel demo` once it lands.

    python examples/quickstart.py --steps 300 --linger 60
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

from openlora_otel import ConfigError, MissingDependencyError, setup_telemetry


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record synthetic training values and serve them.")
    parser.add_argument(
        "--steps", type=positive_int, default=200, help="optimizer steps to simulate (default 200)"
    )
    parser.add_argument(
        "--step-time", type=non_negative_float, default=0.05, help="seconds per step (default 0.05)"
    )
    parser.add_argument(
        "--linger", type=non_negative_float, default=0.0, help="seconds to keep serving after the loop"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    try:
        telemetry = setup_telemetry("openlora-quickstart")
    except (ConfigError, MissingDependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    rng = random.Random(args.seed)
    meter = telemetry.meter
    loss = meter.create_gauge(
        "openlora.training.loss", unit="1", description="Training loss (synthetic here)"
    )
    steps = meter.create_counter("openlora.training.steps", unit="{step}", description="Optimizer steps")
    tokens = meter.create_counter("openlora.training.tokens", unit="{token}", description="Tokens processed")
    duration = meter.create_histogram(
        "openlora.training.step.duration", unit="s", description="Step wall time"
    )

    where = (
        telemetry.prometheus_url or ",".join(telemetry.config.enabled_exporters) or "nowhere (exporter none)"
    )
    print(f"run {telemetry.run_id}: metrics -> {where}", flush=True)
    try:
        with telemetry:
            for step in range(1, args.steps + 1):
                started = time.perf_counter()
                time.sleep(args.step_time)
                value = 2.5 * math.exp(-step / (args.steps / 3)) + 0.3 + rng.gauss(0, 0.03)
                loss.set(value)
                steps.add(1)
                tokens.add(512)
                duration.record(time.perf_counter() - started)
                if step % max(1, args.steps // 10) == 0 or step == args.steps:
                    print(f"step {step}/{args.steps} loss {value:.3f}", flush=True)
            if args.linger:
                print(f"serving the final values for {args.linger:g} s at {where}", flush=True)
                time.sleep(args.linger)
    except KeyboardInterrupt:
        print("interrupted; telemetry flushed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

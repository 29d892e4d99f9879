"""Quickstart without torch: record training-style values through TrainingMetrics and serve them.

The smallest program built on openlora-otel: setup_telemetry() with whatever
OTEL_* variables are set (by default a Prometheus endpoint on localhost:9464)
and one record_step() per step. The values are synthetic (a decaying loss
curve); `openlora-otel demo` is the real LoRA fine-tune.

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
    training = telemetry.training
    training.set_adapter(
        r=8,
        alpha=16,
        dropout=0.05,
        target_modules=["q_proj", "v_proj"],
        trainable_params=4096,
        total_params=1_000_000,
    )
    where = (
        telemetry.prometheus_url or ",".join(telemetry.config.enabled_exporters) or "nowhere (exporter none)"
    )
    print(f"run {telemetry.run_id}: metrics -> {where}", flush=True)
    try:
        with telemetry:
            for step in range(1, args.steps + 1):
                time.sleep(args.step_time)
                loss = 2.5 * math.exp(-step / (args.steps / 3)) + 0.3 + rng.gauss(0, 0.03)
                training.record_step(
                    loss=loss, grad_norm=abs(rng.gauss(1.0, 0.2)), learning_rate=1e-4, tokens=512, samples=4
                )
                if step % max(1, args.steps // 10) == 0 or step == args.steps:
                    print(f"step {step}/{args.steps} loss {loss:.3f}", flush=True)
            if args.linger:
                print(f"serving the final values for {args.linger:g} s at {where}", flush=True)
                time.sleep(args.linger)
    except KeyboardInterrupt:
        print("interrupted; telemetry flushed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

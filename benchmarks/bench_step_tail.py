"""The tail of one ``record_step`` call with CPU-tensor loss and gradient norm, side by side in one run.

- prometheus_client: the seeds' recipe (three gauges, two counters, a histogram) with the two
  ``.item()`` calls it needs for tensor values;
- openlora-otel: one ``TrainingMetrics.record_step(loss=tensor, grad_norm=tensor, ...)`` on a provider
  built as ``setup_telemetry`` builds it, a reader collecting every 10,000 steps (off the timed calls,
  as a scrape thread would).

Each call is timed on its own (``time.perf_counter_ns``, wall time: a stall on the training thread is
what matters), the two variants alternating in blocks so that the machine's noise falls on both. It
prints p50, p99, p99.9 and the maximum of each and the ratios; the target is openlora-otel's p99.9 at
most 1.0 times prometheus_client's (no millisecond stall every few hundred steps: kept tensors used to
be folded on the training thread every 512th step).

    python benchmarks/bench_step_tail.py [--steps 1000000] [--block 50000]
"""

from __future__ import annotations

import argparse
import gc
import time

from bench_record_step import openlora_tensor_variant, prometheus_tensor_variant


def quantile(ordered: list[int], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="calls per variant (default %(default)s)")
    parser.add_argument("--block", type=int, default=50_000, help="calls per block (default %(default)s)")
    parser.add_argument("--collect-every", type=int, default=10_000, help="(default %(default)s)")
    args = parser.parse_args()

    variants = {
        "prometheus_client + 2 .item()": prometheus_tensor_variant(),
        "openlora-otel record_step": openlora_tensor_variant(),
    }
    samples: dict[str, list[int]] = {name: [] for name in variants}
    clock = time.perf_counter_ns
    done = 0
    gc.collect()
    while done < args.steps:
        block = min(args.block, args.steps - done)
        for name, (step, collect) in variants.items():
            timings = samples[name]
            for i in range(done, done + block):
                start = clock()
                step(i)
                timings.append(clock() - start)
                if i % args.collect_every == args.collect_every - 1:
                    collect()
        done += block

    print(f"{args.steps:,} calls each, microseconds per call (wall time)")
    print(f"{'variant':32} {'p50':>8} {'p99':>8} {'p99.9':>8} {'max':>10}")
    stats = {}
    for name, timings in samples.items():
        ordered = sorted(timings)
        stats[name] = (quantile(ordered, 0.5), quantile(ordered, 0.99), quantile(ordered, 0.999), ordered[-1] / 1000)
        p50, p99, p999, worst = stats[name]
        print(f"{name:32} {p50:8.2f} {p99:8.2f} {p999:8.2f} {worst:10.1f}")
    base, ours = stats["prometheus_client + 2 .item()"], stats["openlora-otel record_step"]
    print(
        "ratios openlora-otel / prometheus_client: "
        f"p50 {ours[0] / base[0]:.2f}, p99 {ours[1] / base[1]:.2f}, p99.9 {ours[2] / base[2]:.2f} "
        f"(target at most 1.0), max {ours[3] / base[3]:.2f}"
    )


if __name__ == "__main__":
    main()

"""What the goodput accounting costs, side by side in one run.

- ``record_step`` before and after: this checkout's ``TrainingMetrics.record_step`` against the
  one of ``--before`` (default: the commit before goodput), whose ``training/metrics.py`` is read
  from git and loaded beside it in the same process (its imports resolve to this checkout's modules,
  unchanged between the two but for the goodput clock). prometheus_client's six updates per step run
  in the same rounds as the yardstick.
- a phase mark: ``with training.phase("evaluation"): pass`` (enter and leave), against an empty
  ``with`` of ``contextlib.nullcontext()`` and two ``time.perf_counter()`` calls (the least any timer does).

Variants are interleaved in rounds, timed with ``time.process_time``; medians and ratios are printed.
Targets: record_step after / before within noise (the ratio's spread over the rounds is printed),
a mark under 1 us.

    python benchmarks/bench_goodput.py [--steps 200000] [--marks 200000] [--rounds 7] [--before REF]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_record_step import prometheus_variant, time_variant  # the same loop and yardstick
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel.training.metrics import TrainingMetrics, step_duration_view

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "dc154b8~1"  # the commit before the goodput clock


# The helpers an older metrics.py imports under the private names they had before issue 30 (move 3)
# made them public: the same objects, lent under the old names while that source is loaded.
OLD_NAMES = {
    "arguments": {
        "_INT64_MAX": "INT64_MAX", "_Foreign": "Foreign", "_prepare": "prepare_value",
        "_host_number": "host_number", "_count": "checked_count", "_seconds": "checked_seconds",
        "_positive": "checked_positive", "_adapter_values": "adapter_values",
    },
    "readback": {
        "_fold_by_device": "fold_by_device", "_fold_partials": "fold_partials",
        "_poll_readbacks": "poll_readbacks", "_start_readback": "start_readback",
    },
    "window": {
        "_loss_window": "loss_window", "_Readers": "Readers", "_Series": "Series",
        "_Snapshot": "Snapshot", "_span_snapshot": "span_snapshot", "_Window": "Window",
    },
}  # fmt: skip


def load_before(ref: str) -> type:
    """``TrainingMetrics`` as ``ref`` had it, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{ref}:openlora_otel/training/metrics.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    spec = importlib.util.spec_from_loader("openlora_otel.training._metrics_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    lent = []
    for name, renamed in OLD_NAMES.items():
        helpers = importlib.import_module(f"openlora_otel.training.{name}")
        for old, new in renamed.items():
            if not hasattr(helpers, old):
                setattr(helpers, old, getattr(helpers, new))
                lent.append((helpers, old))
    try:
        exec(compile(source, f"{ref}:openlora_otel/training/metrics.py", "exec"), module.__dict__)
    finally:
        for helpers, old in lent:
            delattr(helpers, old)
    return module.TrainingMetrics


def record_variant(cls: type):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[step_duration_view()])
    record = cls(provider.get_meter("bench"), window_histogram=True).record_step

    def step(i: int) -> None:
        record(loss=2.0, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1)

    return step, reader.collect


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000, help="record_step calls per variant per round")
    parser.add_argument("--marks", type=int, default=200_000, help="phase marks per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", default=BEFORE, help=f"git ref of the 'before' record_step (default {BEFORE})")
    args = parser.parse_args()

    steps = {
        "prometheus_client (6 updates)": prometheus_variant(),
        f"record_step before ({args.before})": record_variant(load_before(args.before)),
        "record_step now": record_variant(TrainingMetrics),
    }
    training = TrainingMetrics(MeterProvider().get_meter("bench"))
    mark = training.phase("evaluation")
    null = contextlib.nullcontext()
    clock = time.perf_counter

    def with_mark(i: int) -> None:
        with mark:
            pass

    def with_null(i: int) -> None:
        with null:
            pass

    def two_clock_reads(i: int) -> None:
        clock()
        clock()

    marks = {"phase mark (enter + leave)": with_mark, "empty with nullcontext()": with_null,
             "two perf_counter() calls": two_clock_reads}  # fmt: skip

    step_times: dict[str, list[float]] = {name: [] for name in steps}
    mark_times: dict[str, list[float]] = {name: [] for name in marks}
    for _ in range(args.rounds):
        for name, (step, collect) in steps.items():
            step_times[name].append(time_variant(step, collect, args.steps, collect_every=10_000)[0])
        for name, call in marks.items():
            gc.disable()
            started = time.process_time()
            for i in range(args.marks):
                call(i)
            mark_times[name].append((time.process_time() - started) / args.marks)
            gc.enable()

    before_name, now_name = list(steps)[1:]
    ratios = [now / before for now, before in zip(step_times[now_name], step_times[before_name], strict=True)]
    print(f"CPU time per call, median of {args.rounds} rounds")
    for name, values in {**step_times, **mark_times}.items():
        print(f"  {name:<44}{statistics.median(values) * 1e6:8.3f} us")
    print(
        f"record_step now / before: {statistics.median(ratios):.3f} "
        f"(per-round range {min(ratios):.3f} to {max(ratios):.3f}; target: within noise)"
    )
    yardstick = statistics.median(step_times["prometheus_client (6 updates)"])
    print(
        f"record_step / prometheus_client: before {statistics.median(step_times[before_name]) / yardstick:.2f}, "
        f"now {statistics.median(step_times[now_name]) / yardstick:.2f}"
    )
    print(f"phase mark: {statistics.median(mark_times['phase mark (enter + leave)']) * 1e6:.3f} us (target < 1 us)")


if __name__ == "__main__":
    main()

"""What the run history file (OPENLORA_HISTORY_DIR) costs, side by side with it off.

1. One line on the background thread: a collection plus the OTLP/JSON encoding
   and the append, against the same collection alone (``InMemoryMetricReader``),
   with training and host metrics as a run has them; line size.
2. ``record_step`` on the main thread with no history (twice: the A/A pair
   shows the machine's noise), a line every 5 s (the default) and every 100 ms
   (50 times more often), in alternating rounds: wall and thread CPU per call,
   and each one's ratio to no history.

    python benchmarks/bench_history.py [--rounds 5] [--steps 200000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from openlora_otel import TelemetryConfig, setup_telemetry  # noqa: E402
from openlora_otel.exporters.history_writer import encode_line  # noqa: E402


def _config(history_dir: str | None, interval_ms: float = 86_400_000.0) -> TelemetryConfig:
    return TelemetryConfig(
        exporters=("none",),
        gpu_metrics="off",
        quiet=True,
        handle_sigterm=False,
        history_dir=history_dir,
        history_interval_ms=interval_ms,
    )


def _steps(telemetry, count: int) -> None:
    record = telemetry.training.record_step
    for step in range(count):
        record(loss=2.0 - step * 1e-6, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1)


def one_line(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        reader = InMemoryMetricReader()
        telemetry = setup_telemetry(config=_config(folder), metric_readers=[reader])
        try:
            _steps(telemetry, 100)
            history = telemetry.meter_provider._metric_readers[0]
            collect_only, with_line, encode_only = [], [], []
            size = 0
            for _ in range(repeat):
                _steps(telemetry, 10)
                start = time.thread_time()
                data = reader.get_metrics_data()
                collect_only.append(time.thread_time() - start)
                start = time.thread_time()
                line = encode_line(data)
                encode_only.append(time.thread_time() - start)
                size = len(line)
                start = time.thread_time()
                history.collect()  # collection, encoding and append, as the reader's thread does it
                with_line.append(time.thread_time() - start)
        finally:
            telemetry.shutdown()
    c, w, e = (statistics.median(x) * 1e3 for x in (collect_only, with_line, encode_only))
    print(f"one history line (thread CPU, median of {repeat}), training + host metrics:")
    print(f"  collection alone           {c:7.2f} ms")
    print(f"  collection + encode + write {w:6.2f} ms   ratio {w / c:.1f}x  (encode alone {e:.2f} ms)")
    print(f"  line size                  {size / 1024:7.1f} KiB  ({size * 17280 / 2**20:.0f} MiB/day at the default 5 s)")


def record_step(rounds: int, steps: int) -> None:
    # "off again" is an A/A pair: how far two identical setups drift apart on this machine.
    variants = {"off": None, "off again": None, "every 5 s (default)": 5000.0, "every 100 ms": 100.0}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    lines: dict[str, int] = {}
    for _ in range(rounds):
        for name, interval in variants.items():
            with tempfile.TemporaryDirectory() as folder:
                config = _config(folder if interval else None, interval_ms=interval or 5000.0)
                telemetry = setup_telemetry(config=config)
                _steps(telemetry, 1000)  # warm: every instrument created
                wall0, cpu0 = time.perf_counter(), time.thread_time()
                _steps(telemetry, steps)
                walls[name].append((time.perf_counter() - wall0) / steps * 1e6)
                cpus[name].append((time.thread_time() - cpu0) / steps * 1e6)
                telemetry.shutdown()
                lines[name] = sum(p.read_bytes().count(b"\n") for p in Path(folder).glob("*.jsonl"))
    print(f"\nrecord_step on the main thread, {rounds} alternating rounds of {steps} steps (µs per call, medians):")
    base_wall, base_cpu = statistics.median(walls["off"]), statistics.median(cpus["off"])
    for name in variants:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        print(
            f"  history {name:20} wall {wall:5.2f} ({wall / base_wall:5.3f})   "
            f"thread CPU {cpu:5.2f} ({cpu / base_cpu:5.3f})   {lines[name]} lines in the last round"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    one_line(args.repeat)
    record_step(args.rounds, args.steps)


if __name__ == "__main__":
    main()

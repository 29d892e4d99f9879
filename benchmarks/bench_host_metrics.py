"""What host and process metrics cost, side by side with them off, and proof they stay off the training thread.

Four comparisons, each with ``OPENLORA_HOST_METRICS`` true vs false in one run:

1. one in-memory collection (``InMemoryMetricReader``) of a run with training
   metrics, GPU metrics off: wall and CPU time of the collecting thread;
2. one scrape of the pull endpoint (``GET /metrics``, collection plus text
   exposition): time and bytes;
3. each host metric alone on a bare provider, minus an empty provider's
   collection: which read costs what;
4. ``setup_telemetry()`` in fresh interpreters.

Then the reads of one collection from each source side by side (``/proc`` read directly, on Linux,
and psutil), and a loop that calls ``record_step`` on the main thread while another thread
collects, every read attributed to its thread.

    python benchmarks/bench_host_metrics.py [--repeat 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from openlora_otel import TelemetryConfig, setup_telemetry  # noqa: E402
from openlora_otel.hardware.host import SCOPE_NAME, selection, start_host_metrics  # noqa: E402


def _config(host: bool, **changes: object) -> TelemetryConfig:
    return TelemetryConfig(gpu_metrics="off", host_metrics=host, quiet=True, handle_sigterm=False, **changes)


def _record_some_steps(telemetry) -> None:
    for step in range(50):
        telemetry.training.record_step(
            loss=2.0 - step * 0.01, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1
        )


def _timed(fn, repeat: int) -> tuple[float, float]:
    """Median wall and median thread-CPU seconds of ``fn()``."""
    walls, cpus = [], []
    for _ in range(repeat):
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.thread_time() - cpu0)
    return statistics.median(walls), statistics.median(cpus)


def in_memory(host: bool, repeat: int) -> tuple[float, float, int]:
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=_config(host, exporters=("none",)), metric_readers=[reader])
    try:
        _record_some_steps(telemetry)
        reader.get_metrics_data()  # first collection registers every stream
        wall, cpu = _timed(reader.get_metrics_data, repeat)
        data = reader.get_metrics_data()
        points = sum(
            len(metric.data.data_points)
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        )
    finally:
        telemetry.shutdown()
    return wall, cpu, points


def scrape(host: bool, repeat: int) -> tuple[float, int]:
    telemetry = setup_telemetry(
        config=_config(host, prometheus_host="127.0.0.1", prometheus_port=0, final_scrape_timeout_s=0.0)
    )
    url = telemetry.prometheus_url
    assert url is not None
    size = 0

    def get() -> None:
        nonlocal size
        with urllib.request.urlopen(url, timeout=10) as response:
            size = len(response.read())

    try:
        _record_some_steps(telemetry)
        get()
        wall, _ = _timed(get, repeat)
    finally:
        telemetry.shutdown()
    return wall, size


def per_metric(repeat: int) -> list[tuple[str, int, float]]:
    """(metric, points, added ms per collection) for each metric of the selection alone."""
    chosen = selection(system=True)

    def collect_cost(name: str | None) -> tuple[float, int]:
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        handle = None
        if name is not None:
            handle = start_host_metrics(provider, excluded=[other for other in chosen if other != name])
        try:
            reader.get_metrics_data()
            wall, _ = _timed(reader.get_metrics_data, repeat)
            data = reader.get_metrics_data()
            points = sum(
                len(m.data.data_points)
                for rm in (data.resource_metrics if data else [])
                for sm in rm.scope_metrics
                for m in sm.metrics
            )
        finally:
            if handle is not None:
                handle.stop()
            provider.shutdown()
        return wall, points

    empty, _ = collect_cost(None)
    rows = []
    for name in chosen:
        wall, points = collect_cost(name)
        rows.append((name, points, (wall - empty) * 1000))
    return rows


SETUP = """
import json, sys, time
t0 = time.perf_counter()
from openlora_otel import TelemetryConfig, setup_telemetry
t1 = time.perf_counter()
telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="off", quiet=True,
                                                   handle_sigterm=False, host_metrics=sys.argv[1] == "on"))
t2 = time.perf_counter()
telemetry.shutdown()
print(json.dumps({"import": t1 - t0, "setup": t2 - t1}))
"""


def setup_cost(host: bool, repeat: int) -> float:
    times = []
    # Bytecode written and reused, as an installed package has it: under PYTHONDONTWRITEBYTECODE every
    # module imported at setup would be compiled again in each interpreter (a few ms for the host modules).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "OPENLORA_")) and k != "PYTHONDONTWRITEBYTECODE"
    }
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", SETUP, "on" if host else "off"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        times.append(json.loads(out.splitlines()[-1])["setup"])
    return statistics.median(times)


def source_reads(repeat: int) -> list[tuple[str, float]]:
    """(source, median thread-CPU ms) of every host callback called once, for each source this platform has."""
    import psutil

    from openlora_otel.hardware import host
    from openlora_otel.hardware.procfs import open_procfs

    sources = [source for source in (open_procfs(), host.PsutilSource(psutil)) if source is not None]
    rows = []
    for source in sources:
        readings = host._Readings(source, selection(system=True))
        callbacks = [readings.callback(name) for name in selection(system=True)]
        _, cpu = _timed(lambda callbacks=callbacks: [callback(None) for callback in callbacks], repeat)
        rows.append((source.name, cpu * 1e3))
    return rows


def threads_that_read(seconds: float) -> Counter:
    """Run record_step on the main thread while another thread collects; count the host reads per thread."""
    from openlora_otel.hardware import host

    calls: Counter = Counter()
    real = host._source

    class Counting:
        def __init__(self, inner) -> None:
            self.name = inner.name
            self._inner = inner

        def __getattr__(self, method: str):
            original = getattr(self._inner, method)

            def counting(*args, **kwargs):
                calls[threading.current_thread().name] += 1
                return original(*args, **kwargs)

            return counting

    host._source = lambda: Counting(real())
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=_config(True, exporters=("none",)), metric_readers=[reader])
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            reader.get_metrics_data()
            time.sleep(0.01)

    collector = threading.Thread(target=collect, name="collector")
    try:
        collector.start()
        deadline = time.monotonic() + seconds
        steps = 0
        while time.monotonic() < deadline:
            telemetry.training.record_step(loss=1.0, tokens=8, step_time_s=0.01)
            steps += 1
        calls["(record_step calls on MainThread)"] = steps
    finally:
        stop.set()
        collector.join(10)
        telemetry.shutdown()
        host._source = real
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="collections timed per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="alternating off/on rounds")
    parser.add_argument("--setup-repeat", type=int, default=5, help="fresh interpreters per side")
    args = parser.parse_args()
    if args.repeat < 1 or args.rounds < 1 or args.setup_repeat < 1:
        parser.error("--repeat, --rounds and --setup-repeat must be >= 1")

    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, selection: {', '.join(selection(system=True))}"
    )
    results: dict[tuple[str, bool], list] = {}
    for _ in range(args.rounds):
        for host in (False, True):
            results.setdefault(("mem", host), []).append(in_memory(host, args.repeat))
            results.setdefault(("scrape", host), []).append(scrape(host, args.repeat))

    def med(kind: str, host: bool, index: int) -> float:
        return statistics.median(r[index] for r in results[(kind, host)])

    print("\n1. one in-memory collection (median of round medians)")
    print(f"{'':>22}{'off':>12}{'on':>12}{'on/off':>10}{'added':>12}")
    for label, index, scale, unit in (("wall", 0, 1e3, "ms"), ("CPU (collector)", 1, 1e3, "ms")):
        off, on = med("mem", False, index) * scale, med("mem", True, index) * scale
        print(f"{label + ' ' + unit:>22}{off:>12.3f}{on:>12.3f}{on / off:>10.2f}{on - off:>12.3f}")
    print(f"{'data points':>22}{med('mem', False, 2):>12.0f}{med('mem', True, 2):>12.0f}")

    print("\n2. one scrape of /metrics (collection + exposition)")
    off, on = med("scrape", False, 0) * 1e3, med("scrape", True, 0) * 1e3
    print(f"{'wall ms':>22}{off:>12.3f}{on:>12.3f}{on / off:>10.2f}{on - off:>12.3f}")
    off_b, on_b = med("scrape", False, 1), med("scrape", True, 1)
    print(f"{'bytes':>22}{off_b:>12.0f}{on_b:>12.0f}{on_b / off_b:>10.2f}{on_b - off_b:>12.0f}")

    print(f"\n3. each metric alone ({SCOPE_NAME}), added to an empty provider's collection")
    print(f"{'metric':>26}{'points':>8}{'added ms':>10}")
    for name, points, added in per_metric(args.repeat):
        print(f"{name:>26}{points:>8}{added:>10.3f}")

    print("\n4. setup_telemetry() in a fresh interpreter (median)")
    off, on = setup_cost(False, args.setup_repeat) * 1e3, setup_cost(True, args.setup_repeat) * 1e3
    print(f"{'setup ms':>22}{off:>12.1f}{on:>12.1f}{on / off:>10.2f}{on - off:>12.1f}")

    print("\n5. the reads of one collection, by source (every host callback once; thread CPU, median)")
    rows = source_reads(args.repeat)
    for name, cpu in rows:
        print(f"{name:>22}{cpu:>12.3f} ms" + (f"{cpu / rows[0][1]:>10.2f}x" if len(rows) > 1 else ""))

    print("\n6. host reads by thread while record_step runs on the main thread (2 s)")
    for thread, count in sorted(threads_that_read(2.0).items()):
        print(f"{thread:>40}: {count}")


if __name__ == "__main__":
    main()

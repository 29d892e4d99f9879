"""What `openlora-otel diagnose --prometheus` costs on a 64-rank, 2-hour run: its queries and its time.

The data is bench_rules_cost.py's (its functions, reused): the series one rank really exports (an
in-process ``setup_telemetry()`` with every training argument, and its GPU's series: one H100 of the
fake NVML and the torch allocator's, as a rank on a GPU reports them; ``--no-gpu``: without them,
as before 2026-11-29), ``--ranks`` copies of
them every 15 s over the ``--hours`` ending a minute ago, backfilled with ``promtool tsdb
create-blocks-from openmetrics``. A Prometheus (Debian's 2.42; ``--prometheus3`` for build/bin's) on
that data, without rules. Then, side by side, ``--repeat`` times each:

- ``report``: the run read as `openlora-otel report --prometheus` reads it (its lowest rank's curves);
- ``diagnose``: the run read as `diagnose` reads it (every rank, ``every_rank=True``) and diagnosed.

It prints each one's queries (``PrometheusSource.get`` calls) and median seconds, and their ratio.
The backfilled samples sit in blocks on disk, outside the head: a live Prometheus answers the last
two to three hours from memory, so real reads can be faster than these.

    python benchmarks/bench_diagnose.py [--ranks 64] [--hours 2] [--repeat 3] [--prometheus3] [--no-gpu]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_rules_cost import free_port, get, one_rank_series, write_openmetrics  # noqa: E402

RUN_ID = "bench-rules"  # the run id one_rank_series gives its rank


def start_prometheus(binary: str, data: Path, work: Path) -> tuple[subprocess.Popen, str]:
    config = work / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        try:
            if "Ready" in get(f"{base}/-/ready"):
                return process, base
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"Prometheus did not become ready; see {work / 'prometheus.log'}")
        time.sleep(0.5)


def timed(base: str, every_rank: bool) -> tuple[float, int, object]:
    """Seconds and queries of one read (and diagnosis, with ``every_rank``)."""
    from openlora_otel.report import prometheus as source
    from openlora_otel.report.diagnosis import diagnose

    asked: list[str] = []
    get_ = source.PrometheusSource.get

    def counted(self, path, params):  # type: ignore[no-untyped-def]
        asked.append(path)
        return get_(self, path, params)

    source.PrometheusSource.get = counted  # type: ignore[method-assign]
    try:
        began = time.perf_counter()
        (run,) = source.read_prometheus(base, [RUN_ID], every_rank=every_rank)
        result = diagnose(run) if every_rank else run
        return time.perf_counter() - began, len(asked), result
    finally:
        source.PrometheusSource.get = get_  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--hours", type=float, default=2.0, help="history backfilled, ending a minute ago")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prometheus3", action="store_true", help="build/bin's Prometheus 3 instead of 2.42")
    parser.add_argument("--no-gpu", action="store_true", help="the training series alone, without a GPU's")
    args = parser.parse_args()
    bin_dir = ROOT / "build" / "bin"
    prometheus = str(bin_dir / "prometheus") if args.prometheus3 else shutil.which("prometheus") or "prometheus"
    promtool = str(bin_dir / "promtool") if args.prometheus3 else shutil.which("promtool") or "promtool"
    version = subprocess.run([prometheus, "--version"], capture_output=True, text=True).stdout.split("\n")[0]

    probe = one_rank_series(args.ranks, gpu=not args.no_gpu)
    gpu_series = sum(1 for name, _, _ in probe if name.startswith(("hw_", "openlora_gpu_", "openlora_torch_")))
    work = Path(tempfile.mkdtemp(prefix="bench-diagnose-"))
    try:
        source = work / "ranks.om"
        count, points = write_openmetrics(source, probe, args.ranks, time.time() - 60, args.hours)
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(source), str(work / "data")],
                       check=True)  # fmt: skip
        source.unlink()
        print(f"{args.ranks} ranks, {args.hours:g} h: {count} series x {points} points at 15 s = {count * points:,} "
              f"samples ({gpu_series} of each rank's {len(probe)} series its GPU's); {version}")  # fmt: skip
        process, base = start_prometheus(prometheus, work / "data", work)
        try:
            results = {}
            for name, every_rank in (("report", False), ("diagnose", True)):
                runs = [timed(base, every_rank) for _ in range(args.repeat)]
                results[name] = (statistics.median(s for s, _, _ in runs), runs[0][1], runs[-1][2])
        finally:
            process.terminate()
            process.wait(timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'read':10} {'queries':>8} {'median s':>9}")
    for name, (seconds, queries, _) in results.items():
        print(f"{name:10} {queries:8d} {seconds:9.2f}")
    print(f"ratio diagnose/report: {results['diagnose'][0] / results['report'][0]:.2f}x the time, "
          f"{results['diagnose'][1] / results['report'][1]:.2f}x the queries")  # fmt: skip
    findings = results["diagnose"][2]
    print(f"findings: {len(findings)} {[f.kind for f in findings]}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

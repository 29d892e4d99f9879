"""Scale measured, not extrapolated: --ranks simulated ranks pushed through agent -> gateway -> Thanos Receive, and -> Cortex.

What runs (all on 127.0.0.1, in a temporary directory removed at the end), once per store of
``--stores`` (default ``thanos,cortex``), each on its own so that they do not share the cores:

- the gateway path of tests/support/metrics_paths.py with the shipped files: a Collector agent
  (deploy/collector/agent.yaml) taking OTLP over HTTP, forwarding over OTLP gRPC to a Collector
  gateway (deploy/collector/gateway.yaml), which remote-writes to the store:
  ``thanos``: two Thanos receivers in a hashring (replication 2), Thanos Query over them and the
  ruler, Thanos Ruler evaluating openlora_otel/rules/openlora.yml (deploy/thanos/);
  ``cortex``: Cortex as one process, its ruler evaluating the same rules (deploy/cortex/cortex.yaml);
- ``--processes`` generator processes (tests/support/rank_group.py) holding ``--ranks`` ranks
  between them, each rank a whole ``Telemetry`` with its own Resource (run id, rank, local rank,
  world size, node), the real OTLP exporter every ``--interval-s``, a fake NVML of its node's 8 GPUs
  (each rank exports its own, as ``OPENLORA_GPU_DEVICES=process`` does), a step every ``--step-s``
  with every training metric, an evaluation every 40.

Once every rank's ``target_info`` is in the store and two intervals have passed, over ``--window-s``:
active series and samples/s the store accepted (its own counters), CPU seconds per second and RSS of
every tier's processes (/proc), bytes on the wire per rank per interval (what the agent read from
its sockets, OTLP over HTTP, and what the gateway wrote, remote write: /proc/<pid>/io rchar and
wchar, which count socket traffic; the Collectors read no files meanwhile), points the Collectors
refused or failed to send, and every evaluation of each rule group (the seconds it took, as the
ruler reports it, and the evaluations it missed); then every query of the cluster and training
dashboards (``$run`` the simulated run, ``$__rate_interval`` four intervals, as Grafana makes it),
``--repeats`` times each, p50 and the slowest.

    python benchmarks/bench_scale_out.py [--ranks 1000] [--processes 4] [--interval-s 15]
                                         [--window-s 120] [--stores thanos,cortex] [--json out.json]

On 2 cores everything shares the machine: the figures say where it saturates, and the per-series
and per-sample costs are what the sizing in docs/how-to/beyond-one-prometheus.md is computed from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.dashboards import CLUSTER_DASHBOARD, TRAINING_DASHBOARD, panels, substitute  # noqa: E402
from tests.support.metrics_paths import MetricsPath, push_env  # noqa: E402
from tests.support.polling import wait_until  # noqa: E402

RUN_ID = "scale-out"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
GENERATOR = ROOT / "tests" / "support" / "rank_group.py"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def io_bytes(pid: int) -> tuple[int, int]:
    values = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(values["rchar"]), int(values["wchar"])


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (with ``labels``) in the text exposition at ``url``."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def dashboard_queries(interval_s: float) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the cluster and training dashboards, ``$run`` the run."""
    queries = []
    for path in (CLUSTER_DASHBOARD, TRAINING_DASHBOARD):
        for panel in panels(path):
            for target in panel.get("targets", []):
                # $__rate_interval as Grafana makes it for the ranks' interval: four of them.
                expr = substitute(target["expr"], run=RUN_ID, __rate_interval=f"{4 * interval_s:g}s")
                queries.append((f"{path.stem}: {panel['title']}", expr))
    return queries


def query_series(base_url: str, expr: str, timeout_s: float) -> int:
    """The number of series ``expr`` returns at ``base_url`` (Prometheus' HTTP API)."""
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return len(body["data"]["result"])


def timed_queries(store, repeats: int, interval_s: float, timeout_s: float) -> list[dict]:
    """Each dashboard query ``repeats`` times; one that takes longer than ``timeout_s`` (or fails) is
    counted as such, with ``timeout_s`` as its time."""
    out = []
    for title, expr in dashboard_queries(interval_s):
        took, failed, series = [], 0, 0
        for _ in range(repeats):
            started = time.perf_counter()
            try:
                series = query_series(store.url, expr, timeout_s)
            except (OSError, RuntimeError):
                failed += 1
                took.append(timeout_s)
                continue
            took.append(time.perf_counter() - started)
        out.append(
            {"panel": title, "p50_s": statistics.median(took), "max_s": max(took), "series": series, "failed": failed}
        )
    return out


def rule_evaluations(rules_url: str) -> dict[str, tuple[str, float]]:
    """Each rule group's last evaluation: (when, seconds it took), as the ruler reports it."""
    with urllib.request.urlopen(f"{rules_url}/api/v1/rules", timeout=30) as response:
        groups = json.load(response)["data"]["groups"]
    return {g["name"]: (g.get("lastEvaluation", ""), float(g.get("evaluationTime", 0.0))) for g in groups}


def missed_iterations(metrics_url: str) -> float:
    """Rule group evaluations skipped because the one before had not finished (Thanos Ruler's and
    Cortex's names)."""
    return metric_sum(metrics_url, "prometheus_rule_group_iterations_missed_total") + metric_sum(
        metrics_url, "cortex_prometheus_rule_group_iterations_missed_total"
    )


class Tiers:
    """The processes of each tier, by name, and their CPU and I/O counters."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids

    def snapshot(self) -> dict[str, dict[str, float]]:
        out = {}
        for tier, pids in self.pids.items():
            io = [io_bytes(pid) for pid in pids]
            out[tier] = {
                "cpu_s": sum(cpu_seconds(pid) for pid in pids),
                "rss_bytes": sum(rss_bytes(pid) for pid in pids),
                "read_bytes": sum(r for r, _ in io),
                "written_bytes": sum(w for _, w in io),
            }
        return out


def store_counters(store_name: str, path: MetricsPath) -> tuple[float, float]:
    """(samples accepted so far, active series now) from the store's own metrics. For Thanos the
    samples are summed over the two receivers (each keeps every series: replication 2) and the series
    are one receiver's; Cortex's include the ruler's recorded series."""
    store = path.prometheus
    if store_name == "thanos":
        urls = [f"{r.url}/metrics" for r in store.receivers]
        samples = sum(metric_sum(u, "prometheus_tsdb_head_samples_appended_total") for u in urls)
        series = max(metric_sum(u, "prometheus_tsdb_head_series") for u in urls)
    else:
        url = f"{store.base}/metrics"
        samples = metric_sum(url, "cortex_ingester_ingested_samples_total")
        series = metric_sum(url, "cortex_ingester_memory_series")
    return samples, series


def collector_points(path: MetricsPath) -> dict[str, float]:
    out = {}
    for tier, collector in (("agent", path.collector), ("gateway", path.gateway)):
        url = f"http://127.0.0.1:{collector.ports['self_metrics']}/metrics"
        for key, name in (
            ("accepted", "otelcol_receiver_accepted_metric_points"),
            ("refused", "otelcol_receiver_refused_metric_points"),
            ("send_failed", "otelcol_exporter_send_failed_metric_points"),
        ):
            # With or without the _total suffix, as the Collector's release names them.
            out[f"{tier}_{key}_points"] = metric_sum(url, name) + metric_sum(url, f"{name}_total")
    return out


def run_store(store_name: str, args: argparse.Namespace) -> dict:
    result: dict = {"store": store_name, "ranks": args.ranks, "interval_s": args.interval_s}
    with tempfile.TemporaryDirectory(prefix=f"scale-{store_name}-") as tmp:
        workdir = Path(tmp)
        if args.keep:
            workdir = args.keep / store_name
            workdir.mkdir(parents=True, exist_ok=False)
        rules = workdir / "openlora.yml"
        rules.write_text(RULES.read_text())
        path = MetricsPath(
            "gateway", store_name, workdir, rule_files=[str(rules)], evaluation_interval=args.evaluation_interval
        )
        with path:
            env = {
                **os.environ,
                **push_env(path.otlp_endpoint),
                "OTEL_METRIC_EXPORT_INTERVAL": str(int(args.interval_s * 1000)),
                "OPENLORA_RUN_ID": RUN_ID,
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1",
            }
            per = math.ceil(args.ranks / args.processes)
            generators = []
            started = time.monotonic()
            try:
                for first in range(0, args.ranks, per):
                    count = min(per, args.ranks - first)
                    log = (workdir / f"generator-{first}.log").open("wb")
                    argv = [sys.executable, str(GENERATOR), f"--first-rank={first}", f"--count={count}"]
                    argv += [f"--world-size={args.ranks}", f"--step-s={args.step_s}", f"--max-s={args.max_s}"]
                    generators.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log))
                for generator in generators:
                    line = generator.stdout.readline().decode()
                    if not line.startswith("ready"):
                        raise RuntimeError(f"a generator did not start: {line!r}; see its log in {workdir}")
                result["generators_ready_s"] = time.monotonic() - started
                store = path.prometheus
                reporting = f'count(target_info{{openlora_run_id="{RUN_ID}"}})'

                def all_in() -> bool:
                    found = store.query(reporting)
                    return bool(found) and int(float(found[0]["value"][1])) >= args.ranks

                if not wait_until(all_in, args.max_s / 2, interval=2):
                    raise RuntimeError(f"only {store.query(reporting)} of {args.ranks} ranks reached {store_name}")
                result["all_ranks_in_s"] = time.monotonic() - started
                time.sleep(2 * args.interval_s)

                tiers = {"generators": [g.pid for g in generators], "agent": [path.collector.pid],
                         "gateway": [path.gateway.pid]}  # fmt: skip
                if store_name == "thanos":
                    tiers["receivers"] = [r.pid for r in store.receivers]
                    tiers["query"] = [store.querier.pid]
                    tiers["ruler"] = [store.ruler.pid]
                else:
                    tiers["cortex"] = [store.server.pid]
                processes = Tiers(tiers)
                before = processes.snapshot()
                samples_before, _ = store_counters(store_name, path)
                points_before = collector_points(path)
                ruler_metrics = f"{store.ruler.url}/metrics" if store_name == "thanos" else f"{store.base}/metrics"
                missed_before = missed_iterations(ruler_metrics)
                # Every evaluation of every group in the window, read every few seconds: before the
                # dashboard queries below, which load the same store.
                evaluations: dict[str, dict[str, float]] = {}
                t0 = time.monotonic()
                while time.monotonic() - t0 < args.window_s:
                    for group, (when, took) in rule_evaluations(store.rules_url).items():
                        evaluations.setdefault(group, {})[when] = took
                    time.sleep(min(5.0, max(0.0, args.window_s - (time.monotonic() - t0))))
                after = processes.snapshot()
                samples_after, series = store_counters(store_name, path)
                points_after = collector_points(path)
                window = time.monotonic() - t0
                intervals = window / args.interval_s
                result["window_s"] = window
                result["active_series"] = series
                result["samples_per_s"] = (samples_after - samples_before) / window
                result["tiers"] = {
                    tier: {
                        "cpu_per_s": (after[tier]["cpu_s"] - before[tier]["cpu_s"]) / window,
                        "rss_bytes": after[tier]["rss_bytes"],
                    }
                    for tier in tiers
                }
                result["agent_bytes_in_per_rank_interval"] = (
                    after["agent"]["read_bytes"] - before["agent"]["read_bytes"]
                ) / intervals / args.ranks
                result["gateway_bytes_out_per_rank_interval"] = (
                    after["gateway"]["written_bytes"] - before["gateway"]["written_bytes"]
                ) / intervals / args.ranks
                result["collector_points"] = {k: points_after[k] - points_before[k] for k in points_after}
                result["rules"] = [
                    {
                        "group": group,
                        "evaluations": len(times),
                        "mean_s": statistics.mean(times.values()),
                        "max_s": max(times.values()),
                    }
                    for group, times in evaluations.items()
                ]
                result["missed_iterations"] = missed_iterations(ruler_metrics) - missed_before
                result["queries"] = timed_queries(store, args.repeats, args.interval_s, args.query_timeout_s)
            finally:
                for generator in generators:
                    generator.terminate()
                for generator in generators:
                    try:
                        generator.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        generator.kill()
                        generator.wait()
    return result


def report(results: list[dict]) -> None:
    for r in results:
        print(f"\n== {r['store']}: {r['ranks']} ranks, every {r['interval_s']:g} s, window {r['window_s']:.0f} s ==")
        print(f"generators ready after {r['generators_ready_s']:.0f} s; every rank in the store after "
              f"{r['all_ranks_in_s']:.0f} s")  # fmt: skip
        copies = " on each receiver" if r["store"] == "thanos" else ""
        print(f"active series {r['active_series']:,.0f}{copies} ({r['active_series'] / r['ranks']:.0f} per rank); "
              f"samples accepted {r['samples_per_s']:,.0f}/s")  # fmt: skip
        print(f"bytes per rank per interval: {r['agent_bytes_in_per_rank_interval']:,.0f} into the agent (OTLP/HTTP), "
              f"{r['gateway_bytes_out_per_rank_interval']:,.0f} out of the gateway (remote write)")  # fmt: skip
        print("collector points in the window: " + ", ".join(f"{k} {v:,.0f}" for k, v in r["collector_points"].items()))
        print(f"{'tier':<12}{'CPU (cores)':>12}{'RSS (MiB)':>12}")
        for tier, t in r["tiers"].items():
            print(f"{tier:<12}{t['cpu_per_s']:>12.2f}{t['rss_bytes'] / 2**20:>12.0f}")
        took = sorted(r["queries"], key=lambda q: -q["p50_s"])
        p50s = [q["p50_s"] for q in r["queries"]]
        print(f"{len(took)} dashboard queries: median of p50 {statistics.median(p50s) * 1000:.0f} ms, "
              f"slowest p50 {took[0]['p50_s'] * 1000:.0f} ms, slowest single {max(q['max_s'] for q in took) * 1000:.0f} ms")  # fmt: skip
        failed = sum(q["failed"] for q in r["queries"])
        if failed:
            print(f"  {failed} query runs failed or took longer than the limit (counted at the limit)")
        for q in took[:5]:
            print(f"  {q['p50_s'] * 1000:7.0f} ms p50 {q['max_s'] * 1000:7.0f} ms max  {q['series']:5d} series  {q['panel']}")
        total = sum(g["mean_s"] for g in r["rules"])
        slowest = sorted(r["rules"], key=lambda g: -g["mean_s"])[:4]
        print(f"rules: {len(r['rules'])} groups, {total:.2f} s of evaluation per round (means over the window); "
              f"{r['missed_iterations']:.0f} evaluations missed; slowest: "
              + ", ".join(f"{g['group']} {g['mean_s']:.2f} s (max {g['max_s']:.2f}, {g['evaluations']} seen)" for g in slowest))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4, help="generator processes holding the ranks")
    parser.add_argument("--interval-s", type=float, default=15.0, help="the ranks' OTLP export interval")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds between a rank's steps")
    parser.add_argument("--window-s", type=float, default=120.0, help="the measured window")
    parser.add_argument("--repeats", type=int, default=3, help="times each dashboard query runs")
    parser.add_argument("--query-timeout-s", type=float, default=60.0, help="a dashboard query's limit")
    parser.add_argument("--evaluation-interval", default="15s", help="the rulers' (the shipped 15 s)")
    parser.add_argument("--stores", default="thanos,cortex", help="comma-separated: thanos, cortex")
    parser.add_argument("--max-s", type=float, default=1800.0, help="the generators' own time limit")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", type=Path, help="a new directory to keep the servers' logs and data in")
    args = parser.parse_args()
    results = [run_store(store, args) for store in args.stores.split(",")]
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Scale measured, not extrapolated: --ranks simulated ranks into Thanos and Cortex, pushed through load-balanced gateways and pulled.

What runs (all on 127.0.0.1, in a temporary directory removed at the end), once per store of
``--stores`` (default ``thanos,cortex,thanos-sidecar``), each on its own so that they do not share
the cores:

- ``thanos`` and ``cortex``, pushed: the gateway path of tests/support/metrics_paths.py with the
  shipped files. A Collector agent (deploy/collector/agent.yaml with the overlay
  agent-loadbalancing.yaml, on collector/otelcol-openlora-lb, its resolver a static list) takes OTLP
  over HTTP and load-balances it by ``service.instance.id`` over ``--gateways`` Collector gateways
  (deploy/collector/gateway.yaml; with ``--gateways 1`` the agent sends to the one over OTLP gRPC
  without the overlay), which remote-write to the store. ``thanos``: two Thanos receivers in a
  hashring (replication 2), Thanos Query over them and the ruler, Thanos Ruler evaluating
  openlora_otel/rules/openlora.yml (deploy/thanos/); ``cortex``: Cortex as one process, its ruler
  evaluating the same rules (deploy/cortex/cortex.yaml). The ranks push with the real OTLP exporter
  every ``--interval-s``.
- ``thanos-sidecar``, pulled: every rank serves its own pull endpoint (the real one,
  ``OTEL_METRICS_EXPORTER=prometheus`` on a port of its own: OTEL_EXPORTER_PROMETHEUS_PORT plus its
  RANK), a Prometheus 3 scrapes all of them every ``--interval-s`` and evaluates the rules, its Thanos
  sidecar, a store gateway and Thanos Query over both (the sidecar shape of deploy/thanos/).
- ``--processes`` generator processes (tests/support/rank_group.py) holding ``--ranks`` ranks
  between them, each rank a whole ``Telemetry`` with its own Resource (run id, rank, local rank,
  world size, node), a fake NVML of its node's 8 GPUs (each rank exports its own, as
  ``OPENLORA_GPU_DEVICES=process`` does), a step every ``--step-s`` with every training metric, an
  evaluation every 40.

Once every rank's ``target_info`` is in the store (or, past saturation, after ``--arrival-s``: the
figures then say how many ranks reported and how many collections the rank processes gave up on) and
two intervals have passed, over ``--window-s``:
active series and samples/s the store accepted (its own counters), CPU seconds per second and RSS of
every tier's processes (/proc), bytes on the wire per rank per interval (/proc/<pid>/io rchar and
wchar, which count what a process reads or writes with read() and write(), sockets included, as Go
does: what the agent read, the ranks' OTLP requests; what the gateways wrote, remote write; what
Prometheus read, the ranks' scrape answers; the Collectors and Prometheus read no files meanwhile), how the gateways split the ranks, points
the Collectors refused or failed to send, the scrapes' durations (pulled), and every evaluation of
each rule group (the seconds it took, as the ruler reports it, and the evaluations it missed); then
every query of the cluster and training dashboards (``$run`` the simulated run, ``$__rate_interval``
four intervals, as Grafana makes it), ``--repeats`` times each, one after the other: p50, p99 and
the slowest of those runs (with 10 runs, p99 is the second slowest plus 0.91 of the way to the
slowest: the slow end, not a percentile of thousands). The queries are instant queries at the end of
the run (Grafana's time-series panels ask range queries, which cost more).

    python benchmarks/bench_scale_out.py [--ranks 1000] [--processes 4] [--interval-s 15] [--gateways 2]
                                         [--window-s 120] [--repeats 10] [--stores thanos,cortex,thanos-sidecar]
                                         [--json out.json] [--markdown queries.md]

On 2 cores everything shares the machine: the figures say where it saturates, and the per-series
and per-sample costs are what the sizing in docs/how-to/beyond-one-prometheus.md is computed from.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.dashboards import CLUSTER_DASHBOARD, TRAINING_DASHBOARD, panels, substitute  # noqa: E402
from tests.support.long_term_stores import Cortex, ThanosReceive, ThanosSidecar  # noqa: E402
from tests.support.metrics_paths import MetricsPath, push_env  # noqa: E402
from tests.support.polling import wait_until  # noqa: E402
from tests.support.processes import free_port_range  # noqa: E402

RUN_ID = "scale-out"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
GENERATOR = ROOT / "tests" / "support" / "rank_group.py"
STORES = ("thanos", "cortex", "thanos-sidecar")
PULL_JOB = "openlora"  # the job of the ranks' endpoints in the sidecar shape's Prometheus
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


def exposition(url: str) -> str:
    """The text exposition at ``url`` (a /metrics page)."""
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def metric_total(text: str, *names: str) -> float:
    """The sum of the samples of every one of ``names`` in the exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_sum(url: str, *names: str) -> float:
    """The sum of the samples of ``names`` in the exposition at ``url``, read once."""
    return metric_total(exposition(url), *names)


def dashboard_queries(interval_s: float) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the cluster and training dashboards, ``$run`` the run;
    a panel's second and later queries are titled with their letter (``refId``)."""
    queries = []
    for path in (CLUSTER_DASHBOARD, TRAINING_DASHBOARD):
        for panel in panels(path):
            targets = panel.get("targets", [])
            for target in targets:
                # $__rate_interval as Grafana makes it for the ranks' interval: four of them.
                expr = substitute(target["expr"], run=RUN_ID, __rate_interval=f"{4 * interval_s:g}s")
                which = f" ({target.get('refId', '?')})" if len(targets) > 1 else ""
                queries.append((f"{path.stem}: {panel['title']}{which}", expr))
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
    """Each dashboard query ``repeats`` times, one after the other: p50, p99 (linear between the runs'
    order statistics) and the slowest. A run that takes longer than ``timeout_s`` (or fails) is counted
    as such, with ``timeout_s`` as its time."""
    out = []
    for title, expr in dashboard_queries(interval_s):
        took, failed, series = [], 0, 0
        for _ in range(repeats):
            started = time.perf_counter()
            try:
                series = query_series(store.url, expr, timeout_s)
            except (OSError, RuntimeError, ValueError, http.client.HTTPException):
                failed += 1
                took.append(timeout_s)
                continue
            took.append(time.perf_counter() - started)
        p99 = statistics.quantiles(took, n=100, method="inclusive")[98] if len(took) > 1 else took[0]
        out.append(
            {
                "panel": title,
                "p50_s": statistics.median(took),
                "p99_s": p99,
                "max_s": max(took),
                "series": series,
                "failed": failed,
            }
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
    return metric_sum(
        metrics_url,
        "prometheus_rule_group_iterations_missed_total",
        "cortex_prometheus_rule_group_iterations_missed_total",
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


def store_counters(store_name: str, store) -> tuple[float, float]:
    """(samples accepted so far, active series now) from the store's own metrics. For Thanos Receive
    the samples are summed over the two receivers (each keeps every series: replication 2) and the
    series are one receiver's; Cortex's and the sidecar shape's Prometheus' include the rules'
    recorded series."""
    if store_name == "thanos":
        urls = [f"{r.url}/metrics" for r in store.receivers]
        samples = sum(metric_sum(u, "prometheus_tsdb_head_samples_appended_total") for u in urls)
        series = max(metric_sum(u, "prometheus_tsdb_head_series") for u in urls)
    elif store_name == "cortex":
        url = f"{store.base}/metrics"
        samples = metric_sum(url, "cortex_ingester_ingested_samples_total")
        series = metric_sum(url, "cortex_ingester_memory_series")
    else:
        url = f"{store.prometheus.url}/metrics"
        samples = metric_sum(url, "prometheus_tsdb_head_samples_appended_total")
        series = metric_sum(url, "prometheus_tsdb_head_series")
    return samples, series


def ruler_metrics_url(store_name: str, store) -> str:
    """Where the process evaluating the rules serves its own metrics."""
    if store_name == "thanos":
        return f"{store.ruler.url}/metrics"
    if store_name == "cortex":
        return f"{store.base}/metrics"
    return f"{store.prometheus.url}/metrics"


def collector_points(path: MetricsPath) -> dict[str, float]:
    """Points the agent and the gateways (summed) accepted, refused, and failed to send so far."""
    out: dict[str, float] = {}
    for tier, collectors in (("agent", [path.collector]), ("gateways", path.gateways)):
        pages = [exposition(f"http://127.0.0.1:{c.ports['self_metrics']}/metrics") for c in collectors]
        for key, name in (
            ("accepted", "otelcol_receiver_accepted_metric_points"),
            ("refused", "otelcol_receiver_refused_metric_points"),
            ("send_failed", "otelcol_exporter_send_failed_metric_points"),
        ):
            # With or without the _total suffix, as the Collector's release names them.
            out[f"{tier}_{key}_points"] = sum(metric_total(page, name, f"{name}_total") for page in pages)
    return out


def answer(server, expr: str) -> list[dict] | None:
    """``expr``'s instant result at ``server``, or None when it failed or took too long: a saturated
    machine answers late, and one late figure must not end the measurement."""
    try:
        return server.query(expr)
    except (OSError, AssertionError, ValueError):
        return None


def ranks_by_gateway(store) -> dict[str, int]:
    """How many ranks' ``target_info`` came through each gateway (each stamps its own
    ``deployment.environment.name`` when there are several); empty if the store did not answer."""
    found = answer(store, f'count by (deployment_environment_name) (target_info{{openlora_run_id="{RUN_ID}"}})')
    return {s["metric"].get("deployment_environment_name", "?"): int(float(s["value"][1])) for s in found or []}


def scrape_figures(store, window_s: float) -> dict[str, float]:
    """The sidecar shape's scrapes of the ranks over the window: targets up, mean and slowest duration."""
    window = f"{int(window_s)}s"
    job = f'job="{PULL_JOB}"'

    def one(expr: str) -> float:
        found = answer(store.prometheus, expr)
        return float(found[0]["value"][1]) if found else math.nan

    return {
        "targets_up": one(f"sum(up{{{job}}})"),
        "scrape_mean_s": one(f"avg(avg_over_time(scrape_duration_seconds{{{job}}}[{window}]))"),
        "scrape_max_s": one(f"max(max_over_time(scrape_duration_seconds{{{job}}}[{window}]))"),
        "samples_per_scrape": one(f"avg(scrape_samples_scraped{{{job}}})"),
    }


def collection_timeouts(workdir: Path) -> int:
    """Collections the rank processes gave up on so far (the SDK logs each: that rank's interval is not
    exported): what a rank process past its CPU shows first."""
    return sum(
        log.read_text(errors="replace").count("Metric collection timed out") for log in workdir.glob("generator-*.log")
    )


def start_generators(args: argparse.Namespace, env: dict[str, str], workdir: Path) -> list[subprocess.Popen]:
    """``--processes`` rank groups holding ``--ranks`` ranks, each started and ready (or an error)."""
    per = math.ceil(args.ranks / args.processes)
    generators: list[subprocess.Popen] = []
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
    except BaseException:
        stop_generators(generators)
        raise
    return generators


def stop_generators(generators: list[subprocess.Popen]) -> None:
    for generator in generators:
        generator.terminate()
    for generator in generators:
        try:
            generator.wait(timeout=120)
        except subprocess.TimeoutExpired:
            generator.kill()
            generator.wait()


def run_store(store_name: str, args: argparse.Namespace) -> dict:
    pulled = store_name == "thanos-sidecar"
    result: dict = {
        "store": store_name,
        "ranks": args.ranks,
        "interval_s": args.interval_s,
        "gateways": 0 if pulled else args.gateways,
    }
    with tempfile.TemporaryDirectory(prefix=f"scale-{store_name}-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        if args.keep:
            workdir = args.keep / store_name
            workdir.mkdir(parents=True, exist_ok=False)
        rules = workdir / "openlora.yml"
        rules.write_text(RULES.read_text())
        env = {
            **os.environ,
            "OPENLORA_RUN_ID": RUN_ID,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
        }
        path = None
        if pulled:
            base = free_port_range(args.ranks)
            env.update(
                OTEL_METRICS_EXPORTER="prometheus",
                OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                OTEL_EXPORTER_PROMETHEUS_PORT=str(base),
                OPENLORA_PROMETHEUS_PORT_OFFSET="rank",
            )
            started = time.monotonic()
            generators = start_generators(args, env, workdir)
            stack.callback(stop_generators, generators)
            result["generators_ready_s"] = time.monotonic() - started
            targets = [f"127.0.0.1:{base + rank}" for rank in range(args.ranks)]
            store = ThanosSidecar(
                workdir,
                targets,
                [str(rules)],
                scrape_interval=f"{int(args.interval_s * 1000)}ms",
                evaluation_interval=args.evaluation_interval,
            )
            stack.callback(store.stop)
        else:
            path = stack.enter_context(
                MetricsPath(
                    "gateway",
                    store_name,
                    workdir,
                    rule_files=[str(rules)],
                    evaluation_interval=args.evaluation_interval,
                    gateways=args.gateways,
                )
            )
            store = path.prometheus
            env.update(push_env(path.otlp_endpoint), OTEL_METRIC_EXPORT_INTERVAL=str(int(args.interval_s * 1000)))
            started = time.monotonic()
            generators = start_generators(args, env, workdir)
            stack.callback(stop_generators, generators)
            result["generators_ready_s"] = time.monotonic() - started

        def reporting() -> int:
            found = answer(store, f'count(target_info{{openlora_run_id="{RUN_ID}"}})')
            return int(float(found[0]["value"][1])) if found else 0

        # A machine past saturation never has every rank in at once (their collections time out, their
        # points wait): measure it as it is after --arrival-s, and say so.
        if wait_until(lambda: reporting() >= args.ranks, args.arrival_s, interval=2):
            result["all_ranks_in_s"] = time.monotonic() - started
        elif reporting() == 0:
            raise RuntimeError(f"no rank reached {store_name} in {args.arrival_s:g} s; see the logs in {workdir}")
        else:
            result["all_ranks_in_s"] = None
        time.sleep(2 * args.interval_s)
        timeouts_before = collection_timeouts(workdir)

        tiers: dict[str, list[int]] = {"generators": [g.pid for g in generators]}
        if path is not None:
            tiers["agent"] = [path.collector.pid]
            tiers["gateways"] = [g.pid for g in path.gateways]
        if isinstance(store, ThanosReceive):
            tiers["receivers"] = [r.pid for r in store.receivers]
            tiers["query"] = [store.querier.pid]
            tiers["ruler"] = [store.ruler.pid]
        elif isinstance(store, Cortex):
            tiers["cortex"] = [store.server.pid]
        else:
            tiers["prometheus"] = [store.prometheus.pid]
            tiers["sidecar"] = [store.sidecar.pid]
            tiers["store_gateway"] = [store.store.pid]
            tiers["query"] = [store.querier.pid]
        processes = Tiers(tiers)
        before = processes.snapshot()
        samples_before, _ = store_counters(store_name, store)
        points_before = collector_points(path) if path is not None else {}
        ruler_metrics = ruler_metrics_url(store_name, store)
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
        samples_after, series = store_counters(store_name, store)
        window = time.monotonic() - t0
        result["ranks_reporting"] = reporting()
        result["collection_timeouts"] = collection_timeouts(workdir) - timeouts_before
        per_rank_interval = window / args.interval_s * args.ranks

        def moved(tier: str, key: str) -> float:
            return (after[tier][key] - before[tier][key]) / per_rank_interval

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
        # Not the ranks' own counters: Python sends on its sockets with send(), which wchar does not count.
        wire = {}
        if path is not None:
            wire["agent_read"] = moved("agent", "read_bytes")
            wire["gateways_wrote"] = moved("gateways", "written_bytes")
            result["collector_points"] = {k: v - points_before[k] for k, v in collector_points(path).items()}
            result["ranks_by_gateway"] = ranks_by_gateway(store)
        else:
            wire["prometheus_read"] = moved("prometheus", "read_bytes")
            result["scrapes"] = scrape_figures(store, window)
        result["bytes_per_rank_interval"] = wire
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
    return result


WIRE_NAMES = {
    "agent_read": "read by the agent (OTLP/HTTP)",
    "gateways_wrote": "written by the gateways (remote write)",
    "prometheus_read": "read by Prometheus (scrapes)",
}


def report(results: list[dict]) -> None:
    for r in results:
        how = "pulled" if not r["gateways"] else f"pushed through {r['gateways']} gateway(s)"
        print(f"\n== {r['store']}: {r['ranks']} ranks {how}, every {r['interval_s']:g} s, window {r['window_s']:.0f} s ==")
        arrived = (f"every rank in the store after {r['all_ranks_in_s']:.0f} s" if r["all_ranks_in_s"] is not None
                   else "NOT every rank in the store at once (saturated)")  # fmt: skip
        print(f"generators ready after {r['generators_ready_s']:.0f} s; {arrived}; ranks reporting at the window's "
              f"end {r['ranks_reporting']} of {r['ranks']}; {r['collection_timeouts']} collections the ranks gave up "
              "on in the window")  # fmt: skip
        copies = " on each receiver" if r["store"] == "thanos" else ""
        print(f"active series {r['active_series']:,.0f}{copies} ({r['active_series'] / r['ranks']:.0f} per rank); "
              f"samples accepted {r['samples_per_s']:,.0f}/s")  # fmt: skip
        print("bytes per rank per interval: " + ", ".join(
            f"{v:,.0f} {WIRE_NAMES[k]}" for k, v in r["bytes_per_rank_interval"].items()))  # fmt: skip
        if "collector_points" in r:
            print("collector points in the window: " + ", ".join(f"{k} {v:,.0f}" for k, v in r["collector_points"].items()))
            print("ranks by gateway: " + ", ".join(f"{k} {v}" for k, v in sorted(r["ranks_by_gateway"].items())))
        if "scrapes" in r:
            s = r["scrapes"]
            print(f"scrapes: {s['targets_up']:.0f} targets up, {s['samples_per_scrape']:.0f} samples each, "
                  f"mean {s['scrape_mean_s'] * 1000:.0f} ms, slowest {s['scrape_max_s'] * 1000:.0f} ms")  # fmt: skip
        print(f"{'tier':<14}{'CPU (cores)':>12}{'RSS (MiB)':>12}")
        for tier, t in r["tiers"].items():
            print(f"{tier:<14}{t['cpu_per_s']:>12.2f}{t['rss_bytes'] / 2**20:>12.0f}")
        took = sorted(r["queries"], key=lambda q: -q["p99_s"])
        print(f"{len(took)} dashboard queries: median p50 {statistics.median(q['p50_s'] for q in took) * 1000:.0f} ms, "
              f"median p99 {statistics.median(q['p99_s'] for q in took) * 1000:.0f} ms; "
              f"{sum(q['p99_s'] < 1 for q in took)} with p99 under 1 s; slowest single "
              f"{max(q['max_s'] for q in took) * 1000:.0f} ms")  # fmt: skip
        failed = sum(q["failed"] for q in r["queries"])
        if failed:
            print(f"  {failed} query runs failed or took longer than the limit (counted at the limit)")
        for q in took[:8]:
            print(f"  p50 {q['p50_s'] * 1000:7.0f} ms  p99 {q['p99_s'] * 1000:7.0f} ms  {q['series']:6d} series  {q['panel']}")
        total = sum(g["mean_s"] for g in r["rules"])
        slowest = sorted(r["rules"], key=lambda g: -g["mean_s"])[:4]
        print(f"rules: {len(r['rules'])} groups, {total:.2f} s of evaluation per round (means over the window); "
              f"{r['missed_iterations']:.0f} evaluations missed; slowest: "
              + ", ".join(f"{g['group']} {g['mean_s']:.2f} s (max {g['max_s']:.2f}, {g['evaluations']} seen)" for g in slowest))  # fmt: skip


def markdown(results: list[dict]) -> str:
    """Every dashboard query's p50 / p99 in milliseconds, one column per store, as a Markdown table."""
    header = "| query | " + " | ".join(f"{r['store']} p50 / p99 (ms)" for r in results) + " |"
    lines = [header, "| --- |" + " ---: |" * len(results)]
    for index, query in enumerate(results[0]["queries"]):
        cells = []
        for r in results:
            q = r["queries"][index]
            cell = f"{q['p50_s'] * 1000:,.0f} / {q['p99_s'] * 1000:,.0f}"
            cells.append(cell + (f" ({q['failed']} failed)" if q["failed"] else ""))
        lines.append(f"| {query['panel']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4, help="generator processes holding the ranks")
    parser.add_argument("--interval-s", type=float, default=15.0, help="the ranks' OTLP export interval, or the scrape interval")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds between a rank's steps")
    parser.add_argument("--gateways", type=int, default=2, help="Collector gateways the agent load-balances over (1: no overlay)")
    parser.add_argument("--window-s", type=float, default=120.0, help="the measured window")
    parser.add_argument("--repeats", type=int, default=10, help="times each dashboard query runs")
    parser.add_argument("--query-timeout-s", type=float, default=60.0, help="a dashboard query's limit")
    parser.add_argument("--evaluation-interval", default="15s", help="the rulers' (the shipped 15 s)")
    parser.add_argument("--stores", default=",".join(STORES), help=f"comma-separated, of: {', '.join(STORES)}")
    parser.add_argument("--max-s", type=float, default=3600.0, help="the generators' own time limit")
    parser.add_argument("--arrival-s", type=float, default=300.0, help="how long to wait for every rank to reach the store; then it measures what arrived")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--markdown", type=Path, help="also write every query's p50 / p99 here, a table")
    parser.add_argument("--keep", type=Path, help="a new directory to keep the servers' logs and data in")
    args = parser.parse_args()
    # Stopped (SIGTERM): unwind, so that the servers and rank processes started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stores = args.stores.split(",")
    unknown = [s for s in stores if s not in STORES]
    if unknown:
        parser.error(f"--stores {args.stores!r}: {', '.join(unknown)} unknown (accepted: {', '.join(STORES)})")
    for name in ("ranks", "processes", "gateways", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: at least 1")
    for name in ("interval_s", "step_s", "window_s", "query_timeout_s", "arrival_s", "max_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: a number of seconds above 0")
    results = []
    for store in stores:
        results.append(run_store(store, args))
        report(results[-1:])
        if args.json:  # after each store: a later failure keeps the earlier figures
            args.json.write_text(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text(markdown(results))


if __name__ == "__main__":
    main()

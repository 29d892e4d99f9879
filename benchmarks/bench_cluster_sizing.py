"""Cluster sizing by simulation: many telemetry-only ranks scraped by real Prometheus servers, measured, then extrapolated.

What runs (all on 127.0.0.1, in a temporary directory removed at the end):

- ``--processes`` simulated ranks (default 32), 8 per simulated node, each a
  separate Python process (``_sizing_rank.py``) with the environment torchrun
  would give it (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, LOCAL_WORLD_SIZE)
  plus one OPENLORA_RUN_ID, ``setup_telemetry()`` with a fake NVML of 8 GPUs
  (OPENLORA_GPU_METRICS=on, OPENLORA_GPU_DEVICES=process: each rank exports
  its own GPU) and a step every ``--step-s`` with every training metric.
  Each simulated node has its own base port (OTEL_EXPORTER_PROMETHEUS_PORT)
  and the ranks add LOCAL_RANK to it, the default port offset.
- ``--baseline-processes`` more ranks (default 2) with OTEL_SDK_DISABLED=true,
  same loop: their memory and CPU are the "telemetry off" side.
- One rank with OPENLORA_GPU_DEVICES=all, not scraped: what each rank would
  export if every rank reported every GPU of its node.
- Three Debian Prometheus 2.42 servers: a **direct** one scraping every rank;
  an **agent** (``--enable-feature=agent``) scraping every rank too and
  remote-writing to a **central** one (``--web.enable-remote-write-receiver``).
  All start with no targets; their memory is read (the baseline), then the
  ranks are added by a config reload. None scrapes itself: their own metrics
  are read from their ``/metrics`` by this script, so they add no series.

Measured over ``--window-s`` once every target is up and warm: series per
rank (``count by (instance)`` on the direct and the central server), bytes
per scrape (this script fetches every rank's ``/metrics`` as plain text, as
OpenMetrics, and as Prometheus asks for it: OpenMetrics, gzip), scrape
duration (``scrape_duration_seconds``), samples/s ingested (the increase of
``prometheus_tsdb_head_samples_appended_total``; the agent's
``prometheus_remote_storage_samples_in_total`` and remote-write bytes), each
server's resident memory against its baseline, hence bytes per head series,
and each rank's RSS and CPU against the telemetry-off ranks.

Then the figures are extrapolated to 128 / 1,024 / 4,096 nodes of 8 GPUs at
``--target-interval-s`` (default 15 s, Prometheus's usual interval). What
scales with what: series per rank and bytes per scrape do not depend on the
interval nor on the number of ranks; samples/s and bytes/s are
``ranks * per-rank figure / interval``; head memory is series times the bytes
per series measured here (a young head: see the printed assumptions).

The machine this runs on decides the scrape durations and CPU figures (ranks
and servers share its cores); the counts and byte figures do not depend on it.

    python benchmarks/bench_cluster_sizing.py [--processes 32] [--scrape-interval-s 15] [--window-s 120]
                                              [--json out.json] [--from-json out.json]

A shorter ``--scrape-interval-s 2`` gives numbers in about 2.5 minutes (32
ranks, ``--window-s 90``); ``--from-json`` reprints a saved run's report.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gzip
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = Path(__file__).resolve().with_name("_sizing_rank.py")
GPUS_PER_NODE = 8
JOB = "openlora"
NODE_COUNTS = (128, 1024, 4096)
# Series Prometheus adds to every target on its own, whatever the target serves.
SYNTHETIC_SERIES = (
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
)
# The Accept header Prometheus 2.42 sends (scrape/scrape.go); it also asks for gzip.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
TEXT_ACCEPT = "text/plain;version=0.0.4"
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0"
FAMILIES = (  # (label in the breakdown, series-name prefixes), first match wins
    ("training", ("openlora_training_",)),
    ("GPU", ("hw_", "openlora_gpu_", "openlora_process_gpu_", "openlora_torch_")),
    ("adapter/model", ("openlora_adapter_", "openlora_model_")),
    ("target_info", ("target_info",)),
)
MiB = 2**20
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# -- processes -------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script dies, even by SIGKILL (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Processes:
    """Children started in their own process groups, so each can be ended with everything it started.

    ``stop_all`` ends them (SIGTERM, then SIGKILL after a grace period); if this
    script is killed before it runs, the kernel kills them (``PR_SET_PDEATHSIG``).
    """

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("wb") as handle:
            child = subprocess.Popen(
                args,
                env=env,
                cwd=ROOT,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.children.append(child)
        return child

    def stop_all(self, grace_s: float = 10.0) -> None:
        alive = [c for c in self.children if c.poll() is None]
        for child in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in alive:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=5)


def child_env(**extra: str) -> dict[str, str]:
    """This environment without OTEL_*/OPENLORA_* or torchrun's variables, plus ``extra``."""
    own = ("OTEL_", "OPENLORA_", "TORCHELASTIC_", "CUDA_VISIBLE_DEVICES")
    rank_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(own) and k not in rank_vars}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_block(count: int) -> int:
    """The first port of ``count`` consecutive ports free on 127.0.0.1 right now (bounded search)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        if all(port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free consecutive ports found")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> bytes:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


# -- Prometheus -------------------------------------------------------------------------------


@dataclass
class Server:
    """One Debian Prometheus on loopback: direct, agent or central."""

    name: str
    workdir: Path
    interval_s: float
    agent: bool = False
    receiver: bool = False
    remote_write: str | None = None
    port: int = field(default_factory=lambda: free_port_block(1))
    process: subprocess.Popen | None = None
    rss_samples: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self, targets: list[str]) -> None:
        interval = f"{self.interval_s:g}s"
        lines = [
            "global:",
            f"  scrape_interval: {interval}",
            f"  scrape_timeout: {min(self.interval_s, 10.0):g}s",
            "scrape_configs:",
        ]
        if targets:
            lines += [
                f"  - job_name: {JOB}",
                "    static_configs:",
                "      - targets: [" + ", ".join(f'"{t}"' for t in targets) + "]",
            ]
        else:
            lines[-1] += " []"
        if self.remote_write:
            lines += ["remote_write:", f"  - url: {self.remote_write}"]
        (self.workdir / "prometheus.yml").write_text("\n".join(lines) + "\n")

    def start(self, processes: Processes) -> None:
        self.workdir.mkdir(parents=True)
        self.write_config([])
        args = [
            shutil.which("prometheus") or "/usr/bin/prometheus",
            f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        if self.agent:
            args += ["--enable-feature=agent", f"--storage.agent.path={self.workdir / 'wal'}"]
        else:
            args += [f"--storage.tsdb.path={self.workdir / 'data'}"]
        if self.receiver:
            args.append("--web.enable-remote-write-receiver")
        self.process = processes.start(args, os.environ.copy(), self.workdir / "log")

    def ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} prometheus exited: {(self.workdir / 'log').read_text()[-2000:]}")
        try:
            return http_get(self.url + "/-/ready", timeout=1).startswith(b"Prometheus")
        except OSError:
            return False

    def reload(self, targets: list[str]) -> None:
        """Give it the targets: new config, SIGHUP, and wait for the reload to be reported."""
        before = self.own_metrics().get("prometheus_config_last_reload_success_timestamp_seconds", 0.0)
        self.write_config(targets)
        assert self.process is not None
        time.sleep(1.0)  # the reload timestamp has one-second resolution
        self.process.send_signal(signal.SIGHUP)

        def reloaded() -> bool:
            own = self.own_metrics()
            if own.get("prometheus_config_last_reload_successful") == 0.0:
                raise RuntimeError(
                    f"{self.name} rejected its config: {(self.workdir / 'log').read_text()[-2000:]}"
                )
            return own.get("prometheus_config_last_reload_success_timestamp_seconds", 0.0) > before

        wait_until(f"{self.name} to reload its config", reloaded, 30)

    def own_metrics(self) -> dict[str, float]:
        """Its own /metrics, label sets summed per name (not stored anywhere: it does not scrape itself)."""
        totals: dict[str, float] = {}
        for line in http_get(self.url + "/metrics").decode().splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def query(self, expr: str) -> list[dict]:
        body = json.loads(http_get(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        if body.get("status") != "success":
            raise RuntimeError(f"{self.name}: query {expr!r} failed: {body}")
        return body["data"]["result"]

    def values_by_instance(self, expr: str) -> dict[str, float]:
        return {r["metric"].get("instance", ""): float(r["value"][1]) for r in self.query(expr)}

    def sample_rss(self) -> None:
        assert self.process is not None
        self.rss_samples.append(rss_bytes(self.process.pid))


# -- ranks ------------------------------------------------------------------------------------


@dataclass
class Rank:
    rank: int
    process: subprocess.Popen
    port: int | None  # None: telemetry off (nothing served)
    cpu_start: float = 0.0
    cpu_end: float = 0.0
    rss: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.target}/metrics"


def rank_env(run_id: str, rank: int, world: int, base_port: int, **extra: str) -> dict[str, str]:
    node, local = divmod(rank, GPUS_PER_NODE)
    settings = dict(
        RANK=str(rank),
        LOCAL_RANK=str(local),
        WORLD_SIZE=str(world),
        GROUP_RANK=str(node),
        LOCAL_WORLD_SIZE=str(GPUS_PER_NODE),
        GROUP_WORLD_SIZE=str(-(-world // GPUS_PER_NODE)),
        OPENLORA_RUN_ID=run_id,
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        # Each simulated node gets its own base port; the rank adds LOCAL_RANK (the default offset).
        OTEL_EXPORTER_PROMETHEUS_PORT=str(base_port + node * GPUS_PER_NODE),
        OPENLORA_GPU_METRICS="on",
        OPENLORA_GPU_DEVICES="process",
        # Ending a rank must not wait for one more scrape: the benchmark is over by then.
        OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
        OPENLORA_QUIET="true",
    )
    settings.update(extra)
    return child_env(**settings)


def served_ok(url: str) -> bool:
    try:
        return b"openlora_training_steps_total" in http_get(url, timeout=2)
    except OSError:
        return False


def exposition_samples(text: str) -> list[str]:
    """Series names of every sample line in a text or OpenMetrics exposition."""
    return [
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    ]


def family(name: str) -> str:
    for label, prefixes in FAMILIES:
        if name.startswith(prefixes):
            return label
    return "other"


def fetch_sizes(rank: Rank) -> dict[str, int]:
    text = http_get(rank.url, {"Accept": TEXT_ACCEPT})
    openmetrics = http_get(rank.url, {"Accept": OPENMETRICS_ACCEPT})
    wire = http_get(rank.url, {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
    gzip.decompress(wire)  # it really is gzip
    return {"text": len(text), "openmetrics": len(openmetrics), "wire": len(wire)}


# -- the run ----------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


def fmt_rate(value: float) -> str:
    return fmt_bytes(value) + "/s"


@dataclass
class Fleet:
    """The simulated ranks: scraped ones, telemetry-off ones, and the one exporting every GPU."""

    ranks: list[Rank]
    disabled: list[Rank]
    all_gpus: Rank

    @classmethod
    def start(cls, args: argparse.Namespace, processes: Processes, tmp: Path) -> Fleet:
        world = args.processes
        base_port = free_port_block(world)
        run_id = f"sizing-{os.getpid()}"
        command = [sys.executable, str(RANK_SCRIPT), "--step-s", str(args.step_s), "--max-s", str(args.max_s)]
        ranks = [
            Rank(
                rank,
                processes.start(command, rank_env(run_id, rank, world, base_port), tmp / f"rank{rank}.log"),
                base_port + rank,
            )
            for rank in range(world)
        ]
        off = rank_env(run_id, 0, world, base_port, OTEL_SDK_DISABLED="true")
        disabled = [
            Rank(i, processes.start(command, off, tmp / f"off{i}.log"), None)
            for i in range(args.baseline_processes)
        ]
        all_port = free_port_block(1)
        env = rank_env(
            f"{run_id}-all",
            0,
            1,
            all_port,
            OPENLORA_GPU_DEVICES="all",
            OPENLORA_PROMETHEUS_PORT_OFFSET="none",
        )
        all_gpus = Rank(-1, processes.start(command, env, tmp / "rank-1.log"), all_port)
        fleet = cls(ranks, disabled, all_gpus)

        def serving() -> bool:
            for r in [*ranks, all_gpus]:
                if r.process.poll() is not None:
                    raise RuntimeError(
                        f"rank {r.rank} exited: {(tmp / f'rank{r.rank}.log').read_text()[-2000:]}"
                    )
            return all(served_ok(r.url) for r in [*ranks, all_gpus])

        wait_until(f"{world + 1} ranks to serve /metrics", serving, 60 + 3 * world, poll_s=1.0)
        return fleet


def memory_reading(server: Server) -> dict[str, float]:
    own = server.own_metrics()
    return {
        "rss": median([float(v) for v in server.rss_samples]),
        "heap": own.get("go_memstats_heap_inuse_bytes", 0.0),
        "series": own.get("prometheus_tsdb_head_series", own.get("prometheus_agent_active_series", 0.0)),
    }


def counters(direct: Server, agent: Server, central: Server) -> dict[str, float]:
    d, a, c = direct.own_metrics(), agent.own_metrics(), central.own_metrics()
    return {
        "t": time.monotonic(),
        "samples_s_direct": d["prometheus_tsdb_head_samples_appended_total"],
        "samples_s_central": c["prometheus_tsdb_head_samples_appended_total"],
        "samples_s_agent_in": a["prometheus_remote_storage_samples_in_total"],
        "samples_s_agent_sent": a["prometheus_remote_storage_samples_total"],
        "remote_write_bytes_s": a["prometheus_remote_storage_bytes_total"],
        "cpu_direct": d["process_cpu_seconds_total"],
        "cpu_agent": a["process_cpu_seconds_total"],
        "cpu_central": c["process_cpu_seconds_total"],
    }


def scrape_figures(direct: Server, central: Server, targets: list[str], window_s: float) -> dict:
    """What the servers stored: series per rank and scrape durations (the agent's reach the central server)."""
    window = f"{int(window_s)}s"
    per_rank_direct = direct.values_by_instance(f'count by (instance) ({{job="{JOB}"}})')
    per_rank_central = central.values_by_instance(f'count by (instance) ({{job="{JOB}"}})')
    missing = [t for t in targets if t not in per_rank_direct or t not in per_rank_central]
    if missing:
        raise RuntimeError(f"targets without series: {missing}")
    figures = {
        "series_per_rank_direct": sorted(per_rank_direct.values()),
        "series_per_rank_central": sorted(per_rank_central.values()),
        "samples_scraped_per_rank": sorted(
            direct.values_by_instance(f'scrape_samples_scraped{{job="{JOB}"}}').values()
        ),
    }
    for name, server in (("direct", direct), ("agent", central)):
        mean = server.values_by_instance(f'avg_over_time(scrape_duration_seconds{{job="{JOB}"}}[{window}])')
        peak = server.values_by_instance(f'max_over_time(scrape_duration_seconds{{job="{JOB}"}}[{window}])')
        figures[f"scrape_s_{name}"] = median(list(mean.values()))
        figures[f"scrape_s_{name}_max"] = max(peak.values())
    return figures


def exposition_figures(fleet: Fleet) -> dict:
    """What the ranks serve: bytes per scrape in each format, and series by family."""
    sizes = [fetch_sizes(r) for r in fleet.ranks]
    breakdown: dict[str, int] = {}
    for name in exposition_samples(http_get(fleet.ranks[0].url, {"Accept": TEXT_ACCEPT}).decode()):
        breakdown[family(name)] = breakdown.get(family(name), 0) + 1
    breakdown["Prometheus per target (up, scrape_*)"] = len(SYNTHETIC_SERIES)
    all_names = exposition_samples(http_get(fleet.all_gpus.url, {"Accept": TEXT_ACCEPT}).decode())
    return {
        "breakdown": breakdown,
        "gpu_series_process": breakdown.get("GPU", 0),
        "gpu_series_all": sum(family(n) == "GPU" for n in all_names),
        "bytes_text": median([s["text"] for s in sizes]),
        "bytes_openmetrics": median([s["openmetrics"] for s in sizes]),
        "bytes_wire": median([s["wire"] for s in sizes]),
    }


def run(args: argparse.Namespace) -> dict:
    if shutil.which("prometheus") is None:
        raise SystemExit("the prometheus binary is not installed (Debian package `prometheus`)")
    interval = args.scrape_interval_s
    processes = Processes()
    tmp = Path(tempfile.mkdtemp(prefix="openlora-sizing-"))
    try:
        # Servers first, with no targets: their memory before the ranks are added is the baseline.
        central = Server("central", tmp / "central", interval, receiver=True)
        direct = Server("direct", tmp / "direct", interval)
        agent = Server(
            "agent", tmp / "agent", interval, agent=True, remote_write=f"{central.url}/api/v1/write"
        )
        servers = (direct, agent, central)
        for server in servers:
            server.start(processes)
        for server in servers:
            wait_until(f"the {server.name} prometheus to be ready", server.ready, 60)
        servers_up = time.monotonic()

        fleet = Fleet.start(args, processes, tmp)
        print(f"{args.processes} ranks serving; servers settling for the baseline", file=sys.stderr)
        while time.monotonic() - servers_up < args.settle_s:  # Go runtime and caches warm, no targets yet
            time.sleep(0.5)
        baseline = {}
        for server in servers:
            for _ in range(3):
                server.sample_rss()
                time.sleep(0.3)
            baseline[server.name] = memory_reading(server)
            server.rss_samples.clear()

        targets = [r.target for r in fleet.ranks]
        direct.reload(targets)
        agent.reload(targets)
        up_query = f'count(up{{job="{JOB}"}} == 1)'
        for server in (direct, central):
            wait_until(
                f"{server.name} to see {args.processes} targets up",
                lambda s=server: (
                    (s.query(up_query) or [{"value": [0, "0"]}])[0]["value"][1] == str(args.processes)
                ),
                30 + 4 * interval,
            )
        print("all targets up; warming up, then measuring", file=sys.stderr)
        time.sleep(3 * interval)  # every target scraped a few times, every series created

        # The window: counters at both ends, server memory sampled along the way.
        start = counters(direct, agent, central)
        measured = [*fleet.ranks, *fleet.disabled]
        for r in measured:
            r.cpu_start = cpu_seconds(r.process.pid)
        deadline = start["t"] + args.window_s
        while time.monotonic() < deadline:
            for server in servers:
                server.sample_rss()
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        end = counters(direct, agent, central)
        for r in measured:
            r.cpu_end = cpu_seconds(r.process.pid)
            r.rss = rss_bytes(r.process.pid)
        elapsed = end["t"] - start["t"]

        results: dict = {"processes": args.processes, "scrape_interval_s": interval, "elapsed_s": elapsed}
        results.update({key: (end[key] - start[key]) / elapsed for key in start if key != "t"})
        results.update(scrape_figures(direct, central, targets, args.window_s))
        results.update(exposition_figures(fleet))
        memory = {}
        for server in servers:
            loaded, base = memory_reading(server), baseline[server.name]
            added = loaded["series"] - base["series"]
            memory[server.name] = {
                "rss_baseline": base["rss"],
                "rss": loaded["rss"],
                "series_added": added,
                "rss_per_series": (loaded["rss"] - base["rss"]) / added if added else float("nan"),
                "heap_per_series": (loaded["heap"] - base["heap"]) / added if added else float("nan"),
            }
        results["memory"] = memory

        def cpu(r: Rank) -> float:
            return (r.cpu_end - r.cpu_start) / elapsed

        results["rank_rss_on"] = median([float(r.rss) for r in fleet.ranks])
        results["rank_rss_off"] = median([float(r.rss) for r in fleet.disabled])
        results["rank_cpu_on"] = median([cpu(r) for r in fleet.ranks])
        results["rank_cpu_off"] = median([cpu(r) for r in fleet.disabled])
        return results
    finally:
        processes.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


# -- the report -------------------------------------------------------------------------------


def report(r: dict, target_interval: float) -> None:
    n, interval = r["processes"], r["scrape_interval_s"]
    per_rank = median(r["series_per_rank_direct"])
    exposed = median(r["samples_scraped_per_rank"])
    mem = r["memory"]
    cpu_per_scrape = (r["rank_cpu_on"] - r["rank_cpu_off"]) * interval / 2
    print(
        f"\n== measured: {n} ranks ({n // GPUS_PER_NODE} simulated nodes of {GPUS_PER_NODE}), scrape every {interval:g} s, "
        f"window {r['elapsed_s']:.0f} s =="
    )
    rows = [
        (
            "series per rank, stored (direct; min-max)",
            f"{per_rank:.0f} ({min(r['series_per_rank_direct']):.0f}-{max(r['series_per_rank_direct']):.0f})",
        ),
        ("series per rank, stored (central, via agent)", f"{median(r['series_per_rank_central']):.0f}"),
        ("  of which exposed by the rank (scrape_samples_scraped)", f"{exposed:.0f}"),
        *[(f"    {k}", str(v)) for k, v in r["breakdown"].items()],
        (
            "GPU series per rank, OPENLORA_GPU_DEVICES=process / all",
            f"{r['gpu_series_process']} / {r['gpu_series_all']}",
        ),
        ("bytes per scrape: text 0.0.4", fmt_bytes(r["bytes_text"])),
        ("bytes per scrape: OpenMetrics", fmt_bytes(r["bytes_openmetrics"])),
        ("bytes per scrape: as Prometheus asks (OpenMetrics, gzip)", fmt_bytes(r["bytes_wire"])),
        (
            "scrape duration, direct: median of per-rank means / max",
            f"{r['scrape_s_direct'] * 1000:.1f} ms / {r['scrape_s_direct_max'] * 1000:.1f} ms",
        ),
        (
            "scrape duration, agent: median of per-rank means / max",
            f"{r['scrape_s_agent'] * 1000:.1f} ms / {r['scrape_s_agent_max'] * 1000:.1f} ms",
        ),
        ("samples/s appended, direct", f"{r['samples_s_direct']:,.1f}"),
        (
            "samples/s into the agent / sent by remote write",
            f"{r['samples_s_agent_in']:,.1f} / {r['samples_s_agent_sent']:,.1f}",
        ),
        ("samples/s appended, central", f"{r['samples_s_central']:,.1f}"),
        ("remote-write bytes/s (agent -> central)", fmt_rate(r["remote_write_bytes_s"])),
    ]
    for name in ("direct", "agent", "central"):
        m = mem[name]
        rows.append(
            (
                f"{name}: RSS baseline -> loaded (head series added)",
                f"{fmt_bytes(m['rss_baseline'])} -> {fmt_bytes(m['rss'])} (+{m['series_added']:.0f})",
            )
        )
        rows.append(
            (
                f"{name}: bytes per series, RSS / Go heap in use",
                f"{m['rss_per_series']:,.0f} / {m['heap_per_series']:,.0f}",
            )
        )
    rows += [
        (
            "CPU, cores: direct / agent / central",
            f"{r['cpu_direct']:.3f} / {r['cpu_agent']:.3f} / {r['cpu_central']:.3f}",
        ),
        (
            "rank RSS: telemetry on / OTEL_SDK_DISABLED=true",
            f"{fmt_bytes(r['rank_rss_on'])} / {fmt_bytes(r['rank_rss_off'])}",
        ),
        (
            "rank CPU, cores: on / off (two scrapers per rank)",
            f"{r['rank_cpu_on']:.4f} / {r['rank_cpu_off']:.4f}",
        ),
        (
            "rank CPU per scrape served (on - off, two scrapes per interval)",
            f"{cpu_per_scrape * 1000:.1f} ms",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")

    expected = n * per_rank / interval
    print("\n== ratios ==")
    ratios = [
        ("direct samples/s / (ranks * stored series per rank / interval)", r["samples_s_direct"] / expected),
        ("central samples/s / direct samples/s", r["samples_s_central"] / r["samples_s_direct"]),
        ("agent samples sent / samples in", r["samples_s_agent_sent"] / r["samples_s_agent_in"]),
        ("OpenMetrics bytes / text bytes", r["bytes_openmetrics"] / r["bytes_text"]),
        ("wire (gzip) bytes / OpenMetrics bytes", r["bytes_wire"] / r["bytes_openmetrics"]),
        ("agent RSS / direct RSS (loaded)", mem["agent"]["rss"] / mem["direct"]["rss"]),
        ("central RSS / direct RSS (loaded)", mem["central"]["rss"] / mem["direct"]["rss"]),
        ("rank RSS on / off", r["rank_rss_on"] / r["rank_rss_off"]),
        ("GPU series per rank, all / process", r["gpu_series_all"] / max(1, r["gpu_series_process"])),
    ]
    width = max(len(k) for k, _ in ratios)
    for key, value in ratios:
        print(f"  {key:<{width}}  {value:.3f}")

    bytes_per_series = mem["direct"]["rss_per_series"]
    rw_bytes_per_sample = r["remote_write_bytes_s"] / r["samples_s_agent_sent"]
    agent_rss_per_series = mem["agent"]["rss_per_series"]
    print(
        f"\n== extrapolated: nodes of {GPUS_PER_NODE} GPUs, one rank per GPU, scrape every {target_interval:g} s ==\n"
        f"assumptions: {per_rank:.0f} stored series per rank (this run: each rank exports only its own GPU, "
        f"OPENLORA_GPU_DEVICES=process; with `all` each rank would add {r['gpu_series_all'] - r['gpu_series_process']} more); "
        f"{fmt_bytes(r['bytes_wire'])} per scrape on the wire ({fmt_bytes(r['bytes_openmetrics'])} uncompressed); "
        f"head memory {bytes_per_series:,.0f} B per series (measured above, direct server RSS, young head); "
        f"remote write {rw_bytes_per_sample:.1f} B per sample (measured); "
        f"per-node agent {fmt_bytes(mem['agent']['rss_baseline'])} + {agent_rss_per_series:,.0f} B per series (measured)."
    )
    header = (
        f"  {'nodes':>6} {'ranks':>7} {'series':>11} {'samples/s':>11} {'scraped/s (gzip)':>17} "
        f"{'scraped/s (raw)':>16} {'remote write/s':>15} {'head memory':>12}"
    )
    print(header)
    for nodes in NODE_COUNTS:
        ranks = nodes * GPUS_PER_NODE
        series = ranks * per_rank
        samples = series / target_interval
        print(
            f"  {nodes:>6,} {ranks:>7,} {series:>11,.0f} {samples:>11,.0f} "
            f"{fmt_rate(ranks * r['bytes_wire'] / target_interval):>17} "
            f"{fmt_rate(ranks * r['bytes_openmetrics'] / target_interval):>16} "
            f"{fmt_rate(samples * rw_bytes_per_sample):>15} {fmt_bytes(series * bytes_per_series):>12}"
        )
    node_series = GPUS_PER_NODE * per_rank
    print(
        f"  per node agent: {node_series:,.0f} series, {node_series / target_interval:,.1f} samples/s, "
        f"remote write {fmt_rate(node_series / target_interval * rw_bytes_per_sample)}, "
        f"RSS about {fmt_bytes(mem['agent']['rss_baseline'] + node_series * agent_rss_per_series)}"
    )
    print(
        f"  per rank: {fmt_bytes(r['rank_rss_on'] - r['rank_rss_off'])} RSS for telemetry, "
        f"{cpu_per_scrape / target_interval * 100:.3f} % of a core for one scraper (as measured per scrape)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--processes", type=int, default=32, help="simulated ranks, 8 per node (default 32; try 64)"
    )
    parser.add_argument(
        "--scrape-interval-s", type=float, default=15.0, help="scrape interval of the run (default 15)"
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=None,
        help="measurement window (default 8 scrape intervals, at least 60 s)",
    )
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds between simulated optimizer steps")
    parser.add_argument("--baseline-processes", type=int, default=2, help="ranks with OTEL_SDK_DISABLED=true")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=15.0,
        help="servers run this long with no targets before the baseline",
    )
    parser.add_argument(
        "--target-interval-s", type=float, default=15.0, help="scrape interval of the extrapolation"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the measured figures here")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="print the report of an earlier --json, run nothing"
    )
    args = parser.parse_args()
    if args.from_json:
        report(json.loads(args.from_json.read_text()), args.target_interval_s)
        return
    if args.processes < 1 or args.scrape_interval_s < 1:
        parser.error("--processes must be >= 1 and --scrape-interval-s >= 1")
    if args.window_s is None:
        args.window_s = max(60.0, 8 * args.scrape_interval_s)
    # Every rank stops by itself after this, even if this script is killed.
    args.max_s = args.settle_s + args.window_s + 10 * args.scrape_interval_s + 300 + 3 * args.processes
    # SIGTERM unwinds like Ctrl-C, so run()'s cleanup ends every child and removes the temp dir.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    results = run(args)
    report(results, args.target_interval_s)
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

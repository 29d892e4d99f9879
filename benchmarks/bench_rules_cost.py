"""What the recording and alerting rules cost a Prometheus that holds the series of 64 training ranks.

- the series one rank really exports: an in-process ``setup_telemetry()`` (Prometheus exporter,
  no GPU, no host metrics, the rank attributes torchrun would give) records a few steps with every
  argument, an evaluation phase and ``record_eval``, and its ``/metrics`` is fetched once. That is
  the whole training set: every training series, goodput's ``openlora_training_time_seconds_total``
  with its 8 phases, run info, outcome, ``target_info``. No GPU series (a rank on a GPU node adds
  its GPUs' series; the ``openlora-gpu`` group then has work, here it evaluates over nothing).
- ``--ranks`` copies of that set (instance ``node<k>:<9464 + local rank>``, 8 ranks a node,
  ``target_info``'s rank labels per rank, one run id, job ``openlora``) plus ``up`` and
  ``scrape_duration_seconds``, every 15 s over the ``--hours`` ending a minute ago: counters grow at
  a steady rate with a little jitter, gauges vary. Written as OpenMetrics and backfilled with
  ``promtool tsdb create-blocks-from openmetrics``.
- a Prometheus (Debian's ``prometheus`` 2.42; ``--prometheus3`` for ``build/bin/prometheus``) on
  that data directory with ``openlora_otel/rules/openlora.yml``, evaluation_interval 15 s, no scrape
  targets. After ``--evals`` evaluations it reads its own ``/metrics`` at each one:
  ``prometheus_rule_group_last_duration_seconds`` per group (median of the readings), the rules per
  group, the total and goodput's share; then, through the query API, the series it holds
  (``count({__name__=~".+"})``) and those the recording rules added (``count({__name__=~".*:.*"})``).

The backfilled samples sit in blocks on disk, outside the head: the rules read them through the
querier, as a real Prometheus reads data older than the head's two to three hours. In a real server
the recent samples (the 5 m to 1 h windows most rules read) are in the head, in memory, so real
evaluations can be faster than these; the [2h] windows reach into blocks there too.

    python benchmarks/bench_rules_cost.py [--ranks 64] [--hours 2] [--evals 5] [--prometheus3] [--keep DIR]
        [--baseline-rules FILE]

``--baseline-rules FILE`` evaluates another rules file too (an earlier version of openlora.yml), on a copy
of the same data, and prints the two side by side with their ratio per group.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
INTERVAL_S = 15
RANKS_PER_NODE = 8
BASE_PORT = 9464
STEP_S = 0.5  # a step every half second
TOKENS_PER_STEP = 8 * 2048
SAMPLES_PER_STEP = 8
# Each phase's share of wall time after startup (productive is the rest).
PHASE_SHARE = {"data_wait": 0.05, "evaluation": 0.04, "checkpoint_save": 0.01, "checkpoint_load": 0.0,
               "lost_progress": 0.0, "idle": 0.0}  # fmt: skip
STARTUP_S = 95.0
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_rank_series(world_size: int, *, gpu: bool = False) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample one rank's /metrics serves; ``gpu``: with its GPU's series (one
    H100 of the fake NVML, tests/support/fake_nvml.py, and the torch allocator's, as a rank on a GPU reports them)."""
    from openlora_otel import setup_telemetry
    from openlora_otel.config import TelemetryConfig
    from openlora_otel.names import (
        GROUP_RANK_ATTRIBUTE,
        LOCAL_RANK_ATTRIBUTE,
        RANK_ATTRIBUTE,
        WORLD_SIZE_ATTRIBUTE,
    )

    rank_attributes = {RANK_ATTRIBUTE: "0", LOCAL_RANK_ATTRIBUTE: "0",
                       WORLD_SIZE_ATTRIBUTE: str(world_size), GROUP_RANK_ATTRIBUTE: "0"}  # fmt: skip
    if gpu:
        from openlora_otel.hardware import gpu as gpu_metrics
        from openlora_otel.hardware import nvml
        from tests.support.fake_nvml import FakeNvml, h100s

        fake = FakeNvml(h100s(1))
        nvml.load_pynvml_backend = lambda: fake
        stats = {"allocated_bytes.all.current": 20 * 2**30, "reserved_bytes.all.current": 22 * 2**30,
                 "allocated_bytes.all.peak": 21 * 2**30, "num_ooms": 0, "num_alloc_retries": 0}  # fmt: skip
        uuid = fake.gpus[0].uuid.removeprefix("GPU-")
        gpu_metrics.torch_allocator_stats = lambda: [(0, uuid, dict(stats))]
    config = TelemetryConfig(exporters=("prometheus",), prometheus_host="127.0.0.1", prometheus_port=free_port(),
                             gpu_metrics="on" if gpu else "off", gpu_devices="all", host_metrics=False, quiet=True,
                             run_id="bench-rules", resource_attributes=rank_attributes)  # fmt: skip
    telemetry = setup_telemetry(config=config)
    try:
        training = telemetry.training
        for step in range(1, 6):
            training.record_step(loss=2.0 / step, grad_norm=1.1, learning_rate=2e-4, tokens=TOKENS_PER_STEP,
                                 samples=SAMPLES_PER_STEP, data_time_s=0.01)  # fmt: skip
        with training.phase("evaluation"):
            time.sleep(0.01)
        training.record_eval(loss=1.2, accuracy=0.6)
        url = telemetry.prometheus_url
        assert url is not None
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        telemetry.shutdown()
    series = []
    for line in text.splitlines():
        match = LINE.match(line)
        if not line or line.startswith("#") or match is None:
            continue
        labels = {k: v for k, v in LABEL.findall(match.group(2) or "")}
        series.append((match.group(1), labels, float(match.group(3))))
    return series


def label_text(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def value_function(name: str, labels: dict[str, str], probe: float, rank: int, start: float):
    """A function of (t) for one series of one rank: counters grow, gauges vary."""
    rng = random.Random(f"{name}{label_text(labels)}{rank}")
    phase0 = rng.uniform(0, 6.28)
    rate = 1.0 / STEP_S * (1.0 + 0.01 * (rank % 5))  # steps per second, slightly different per rank

    def steps(t: float) -> float:
        return max(0.0, (t - start - STARTUP_S) * rate)

    if name in ("target_info", "openlora_run_info", "openlora_run_outcome"):
        return lambda t: 1.0
    if name == "openlora_training_steps_total":
        return lambda t: float(int(steps(t)))
    if name == "openlora_training_tokens_total":
        return lambda t: float(int(steps(t)) * TOKENS_PER_STEP)
    if name == "openlora_training_samples_total":
        return lambda t: float(int(steps(t)) * SAMPLES_PER_STEP)
    if name == "openlora_training_time_seconds_total":
        phase = labels.get("openlora_training_phase", "")
        if phase == "startup":
            return lambda t: STARTUP_S
        share = PHASE_SHARE.get(phase, 1.0 - sum(PHASE_SHARE.values()))
        return lambda t: max(0.0, (t - start - STARTUP_S) * share)
    if name.endswith("_total"):  # non-finite counts, steps lost: stay at 0
        return lambda t: 0.0
    if name == "openlora_training_step_duration_seconds_count":
        return lambda t: float(int(steps(t)))
    if name == "openlora_training_step_duration_seconds_sum":
        return lambda t: int(steps(t)) * STEP_S
    if name == "openlora_training_step_duration_seconds_bucket":
        le = labels["le"]
        share = 1.0 if le == "+Inf" else 1.0 / (1.0 + math.exp(-(float(le) - STEP_S) / 0.05))
        return lambda t: float(int(int(steps(t)) * share))
    if name == "openlora_training_last_step_timestamp_seconds":
        return lambda t: t - rng.uniform(0.0, STEP_S)
    if name == "openlora_training_loss" or name.startswith("openlora_training_loss_"):
        scale = {"openlora_training_loss_max": 1.1, "openlora_training_loss_min": 0.9}.get(name, 1.0)
        return lambda t: (
            scale * (0.5 + 1.5 / math.sqrt(1.0 + steps(t) / 100.0) + 0.02 * math.sin(t / 60 + phase0))
        )
    if name == "openlora_training_eval_loss":
        return lambda t: 0.6 + 1.5 / math.sqrt(1.0 + steps(t) / 100.0)
    if name == "openlora_training_data_wait_fraction":
        return lambda t: PHASE_SHARE["data_wait"] * (1.0 + 0.2 * math.sin(t / 60 + phase0))
    if name == "openlora_training_data_wait_duration_seconds":
        return lambda t: PHASE_SHARE["data_wait"] * STEP_S * (1.0 + 0.2 * math.sin(t / 60 + phase0))
    if name == "openlora_training_window_steps":
        return lambda t: INTERVAL_S / STEP_S
    if name.startswith("openlora_training_throughput_"):
        per_step = TOKENS_PER_STEP if "tokens" in name else SAMPLES_PER_STEP
        return lambda t: per_step * rate * (1.0 + 0.03 * math.sin(t / 45 + phase0))
    if name.startswith(("hw_", "openlora_gpu_", "openlora_torch_")):
        # A healthy GPU: states, limits, link widths and zeros stay as read; the rest wanders by 2 %.
        if not probe or name.startswith(("hw_status", "hw_gpu_memory_limit", "openlora_gpu_pcie")) or "info" in name:
            return lambda t: probe
        return lambda t: probe * (1.0 + 0.02 * math.sin(t / 90 + phase0))
    base = probe if probe else 1.0
    return lambda t: base * (1.0 + 0.1 * math.sin(t / 90 + phase0))


def write_openmetrics(path: Path, probe, ranks: int, end: float, hours: float) -> tuple[int, int]:
    """Every sample of every rank, time-major (the backfill wants each series' samples in order)."""
    start = end - hours * 3600
    start -= start % INTERVAL_S
    run_start = start - 600  # the run began ten minutes before the window
    series = []  # (prefix "name{labels} ", fn)
    for rank in range(ranks):
        node, local = divmod(rank, RANKS_PER_NODE)
        target = {"job": "openlora", "instance": f"node{node}:{BASE_PORT + local}"}
        for name, labels, value in probe:
            labels = {**labels, **target}
            if name == "target_info":
                labels.update(openlora_rank=str(rank), openlora_local_rank=str(local),
                              openlora_world_size=str(ranks), openlora_group_rank=str(node),
                              host_name=f"node{node}", process_pid=str(1000 + local),
                              service_instance_id=f"00000000-0000-4000-8000-{rank:012d}")  # fmt: skip
            fn = value_function(name, labels, value, rank, run_start)
            series.append((name + label_text(labels) + " ", fn))
        series.append(("up" + label_text(target) + " ", lambda t: 1.0))
        jitter = random.Random(rank)
        series.append(("scrape_duration_seconds" + label_text(target) + " ",
                        lambda t, j=jitter: 0.004 + j.uniform(0, 0.003)))  # fmt: skip
    points = 0
    with path.open("w") as out:
        t = start
        while t <= end:
            stamp = f" {t:.0f}\n"
            out.write("".join(prefix + repr(fn(t)) + stamp for prefix, fn in series))
            points += 1
            t += INTERVAL_S
        out.write("# EOF\n")
    return len(series), points


def get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def query(base: str, expr: str) -> float:
    body = json.loads(get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def group_metrics(text: str, metric: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            match = re.search(r'rule_group="[^"]*;([^"]+)"', line)
            if match:
                values[match.group(1)] = float(line.rsplit(" ", 1)[1])
    return values


def run_prometheus(
    binary: str, data: Path, work: Path, evals: int, rules: Path = RULES
) -> tuple[dict, dict, float, float, list]:
    config = work / "prometheus.yml"
    config.write_text(f"global:\n  evaluation_interval: {INTERVAL_S}s\n  scrape_interval: {INTERVAL_S}s\n"
                      f"rule_files:\n  - {rules}\nscrape_configs: []\n")  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if "Ready" in get(f"{base}/-/ready"):
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"Prometheus did not become ready; see {work / 'prometheus.log'}")
            time.sleep(0.5)
        readings: dict[str, list[float]] = {}
        seen_at: dict[str, float] = {}
        deadline = time.monotonic() + (evals + 2) * INTERVAL_S + 30
        while time.monotonic() < deadline:
            text = get(f"{base}/metrics")
            stamps = group_metrics(text, "prometheus_rule_group_last_evaluation_timestamp_seconds")
            durations = group_metrics(text, "prometheus_rule_group_last_duration_seconds")
            for group, stamp in stamps.items():
                if stamp > 0 and seen_at.get(group) != stamp:
                    seen_at[group] = stamp
                    readings.setdefault(group, []).append(durations[group])
            if readings and min(len(v) for v in readings.values()) >= evals:
                break
            time.sleep(1.0)
        rules = group_metrics(text, "prometheus_rule_group_rules")
        total_series = query(base, 'count({__name__=~".+"})')
        recorded = query(base, 'count({__name__=~".*:.*"})')
        firing = json.loads(get(f"{base}/api/v1/alerts"))["data"]["alerts"]
        goodput = query(base, "avg(run:openlora_training_goodput:ratio1h)")
        return readings, rules, total_series, recorded, firing, goodput
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--hours", type=float, default=2.0, help="history backfilled, ending a minute ago")
    parser.add_argument("--evals", type=int, default=5, help="evaluations read per group")
    parser.add_argument("--prometheus3", action="store_true", help="build/bin's Prometheus 3 instead of 2.42")
    parser.add_argument("--keep", type=Path, help="keep the OpenMetrics file, data and log in this directory")
    parser.add_argument(
        "--baseline-rules",
        type=Path,
        metavar="FILE",
        help="also evaluate this rules file (an earlier openlora.yml, say: git show REV:openlora_otel/rules/openlora.yml)"
        " on a copy of the same data, before the shipped one, and print both with their ratio per group",
    )
    args = parser.parse_args()
    if args.prometheus3:
        prometheus, promtool = (
            str(ROOT / "build" / "bin" / "prometheus"),
            str(ROOT / "build" / "bin" / "promtool"),
        )
    else:
        prometheus, promtool = (
            shutil.which("prometheus") or "prometheus",
            shutil.which("promtool") or "promtool",
        )
    version = subprocess.run([prometheus, "--version"], capture_output=True, text=True).stdout.split("\n")[0]

    probe = one_rank_series(args.ranks)
    print(f"one rank exports {len(probe)} series ({len({n for n, _, _ in probe})} names); {version}")

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-rules-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    try:
        began = time.monotonic()
        end = time.time() - 60
        source = work / "ranks.om"
        count, points = write_openmetrics(source, probe, args.ranks, end, args.hours)
        written = time.monotonic() - began
        print(f"{args.ranks} ranks: {count} series x {points} points at {INTERVAL_S} s = {count * points:,} samples, "
              f"{source.stat().st_size / 2**20:.0f} MiB written in {written:.0f} s")  # fmt: skip
        began = time.monotonic()
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(source), str(data)],
                       check=True)  # fmt: skip
        print(f"backfilled in {time.monotonic() - began:.0f} s; newest sample {time.time() - end:.0f} s old "
              f"at Prometheus start (lookback 5 m)")  # fmt: skip
        if not args.keep:
            source.unlink()

        baseline: dict[str, float] = {}
        if args.baseline_rules:
            # A copy of the data before either Prometheus writes to it (each adds its recorded series).
            baseline_work = work / "baseline"
            shutil.rmtree(baseline_work, ignore_errors=True)
            baseline_work.mkdir()
            shutil.copytree(data, baseline_work / "data")
            base_readings, *_ = run_prometheus(
                prometheus, baseline_work / "data", baseline_work, args.evals, args.baseline_rules.resolve()
            )
            baseline = {group: statistics.median(values) for group, values in base_readings.items()}
        readings, rules, total_series, recorded, firing, goodput_ratio = run_prometheus(
            prometheus, data, work, args.evals
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f'\nseries held: {total_series:.0f} (count({{__name__=~".+"}})), recorded by the rules: {recorded:.0f}'
    )
    names = sorted({f"{a['labels']['alertname']} ({a['state']})" for a in firing})
    print(f"alerts pending or firing: {len(firing)} {', '.join(names)}")
    print(f"run:openlora_training_goodput:ratio1h = {goodput_ratio:.3f} (the data's productive share: 0.90)")
    print(f"\n{'group':24} {'rules':>5} {'evals':>5} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    medians = {}
    for group in sorted(readings):
        values = readings[group]
        medians[group] = statistics.median(values)
        print(f"{group:24} {rules.get(group, 0):5.0f} {len(values):5d} {medians[group] * 1e3:10.2f} "
              f"{min(values) * 1e3:8.2f} {max(values) * 1e3:8.2f}")  # fmt: skip
    total = sum(medians.values())
    print(f"{'total':24} {sum(rules.values()):5.0f} {'':5} {total * 1e3:10.2f}")
    goodput = medians.get("openlora-goodput", 0.0)
    print(f"goodput group's share: {goodput / total:.1%}; evaluation wall time {total / INTERVAL_S:.2%} "
          f"of the {INTERVAL_S} s interval")  # fmt: skip
    if baseline:
        print(
            f"\nside by side with {args.baseline_rules} (median ms per evaluation, on a copy of the same data)"
        )
        print(f"{'group':24} {'baseline':>9} {'shipped':>9} {'ratio':>6}")
        for group in sorted(set(baseline) | set(medians)):
            old, new = baseline.get(group, 0.0), medians.get(group, 0.0)
            ratio = f"{new / old:6.2f}" if old else f"{'-':>6}"
            print(f"{group:24} {old * 1e3:9.2f} {new * 1e3:9.2f} {ratio}")
        old_total = sum(baseline.values())
        print(f"{'total':24} {old_total * 1e3:9.2f} {total * 1e3:9.2f} {total / old_total:6.2f}")
    print("MEDIANS_JSON " + json.dumps({g: round(v * 1e3, 3) for g, v in medians.items()}))


if __name__ == "__main__":
    main()

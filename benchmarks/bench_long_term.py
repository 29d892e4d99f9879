"""Thirty days of a 64-rank run in a Thanos bucket, compacted and downsampled, and every panel of the
training and cluster dashboards asked for those 30 days through Thanos Query, raw and downsampled.

- the series: one simulated rank (tests/support/rank_group.py's ``start_rank``: a whole Telemetry with
  a fake NVML of its node's 8 GPUs, host metrics on, a torch allocator, one XID, the divergence
  guard) records steps and evaluations, and its ``/metrics`` is read twice (GPU activity is a rate of
  two readings); that is one rank's set, on the pull path (the sidecar shape: a Prometheus scrapes the ranks). 64 copies
  (8 nodes of 8), each with its rank's identity on ``target_info`` and its own GPU, plus ``up``.
  Counters grow at a steady rate in proportion to the steps (each rank a little faster or slower),
  gauges vary, the losses fall, timestamps follow the clock.
- the recorded series: the shipped rules evaluated by a Prometheus 3 over the last hour of those
  series; each record's series then extends over the 30 days with the value it had (varying by 2 %).
  The rules are not evaluated over the 30 days (a month of evaluations would take longer than the rest
  together); their label sets are the rules' own.
- the blocks: written by benchmarks/blockgen (Prometheus's block writer, Go), a sample every
  ``--interval`` (15 s, the shipped scrape interval) from 30 days ago to ten minutes ago, in 2-hour
  blocks, each with the Thanos metadata a sidecar gives its uploads (external labels cluster and
  replica), into a directory bucket.
- ``thanos compact`` (deploy/thanos/compact.default, run once instead of ``--wait``, and
  ``--consistency-delay=0s`` since every block was just made) compacts them (2 h, 8 h, 2 d, 14 d) and
  downsamples (5 m for blocks of 40 h and more, 1 h for those of 10 days and more); its time is printed.
- a store gateway over the bucket, Thanos Query over the store (deploy/thanos/*.default), and every
  panel query of grafana/dashboards/openlora-training.json and openlora-cluster.json over the 30 days
  as Grafana asks it: a range query with the step Grafana uses for that range (30 min: a panel of
  about 1,000 points, 43 min, rounded down) and ``$__rate_interval`` as Grafana computes it (step +
  scrape interval), or, for an instant target, one query at the end with ``$__range`` the 30 days; at
  each ``max_source_resolution``: raw, 5m, 1h and auto (Query's choice: a fifth of the step). Per
  query: seconds (the best of ``--repeats``), series and points returned, and against raw: the points
  missing (after the first step, which no downsampled chunk starts early enough to give) and the
  largest difference of a point, relative to the largest value of its series.

    python benchmarks/bench_long_term.py [--days 30] [--ranks 64] [--interval 15] [--repeats 2] [--keep DIR]
        [--json FILE]

``--keep DIR`` keeps the bucket; run again with the same DIR, the queries run again on it (the bucket
is made once).

Needs build/bin/thanos and build/bin/prometheus (tools/build.sh thanos prometheus) and Go (blockgen is
built on the first run). About 30 GB of disk for 30 days of 64 ranks at 15 s (the compacted sources
stay in the bucket, marked for deletion).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from openlora_otel.hardware import gpu  # noqa: E402
from openlora_otel.training.guard import DivergenceGuard  # noqa: E402
from tests.support.built import built  # noqa: E402
from tests.support.dashboards import panels, substitute  # noqa: E402
from tests.support.long_term_stores import (  # noqa: E402
    THANOS,
    bucket_config,
    thanos_query,
    thanos_store,
    wait_for_stores,
)
from tests.support.processes import free_port  # noqa: E402
from tests.support.prometheus_server import Prometheus  # noqa: E402
from tests.support.rank_group import start_rank  # noqa: E402
from tests.support.shipped import rewrite_args, shipped_args  # noqa: E402

BLOCKGEN = ROOT / "benchmarks" / "blockgen"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
DASHBOARDS = [ROOT / "grafana" / "dashboards" / f"openlora-{name}.json" for name in ("training", "cluster")]
RANKS_PER_NODE = 8
BASE_PORT = 9464
RUN_ID = "long-term-bench"
PROBE_STEPS = 20
STEP_RATE = 2.0  # steps per second
EXTERNAL_LABELS = {"cluster": "openlora-bench", "replica": "0"}
STEP_S = 1800  # Grafana's step for a 30-day range on a panel of about 1,000 points
RESOLUTIONS = ("0s", "5m", "1h", "auto")
RARE_EVENTS = ("nonfinite", "error", "xid", "trips", "remap", "lost", "restart")
CONSTANT_GAUGES = ("_info", "_link_", "limit", "peak", "trainable", "params", "lora", "world", "flops_per_token")


# -- the series ------------------------------------------------------------------------------------


def probe_rank() -> list[tuple[str, dict[str, str], float, str]]:
    """(name, labels, value, type) of every sample one simulated rank serves on /metrics."""
    env = {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(free_port()),
        "OPENLORA_RUN_ID": RUN_ID,
        "OPENLORA_RUN_NAME": "a month of LoRA",
    }
    telemetry, fake = start_rank(0, RANKS_PER_NODE, env, host_metrics=True)
    # The torch allocator of the rank's GPU, as torch.cuda.memory_stats() would give it.
    stats = {"allocated_bytes.all.current": 30 * 2**30, "reserved_bytes.all.current": 34 * 2**30,
             "allocated_bytes.all.peak": 32 * 2**30}  # fmt: skip
    uuid = fake.gpus[0].uuid.removeprefix("GPU-")
    gpu.torch_allocator_stats = lambda: [(0, uuid, stats)]
    try:
        training = telemetry.training
        training.set_model_flops(6 * 7e9, peak_flops=989e12)
        training.attach_guard(DivergenceGuard())
        url = telemetry.prometheus_url
        assert url is not None
        urllib.request.urlopen(url, timeout=10).read()  # the first collection registers the GPUs for events
        fake.inject_xid(fake.gpus[0], 31)  # one XID (a page fault), so its series exists
        for step in range(1, PROBE_STEPS + 1):
            training.record_step(loss=2.0 / math.sqrt(step), grad_norm=1.0, learning_rate=2e-4, tokens=8 * 2048,
                                 samples=8, step_time_s=1 / STEP_RATE, data_time_s=0.05)  # fmt: skip
            training.record_epoch(step / 1000)
        training.record_eval(loss=1.9, accuracy=float("nan"))  # one evaluation that counted nothing
        training.record_eval(loss=1.9, accuracy=0.5)
        time.sleep(0.5)
        text = urllib.request.urlopen(url, timeout=10).read().decode()  # the second: GPM rates, the XID
    finally:
        telemetry.shutdown()
    return [
        (sample.name, dict(sample.labels), float(sample.value), family.type)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def model(name: str, kind: str, value: float, rng: random.Random, speed: float) -> tuple[str, list[float]]:
    """The blockgen model of one series of a rank that takes ``speed`` steps a second."""
    phase = rng.uniform(0, 2 * math.pi)
    counter = kind in ("counter", "histogram") or name.endswith(("_total", "_count", "_sum", "_bucket"))
    if name.endswith("_created"):
        return "const", [value]
    if counter and any(part in name for part in RARE_EVENTS):
        return "const", [value]  # counts of faults and losses: what the probe saw, not growing
    if counter:
        # In proportion to the steps: the probe's value after PROBE_STEPS steps, at this rank's speed.
        return ("linear", [0.0, value / PROBE_STEPS * speed / STEP_RATE]) if value else ("const", [0.0])
    if name.endswith("_timestamp_seconds"):
        return "now", [rng.uniform(0.0, 1.0)]
    if "loss" in name and "nonfinite" not in name:
        # From about twice the value to half of it over the month.
        return "decay", [0.5 * value, 1.5 * value, 1.0 / 86400, 0.02 * value, phase]
    if value in (0.0, 1.0) or any(part in name for part in CONSTANT_GAUGES):
        return "const", [value]  # states, flags, link widths, limits, sizes: they hold
    return "sine", [value, 0.1, rng.uniform(60, 600), phase]


def rank_series(probe, ranks: int) -> list[dict]:
    """Every series of ``ranks`` ranks from the probe of one, as blockgen's spec lines."""
    lines = []
    for rank in range(ranks):
        node, local = divmod(rank, RANKS_PER_NODE)
        target = {"job": "openlora", "instance": f"node{node}:{BASE_PORT + local}"}
        rng = random.Random(rank)
        speed = STEP_RATE * rng.uniform(0.97, 1.03)  # each rank a little faster or slower
        for name, labels, value, kind in probe:
            labels = {**labels, **target, "__name__": name}
            if name == "target_info":
                labels.update(openlora_rank=str(rank), openlora_local_rank=str(local),
                              openlora_group_rank=str(node), openlora_world_size=str(ranks),
                              host_name=f"node{node}", service_instance_id=f"rank-{rank}")  # fmt: skip
            # The probe's rank reports its own GPU, index 0: this rank reports GPU ``local`` of its node.
            labels = {k: (f"{v}-node{node}-gpu{local}" if v.startswith("GPU-") else v) for k, v in labels.items()}
            if "openlora_gpu_index" in labels:
                labels["openlora_gpu_index"] = str(local)
            kind_model, params = model(name, kind, value, rng, speed)
            lines.append({"labels": labels, "model": kind_model, "p": params})
        lines.append({"labels": {**target, "__name__": "up"}, "model": "const", "p": [1.0]})
    return lines


def write_spec(path: Path, lines: list[dict]) -> None:
    with path.open("w") as out:
        for line in lines:
            out.write(json.dumps(line) + "\n")


def blockgen(spec: Path, out: Path, start: int, end: int, interval: int) -> str:
    binary = BLOCKGEN / "blockgen"
    if not binary.exists():
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath -buildvcs=false", "GOTOOLCHAIN": "local"}
        subprocess.run(["go", "build", "-o", str(binary), "."], cwd=BLOCKGEN, check=True, env=env)
    done = subprocess.run([str(binary), "-spec", str(spec), "-out", str(out), "-start", str(start),
                           "-end", str(end), "-interval", str(interval)],
                          check=True, capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip()


def recorded_series(workdir: Path, spec_lines: list[dict], interval: int) -> list[dict]:
    """The shipped rules' records over the last hour of ``spec_lines``, as constant-ish spec lines."""
    end = int(time.time()) - 30
    spec = workdir / "hour.jsonl"
    write_spec(spec, spec_lines)
    blockgen(spec, workdir / "data", end - 3600, end, interval)
    prometheus = Prometheus(workdir, [], rule_files=[str(RULES)], major=3, evaluation_interval=f"{interval}s",
                            extra_args=("--storage.tsdb.retention.time=2d",))  # fmt: skip
    try:
        time.sleep(4 * interval + 5)  # four evaluations of every group
        result = prometheus.query('{__name__=~".+:.+"}')
    finally:
        prometheus.stop()
    made = {series["metric"]["__name__"] for series in result}
    shipped = {rule["record"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
               if "record" in rule}  # fmt: skip
    if shipped - made:
        print(f"records the rules gave no series for: {', '.join(sorted(shipped - made))}")
    rng = random.Random(0)
    lines = []
    for series in result:
        value = float(series["value"][1])
        if not math.isfinite(value):
            continue
        params = [value, 0.02, rng.uniform(60, 600), rng.uniform(0, 6.28)] if value else [0.0]
        lines.append({"labels": series["metric"], "model": "sine" if value else "const", "p": params})
    return lines


def to_thanos_bucket(blocks: Path, bucket: Path) -> int:
    """Give each block the Thanos metadata a sidecar's upload has, and move it into the bucket."""
    bucket.mkdir(parents=True, exist_ok=True)
    count = 0
    for block in sorted(blocks.iterdir()):
        meta_path = block / "meta.json"
        if not meta_path.exists():
            continue
        meta = json.loads(meta_path.read_text())
        files = sorted(p for p in block.rglob("*") if p.is_file() and p.name != "meta.json")
        meta["thanos"] = {
            "version": 1,
            "labels": EXTERNAL_LABELS,
            "downsample": {"resolution": 0},
            "source": "sidecar",
            "segment_files": [p.name for p in files if p.parent.name == "chunks"],
            "files": [{"rel_path": str(p.relative_to(block)), "size_bytes": p.stat().st_size} for p in files]
            + [{"rel_path": "meta.json"}],
        }
        meta_path.write_text(json.dumps(meta, indent=1))
        shutil.move(str(block), str(bucket / block.name))
        count += 1
    return count


def bucket_blocks(bucket: Path) -> list[dict]:
    """The metadata of the blocks in the bucket, less those the compactor marked for deletion."""
    return [
        json.loads(meta.read_text())
        for meta in bucket.glob("*/meta.json")
        if not (meta.parent / "deletion-mark.json").exists()
    ]


def blocks_size(bucket: Path, metas: list[dict]) -> int:
    return sum(p.stat().st_size for meta in metas for p in (bucket / meta["ulid"]).rglob("*") if p.is_file())


def compact(workdir: Path, bucket_yml: Path) -> float:
    args = [a for a in shipped_args(THANOS / "compact.default") if a != "--wait"]
    args = rewrite_args(args, {"--data-dir": str(workdir / "compact"), "--objstore.config-file": str(bucket_yml),
                               "--http-address": "127.0.0.1:0"})  # fmt: skip
    started = time.monotonic()
    log = workdir / "compact.log"
    with log.open("wb") as out:
        done = subprocess.run([built("thanos"), "compact", *args, "--consistency-delay=0s",
                               "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"thanos compact failed: {log.read_text()[-3000:]}")
    return time.monotonic() - started


# -- the queries -----------------------------------------------------------------------------------


def query_range(url: str, expr: str, start: int, end: int, resolution: str, instant: bool) -> tuple[float, dict]:
    """A panel target as Grafana asks it: over the range at the step, or (``instant``) once at its end."""
    params = {"query": expr, "dedup": "true", "max_source_resolution": resolution}
    if instant:
        api, params["time"] = "query", str(end)
    else:
        api = "query_range"
        params.update(start=str(start), end=str(end), step=str(STEP_S))
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(f"{url}/api/v1/{api}?{urllib.parse.urlencode(params)}", timeout=600) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as error:  # Query's own refusals (a timeout, a limit) say why in the body
        text = error.read().decode(errors="replace")
        try:
            body = json.loads(text)
        except ValueError:
            body = {"status": "error", "error": f"HTTP {error.code}: {text[:300]}"}
    return time.perf_counter() - began, body


def points(body: dict) -> dict[tuple, float]:
    out = {}
    for series in body["data"]["result"]:
        key = tuple(sorted(series["metric"].items()))
        for t, v in series.get("values") or [series["value"]]:
            out[(*key, ("@", t))] = float(v)
    return out


def compare(raw: dict[tuple, float], other: dict[tuple, float], after: float) -> tuple[int, float]:
    """The raw points after ``after`` missing from ``other``, and the largest difference of a point in
    both, relative to the largest value of its series in the raw answer. (The first point of a range
    has no downsampled chunk to start from: it is left out.)"""
    scale: dict[tuple, float] = {}
    for key, value in raw.items():
        if math.isfinite(value):
            scale[key[:-1]] = max(scale.get(key[:-1], 0.0), abs(value))
    missing, worst = 0, 0.0
    for key, value in raw.items():
        if float(key[-1][1]) <= after:
            continue
        if key not in other:
            missing += 1
        elif math.isfinite(value) and math.isfinite(other[key]):
            worst = max(worst, abs(other[key] - value) / max(scale[key[:-1]], 1e-12))
    return missing, worst


def run_queries(url: str, start: int, end: int, interval: int, repeats: int) -> list[dict]:
    rate_interval = f"{STEP_S + interval}s"
    rows = []
    for path in DASHBOARDS:
        for panel in panels(path):
            for target in panel["targets"]:
                expr = substitute(target["expr"], run=RUN_ID, job="openlora", __rate_interval=rate_interval,
                                  __range=f"{end - start}s", __interval=f"{STEP_S}s")  # fmt: skip
                row = {"dashboard": path.stem, "panel": panel["title"], "expr": expr,
                       "instant": bool(target.get("instant"))}  # fmt: skip
                raw_points = None
                for resolution in RESOLUTIONS:
                    times, body = [], {}
                    for _ in range(repeats):
                        seconds, body = query_range(url, expr, start, end, resolution, target.get("instant", False))
                        times.append(seconds)
                    if body.get("status") != "success":
                        row[resolution] = {"error": body.get("error", body), "after_s": seconds}
                        continue
                    got = points(body)
                    entry = {"s": min(times), "series": len(body["data"]["result"]), "points": len(got)}
                    # A partial answer: a store failed part of it (Grafana shows these). PromQL's own
                    # notes ("PromQL info: metric might not be a counter", for a record's name) are not.
                    warnings = [w for w in body.get("warnings") or [] if not w.startswith("PromQL info:")]
                    if warnings:
                        entry["warnings"] = warnings
                    if resolution == "0s":
                        raw_points = got
                    elif raw_points is not None:
                        entry["missing"], entry["max_rel_diff"] = compare(raw_points, got, start + STEP_S)
                    row[resolution] = entry
                rows.append(row)
                cells = "  ".join(f"{res} {row[res]['s']:.2f} s" if "s" in row[res] else f"{res} error"
                                  for res in RESOLUTIONS if res in row)  # fmt: skip
                print(f"  {path.stem[9:]:8} {panel['title'][:44]:44} {cells}", flush=True)
    return rows


def summary(rows: list[dict]) -> None:
    print(f"\n{len(rows)} panel queries over the 30 days, step {STEP_S} s:")
    header = f"{'resolution':>10} {'median s':>9} {'p90 s':>7} {'max s':>7} {'empty':>6} {'losing points':>14} " \
             f"{'differing >1%':>14}"
    print(header)
    for resolution in RESOLUTIONS:
        entries = [r[resolution] for r in rows if "s" in r.get(resolution, {})]
        if not entries:
            continue
        seconds = sorted(e["s"] for e in entries)
        p90 = seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))]
        empty = sum(1 for e in entries if e["points"] == 0)
        losing = sum(1 for e in entries if e.get("missing", 0) > 0)
        differing = sum(1 for e in entries if e.get("max_rel_diff", 0) > 0.01)
        print(f"{resolution:>10} {statistics.median(seconds):9.3f} {p90:7.3f} {seconds[-1]:7.3f} {empty:6d} "
              f"{losing:14d} {differing:14d}")  # fmt: skip
    errors = [(r["panel"], res, r[res]["error"]) for r in rows for res in RESOLUTIONS if "error" in r.get(res, {})]
    errors += [(r["panel"], res, "partial: " + "; ".join(r[res]["warnings"])[:300])
               for r in rows for res in RESOLUTIONS if "warnings" in r.get(res, {})]  # fmt: skip
    for panel, resolution, error in errors:
        print(f"  error at {resolution}: {panel}: {error}")
    print("\nslowest raw queries:")
    for row in sorted(rows, key=lambda r: -r.get("0s", {}).get("s", 0))[:8]:
        cells = "  ".join(f"{res} {row[res]['s']:.2f} s" for res in RESOLUTIONS if "s" in row.get(res, {}))
        print(f"  {row['panel'][:48]:48} {cells}")
    print("\nempty raw (nothing of the kind in these runs):")
    for row in rows:
        if row.get("0s", {}).get("points") == 0:
            print(f"  {row['panel'][:48]:48} {row['expr'][:100]}")
    print("\nempty when downsampled (raw has points):")
    for row in rows:
        if row.get("0s", {}).get("points"):
            gone = [res for res in RESOLUTIONS[1:] if row.get(res, {}).get("points") == 0]
            if gone:
                print(f"  {row['panel'][:48]:48} empty at {', '.join(gone)}: {row['expr'][:90]}")


def make_bucket(workdir: Path, args: argparse.Namespace) -> None:
    """The month's blocks in ``workdir/bucket``, compacted and downsampled; what each step took."""
    probe = probe_rank()
    ranks = rank_series(probe, args.ranks)
    print(f"one rank: {len(probe)} series; {args.ranks} ranks: {len(ranks)} series")
    (workdir / "hour").mkdir(exist_ok=True)
    records = recorded_series(workdir / "hour", ranks, args.interval)
    print(f"recorded by the shipped rules over the last hour: {len(records)} series")
    spec = workdir / "month.jsonl"
    write_spec(spec, ranks + records)
    end = int(time.time()) - 600
    end -= end % args.interval
    start = end - int(args.days * 86400)
    print("blockgen:", blockgen(spec, workdir / "blocks", start, end, args.interval))
    uploaded = to_thanos_bucket(workdir / "blocks", workdir / "bucket")
    size = blocks_size(workdir / "bucket", bucket_blocks(workdir / "bucket"))
    print(f"bucket: {uploaded} blocks of 2 h, {size / 2**30:.2f} GiB")
    seconds = compact(workdir, bucket_config(workdir))
    print(f"thanos compact: {seconds:.0f} s")


def describe_bucket(bucket: Path) -> tuple[int, int]:
    """Print the blocks by resolution; the time range of the data (Unix seconds, end exclusive)."""
    blocks = bucket_blocks(bucket)
    by_resolution: dict[int, list[dict]] = {}
    for meta in blocks:
        by_resolution.setdefault(meta["thanos"]["downsample"]["resolution"], []).append(meta)
    print(f"{len(blocks)} blocks in the bucket (the compacted sources, marked for deletion, left out):")
    for resolution, metas in sorted(by_resolution.items()):
        spans = sorted((m["maxTime"] - m["minTime"]) / 3.6e6 for m in metas)
        samples = sum(m["stats"]["numSamples"] for m in metas)
        print(f"  resolution {resolution / 1000:.0f} s: {len(metas)} blocks of {', '.join(f'{h:.0f}' for h in spans)} h,"
              f" {blocks_size(bucket, metas) / 2**30:.2f} GiB, {samples / 1e6:.0f} M samples")  # fmt: skip
    raw = by_resolution[0]
    return min(m["minTime"] for m in raw) // 1000, max(m["maxTime"] for m in raw) // 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--interval", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it; a bucket a run left "
                        "there is queried again, not made again")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every query's figures here")
    args = parser.parse_args()
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="bench-long-term-"))
    workdir.mkdir(parents=True, exist_ok=True)
    servers = []
    try:
        if not (workdir / "compacted").exists():
            make_bucket(workdir, args)
            (workdir / "compacted").touch()
        start, end = describe_bucket(workdir / "bucket")
        store_grpc = free_port()
        servers.append(thanos_store(workdir, bucket_config(workdir), store_grpc))
        query = thanos_query(workdir, [f"127.0.0.1:{store_grpc}"])
        servers.append(query)
        wait_for_stores(query, 1, timeout=120)
        rows = run_queries(query.url, start, end, args.interval, args.repeats)
        summary(rows)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    finally:
        for server in reversed(servers):
            server.stop()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

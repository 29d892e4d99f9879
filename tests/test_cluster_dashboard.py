"""grafana/dashboards/openlora-cluster.json: generated, well formed, and every query on a real two-rank run.

Two training-like processes (RANK 0 and 1 of WORLD_SIZE 2, one OPENLORA_RUN_ID, a fake
NVML each, different step times, the slow one waiting for data most of its step) are
scraped by a real Prometheus that loads the `openlora-ranks` recording rules; every
query of the cluster dashboard must return data, and the values must say which rank is
the slow one, and why.

The helpers here (the rank processes, the rules file, running a dashboard's queries)
are shared with tests/test_scaleout.py, which runs the same queries against the
central stores a Prometheus agent remote-writes to.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from openlora_otel.names import ADAPTER_METRICS, GPU_METRICS, RUN_METRICS, TRAINING_METRICS
from tests.conftest import child_env, reap
from tests.metrics_paths import METRIC_PATHS

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"
CLUSTER_DASHBOARD = GRAFANA / "dashboards" / "openlora-cluster.json"
TRAINING_DASHBOARD = GRAFANA / "dashboards" / "openlora-training.json"

# The shipped rules file; it must define every record the cluster dashboard reads.
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"

# Recorded series the cluster dashboard reads (the issue-10 contract's names, then issue 11's
# per-rank data wait and MFU).
CONTRACT_RECORDS = (
    "rank:openlora_training_step_duration_seconds:mean2m",
    "run:openlora_training_step_duration_seconds:median2m",
    "run:openlora_training_step_duration_seconds:max2m",
    "rank:openlora_training_straggler_ratio:2m",
    "rank:openlora_training_last_step_age_seconds",
    "run:openlora_ranks_reporting:count",
    "run:openlora_world_size:max",
    "run:openlora_training_throughput_tokens_per_second:sum",
    "rank:openlora_training_data_wait_fraction:avg2m",
    "rank:openlora_training_model_flops_utilization:avg2m",
    "rank:openlora_gpu_status:max",
    "rank:openlora_gpu_xid_errors:sum",
    "rank:openlora_gpu_throttle:ratio2m",
)


# STAND-IN, for tests only: the contract's records with the expression shapes it describes,
# so that the dashboard can be run before the real group exists. Not shipped, not the
# reference: openlora_otel/rules/openlora.yml is. PromQL cannot turn a label into a value, so the
# stand-in's world size enumerates the sizes this test can meet.
def rules_text() -> str:
    """The rules the stores load: the shipped file."""
    return RULES.read_text()


def rules_in(path: Path) -> list[dict]:
    """Every rule of a rules file, recording and alerting."""
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def write_rules(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "openlora.yml"
    path.write_text(rules_text())
    return path


# -- the training-like rank processes ----------------------------------------------------------

# One rank: setup_telemetry() from the environment torchrun would set (and OPENLORA_RUN_NAME),
# its learning rate and LoRA r as hyperparameters, a fake NVML of
# WORLD_SIZE GPUs (the rank reports its own, by LOCAL_RANK), the adapter, a divergence guard,
# the model's FLOPs per token and its device's peak (argv[4], argv[5]), and steps of argv[1]
# seconds, of which argv[2] waiting for the batch, until SIGTERM (the SIGTERM guard shuts
# telemetry down) or argv[3] seconds. The first evaluation of LOCAL_RANK 1 has nothing to
# count (an empty shard): its accuracy is NaN.
RANK_SCRIPT = r"""
import os, sys, time
from openlora_otel import setup_telemetry
from openlora_otel.hardware import gpu, nvml
from openlora_otel.training.guard import DivergenceGuard
from tests.fake_nvml import FakeNvml, h100s

step_s, data_s, lifetime_s = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
flops_per_token, peak_flops = float(sys.argv[4]), float(sys.argv[5])
local_rank = int(os.environ["LOCAL_RANK"])
cards = h100s(int(os.environ["WORLD_SIZE"]), processes={os.getpid(): 2 * 2**30})
for index, card in enumerate(cards):
    card.utilization = 0.3 + 0.4 * index  # 0.3 and 0.7 on two GPUs: the node's mean is 0.5
# Rank 1's GPU has a row remap pending (degraded until a reset), so the cluster's GPU status
# panel has a rank to put first.
cards[1 % len(cards)].remap = (1, 0, 1, 0)
fake = FakeNvml(cards)
nvml.load_pynvml_backend = lambda: fake
# Rank 0's GPU reports one application XID (31, a page fault: no alert), as a cluster of any
# size sees now and then, so the XID panel has data; injected once the GPU is registered for
# events (at the first collection), as the driver delivers none before.
xid_card = cards[local_rank] if local_rank == 0 else None
stats = {"allocated_bytes.all.current": 10, "reserved_bytes.all.current": 20, "allocated_bytes.all.peak": 15}
uuid = cards[local_rank].uuid.removeprefix("GPU-")
gpu.torch_allocator_stats = lambda: [(local_rank, uuid, stats)]
telemetry = setup_telemetry("openlora-cluster-test", hyperparameters={"learning_rate": 1e-4, "lora_r": 8})
training = telemetry.training
training.set_adapter(r=8, alpha=16, dropout=0.05, target_modules=["q_proj", "v_proj"],
                     trainable_params=4096, total_params=1_000_000)
training.attach_guard(DivergenceGuard())
training.set_model_flops(flops_per_token, peak_flops=peak_flops)
print(telemetry.prometheus_url, flush=True)
deadline = time.monotonic() + lifetime_s
step = 0
while time.monotonic() < deadline:
    fetch = time.perf_counter()
    time.sleep(data_s)
    data_time = time.perf_counter() - fetch
    time.sleep(step_s - data_s)
    step += 1
    if xid_card is not None and xid_card.uuid in fake.registered:
        fake.inject_xid(xid_card, 31)
        xid_card = None
    training.record_step(
        loss=3.0 / (1 + step / 100), grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4,
        data_time_s=data_time,
    )
    if step % 10 == 0:
        accuracy = float("nan") if local_rank == 1 and step == 10 else 0.5
        training.record_eval(loss=3.5 / (1 + step / 100), accuracy=accuracy)
        training.record_epoch(step / 1000)
telemetry.shutdown()
"""


# The ranks' model: 1 MFLOP per token on a device of 100 GFLOP/s, so 512 tokens every 20 ms is
# an MFU of about a quarter.
FLOPS_PER_TOKEN, PEAK_FLOPS = 1e6, 1e11


def free_port_range(count: int) -> int:
    """A base port such that base .. base + count - 1 are all free on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


class Ranks:
    """``len(step_seconds)`` rank processes of one run on this host, on base_port + LOCAL_RANK.

    ``data_seconds``: how much of each rank's step is spent waiting for its batch (none by default).
    ``push_env``: push the metrics this way (tests/metrics_paths.py) instead of serving them; each rank's
    service.instance.id, its ``instance`` label then, is ``<run_id>-rank<RANK>``, and ``targets`` lists those.
    """

    def __init__(
        self,
        run_id: str,
        step_seconds: list[float],
        *,
        data_seconds: list[float] | None = None,
        lifetime_s: float = 300.0,
        extra_env: dict[str, str] | None = None,
        run_name: str | None = None,
        push_env: dict[str, str] | None = None,
    ) -> None:
        data_seconds = data_seconds or [0.0] * len(step_seconds)
        assert len(data_seconds) == len(step_seconds)
        assert all(0 <= data <= step for data, step in zip(data_seconds, step_seconds, strict=True))
        self.run_id = run_id
        self.run_name = run_name or f"name of {run_id}"
        self.world_size = len(step_seconds)
        self.base_port = free_port_range(self.world_size)
        self.processes: list[subprocess.Popen] = []
        # Output to files, not pipes: a pipe nobody reads would block a chatty rank.
        self.logs = [tempfile.TemporaryFile() for _ in step_seconds]  # noqa: SIM115 (closed in stop())
        self.push = push_env is not None
        if self.push:
            self.targets = [f"{run_id}-rank{rank}" for rank in range(self.world_size)]
        else:
            self.targets = [f"127.0.0.1:{self.base_port + rank}" for rank in range(self.world_size)]
        for rank, step_s in enumerate(step_seconds):
            push = (
                {**push_env, "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={self.targets[rank]}"}
                if push_env is not None
                else {}
            )
            env = child_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.world_size),
                OPENLORA_RUN_ID=run_id,
                OPENLORA_RUN_NAME=self.run_name,
                OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                # The port offset by LOCAL_RANK (the default), as under torchrun.
                OTEL_EXPORTER_PROMETHEUS_PORT=str(self.base_port),
                OPENLORA_GPU_METRICS="on",
                OPENLORA_QUIET="true",
                OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
                PYTHONPATH=str(ROOT),
                **(extra_env or {}),
                **push,
            )
            args = (step_s, data_seconds[rank], lifetime_s, FLOPS_PER_TOKEN, PEAK_FLOPS)
            try:
                process = subprocess.Popen(
                    [sys.executable, "-c", RANK_SCRIPT, *map(str, args)],
                    cwd=ROOT,
                    env=env,
                    stdout=self.logs[rank],
                    stderr=subprocess.STDOUT,
                )
            except BaseException:
                self.stop()
                raise
            self.processes.append(process)

    def wait_serving(self, timeout: float = 60.0) -> None:
        if self.push:
            return  # nothing to serve: a test waits for their series instead
        deadline = time.monotonic() + timeout
        for process, target in zip(self.processes, self.targets, strict=True):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"rank at {target} exited: {self.output(target)}")
                try:
                    with urllib.request.urlopen(f"http://{target}/metrics", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"rank at {target} did not serve in {timeout} s") from None
                    time.sleep(0.2)

    def output(self, target: str) -> str:
        log = self.logs[self.targets.index(target)]
        log.seek(0)
        return log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            reap(process, 20)
        for log in self.logs:
            log.close()


@contextmanager
def ranks(
    run_id: str,
    step_seconds: list[float],
    data_seconds: list[float] | None = None,
    push_env: dict[str, str] | None = None,
) -> Iterator[Ranks]:
    started = Ranks(run_id, step_seconds, data_seconds=data_seconds, push_env=push_env)
    try:
        started.wait_serving()
        yield started
    finally:
        started.stop()


# -- the dashboards' queries -----------------------------------------------------------------------


def dashboard(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(path: Path) -> list[dict]:
    return [p for p in dashboard(path)["panels"] if p["type"] != "row"]


# What Grafana puts in for its own variables: $__rate_interval in panels; $__range (the time range,
# in seconds) and $__interval (the datasource's scrape interval, timeInterval in the provisioned
# datasource) in variable queries. Dashboard variables default to All (.*); hparam to its default.
DATASOURCE_INTERVAL = yaml.safe_load(
    (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
)["datasources"][0]["jsonData"]["timeInterval"]
SUBSTITUTIONS = {
    "$__rate_interval": "15s",
    "$__range": "3600s",
    "$__interval": DATASOURCE_INTERVAL,
    "$job": ".*",
    "$run": ".*",
    "$hparam": "learning_rate",
    "$instance": ".*",
    "$gpu": ".*",
    "$service": ".*",
    "$adapter": ".*",
}


def substitute(expr: str, **values: str) -> str:
    for key, value in {**SUBSTITUTIONS, **{f"${k}": v for k, v in values.items()}}.items():
        expr = expr.replace(key, value)
    return expr


# -- Grafana's query variables, resolved as its Prometheus datasource does --------------------------
# (grafana/packages/grafana-prometheus metric_find_query.ts and the variables' regex handling,
# metricNamesToVariableValues): label_values(selector, label) asks /api/v1/label/<label>/values,
# label_names(metric) /api/v1/labels for series whose name contains metric, query_result(expr) an
# instant query whose series become `name{label="value",...} value timestamp_ms` lines. Then the
# variable's regex: named groups text and value (with the g flag, from any of the matches), else
# the first group, else the whole item; options with the same value keep the first.


def grafana_regex(pattern: str) -> tuple[re.Pattern[str], bool]:
    """A variable's regex, JavaScript `/source/flags` (else anchored), as Python's; and its g flag."""
    match = re.fullmatch(r"/(.*)/([gimsuy]*)", pattern, re.S)
    source, flags = (match.group(1), match.group(2)) if match else (f"^{pattern}$", "")
    source = re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", source)  # named groups; (?<= and (?<! stay
    return re.compile(source, re.I if "i" in flags else 0), "g" in flags


def apply_variable_regex(pattern: str, items: list[str]) -> list[tuple[str, str]]:
    """(text, value) of each item the regex keeps, as Grafana lists them."""
    options: list[tuple[str, str]] = []
    regex, every = grafana_regex(pattern) if pattern else (None, False)
    for item in items:
        text = value = item
        if regex is not None:
            matches = list(regex.finditer(item)) if every else [m for m in [regex.search(item)] if m]
            if not matches:
                continue
            named = [m.groupdict() for m in matches]
            value_group = next((g["value"] for g in named if g.get("value")), None)
            text_group = next((g["text"] for g in named if g.get("text")), None)
            if value_group or text_group:
                value, text = value_group or text_group, text_group or value_group
            elif matches[0].groups():
                text = value = matches[0].group(1)
        if value not in {v for _, v in options}:
            options.append((text, value))
    return options


def http_variable_options(base_url: str) -> Callable[[dict, dict[str, str]], list[tuple[str, str]]]:
    """The options (text, value) Grafana offers for a query variable, asking the store at base_url."""

    def get(path: str, **params: str) -> Any:
        with urllib.request.urlopen(
            f"{base_url}{path}?" + urllib.parse.urlencode(params), timeout=10
        ) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def options(variable: dict, values: dict[str, str]) -> list[tuple[str, str]]:
        query = substitute(variable["query"]["query"], **values)
        if match := re.fullmatch(r"label_values\((.+), (\w+)\)", query):
            items = get(f"/api/v1/label/{match.group(2)}/values", **{"match[]": match.group(1)})
        elif match := re.fullmatch(r"label_names\((.+)\)", query):
            items = get("/api/v1/labels", **{"match[]": f'{{__name__=~".*{match.group(1)}.*"}}'})
        elif match := re.fullmatch(r"query_result\((.+)\)", query):
            result = get("/api/v1/query", query=match.group(1))["result"]
            items = [
                series["metric"].get("__name__", "")
                + "{"
                + ",".join(f'{k}="{v}"' for k, v in series["metric"].items() if k != "__name__")
                + "}"
                + f" {series['value'][1]} {int(series['value'][0] * 1000)}"
                for series in result
            ]
        else:
            raise AssertionError(f"variable {variable['name']}: a query Grafana does not know: {query}")
        return apply_variable_regex(variable.get("regex", ""), items)

    return options


VariableOptions = Callable[[dict, dict[str, str]], list[tuple[str, str]]]


def run_every_query(
    path: Path,
    query: Callable[[str], list[dict]],
    variable_options: VariableOptions,
    run_ids: str | list[str],
    *,
    run_names: dict[str, str] | None = None,
    hparam: str | None = None,
) -> list[str]:
    """Resolve every variable of a dashboard and run every panel query with them; the problems found
    (empty = every variable has values and every query returned data).

    The run variable must offer each of ``run_ids`` (all selected, as Grafana writes several values:
    ``(a|b)``), shown by its name in ``run_names`` where given; the hparam variable, where the
    dashboard has one, must offer ``hparam`` and is set to it."""
    run_ids = [run_ids] if isinstance(run_ids, str) else run_ids
    values = {"run": run_ids[0] if len(run_ids) == 1 else "(" + "|".join(run_ids) + ")"}
    problems = []
    for variable in dashboard(path)["templating"]["list"]:
        if variable["type"] != "query":
            continue
        try:
            offered = variable_options(variable, values)
        except Exception as error:  # an invalid query: say which
            problems.append(f"variable {variable['name']}: {error}")
            continue
        if not offered:
            problems.append(f"variable {variable['name']} has no values")
        by_value = {value: text for text, value in offered}
        if variable["name"] == "run":
            for run_id in run_ids:
                if run_id not in by_value:
                    problems.append(f"variable run does not offer {run_id}: {offered}")
                elif run_names and run_names.get(run_id, by_value[run_id]) != by_value[run_id]:
                    problems.append(f"variable run shows {run_id} as {by_value[run_id]!r}: {offered}")
        if variable["name"] == "hparam":
            if hparam not in by_value:
                problems.append(f"variable hparam does not offer {hparam}: {offered}")
            values["hparam"] = hparam or ""
    for panel in panels(path):
        for target in panel["targets"]:
            expr = substitute(target["expr"], **values)
            try:
                result = query(expr)
            except Exception as error:  # an invalid query: say which
                problems.append(f"{panel['title']}: {expr}: {error}")
                continue
            if not result:
                problems.append(f"{panel['title']}: no data: {expr}")
    return problems


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# -- the generated file and its structure ---------------------------------------------------------


def test_committed_cluster_dashboard_matches_its_generator() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert CLUSTER_DASHBOARD.read_text() == module.render_cluster(), "run: python grafana/build_dashboard.py"


def test_cluster_dashboard_structure() -> None:
    board = dashboard(CLUSTER_DASHBOARD)
    assert board["uid"] != dashboard(TRAINING_DASHBOARD)["uid"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert "${DS_" not in CLUSTER_DASHBOARD.read_text() and "__inputs" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "job", "run"}
    assert variables["datasource"] == next(
        v for v in dashboard(TRAINING_DASHBOARD)["templating"]["list"] if v["name"] == "datasource"
    )
    # Both dashboards link to each other through their shared tag.
    for linked in (board, dashboard(TRAINING_DASHBOARD)):
        assert any(link["type"] == "dashboards" and "openlora" in link["tags"] for link in linked["links"])
        assert "openlora" in linked["tags"]
    titles = " / ".join(p["title"] for p in panels(CLUSTER_DASHBOARD))
    for wanted in (
        "world size",
        "tokens/s",
        "Step time per rank",
        "Straggler ratio per rank",
        "Last step age",
    ):
        assert wanted.lower() in titles.lower(), wanted
    for panel in panels(CLUSTER_DASHBOARD):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"no unit: {panel['title']}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            assert 'openlora_run_id=~"$run"' in expr, f"{panel['title']}: not filtered by run: {expr}"
            if re.search(r"\b(rate|increase)\(", expr):
                assert "[$__rate_interval]" in expr, expr
            for name in _series_names(expr):
                assert name in panel["description"], f"{panel['title']}: description does not name {name}"
            if expr.startswith("sort_desc("):
                assert target.get("instant") and panel["type"] == "bargauge", panel["title"]


KNOWN = {spec.prometheus for spec in (*RUN_METRICS, *TRAINING_METRICS, *ADAPTER_METRICS, *GPU_METRICS)} | {
    spec.prometheus_collector for spec in GPU_METRICS
}


def _series_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr))
    names |= {m.replace("(_ratio)?", "") for m in re.findall(r'__name__=~"([a-z_()?]+)"', expr)}
    return names - {"target_info"}


def test_cluster_dashboard_names_only_exported_series_and_contract_records() -> None:
    used = set()
    for panel in panels(CLUSTER_DASHBOARD):
        for target in panel["targets"]:
            for name in _series_names(target["expr"]):
                assert name in KNOWN or name in CONTRACT_RECORDS, f"{name} is neither exported nor recorded"
                used.add(name)
    assert set(CONTRACT_RECORDS) <= used, (
        f"records the dashboard does not show: {set(CONTRACT_RECORDS) - used}"
    )


def test_rules_the_stores_load_define_every_contract_record() -> None:
    loaded = yaml.safe_load(rules_text())
    records = {rule.get("record") for group in loaded["groups"] for rule in group["rules"]}
    assert set(CONTRACT_RECORDS) <= records


@pytest.mark.process
def test_stand_in_rules_are_valid_for_promtool(tmp_path) -> None:
    import shutil

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (Debian package `prometheus`); .ci/run must install it")
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    path = write_rules(tmp_path / "rules")
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- every query on a real two-rank run ---------------------------------------------------------------

RUN_ID = "cluster-run"
FAST_S, SLOW_S = 0.02, 0.08  # rank 1 is the straggler: ratio about 4 against rank 0, the median without it
SLOW_DATA_S = 0.06  # and it is input-bound: three quarters of its step waiting for data


def _by_rank(result: list[dict]) -> dict[str, float]:
    return {series["metric"]["openlora_rank"]: float(series["value"][1]) for series in result}


@pytest.mark.e2e
@METRIC_PATHS
def test_every_cluster_query_on_a_real_two_rank_run(tmp_path, path: str, major: int) -> None:
    """On each path of tests/metrics_paths.py: pulled (Prometheus 2.42 and 3.16), through our Collector
    (2.42 and 3.16), straight into Prometheus 3's OTLP receiver."""
    from tests.metrics_paths import MetricsPath

    rules = write_rules(tmp_path / "rules")
    with (
        MetricsPath(path, major, tmp_path, rule_files=[str(rules)]) as metrics,
        ranks(
            RUN_ID,
            [FAST_S, SLOW_S],
            data_seconds=[0.0, SLOW_DATA_S],
            push_env=metrics.push_env() if metrics.push else None,
        ) as run,
    ):
        prometheus = metrics.scrape(run.targets)
        straggler = "rank:openlora_training_straggler_ratio:2m"
        assert wait_until(lambda: len(prometheus.query(straggler)) == 2, timeout=60), prometheus.query(
            "up"
        )
        time.sleep(3)  # a few more scrapes: throughput gauges and rates over more than one interval

        problems = run_every_query(
            CLUSTER_DASHBOARD,
            prometheus.query,
            http_variable_options(prometheus.url),
            RUN_ID,
            run_names={RUN_ID: run.run_name},
        )
        assert not problems, "\n".join(problems)

        # The values say what the panels promise.
        assert float(prometheus.query("run:openlora_ranks_reporting:count")[0]["value"][1]) == 2
        assert float(prometheus.query("run:openlora_world_size:max")[0]["value"][1]) == 2
        step_panel = next(
            p for p in panels(CLUSTER_DASHBOARD) if p["title"].startswith("Step time per rank,")
        )
        slowest_first = prometheus.query(substitute(step_panel["targets"][0]["expr"], run=RUN_ID))
        assert [s["metric"]["openlora_rank"] for s in slowest_first] == ["1", "0"]
        step = _by_rank(slowest_first)
        assert FAST_S <= step["0"] < 2 * FAST_S and SLOW_S <= step["1"] < 1.5 * SLOW_S, step
        ratio = _by_rank(prometheus.query(straggler))
        # The baseline leaves the slowest rank out: with two ranks it is rank 0's own step time, so
        # rank 0 is at 1 (exactly in Prometheus, whose group reads this evaluation's records; vmalert
        # reads each record back from the store, where the mean and the baseline may be an
        # evaluation apart: 0.9998 seen).
        assert ratio["1"] > 1.5 and ratio["0"] == pytest.approx(1.0, abs=0.25), ratio
        node = prometheus.query(
            substitute(
                next(p for p in panels(CLUSTER_DASHBOARD) if "per node" in p["title"])["targets"][0][
                    "expr"
                ]
            )
        )
        assert [s["metric"]["host_name"] for s in node] == [socket.gethostname()]
        assert float(node[0]["value"][1]) == pytest.approx(0.5)
        total = float(
            prometheus.query("run:openlora_training_throughput_tokens_per_second:sum")[0]["value"][1]
        )
        # 512 tokens per step: about 25,600/s from rank 0 and 6,400/s from rank 1, less the loop's overhead.
        assert 0.5 * (512 / FAST_S + 512 / SLOW_S) < total < 1.05 * (512 / FAST_S + 512 / SLOW_S), total
        age = _by_rank(prometheus.query("rank:openlora_training_last_step_age_seconds"))
        assert sorted(age) == ["0", "1"] and all(0 <= value < 10 for value in age.values()), age

        # Why rank 1 is slow: it waits for its data. The bars list it first, near 0.75.
        def first_target(title: str) -> str:
            return substitute(
                next(p for p in panels(CLUSTER_DASHBOARD) if p["title"] == title)["targets"][0]["expr"],
                run=RUN_ID,
            )

        waiting = prometheus.query(first_target("Data-wait fraction per rank, highest first"))
        assert [s["metric"]["openlora_rank"] for s in waiting] == ["1", "0"], waiting
        fraction = _by_rank(waiting)
        assert 0.6 < fraction["1"] <= 1.0 and 0.0 <= fraction["0"] < 0.1, fraction
        # OpenloraInputBound's condition (its `for` aside) holds for rank 1 alone.
        (input_bound,) = [r for r in rules_in(rules) if r.get("alert") == "OpenloraInputBound"]
        flagged = prometheus.query(input_bound["expr"])
        assert [s["metric"]["instance"] for s in flagged] == [run.targets[1]], flagged
        # Same model and device on both ranks: the one that waits gets the lower MFU.
        mfu = prometheus.query(first_target("MFU per rank, lowest first"))
        assert [s["metric"]["openlora_rank"] for s in mfu] == ["1", "0"], mfu
        # About 512 / 0.02 tokens/s x 1 MFLOP / 100 GFLOP/s = 0.26 for rank 0, a quarter of that for rank 1.
        utilization = _by_rank(mfu)
        assert (
            0 < utilization["1"] < utilization["0"] < 512 / FAST_S * FLOPS_PER_TOKEN / PEAK_FLOPS * 1.05
        ), mfu
        # The GPUs behind the ranks: rank 1's is degraded (its pending remap), rank 0's is ok and
        # reported its one XID; neither fake GPU is throttled.
        status = prometheus.query(first_target("Worst GPU status per rank, worst first"))
        assert [s["metric"]["openlora_rank"] for s in status] == ["1", "0"], status
        assert _by_rank(status) == {"1": 1.0, "0": 0.0}, status
        xids = _by_rank(prometheus.query(first_target("XID errors per rank, most first")))
        assert xids == {"0": 1.0}, xids
        throttled = prometheus.query(first_target("GPU throttled time per rank"))
        assert {s["metric"]["openlora_rank"] for s in throttled} == {"0", "1"}, throttled
        assert all(float(s["value"][1]) == 0.0 for s in throttled), throttled

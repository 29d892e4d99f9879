"""grafana/dashboards/openlora-cluster.json: generated, well formed, and every query on a real two-rank run.

Two training-like processes (RANK 0 and 1 of WORLD_SIZE 2, one OPENLORA_RUN_ID, a fake
NVML each, different step times, the slow one waiting for data most of its step) are
scraped by a real Prometheus that loads the `openlora-ranks` recording rules; every
query of the cluster dashboard must return data, and the values must say which rank is
the slow one, and why.

The rank processes and the rules file (tests/support/ranks.py) and running a dashboard's
queries (tests/support/dashboards.py) are shared with tests/deploy/test_scaleout.py, which runs the
same queries against the central stores a Prometheus agent remote-writes to.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest
import yaml

from openlora_otel.names import ADAPTER_METRICS, GPU_METRICS, RUN_METRICS, TRAINING_METRICS
from tests.support.dashboards import (
    CLUSTER_DASHBOARD,
    GRAFANA,
    TRAINING_DASHBOARD,
    dashboard,
    http_variable_options,
    panels,
    run_every_query,
    substitute,
)
from tests.support.metrics_paths import METRIC_PATHS
from tests.support.polling import wait_until
from tests.support.prometheus_server import promtool
from tests.support.ranks import FAST_S, FLOPS_PER_TOKEN, PEAK_FLOPS, SLOW_S, ranks, rules_text, write_rules

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


def rules_in(path: Path) -> list[dict]:
    """Every rule of a rules file, recording and alerting."""
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


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
    path = write_rules(tmp_path / "rules")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- every query on a real two-rank run ---------------------------------------------------------------

RUN_ID = "cluster-run"
SLOW_DATA_S = 0.06  # and it is input-bound: three quarters of its step waiting for data


def _by_rank(result: list[dict]) -> dict[str, float]:
    return {series["metric"]["openlora_rank"]: float(series["value"][1]) for series in result}


@pytest.mark.e2e
@METRIC_PATHS
def test_every_cluster_query_on_a_real_two_rank_run(tmp_path, path: str, major: int) -> None:
    """On each path of tests/support/metrics_paths.py: pulled (Prometheus 2.42 and 3.16), through our Collector
    (2.42 and 3.16), straight into Prometheus 3's OTLP receiver."""
    from tests.support.metrics_paths import MetricsPath

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
        if metrics.native:  # not vacuous: the step times are a native histogram there (its _sum, _count recorded)
            names = set(prometheus.get("/api/v1/label/__name__/values")["data"])
            assert "openlora_training_step_duration_seconds" in names, sorted(names)
            assert "openlora_training_step_duration_seconds_bucket" not in names

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

"""The dashboards' run and hparam variables, and the legends' joins, on fixed series in a real Prometheus.

A real demo run is in tests/deploy/test_deployment.py; here small HTTP endpoints serve fixed exposition
text, changed while Prometheus scrapes them, for the cases a demo does not make on its own: a run
renamed while it runs (the callbacks name it at train start), a second run on an endpoint the first
one used (two learning rates one after the other on localhost:9464), and a run without
openlora_run_info (an older openlora-otel). The variables are resolved as Grafana's Prometheus
datasource does (tests/support/dashboards.py); the regex handling is checked on its own first.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.dashboards import (
    CLUSTER_DASHBOARD,
    GRAFANA,
    TRAINING_DASHBOARD,
    apply_variable_regex,
    dashboard,
    http_variable_options,
    panels,
    substitute,
)
from tests.support.polling import wait_until
from tests.support.prometheus_server import PROMETHEUS_MAJORS


def variables(path: Path) -> dict[str, dict]:
    return {variable["name"]: variable for variable in dashboard(path)["templating"]["list"]}


# -- the regex handling, as Grafana's metricNamesToVariableValues --------------------------------------


def test_named_groups_give_text_and_value_in_either_order() -> None:
    regex = variables(TRAINING_DASHBOARD)["run"]["regex"]
    lines = [
        '{openlora_run_id="id-1",openlora_run_name="first"} 1700000000 1700000001000',
        '{openlora_run_name="second",openlora_run_id="id-2"} 1700000000 1700000001000',
        '{openlora_run_id="id-3"} 1 1700000001000',  # no name: shown by its id
        '{openlora_run_id="id-1",openlora_run_name="older-name"} 1600000000 1700000001000',
    ]
    # The first option of a value wins: the query lists the newest name first.
    assert apply_variable_regex(regex, lines) == [("first", "id-1"), ("second", "id-2"), ("id-3", "id-3")]


def test_a_plain_group_and_an_anchored_pattern() -> None:
    names = [
        "__name__",
        "job",
        "openlora_hparam_learning_rate",
        "openlora_run_name",
        "openlora_hparam_lora_r",
    ]
    regex = variables(TRAINING_DASHBOARD)["hparam"]["regex"]
    assert apply_variable_regex(regex, names) == [
        ("learning_rate", "learning_rate"),
        ("lora_r", "lora_r"),
    ]
    # Without slashes Grafana anchors the pattern; without a regex every item is an option.
    assert apply_variable_regex("job", names) == [("job", "job")]
    assert apply_variable_regex("", ["a", "b", "a"]) == [("a", "a"), ("b", "b")]


# -- fixed series in a real Prometheus -----------------------------------------------------------------


class Endpoints:
    """Metrics endpoints on 127.0.0.1 serving whatever text ``set`` gave them last."""

    def __init__(self, count: int) -> None:
        self.texts = [""] * count
        self.servers: list[http.server.ThreadingHTTPServer] = []
        for index in range(count):
            handler = self._handler(index)
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
            self.servers.append(server)
        self.targets = [f"127.0.0.1:{server.server_address[1]}" for server in self.servers]

    def _handler(self, index: int) -> type[http.server.BaseHTTPRequestHandler]:
        endpoints = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = endpoints.texts[index].encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler

    def set(self, index: int, run_id: str, info: str | None, loss: float) -> None:
        """One process of a run: target_info, openlora_run_info with ``info``'s labels (None: no
        such series), and a loss."""
        lines = [f'target_info{{openlora_run_id="{run_id}",service_name="openlora-demo"}} 1']
        if info is not None:
            lines.append(f"openlora_run_info{{{info}}} 1")
        lines.append(f"openlora_training_loss {loss}")
        self.texts[index] = "\n".join(lines) + "\n"

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@contextmanager
def endpoints(count: int) -> Iterator[Endpoints]:
    served = Endpoints(count)
    try:
        yield served
    finally:
        served.close()


# Long enough for a step of the run variable's subquery ($__interval, 5 s) to fall in each phase.
PHASE_S = 7.0


@pytest.mark.e2e
@PROMETHEUS_MAJORS
def test_runs_by_name_across_a_rename_a_reused_endpoint_and_a_run_without_run_info(
    tmp_path, major: int
) -> None:
    from tests.support.prometheus_server import Prometheus, prometheus_binary

    prometheus_binary(major)
    with endpoints(3) as served:
        # Endpoint 0: run-a, named by its id until "train start" renames it; then run-d there.
        served.set(0, "run-a", 'openlora_run_name="run-a"', 2.0)
        served.set(1, "run-b", 'openlora_run_name="beta",openlora_hparam_learning_rate="0.001"', 1.5)
        served.set(2, "run-c", None, 3.5)
        prometheus = Prometheus(tmp_path, served.targets, major=major)
        try:
            assert wait_until(lambda: len(prometheus.query("up == 1")) == 3, timeout=30), prometheus.query(
                "up"
            )
            time.sleep(PHASE_S)
            served.set(
                0,
                "run-a",
                'openlora_run_name="alpha",openlora_hparam_learning_rate="0.1",openlora_hparam_lora_r="8"',
                2.0,
            )
            time.sleep(PHASE_S)
            served.set(0, "run-d", 'openlora_run_name="delta",openlora_hparam_learning_rate="0.3"', 1.0)
            time.sleep(PHASE_S)

            options = http_variable_options(prometheus.url)
            expected = {"run-a": "alpha", "run-b": "beta", "run-c": "run-c", "run-d": "delta"}
            for path in (TRAINING_DASHBOARD, CLUSTER_DASHBOARD):
                offered = options(variables(path)["run"], {})
                assert {value: text for text, value in offered} == expected, (path.name, offered)
            hparams = options(variables(TRAINING_DASHBOARD)["hparam"], {})
            assert hparams == [("learning_rate", "learning_rate"), ("lora_r", "lora_r")], hparams

            # Two runs selected: the loss panel's series carry each one's name and learning rate, now
            # (run-d on the endpoint that served run-a) and over the last phases (no many-to-many).
            (loss_panel,) = [p for p in panels(TRAINING_DASHBOARD) if p["title"].startswith("Loss:")]
            expr = substitute(loss_panel["targets"][0]["expr"], run="(run-a|run-d|run-b)")
            now = {
                (s["metric"]["openlora_run_name"], s["metric"]["openlora_hparam_learning_rate"])
                for s in prometheus.query(expr)
            }
            assert now == {("delta", "0.3"), ("beta", "0.001")}, now
            end = time.time()
            body = prometheus.get(
                "/api/v1/query_range", query=expr, start=str(end - 3 * PHASE_S), end=str(end), step="1"
            )
            assert body["status"] == "success", body
            over_time = {
                (s["metric"]["openlora_run_id"], s["metric"]["openlora_run_name"])
                for s in body["data"]["result"]
            }
            assert over_time == {
                ("run-a", "run-a"),
                ("run-a", "alpha"),
                ("run-d", "delta"),
                ("run-b", "beta"),
            }
            # No hyperparameter key to pick (none offered): the query still runs, the name stays.
            blank = prometheus.query(substitute(loss_panel["targets"][0]["expr"], run="run-b", hparam=""))
            assert [s["metric"]["openlora_run_name"] for s in blank] == ["beta"], blank
        finally:
            prometheus.stop()


# -- a run that began since the subquery's last step ------------------------------------------------

# Grafana's defaults in the variable queries: the last hour, the datasource's interval (5 s).
FRESH_RUN_TEST = """
rule_files: []
evaluation_interval: 1s
tests:
  - interval: 1s
    input_series:
      # An older run, seen at the subquery's steps: offered by its name at its last step (5 s).
      - series: 'target_info{job="openlora",instance="a:9464",openlora_run_id="run-old"}'
        values: '1x5'
      - series: 'openlora_run_info{job="openlora",instance="a:9464",openlora_run_name="old"}'
        values: '1x5'
      # Started at 6 s, after the last step (5 s) before the query's time (8 s): no step has seen it.
      - series: 'target_info{job="openlora",instance="b:9464",openlora_run_id="run-new"}'
        values: '_x6 1x2'
      - series: 'openlora_run_info{job="openlora",instance="b:9464",openlora_run_name="fresh"}'
        values: '_x6 1x2'
      # Named by its id at 0-5 s, renamed at 6 s (the callbacks name a run at train start).
      - series: 'target_info{job="openlora",instance="c:9464",openlora_run_id="run-renamed"}'
        values: '1x8'
      - series: 'openlora_run_info{job="openlora",instance="c:9464",openlora_run_name="run-renamed"}'
        values: '1x5 _x2'
      - series: 'openlora_run_info{job="openlora",instance="c:9464",openlora_run_name="renamed"}'
        values: '_x6 1x2'
    promql_expr_test:
      - expr: {expr}
        eval_time: 8s
        exp_samples:
          - labels: '{openlora_run_id="run-old",openlora_run_name="old"}'
            value: 5
          - labels: '{openlora_run_id="run-new",openlora_run_name="fresh"}'
            value: 8
          - labels: '{openlora_run_id="run-renamed",openlora_run_name="run-renamed"}'
            value: 5
          - labels: '{openlora_run_id="run-renamed",openlora_run_name="renamed"}'
            value: 8
"""


@pytest.mark.process
@PROMETHEUS_MAJORS
@pytest.mark.parametrize(
    "path",
    [TRAINING_DASHBOARD, CLUSTER_DASHBOARD, GRAFANA / "dashboards" / "openlora-inference.json"],
    ids=lambda p: p.stem,
)
def test_a_run_started_since_the_last_step_is_offered_by_its_name(tmp_path, major: int, path: Path) -> None:
    """The run variable's subquery steps at multiples of $__interval; a run whose first samples are
    newer than the last one is offered by its name (and a renamed run by its new name, newest first),
    not by its id until the next multiple: a dashboard opened as a run starts shows its name."""
    from tests.support.prometheus_server import promtool

    query = variables(path)["run"]["query"]["query"]
    expr = substitute(query.removeprefix("query_result(").removesuffix(")"))
    test = tmp_path / "fresh_run_test.yml"
    test.write_text(FRESH_RUN_TEST.replace("{expr}", json.dumps(expr)))
    result = promtool("test", "rules", str(test), major=major)
    assert result.returncode == 0, result.stdout + result.stderr

"""The agent tier load-balanced over two real gateways: deploy/collector/agent.yaml with the overlay
agent-loadbalancing.yaml on collector/otelcol-openlora-lb (its resolver made a static list of the two
gateways, as no DNS server runs here), two gateways on deploy/collector/gateway.yaml remote-writing to a
Prometheus 3, and 16 simulated ranks (tests/support/rank_group.py: each a whole Telemetry with its own
Resource, pushing OTLP every second).

- Each rank's series leave through one gateway, and both gateways carry ranks. Each gateway here
  stamps its own ``deployment.environment.name`` (the shipped resource processor, from
  OPENLORA_ENVIRONMENT), so the ranks' ``target_info`` says which gateway each went through.
- One gateway killed (SIGKILL: nothing flushed) in the middle of the run and started again about
  10 s later. Counted in samples (a push a second): every push each rank made, logged by the rank
  group with the time of its steps counter's point, against the samples Prometheus holds at those
  times (a push that came late on a loaded machine is a wider gap, not a loss): the
  ranks of the other gateway lose none; those of the killed one lose what it held unsent when it was
  killed (its batch of up to 2 s), no more: what the agent could not deliver in the outage waits in the
  agent's queue for that gateway and arrives, in order, once it is back. OpenloraCollectorDown fires
  for the gateway and resolves once it is back; the agent reports no failure (its queue for the
  gateway takes the points).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.alerts import firing, shortened_rules
from tests.support.collector_server import Collector, load_balancing_agent
from tests.support.polling import wait_until
from tests.support.processes import child_env, reap
from tests.support.prometheus_server import Prometheus
from tests.support.rank_group import read_export_log

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "collector"
RANK_GROUP = ROOT / "tests" / "support" / "rank_group.py"
RANKS = 16
RUN_ID = "load-balanced"
STEPS = "openlora_training_steps_total"
# The newest pushes may still wait in the agent's batch and then the gateway's (2 s each).
IN_FLIGHT_S = 6
SELF_JOB = "openlora-collector-self"  # the job of the collector tiers' own metrics (the PodMonitor's)


def gateway_env(prometheus: Prometheus, index: int) -> dict[str, str]:
    return {
        "OPENLORA_REMOTE_WRITE_URL": f"{prometheus.url}/api/v1/write",
        "OPENLORA_REMOTE_WRITE_AUTHORIZATION": "",
        "OPENLORA_ENVIRONMENT": f"gateway-{index}",
    }


def routes(prometheus: Prometheus) -> dict[str, set[str]]:
    """For each rank (its ``instance``), the gateways its target_info came through."""
    found: dict[str, set[str]] = {}
    for series in prometheus.query(f'target_info{{openlora_run_id="{RUN_ID}"}}'):
        labels = series["metric"]
        found.setdefault(labels["instance"], set()).add(labels.get("deployment_environment_name", ""))
    return found


def lost_samples(prometheus: Prometheus, export_log: Path, start: float, end: float) -> dict[str, int]:
    """For each rank, the pushes it made between ``start`` and ``end`` (the rank group's export log)
    whose steps counter has no sample in Prometheus at that push's time; a push the agent did not
    take counts as lost too."""
    body = prometheus.get("/api/v1/query", query=f"{STEPS}[{int(end - start) + 2}s]", time=f"{end:.3f}")
    assert body["status"] == "success", body
    stored = {
        series["metric"]["instance"]: {round(float(t) * 1000) for t, _ in series["values"]}
        for series in body["data"]["result"]
    }
    lost = {}
    for instance, pushes in read_export_log(export_log).items():
        made = [stamp for stamp in pushes if start * 1000 <= stamp <= end * 1000]
        lost[instance] = sum(
            pushes[stamp] != "ok" or stamp not in stored.get(instance, set()) for stamp in made
        )
    return lost


def test_each_rank_keeps_to_one_gateway_and_a_killed_gateway_costs_only_what_it_held(tmp_path: Path) -> None:
    (tmp_path / "self.yml").write_text(yaml.safe_dump(shortened_rules(("openlora-collector",)), sort_keys=False))
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    export_log = tmp_path / "pushes.log"
    prometheus = Prometheus(
        tmp_path,
        [],
        job=SELF_JOB,
        file_sd=[str(targets)],
        major=3,
        rule_files=[str(tmp_path / "self.yml")],
        extra_args=("--web.enable-remote-write-receiver",),
    )
    started: list = [prometheus]
    group = None
    try:
        gateways = []
        for index in (0, 1):
            gateways.append(
                Collector(
                    tmp_path, DEPLOY / "gateway.yaml", env=gateway_env(prometheus, index), name=f"gateway-{index}"
                )
            )
            started.append(gateways[-1])
        agent = load_balancing_agent(tmp_path, gateways)
        started.append(agent)
        assert agent.log_lines("warn") == [] and agent.log_lines("error") == []
        components = [f"127.0.0.1:{c.ports['self_metrics']}" for c in (agent, *gateways)]
        targets.write_text(json.dumps([{"targets": components}]))

        env = child_env(
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=agent.otlp_http,
            OTEL_METRIC_EXPORT_INTERVAL="1000",
            OPENLORA_RUN_ID=RUN_ID,
            PYTHONPATH=str(ROOT),
        )
        group = subprocess.Popen(
            [sys.executable, str(RANK_GROUP), "--first-rank", "0", "--count", str(RANKS), "--world-size",
             str(RANKS), "--step-s", "0.5", "--max-s", "300", "--export-log", str(export_log)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert group.stdout is not None and group.stdout.readline().startswith("ready"), "the ranks did not start"

        # Every rank through exactly one gateway, and both gateways used.
        assert wait_until(lambda: len(routes(prometheus)) == RANKS, 60), routes(prometheus)
        assert prometheus.wait_for(f"count({STEPS}) == {RANKS}", timeout=60)
        routed = routes(prometheus)
        assert all(len(through) == 1 for through in routed.values()), routed
        by_gateway: dict[str, list[str]] = {}
        for instance, (through,) in routed.items():
            by_gateway.setdefault(through, []).append(instance)
        assert sorted(by_gateway) == ["gateway-0", "gateway-1"], by_gateway
        start = time.time()
        time.sleep(5)

        # The gateway with more ranks is killed while the ranks push.
        killed = max((0, 1), key=lambda index: len(by_gateway[f"gateway-{index}"]))
        gateways[killed].kill()
        killed_at = time.time()
        assert wait_until(lambda: "OpenloraCollectorDown" in firing(prometheus), 60), firing(prometheus)
        (down,) = firing(prometheus)["OpenloraCollectorDown"]
        assert down["labels"]["instance"] == components[1 + killed]
        # The agent hands each gateway's points to that gateway's queue, which takes them: its
        # load_balancing exporter fails nothing (the queues of the 0.161 exporter report no metrics of
        # their own), so the gateway's own `up` is what says it is down.
        assert prometheus.query(
            'sum(otelcol_loadbalancer_backend_outcome{success="false"}) > 0'
            ' or sum(otelcol_exporter_send_failed_metric_points) > 0'
        ) == []
        time.sleep(max(0.0, killed_at + 10 - time.time()))
        gateways[killed].restart()
        restarted_at = time.time()
        assert wait_until(lambda: "OpenloraCollectorDown" not in firing(prometheus), 60), firing(prometheus)

        # What the agent queued for the gateway arrives once it is back (the retry's backoff grows to
        # 30 s); then 5 s more of the run.
        # Every rank in the window, not only those whose samples have come: a loaded machine can keep
        # a killed gateway's ranks waiting in the agent's retry backoff past the others.
        def caught_up() -> bool:
            lost = lost_samples(prometheus, export_log, start, time.time() - IN_FLIGHT_S)
            return sorted(lost) == sorted(routed) and max(lost.values()) <= 3

        assert wait_until(caught_up, 90), (
            lost_samples(prometheus, export_log, start, time.time() - IN_FLIGHT_S)
        )
        time.sleep(5)
        end = time.time() - IN_FLIGHT_S
        lost = lost_samples(prometheus, export_log, start, end)
        assert sorted(lost) == sorted(routed), lost
        # Still one gateway per rank: none moved while the other was down (the static list keeps both).
        assert routes(prometheus) == routed
        for instance in by_gateway[f"gateway-{1 - killed}"]:
            assert lost[instance] == 0, (instance, lost)
        # The killed gateway's batch (2 s) was lost with it: at most three samples a series.
        carried = by_gateway[f"gateway-{killed}"]
        assert all(lost[instance] <= 3 for instance in carried), lost
        outage = restarted_at - killed_at
        print(
            f"gateway-{killed} down {outage:.0f} s, carrying {len(carried)} of {RANKS} ranks: they lost"
            f" {sorted(lost[i] for i in carried)} samples of ~{end - start:.0f} each; the other gateway's"
            f" {RANKS - len(carried)} lost none"
        )
    finally:
        if group is not None:
            group.terminate()
            reap(group, 20)
        for server in reversed(started):
            server.stop()

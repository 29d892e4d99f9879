"""Faults of the Thanos shapes (deploy/thanos/) on real components, counted in samples, each with its
openlora-thanos alert firing on a Prometheus that scrapes the components (the shipped rules with a
2 s ``for``; tests/support/alerts.py).

- One of two receivers (replication 2) killed in the middle of a run and started again. Thanos
  takes a write to a hashring of replication 2 once one receiver has it (its quorum for 2 is 1): the
  Prometheus that scrapes the ranks and remote-writes sees no failure, the receiver that stayed up
  holds every sample, the restarted one lacks those of its outage, and Query, deduplicating the two,
  returns one series per rank with every sample.
- The object store unwritable under a sidecar: its uploads fail (a metric and an alert) and are
  retried; once writable the block is uploaded, and after the Prometheus's TSDB is wiped, Query
  answers the whole run from the store gateway.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.support.alerts import firing, shortened_rules
from tests.support.long_term_stores import (
    ThanosReceive,
    bucket_config,
    thanos_component,
    thanos_query,
    thanos_store,
    wait_for_stores,
)
from tests.support.polling import wait_until
from tests.support.processes import free_port
from tests.support.prometheus_server import Prometheus, PrometheusApi, promtool
from tests.support.ranks import FAST_S, SLOW_S, ranks

pytestmark = pytest.mark.e2e

GROUPS = ("openlora-prometheus", "openlora-thanos")
RUN_ID = "thanos-faults"
STEPS = "openlora_training_steps_total"


def counts(store: PrometheusApi, expr: str, at: float, **params: str) -> dict[tuple[str, ...], float]:
    """``expr`` at time ``at``, each series by its labels other than __name__."""
    body = store.get("/api/v1/query", query=expr, time=f"{at:.3f}", **params)
    assert body["status"] == "success", body
    return {
        tuple(sorted((k, v) for k, v in s["metric"].items() if k != "__name__")): float(s["value"][1])
        for s in body["data"]["result"]
    }


def test_a_receiver_killed_and_restarted_loses_no_sample(tmp_path: Path) -> None:
    (tmp_path / "self.yml").write_text(yaml.safe_dump(shortened_rules(GROUPS), sort_keys=False))
    receive = ThanosReceive(tmp_path)
    prometheus = None
    try:
        with ranks(RUN_ID, [FAST_S, SLOW_S]) as run:
            components = [f"127.0.0.1:{r.port}" for r in (*receive.receivers, receive.querier)]
            prometheus = Prometheus(
                tmp_path,
                [*run.targets, *components],
                major=3,
                rule_files=[str(tmp_path / "self.yml")],
                # As an agent would (deploy/prometheus/agent.yml): a short backoff, so the test waits little.
                blocks={"remote_write": [{"url": receive.write_url, "queue_config": {"max_backoff": "1s"}}]},
            )
            assert prometheus.wait_for(f"{STEPS} > 0", timeout=60)
            assert receive.wait_for(f"{STEPS} > 0", timeout=60), "nothing reached Thanos Receive"
            start = time.time()
            time.sleep(5)
            # Receiver 1 is killed (SIGKILL: no flush) while the ranks train. The write quorum of
            # replication 2 is 1: receiver 0 takes every write alone, and Prometheus retries nothing.
            receive.receivers[1].kill()
            killed_at = time.time()
            down = wait_until(lambda: "OpenloraThanosComponentDown" in firing(prometheus), 60)
            assert down, firing(prometheus)
            (alert,) = firing(prometheus)["OpenloraThanosComponentDown"]
            assert alert["labels"]["component"] == "receive"
            assert alert["labels"]["instance"] == f"127.0.0.1:{receive.receivers[1].port}"
            assert wait_until(lambda: "OpenloraThanosReceiveReplicationFailing" in firing(prometheus), 60), (
                firing(prometheus),
                prometheus.query("thanos_receive_replications_total"),
            )
            # The writes succeed on receiver 0 alone: nothing for Prometheus to retry.
            assert "OpenloraPrometheusRemoteWriteFailing" not in firing(prometheus)
            assert prometheus.query("sum(prometheus_remote_storage_samples_retried_total) > 0") == []
            time.sleep(max(0.0, killed_at + 10 - time.time()))  # an outage of 10 s at least
            receive.receivers[1].restart()
            restarted_at = time.time()
            assert wait_until(lambda: "OpenloraThanosComponentDown" not in firing(prometheus), 60), firing(
                prometheus
            )
            time.sleep(5)
            end = time.time()
        window = f"{int((end - start) * 1000)}ms"
        scraped = counts(prometheus, f"count_over_time({STEPS}[{window}])", end)
        assert len(scraped) == 2 and all(n > 15 for n in scraped.values()), scraped

        # Receiver 0 holds every sample Prometheus scraped in the window; receiver 1 those outside its
        # outage. Bounded wait: the last samples arrive with the next sends.
        def by_replica() -> dict[str, dict]:
            raw = counts(receive, f"count_over_time({STEPS}[{window}])", end, dedup="false")
            replicas: dict[str, dict] = {}
            for labels, value in raw.items():
                named = dict(labels)
                replica = named.pop("receive_replica")
                key = tuple(sorted((k, v) for k, v in named.items() if k != "tenant_id"))
                replicas.setdefault(replica, {})[key] = value
            return replicas

        assert wait_until(lambda: by_replica().get("0") == scraped, 60), (scraped, by_replica())
        replicas = by_replica()
        outage = restarted_at - killed_at
        for key, total in scraped.items():
            missing = total - replicas["1"][key]
            # Each rank is scraped every second: about one missing sample per second of the outage.
            assert 0.5 * outage <= missing <= total, (key, missing, outage)
        # Deduplicated, one series per rank, with every sample.
        deduplicated = counts(receive, f"count by (instance) (count_over_time({STEPS}[{window}]))", end)
        assert deduplicated == {(("instance", target),): 1.0 for target in run.targets}, deduplicated
        summed = counts(receive, f"sum(count_over_time({STEPS}[{window}]))", end)
        assert summed == {(): sum(scraped.values())}, (summed, scraped)
        missed = sum(scraped.values()) - sum(replicas["1"].values())
        print(
            f"receiver down {outage:.0f} s: {sum(scraped.values()):.0f} samples of 2 ranks, all on receiver 0"
            f" and through Query; receiver 1 lacks {missed:.0f}"
        )
    finally:
        if prometheus is not None:
            prometheus.stop()
        receive.stop()


PAST_RUN = "past-run"


def past_run(path: Path, start: float, samples: int, interval: int = 15) -> int:
    """An OpenMetrics file of a finished two-rank run: its steps counter every ``interval`` seconds
    from ``start``, as promtool backfills it; the number of samples written."""
    lines = ["# TYPE openlora_training_steps counter"]
    for rank in (0, 1):
        for i in range(samples):
            labels = f'instance="rank-{rank}",job="openlora",openlora_run_id="{PAST_RUN}"'
            lines.append(f"{STEPS}{{{labels}}} {i * 10} {int(start) + i * interval}")
    path.write_text("\n".join([*lines, "# EOF", ""]))
    return 2 * samples


def test_an_unwritable_bucket_is_retried_and_a_wiped_tsdb_is_answered_from_the_store(tmp_path: Path) -> None:
    (tmp_path / "self.yml").write_text(yaml.safe_dump(shortened_rules(("openlora-thanos",)), sort_keys=False))
    # A run that ended two hours ago, backfilled into the Prometheus's data directory: the blocks the
    # sidecar has to upload.
    start = time.time() - 3 * 3600
    written = past_run(tmp_path / "past.om", start, samples=200)
    made = promtool(
        "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "past.om"), str(tmp_path / "data"), major=3
    )
    assert made.returncode == 0, made.stdout + made.stderr
    blocks = [p for p in (tmp_path / "data").iterdir() if (p / "meta.json").exists()]
    assert blocks, made.stdout
    end = start + 200 * 15
    window = f"{int(end - start) + 60}s"
    at = end + 30

    # The bucket is unwritable: where its directory should be there is a file.
    bucket = bucket_config(tmp_path)
    (tmp_path / "bucket").write_text("not a directory\n")
    sidecar_http, sidecar_grpc, store_grpc = free_port(), free_port(), free_port()
    started = []
    try:
        prometheus = Prometheus(
            tmp_path,
            [f"127.0.0.1:{sidecar_http}"],
            major=3,
            rule_files=[str(tmp_path / "self.yml")],
            external_labels={"cluster": "openlora-test", "replica": "0"},
            extra_args=("--storage.tsdb.min-block-duration=2h", "--storage.tsdb.max-block-duration=2h"),
        )
        started.append(prometheus)
        sidecar_values = {
            "--tsdb.path": str(tmp_path / "data"),
            "--prometheus.url": prometheus.url,
            "--grpc-address": f"127.0.0.1:{sidecar_grpc}",
            "--http-address": f"127.0.0.1:{sidecar_http}",
            "--objstore.config-file": str(bucket),
        }
        sidecar = thanos_component("thanos-sidecar", "sidecar", tmp_path, sidecar_values)
        started.append(sidecar)
        # Its uploads fail, are counted, and the alert fires (the shipper tries every 30 s: the rate
        # needs two failures).
        failing = wait_until(
            lambda: "OpenloraThanosBucketOperationsFailing" in firing(prometheus), 120, interval=1
        )
        assert failing, (firing(prometheus), prometheus.query("thanos_objstore_bucket_operation_failures_total"))
        # The shipper asks whether each block is there before it uploads it: that is what fails first.
        operations = {a["labels"]["operation"] for a in firing(prometheus)["OpenloraThanosBucketOperationsFailing"]}
        assert operations and operations <= {"exists", "upload"}, operations
        shipper = "thanos_shipper_dir_sync_failures_total > 0 or thanos_shipper_upload_failures_total > 0"
        assert prometheus.query(shipper), prometheus.query('{__name__=~"thanos_shipper.*"}')
        assert prometheus.query("thanos_shipper_uploads_total")
        assert not prometheus.query("thanos_shipper_uploads_total > 0")

        # Writable again: the next sync uploads every block.
        (tmp_path / "bucket").unlink()
        (tmp_path / "bucket").mkdir()
        uploaded = wait_until(
            lambda: prometheus.query(f"thanos_shipper_uploads_total >= {len(blocks)}"), 90, interval=1
        )
        assert uploaded, prometheus.query("thanos_shipper_uploads_total")
        in_bucket = sorted(p.name for p in (tmp_path / "bucket").iterdir() if (p / "meta.json").exists())
        assert in_bucket == sorted(p.name for p in blocks), in_bucket

        # The Prometheus's TSDB is wiped (a lost disk) and it starts again, empty, with its sidecar.
        sidecar.stop()
        prometheus.stop()
        started.clear()
        shutil.rmtree(tmp_path / "data")
        prometheus = Prometheus(
            tmp_path,
            [],
            major=3,
            external_labels={"cluster": "openlora-test", "replica": "0"},
            extra_args=("--storage.tsdb.min-block-duration=2h", "--storage.tsdb.max-block-duration=2h"),
        )
        started.append(prometheus)
        sidecar_values["--prometheus.url"] = prometheus.url
        started.append(thanos_component("thanos-sidecar", "sidecar", tmp_path, sidecar_values))
        store = thanos_store(tmp_path, bucket, store_grpc)
        started.append(store)
        query = thanos_query(tmp_path, [f"127.0.0.1:{sidecar_grpc}", f"127.0.0.1:{store_grpc}"])
        started.append(query)
        wait_for_stores(query, 2)
        assert counts(prometheus, f"count_over_time({STEPS}[{window}])", at) == {}
        answered = counts(query, f"count_over_time({STEPS}[{window}])", at)
        assert sorted(answered.values()) == [written / 2, written / 2], answered
        assert sum(answered.values()) == written
        print(f"bucket unwritable, then writable: {len(blocks)} blocks uploaded, {written} samples from the store")
    finally:
        for server in reversed(started):
            server.stop()

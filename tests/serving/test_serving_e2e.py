"""``openlora-otel serve`` + ``openlora-otel load``: the server's metrics against what the clients saw.

A demo adapter is trained and saved once (``demo --save``, a few steps); ``serve`` runs it as a
subprocess (the saved adapter as ``a1`` and once more as ``a2``, the base model, and an adapter
whose weights are broken, so its load fails), and ``load`` sends a seeded mix of the three served
models and one the server does not know. Then, through a real Prometheus scraping the server's
endpoint, and through OTLP to a test receiver at the protocol level:

- per adapter, the request counts equal what the load sent and got answered (the base model's
  requests under ``base``, the unknown adapter's 404s under ``other`` with ``unknown_adapter``);
- the server's histograms hold the values the clients measured, less the HTTP around each request.
  Each request's client time is its server time plus an overhead o >= 0 (connect, parsing, the event
  loop handing the first token to the socket; the server's duration ends after its last send, so o
  may be a hair below 0: 1 ms is allowed). That gives bounds that hold for every run, whatever the
  load, at every bucket bound b of both histograms (exact cumulative counts from Prometheus):
  at least as many server values <= b as client values <= b; and at most the client values <= 2b
  plus the requests whose overhead exceeds b, which are at most (sum of the overheads) / b, the sum
  being exact (client sum minus server sum). The dashboards' p50 / p95 (``histogram_quantile``) lie
  at or below the bucket of the client's order statistic of the same rank. An earlier version
  asked the quantiles to be within a bucket of each other: the time-to-first-token buckets are 4 ms
  wide at the bottom, and under load a few ms of client-side overhead on the slowest two requests
  (of 24) put the p95s two buckets apart. Together these still catch a wrong unit, a clock started
  early or late by more than the buckets' resolution, and a wrong population; the means catch the rest:
  the server's is at most the client's, and below it by no more than the HTTP overhead (100 ms
  allowed; 3 to 5 ms measured on 2 cores).
- every query of the inference dashboard returns data on what the server reported. A burst past
  the server's queue adds the ``overloaded`` 503s the server-error panels need, after the
  histograms are compared (the mix alone, as scraped before the burst).
- the same server pushing OTLP through our Collector, through the agent and gateway tiers, and straight
  into Prometheus 3's receiver: the counts per adapter, and every inference query has data.

Small on purpose (a tiny model, 46 requests to one server, 16 to another and 32 to each of three pushing
over OTLP, a few seconds each): the suite runs on 2 cores (about 90 s for this file, most of it the
demo's save and five server starts).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from openlora_otel.cli import main as cli_main
from openlora_otel.names import REQUEST_DURATION_BUCKETS, TTFT_BUCKETS
from tests.support.client_histograms import (
    SLACK_S,
    assert_histogram_holds_client_values,
    assert_quantile_not_above_client,
    bucket_index,
)
from tests.support.prometheus_server import Prometheus
from tests.support.serving import ServeProcess, needs_serve, save_demo

pytestmark = pytest.mark.e2e
needs_serve()

ROOT = Path(__file__).resolve().parents[2]
INFERENCE_DASHBOARD = ROOT / "grafana" / "dashboards" / "openlora-inference.json"
# serve runs on the CPU in these tests: no GPU, no hw.energy, so the inference dashboard's energy panels
# may be empty here (they must still evaluate); tests/serving/test_inference_dashboard.py serves on a fake GPU
# and checks their data.
NO_GPU_PANELS = ("Energy per output token by adapter", "GPU power by adapter")
RUN_ID = "serve-e2e"
MAX_QUEUE = 4  # the server's queue (4 generate at once, its default): the burst goes past it
# The load: a seeded mix of two adapters, the base model and a name the server does not serve.
MIX = "a1=2,a2=1,{base}=1,nope=1"
REQUESTS = 30
BURST = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory ``demo --save`` wrote: the tiny base model and one adapter, ``a1``."""
    directory = tmp_path_factory.mktemp("saved")
    save_demo(directory, "a1", steps=3)
    return directory


@dataclass
class Serving:
    url: str
    metrics_port: int
    log: Path
    base_model: str


@contextmanager
def serving(saved: Path, workdir: Path, *args: str, **env: str) -> Iterator[Serving]:
    """``openlora-otel serve`` (``a1``, ``a1`` again as ``a2``, and ``args``) on free loopback ports with
    ``env``; stopped with SIGTERM (bounded)."""
    process = ServeProcess(
        saved,
        "--adapter",
        f"a2={saved / 'adapters' / 'a1'}",
        *args,
        workdir=workdir,
        env={"OMP_NUM_THREADS": "1", "OPENLORA_RUN_ID": RUN_ID, **env},
    )
    try:
        process.wait_ready(timeout=120)
        status, _, body = process.request("GET", "/v1/models")
        assert status == 200, body
        models = body["data"]
        (base,) = [m["id"] for m in models if not m["adapter"]]
        assert sorted(m["id"] for m in models if m["adapter"]) == ["a1", "a2"], models
        yield Serving(process.url, process.metrics_port, process.log_path, base)
    finally:
        process.stop(timeout=30)


def load(serve: Serving, path: Path, *argv: str) -> dict:
    """Run ``openlora-otel load --url <serve> ARGV --json PATH`` in this process; its JSON results."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main(["load", "--url", serve.url, "--timeout", "60", "--json", str(path), *argv])
    assert code == 0, err.getvalue() + out.getvalue()
    results = json.loads(path.read_text())
    overall = results["overall"]
    # Every slot sent (the cap is far off) and every request answered.
    assert overall["sent"] == overall["answered"] == overall["scheduled"], (
        out.getvalue(),
        serve.log.read_text()[-3000:],
    )
    return results


def load_mix(serve: Serving, path: Path, requests: int = REQUESTS) -> dict:
    """The mix at 10 requests/s: every request to a served model succeeds, the unknown one's all fail."""
    results = load(
        serve, path, "--rate", "10", "--requests", str(requests), "--adapters", MIX.format(base=serve.base_model),
        "--seed", "5", "--max-tokens", "8",
    )  # fmt: skip
    nope = results["models"]["nope"]
    assert nope["sent"] > 0
    assert results["overall"]["ok"] == requests - nope["sent"], serve.log.read_text()[-3000:]
    return results


def expected_counts(base_model: str, *runs: dict) -> dict[tuple[str, str], int]:
    """(adapter label, error type) -> requests, as the server must count what the loads saw."""
    label = {"a1": "a1", "a2": "a2", base_model: "base", "nope": "other"}
    expected: dict[tuple[str, str], int] = {}
    for results in runs:
        for model, summary in results["models"].items():
            for key, count in [(("", summary["ok"])), *summary["by_error"].items()]:
                if count:
                    expected[(label[model], key)] = expected.get((label[model], key), 0) + count
    return expected


def test_bucket_index_follows_le() -> None:
    bounds = (0.01, 0.02, 0.04)
    assert [bucket_index(v, bounds) for v in (0.0, 0.01, 0.011, 0.02, 0.04, 0.05)] == [0, 0, 1, 1, 2, 3]


def test_the_histogram_bounds_accept_overheads_and_refuse_a_wrong_unit_clock_or_population() -> None:
    bounds = (0.005, 0.01, 0.02, 0.04, 0.08)
    server = [0.003, 0.004, 0.004, 0.006, 0.012, 0.03]
    overheads = (0.001, 0.002, 0.011, 0.003, 0.002, 0.015)
    client = [s + o for s, o in zip(server, overheads, strict=True)]

    def check(values: list[float], client: list[float] = client) -> None:
        cumulative = {b: sum(v <= b for v in values) for b in [*bounds, float("inf")]}
        assert_histogram_holds_client_values("ttft", cumulative, client, sum(values), bounds)

    # Two overheads large enough to carry their requests two buckets up: within the bounds.
    check(server)
    assert_quantile_not_above_client("ttft", 0.95, 0.03, client, bounds)
    with pytest.raises(AssertionError, match=r"above the bucket ending at 0\.08 s"):
        assert_quantile_not_above_client("ttft", 0.95, 0.09, client, bounds)
    # Recorded in ms where s were meant.
    with pytest.raises(AssertionError, match=r"the server's mean 9\.8333 s is above the clients'"):
        check([v * 1000 for v in server])
    # A clock stopped early (at the start of the generation, say): far below the clients' times.
    long_client = [v + 0.25 for v in client]
    with pytest.raises(AssertionError, match="more than 100 ms below the clients'"):
        check(server, long_client)
    # A wrong population: the same count, a smaller sum, but fewer under 20 ms than the clients saw.
    with pytest.raises(
        AssertionError, match=r"ttft: 4 of 6 server values <= 0\.02 s; the clients' values allow 5 to"
    ):
        check([0.0001] * 4 + [0.03, 0.03])


# -- through a real Prometheus -------------------------------------------------------------------------


@dataclass
class Scraped:
    serve: Serving
    prometheus: Prometheus
    results: dict  # the mix
    burst: dict  # past the queue, after the mix
    mix_scraped_at: float  # a Prometheus evaluation time: the mix scraped, the burst not yet sent
    evaluate_at: float  # both scraped, within the dashboards' 15 s rate windows

    def query_at(self, at: float):
        def query(expr: str) -> list[dict]:
            body = self.prometheus.get("/api/v1/query", query=expr, time=f"{at:.3f}")
            assert body["status"] == "success", body
            return body["data"]["result"]

        return query


@pytest.fixture(scope="module")
def scraped(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """serve + a Prometheus scraping its metrics endpoint every second; the mix, then a burst."""
    workdir = tmp_path_factory.mktemp("prometheus-e2e")
    broken = workdir / "broken"
    shutil.copytree(saved / "adapters" / "a1", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with serving(
        saved,
        workdir,
        "--adapter",
        f"broken={broken}",
        "--max-queue",
        str(MAX_QUEUE),
        OTEL_METRICS_EXPORTER="prometheus",
    ) as serve:
        prometheus = Prometheus(workdir, [f"127.0.0.1:{serve.metrics_port}"])
        try:
            assert prometheus.wait_for(f'target_info{{openlora_run_id="{RUN_ID}"}}', timeout=30)
            results = load_mix(serve, workdir / "mix.json")
            count = "sum(gen_ai_server_request_duration_seconds_count)"
            assert prometheus.wait_for(f"{count} >= {REQUESTS}", timeout=30), prometheus.query(count)
            mix_scraped_at = time.time()
            # All at once to one adapter, long answers: 4 generate, MAX_QUEUE wait, the rest get 503.
            burst = load(
                serve, workdir / "burst.json", "--rate", "1000", "--requests", str(BURST), "--adapters", "a1",
                "--max-tokens", "48",
            )  # fmt: skip
            assert burst["overall"]["by_error"].get("overloaded", 0) > 0, burst["overall"]
            assert prometheus.wait_for(f"{count} >= {REQUESTS + BURST}", timeout=30), prometheus.query(count)
            # Two more scrapes: a rate over a series the burst created has two samples.
            assert prometheus.wait_for_scrapes(2), prometheus.query("up")
            yield Scraped(serve, prometheus, results, burst, mix_scraped_at, time.time())
        finally:
            prometheus.stop()


def test_request_counts_per_adapter_equal_what_the_load_sent(scraped: Scraped) -> None:
    query = scraped.prometheus.query  # nothing is sent any more: now is the end
    found = {
        (s["metric"]["openlora_adapter_name"], s["metric"].get("error_type", "")): int(float(s["value"][1]))
        for s in query(
            "sum by (openlora_adapter_name, error_type) (gen_ai_server_request_duration_seconds_count)"
        )
    }
    # Every adapter the server has loaded is listed from the start at 0 requests; those are not traffic.
    assert {key: count for key, count in found.items() if count} == expected_counts(
        scraped.serve.base_model, scraped.results, scraped.burst
    )
    assert sum(found.values()) == REQUESTS + BURST
    # The mix alone, as the server counted it before the burst.
    found = {
        (s["metric"]["openlora_adapter_name"], s["metric"].get("error_type", "")): int(float(s["value"][1]))
        for s in scraped.query_at(scraped.mix_scraped_at)(
            "sum by (openlora_adapter_name, error_type) (gen_ai_server_request_duration_seconds_count) > 0"
        )
    }
    assert found == expected_counts(scraped.serve.base_model, scraped.results)
    # Output tokens: the server's token usage is the sum of the usage the clients got.
    (tokens,) = query('sum(openlora_inference_token_usage_sum{gen_ai_token_type="output"})')
    clients = scraped.results["overall"]["output_tokens"] + scraped.burst["overall"]["output_tokens"]
    assert int(float(tokens["value"][1])) == clients
    # The adapters loaded, and the broken one's failed load.
    loaded = {s["metric"]["openlora_adapter_name"] for s in query("openlora_inference_adapter_loaded == 1")}
    assert loaded == {"a1", "a2"}
    (failed,) = query('openlora_inference_adapter_load_duration_seconds_count{error_type!=""}')
    assert failed["metric"]["openlora_adapter_name"] == "broken"


def test_an_unknown_adapter_is_a_404_counted_as_unknown_adapter(scraped: Scraped) -> None:
    nope = scraped.results["models"]["nope"]
    assert nope["by_status"] == {"404": nope["sent"]}
    assert nope["by_error"] == {"unknown_adapter": nope["sent"]}
    (series,) = scraped.prometheus.query(
        'gen_ai_server_request_duration_seconds_count{error_type="unknown_adapter"}'
    )
    assert series["metric"]["openlora_adapter_name"] == "other"
    assert int(float(series["value"][1])) == nope["sent"]


def test_server_histograms_hold_what_the_clients_measured(scraped: Scraped) -> None:
    query = scraped.query_at(scraped.mix_scraped_at)
    overall = scraped.results["overall"]
    # Every successful request streamed text: the client saw a first token where the server counted one.
    assert overall["ttft_s"]["count"] == overall["latency_s"]["count"] == overall["ok"]
    ok = [r for r in scraped.results["requests"] if r["sent"] and r["error"] is None]
    assert len(ok) == overall["ok"]
    for what, metric, key, bounds, selector in (
        ("request duration", "gen_ai_server_request_duration_seconds", "latency_s", REQUEST_DURATION_BUCKETS,
         '{error_type=""}'),
        ("time to first token", "gen_ai_server_time_to_first_token_seconds", "ttft_s", TTFT_BUCKETS, ""),
    ):  # fmt: skip
        client = [r[key] for r in ok]
        cumulative = {
            float(s["metric"]["le"]): round(float(s["value"][1]))
            for s in query(f"sum by (le) ({metric}_bucket{selector})")
        }
        (total,) = query(f"sum({metric}_sum{selector})")
        server_sum = float(total["value"][1])
        assert_histogram_holds_client_values(what, cumulative, client, server_sum, bounds)
        for q in (0.5, 0.95):
            (server,) = query(f"histogram_quantile({q}, sum by (le) ({metric}_bucket{selector}))")
            assert_quantile_not_above_client(
                f"{what} p{int(q * 100)}", q, float(server["value"][1]), client, bounds
            )
        # The sums are exact: the server's mean is the client's less the HTTP around each request.
        server_mean, client_mean = server_sum / len(client), sum(client) / len(client)
        assert server_mean <= client_mean + SLACK_S, (what, client_mean, server_mean)
        assert client_mean - server_mean < 0.1, (what, client_mean, server_mean)


def test_every_inference_dashboard_query_returns_data(scraped: Scraped) -> None:
    from tests.support.dashboards import http_variable_options, run_every_query

    # At a time within 15 s of the traffic: the panels' rates are over [$__rate_interval] = 15 s.
    problems = run_every_query(
        INFERENCE_DASHBOARD,
        scraped.query_at(scraped.evaluate_at),
        http_variable_options(scraped.prometheus.url),
        RUN_ID,
        without_data=NO_GPU_PANELS,
    )
    assert not problems, "\n".join(problems)


# -- through OTLP, at the protocol level ----------------------------------------------------------------


def test_the_same_counts_through_otlp(saved: Path, tmp_path: Path) -> None:
    from tests.support.otlp_receiver import HttpReceiver

    receiver = HttpReceiver()

    def latest(name: str) -> dict[tuple[str, str], int]:
        """The counts of histogram ``name`` in the newest export that has it (cumulative), by adapter and
        error type, zeros left out; every point whole (its buckets add up to its count)."""
        for item in reversed(receiver.received):
            points = [
                point
                for rm in item.request.resource_metrics
                for sm in rm.scope_metrics
                for metric in sm.metrics
                if metric.name == name
                for point in metric.histogram.data_points
            ]
            if points:
                found = {}
                for point in points:
                    attributes = {kv.key: kv.value.string_value for kv in point.attributes}
                    found[(attributes["openlora.adapter.name"], attributes.get("error.type", ""))] = (
                        point.count
                    )
                    assert sum(point.bucket_counts) == point.count
                return {key: count for key, count in found.items() if count}
        return {}

    try:
        with serving(
            saved,
            tmp_path,
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.http_endpoint,
            OTEL_METRIC_EXPORT_INTERVAL="500",
        ) as serve:
            results = load_mix(serve, tmp_path / "mix.json", requests=16)
            expected = expected_counts(serve.base_model, results)
            arrived = receiver.wait_for(
                lambda r: latest("gen_ai.server.request.duration") == expected, timeout=30
            )
            assert arrived, (latest("gen_ai.server.request.duration"), expected)
        # Time to first token: one per successful request , none for failures.
        assert latest("gen_ai.server.time_to_first_token") == {k: n for k, n in expected.items() if not k[1]}
        durations = [
            metric
            for item in receiver.received
            for rm in item.request.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == "gen_ai.server.request.duration"
        ]
        assert {metric.unit for metric in durations} == {"s"}
        assert {
            tuple(point.explicit_bounds) for metric in durations for point in metric.histogram.data_points
        } == {tuple(REQUEST_DURATION_BUCKETS)}
        resource = receiver.resource_attributes()
        assert resource["openlora.run.id"] == RUN_ID
        assert resource["service.name"] == "openlora-serve"
    finally:
        receiver.close()


# -- through the real Collector, its tiers, and Prometheus 3's OTLP receiver ------------------------------


@pytest.mark.parametrize("path", ["collector", "gateway", "otlp"])
def test_serve_under_load_on_the_push_paths(saved: Path, tmp_path: Path, path: str) -> None:
    """``serve`` pushing OTLP (every second) through our Collector, through the agent and gateway tiers, and
    straight into Prometheus 3.16: per adapter the counts the load saw, and every inference query has data."""
    from tests.support.dashboards import http_variable_options, run_every_query
    from tests.support.metrics_paths import MetricsPath
    from tests.support.polling import wait_until

    broken = tmp_path / "broken"  # as for the scraped server: a failed load and 503s, so every panel has data
    shutil.copytree(saved / "adapters" / "a1", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with (
        MetricsPath(path, 3, tmp_path) as metrics,
        serving(
            saved,
            tmp_path,
            "--adapter",
            f"broken={broken}",
            "--max-queue",
            str(MAX_QUEUE),
            **metrics.push_env(),
        ) as serve,
    ):
        results = load_mix(serve, tmp_path / "mix.json", requests=16)
        burst = load(
            serve, tmp_path / "burst.json", "--rate", "1000", "--requests", str(BURST), "--adapters", "a1",
            "--max-tokens", "48",
        )  # fmt: skip
        assert burst["overall"]["by_error"].get("overloaded", 0) > 0, burst["overall"]
        expected = expected_counts(serve.base_model, results, burst)
        prometheus = metrics.scrape([])

        def counts() -> dict[tuple[str, str], int]:
            found = prometheus.query(
                "sum by (openlora_adapter_name, error_type) (gen_ai_server_request_duration_seconds_count) > 0"
            )
            return {
                (s["metric"]["openlora_adapter_name"], s["metric"].get("error_type", "")): int(float(s["value"][1]))
                for s in found
            }

        assert wait_until(lambda: counts() == expected, timeout=30), (counts(), expected)
        time.sleep(2)  # a second sample of every series after the traffic: the panels' rates have two
        problems = run_every_query(
            INFERENCE_DASHBOARD,
            prometheus.query,
            http_variable_options(prometheus.url),
            RUN_ID,
            without_data=NO_GPU_PANELS,
        )
        assert not problems, "\n".join(problems)

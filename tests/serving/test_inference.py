"""InferenceMetrics: what a request records, queue and running counts, adapters, caps, and both recording paths."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.request
from collections.abc import Callable

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

import openlora_otel.inference.metrics as inference_module
from openlora_otel import names, setup_telemetry
from openlora_otel.config import ConfigError, TelemetryConfig
from openlora_otel.inference import (
    ADAPTER_BASE,
    ADAPTER_OTHER,
    AdapterOrigin,
    InferenceMetrics,
    inference_views,
)
from openlora_otel.views import observable_views
from tests.support.clock import FakeClock
from tests.support.readings import points

DURATION = "gen_ai.server.request.duration"
TTFT = "gen_ai.server.time_to_first_token"
TPOT = "gen_ai.server.time_per_output_token"
TOKENS = "openlora.inference.token.usage"
RUNNING = "openlora.inference.requests.running"
WAITING = "openlora.inference.requests.waiting"
LOADED = "openlora.inference.adapter.loaded"
LOAD = "openlora.inference.adapter.load.duration"
INFO = "openlora.inference.adapter.info"


def base_attrs(adapter: str, **extra: str) -> dict[str, str]:
    """A request's attributes: it asked for the adapter by name (the base's name for the base); tiny-llama served it."""
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "openlora",
        "gen_ai.request.model": "tiny-llama" if adapter == "base" else adapter,
        "gen_ai.response.model": "tiny-llama",
        "openlora.adapter.name": adapter,
        **extra,
    }


class Rig:
    """InferenceMetrics on an in-memory reader: with the window views (merged) or without (one by one)."""

    def __init__(self, merged: bool, **kwargs: object) -> None:
        self.reader = InMemoryMetricReader()
        views = [*inference_views(), *observable_views()] if merged else []
        self.provider = MeterProvider(metric_readers=[self.reader], views=views)
        self.metrics = InferenceMetrics(
            self.provider.get_meter("test"), model="tiny-llama", window_histogram=merged, **kwargs
        )

    def collect(self):
        return self.reader.get_metrics_data()


@pytest.fixture(params=[True, False], ids=["windows", "one-by-one"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(request.param)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(inference_module, "time", fake)
    return fake


def point(data, name: str, attributes: dict[str, str]):
    found = [p for p in points(data, name) if dict(p.attributes) == attributes]
    assert len(found) <= 1
    return found[0] if found else None


def test_a_streamed_request_records_duration_ttft_tpot_and_tokens(rig: Rig, clock: FakeClock) -> None:
    with rig.metrics.request("a1", queued=True) as req:
        clock.sleep(0.05)  # queued
        req.start()
        clock.sleep(0.10)
        req.first_token()
        clock.sleep(0.30)  # 3 more tokens at 0.1 s each
        req.tokens(input=12, output=4)
    data = rig.collect()
    attrs = base_attrs("a1")
    duration = point(data, DURATION, attrs)
    assert duration.count == 1 and duration.sum == pytest.approx(0.45)
    # 0.45 s lies in (0.32, 0.64]: the 7th bucket.
    assert list(duration.bucket_counts).index(1) == names.REQUEST_DURATION_BUCKETS.index(0.64)
    assert tuple(duration.explicit_bounds) == names.REQUEST_DURATION_BUCKETS
    ttft = point(data, TTFT, attrs)
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.15)  # from arrival: queue wait included
    assert tuple(ttft.explicit_bounds) == names.TTFT_BUCKETS
    tpot = point(data, TPOT, attrs)
    assert tpot.count == 1 and tpot.sum == pytest.approx(0.1)
    assert tuple(tpot.explicit_bounds) == names.TPOT_BUCKETS
    assert point(data, TOKENS, {**attrs, "gen_ai.token.type": "input"}).sum == 12
    assert point(data, TOKENS, {**attrs, "gen_ai.token.type": "output"}).sum == 4
    assert tuple(point(data, TOKENS, {**attrs, "gen_ai.token.type": "output"}).explicit_bounds) == (
        names.TOKEN_BUCKETS
    )


def test_totals_are_exact_over_many_requests_and_collections(rig: Rig, clock: FakeClock) -> None:
    for round_ in range(3):
        for i in range(50):
            with rig.metrics.request(None) as req:
                clock.sleep(0.001 * (i + 1))
                req.first_token()
                req.tokens(input=3, output=1)  # one output token: no time per output token
        data = rig.collect()
        duration = point(data, DURATION, base_attrs(ADAPTER_BASE))
        assert duration.count == 50 * (round_ + 1)
        assert duration.sum == pytest.approx((round_ + 1) * sum(0.001 * (i + 1) for i in range(50)))
        assert duration.min == pytest.approx(0.001) and duration.max == pytest.approx(0.05)
        assert point(data, TPOT, base_attrs(ADAPTER_BASE)) is None
        tokens = point(data, TOKENS, {**base_attrs(ADAPTER_BASE), "gen_ai.token.type": "input"})
        assert tokens.count == 50 * (round_ + 1) and tokens.sum == 150 * (round_ + 1)


def test_failures_count_in_the_duration_only_with_their_error_type(rig: Rig, clock: FakeClock) -> None:
    with rig.metrics.request("a1") as req:
        req.first_token()
        req.tokens(input=5, output=2)
        req.fail("invalid_request")
    with pytest.raises(KeyError), rig.metrics.request("a1"):
        raise KeyError("boom")
    req = rig.metrics.request("a1")
    req.end(error="overloaded")
    req.end()  # idempotent
    with rig.metrics.request("a1") as req:
        req.fail("unknown")
        req.fail(None)  # it succeeded after all
    data = rig.collect()
    for error in ("invalid_request", "KeyError", "overloaded"):
        assert point(data, DURATION, base_attrs("a1", **{"error.type": error})).count == 1, error
    assert point(data, DURATION, base_attrs("a1")).count == 1
    assert {p.attributes.get("error.type") for p in points(data, TTFT)} <= {None}
    assert {p.attributes.get("error.type") for p in points(data, TOKENS)} <= {None}


def test_cancelled_requests_are_cancelled(rig: Rig) -> None:
    async def stream() -> None:
        with rig.metrics.request("a1"):
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(stream())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())

    def generator():
        with rig.metrics.request("a1"):
            yield 1
            yield 2

    it = generator()
    next(it)
    it.close()  # the client went away mid-stream
    data = rig.collect()
    assert point(data, DURATION, base_attrs("a1", **{"error.type": "cancelled"})).count == 2


def test_waiting_and_running_follow_the_requests(rig: Rig) -> None:
    def counts() -> tuple[float | None, float | None]:
        data = rig.collect()
        running = point(data, RUNNING, base_attrs("a1"))
        waiting = point(data, WAITING, base_attrs("a1"))
        return (running and running.value, waiting and waiting.value)

    queued = [rig.metrics.request("a1", queued=True) for _ in range(3)]
    direct = rig.metrics.request("a1")
    assert counts() == (1, 3)
    queued[0].start()
    queued[1].first_token()  # implies start
    assert counts() == (3, 1)
    queued[2].end(error="overloaded")  # never left the queue
    direct.end()
    queued[0].end()
    assert counts() == (1, 0)
    queued[1].end()
    assert counts() == (0, 0)


def test_a_loaded_adapter_is_visible_before_and_without_requests(clock: FakeClock) -> None:
    rig = Rig(True)
    with rig.metrics.loading_adapter("a1"):
        clock.sleep(0.25)
    rig.metrics.adapter_loaded("a2", load_time_s=0.5)
    data = rig.collect()
    assert point(data, LOADED, {"openlora.adapter.name": "a1"}).value == 1
    assert point(data, LOADED, {"openlora.adapter.name": "a2"}).value == 1
    # The request-count series exists at 0, so the first request is a rise that rate() sees.
    assert point(data, DURATION, base_attrs("a1")).count == 0
    assert point(data, RUNNING, base_attrs("a2")).value == 0
    assert point(data, WAITING, base_attrs("a2")).value == 0
    assert point(data, LOAD, {"openlora.adapter.name": "a1"}).sum == pytest.approx(0.25)
    rig.metrics.adapter_unloaded("a1")
    assert rig.metrics.loaded_adapters == ("a2",)
    data = rig.collect()
    assert point(data, LOADED, {"openlora.adapter.name": "a1"}).value == 0
    assert point(data, LOADED, {"openlora.adapter.name": "a2"}).value == 1


ORIGIN = AdapterOrigin(
    run_id="run-1", run_name="support-v2", base_model="tiny-llama", base_fingerprint="0123abcd", final_eval_loss=1.2345678
)
ORIGIN_ATTRS = {
    "openlora.training.run.id": "run-1",
    "openlora.training.run.name": "support-v2",
    "openlora.adapter.base_model": "tiny-llama",
    "openlora.adapter.base_fingerprint": "0123abcd",
    "openlora.training.final_eval_loss": "1.23457",
}


def infos(data) -> dict[str, dict[str, str]]:
    """The info series by adapter name: each adapter has at most one, of value 1."""
    found: dict[str, dict[str, str]] = {}
    for p in points(data, INFO):
        attributes = dict(p.attributes)
        name = attributes.pop("openlora.adapter.name")
        assert name not in found and p.value == 1, (name, found)
        found[name] = attributes
    return found


def test_a_loaded_adapter_has_one_info_series_with_its_origin_and_the_requests_do_not(rig: Rig) -> None:
    with rig.metrics.loading_adapter("a1", trained_by=ORIGIN):
        pass
    rig.metrics.adapter_loaded("a2", load_time_s=0.1, trained_by=AdapterOrigin(run_id="run-2"))
    rig.metrics.adapter_loaded("plain")  # from elsewhere: only its name is known
    rig.metrics.request("a1").end()
    data = rig.collect()
    assert infos(data) == {"a1": ORIGIN_ATTRS, "a2": {"openlora.training.run.id": "run-2"}, "plain": {}}
    # The origin is on the info series only: no request, load or loaded series carries it.
    for name in (DURATION, RUNNING, WAITING, LOADED, LOAD):
        for p in points(data, name):
            assert not set(p.attributes) & set(ORIGIN_ATTRS), (name, dict(p.attributes))
    # Collected again, the same series (observed every collection, not once).
    assert infos(rig.collect()) == infos(data)


def test_the_info_series_is_replaced_on_reload_and_gone_after_unload(rig: Rig) -> None:
    rig.metrics.adapter_loaded("a1", trained_by=ORIGIN)
    rig.metrics.adapter_loaded("a2", trained_by=ORIGIN)
    assert set(infos(rig.collect())) == {"a1", "a2"}
    retrained = AdapterOrigin(run_id="run-9", run_name="support-v3", final_eval_loss=float("nan"))
    with rig.metrics.loading_adapter("a1", trained_by=retrained):
        pass
    rig.metrics.adapter_unloaded("a2")
    data = rig.collect()
    assert infos(data) == {
        "a1": {
            "openlora.training.run.id": "run-9",
            "openlora.training.run.name": "support-v3",
            "openlora.training.final_eval_loss": "NaN",
        }
    }
    assert point(data, LOADED, {"openlora.adapter.name": "a2"}).value == 0  # the loaded gauge stays, at 0
    # A failed reload changes nothing; loading a2 again brings its series back.
    with pytest.raises(OSError), rig.metrics.loading_adapter("a1", trained_by=ORIGIN):
        raise OSError("disk")
    rig.metrics.adapter_loaded("a2")
    assert infos(rig.collect()) == {"a1": infos(data)["a1"], "a2": {}}


def test_the_info_series_are_bounded_by_the_adapter_cap_and_their_values_cut() -> None:
    rig = Rig(True, max_adapters=2)
    long = "x" * 500
    for i in range(50):
        rig.metrics.adapter_loaded(f"a{i}", trained_by=AdapterOrigin(run_id=f"run-{i}", run_name=long))
    found = infos(rig.collect())
    # One series per adapter with its own slot; those past the cap share "other" and get none.
    assert set(found) == {"a0", "a1"}
    assert found["a0"] == {"openlora.training.run.id": "run-0", "openlora.training.run.name": "x" * 100}
    for i in range(50):
        rig.metrics.adapter_unloaded(f"a{i}")
    assert infos(rig.collect()) == {}


def test_a_bad_origin_is_refused_and_a_bad_loss_left_out(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(TypeError, match="AdapterOrigin"):
        rig.metrics.adapter_loaded("a1", trained_by={"run_id": "run-1"})
    with caplog.at_level(logging.WARNING):
        rig.metrics.adapter_loaded("a1", trained_by=AdapterOrigin(run_id="", final_eval_loss="low"))
    assert infos(rig.collect()) == {"a1": {}}
    assert any("final_eval_loss" in r.getMessage() for r in caplog.records)
    assert AdapterOrigin(final_eval_loss=float("inf")).attributes() == {"openlora.training.final_eval_loss": "+Inf"}
    assert AdapterOrigin(final_eval_loss=3).attributes() == {"openlora.training.final_eval_loss": "3"}


def test_a_failed_load_records_its_error_and_the_adapter_is_not_loaded(rig: Rig) -> None:
    with pytest.raises(FileNotFoundError), rig.metrics.loading_adapter("broken"):
        raise FileNotFoundError("adapter_config.json")
    data = rig.collect()
    failed = point(data, LOAD, {"openlora.adapter.name": "broken", "error.type": "FileNotFoundError"})
    assert failed.count == 1
    assert point(data, LOADED, {"openlora.adapter.name": "broken"}) is None
    assert rig.metrics.loaded_adapters == ()


@pytest.mark.parametrize("name", [ADAPTER_BASE, ADAPTER_OTHER])
def test_reserved_adapter_names_cannot_be_loaded(rig: Rig, name: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        rig.metrics.adapter_loaded(name)


def test_adapter_names_are_capped_and_loaded_ones_keep_their_slots(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(True, max_adapters=3)
    rig.metrics.adapter_loaded("a1")
    rig.metrics.adapter_loaded("a2")
    with caplog.at_level(logging.WARNING):
        for i in range(1000):  # made-up names from clients past the cap
            rig.metrics.request(f"tenant-{i}").end()
    rig.metrics.request(ADAPTER_OTHER).end(
        error="unknown_adapter"
    )  # what a server passes for a name it lacks
    data = rig.collect()
    adapters = {p.attributes["openlora.adapter.name"] for p in points(data, DURATION)}
    assert adapters == {"a1", "a2", "tenant-0", "other"}
    assert point(data, DURATION, base_attrs("other")).count == 999
    assert point(data, DURATION, base_attrs("other", **{"error.type": "unknown_adapter"})).count == 1
    assert len(rig.metrics.adapter_names) == 3  # names past the cap are not remembered
    warnings = [r for r in caplog.records if "distinct adapter" in r.getMessage()]
    assert len(warnings) == 1 and "'tenant-1'" in warnings[0].getMessage()


def test_error_types_and_models_are_capped(rig: Rig) -> None:
    for i in range(40):
        rig.metrics.request("a1", model=f"m{i % 20}").end(error=f"E{i}")
    data = rig.collect()
    errors = {p.attributes["error.type"] for p in points(data, DURATION)}
    assert len(errors) == 17 and "_OTHER" in errors
    models = {p.attributes["gen_ai.request.model"] for p in points(data, DURATION)}
    # tiny-llama (the default) and 7 more, then _OTHER.
    assert len(models - {"_OTHER"}) == 7 and "_OTHER" in models


def test_a_clients_error_types_are_not_capped_and_leave_the_cap_to_the_servers(rig: Rig) -> None:
    """A public endpoint sees many kinds of bad requests: those (CLIENT_ERROR_PATTERN, a bounded set)
    never take a slot of the cap, never become _OTHER (which the server-error ratio counts), and the
    server's own error types keep all 16 slots."""
    client = ["400", "401", "403", "404", "405", "408", "413", "415", "422", "499", "invalid_request_error",
              "unknown_adapter", "INVALID_ARGUMENT", "NOT_FOUND", "CANCELLED", "request_too_large", "PERMISSION_DENIED"]  # fmt: skip
    for error in client:
        rig.metrics.request("a1").end(error=error)
    for i in range(17):
        rig.metrics.request("a1").end(error=f"ServerError{i}")
    for error in client:  # still themselves after the cap is full
        rig.metrics.request("a1").end(error=error)
    errors = {p.attributes["error.type"]: p.count for p in points(rig.collect(), DURATION) if "error.type" in p.attributes}
    assert {e: errors[e] for e in client} == dict.fromkeys(client, 2)
    assert {e for e in errors if e.startswith("ServerError")} == {f"ServerError{i}" for i in range(16)}
    assert errors["_OTHER"] == 1  # the 17th of the server's


def test_bad_token_counts_are_ignored_with_one_warning(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with rig.metrics.request("a1") as req:
                req.tokens(input=-1, output=2.5)  # type: ignore[arg-type]
    data = rig.collect()
    assert point(data, DURATION, base_attrs("a1")).count == 3
    assert points(data, TOKENS) == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("input token count" in m for m in messages) == 1
    assert sum("output token count" in m for m in messages) == 1


def test_a_first_token_time_that_is_not_a_number_is_ignored_with_one_warning(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    # It used to be taken and then raise TypeError in end(): out of the app's `with` block or error path.
    with caplog.at_level(logging.WARNING):
        for at in ("12.5", True, object()):
            with rig.metrics.request("a1") as request:
                request.first_token(at=at)  # type: ignore[arg-type]
            assert request.ended
    data = rig.collect()
    assert point(data, DURATION, base_attrs("a1")).count == 3
    assert points(data, TTFT) == []
    assert sum("first_token(at=...)" in r.getMessage() for r in caplog.records) == 1


def test_the_decorator_times_sync_and_async_calls(rig: Rig) -> None:
    @rig.metrics.instrument(adapter="a1")
    def generate(x: int) -> int:
        if x < 0:
            raise ValueError(x)
        return x * 2

    @rig.metrics.instrument(adapter="a1", operation="chat")
    async def chat() -> str:
        return "hi"

    assert generate(2) == 4
    with pytest.raises(ValueError):
        generate(-1)
    assert asyncio.run(chat()) == "hi"
    data = rig.collect()
    assert point(data, DURATION, base_attrs("a1")).count == 1
    assert point(data, DURATION, base_attrs("a1", **{"error.type": "ValueError"})).count == 1
    assert point(data, DURATION, {**base_attrs("a1"), "gen_ai.operation.name": "chat"}).count == 1


def test_setup_telemetry_serves_the_contract_series_with_merged_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("prometheus",), prometheus_host="127.0.0.1", prometheus_port=0),
        service_name="openlora-serve",
    )
    try:
        inference = telemetry.inference
        assert inference is telemetry.inference and inference.window_histogram
        inference.set_model("tiny-llama")
        inference.adapter_loaded("a1", load_time_s=0.2, trained_by=ORIGIN)
        with inference.request("a1", queued=True) as req:
            req.start()
            req.first_token()
            req.tokens(input=4, output=3)
        inference.request(ADAPTER_OTHER).end(error="unknown_adapter")  # a name the server lacks
        with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
            body = response.read().decode()
    finally:
        telemetry.shutdown()
    samples = [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    ]

    def served(name: str, **labels: str) -> list[float]:
        return [v for n, got, v in samples if n == name and labels.items() <= got.items()]

    for spec in names.INFERENCE_METRICS:
        suffix = "_count" if spec.kind == "histogram" else ""
        assert served(spec.prometheus + suffix), spec.prometheus
    common = {
        "gen_ai_operation_name": "text_completion",
        "gen_ai_provider_name": "openlora",
        "gen_ai_response_model": "tiny-llama",
    }
    count = "gen_ai_server_request_duration_seconds_count"
    other = {"openlora_adapter_name": "other", "gen_ai_request_model": "other"}
    a1 = {"openlora_adapter_name": "a1", "gen_ai_request_model": "a1"}
    assert served(count, error_type="unknown_adapter", **other, **common) == [1.0]
    assert served(count, **a1, **common) == [1.0]
    assert served("openlora_inference_token_usage_sum", gen_ai_token_type="output", **a1, **common) == [3.0]
    assert served("openlora_inference_adapter_loaded", openlora_adapter_name="a1") == [1.0]
    origin = {key.replace(".", "_"): value for key, value in ORIGIN_ATTRS.items()}
    assert served("openlora_inference_adapter_info", openlora_adapter_name="a1", **origin) == [1.0]
    # Run identity only in target_info, never on the serving series (openlora_run_outcome, the
    # process's own end, names its run because it outlives its target).
    assert not [
        n for n, got, _ in samples if n not in ("target_info", "openlora_run_outcome") and "openlora_run_id" in got
    ]


@pytest.mark.parametrize("raw", ["0", "1001", "ten", "-3"])
def test_the_adapter_cap_variable_is_checked_at_setup(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("OPENLORA_INFERENCE_MAX_ADAPTERS", raw)
    with pytest.raises(ConfigError, match="OPENLORA_INFERENCE_MAX_ADAPTERS") as error:
        setup_telemetry()
    assert raw in str(error.value) and "1 to 1000" in str(error.value)


def test_the_adapter_cap_variable_reaches_telemetry_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENLORA_INFERENCE_MAX_ADAPTERS", "2")
    reader = InMemoryMetricReader()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry(metric_readers=[reader])
    try:
        for name in ("a", "b", "c"):
            telemetry.inference.request(name).end()
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()
    assert {p.attributes["openlora.adapter.name"] for p in points(data, DURATION)} == {"a", "b", "other"}


def test_an_aborted_collection_loses_no_request() -> None:
    """A collection that times out after the windows were handed over keeps them for the next one."""
    from tests.support.readings import SlowOnce

    rig = Rig(True)
    SlowOnce(rig.provider.get_meter("slow"), seconds=0.3)
    for _ in range(5):
        rig.metrics.request("a1").end()
    with pytest.raises(Exception, match=r"[Tt]imeout|[Tt]imed out"):
        rig.reader.collect(timeout_millis=100)
    rig.metrics.request("a1").end()
    data = rig.collect()
    assert point(data, DURATION, base_attrs("a1")).count == 6


def test_an_unloaded_adapter_without_traffic_gets_no_new_series() -> None:
    rig = Rig(True)
    rig.metrics.adapter_loaded("old")
    rig.metrics.adapter_unloaded("old")
    rig.metrics.adapter_loaded("new")
    data = rig.collect()
    assert point(data, LOADED, {"openlora.adapter.name": "old"}).value == 0
    assert point(data, DURATION, base_attrs("new")).count == 0
    assert point(data, DURATION, base_attrs("old")) is None
    assert point(data, RUNNING, base_attrs("old")) is None
    assert point(data, WAITING, base_attrs("old")) is None


def test_told_of_views_that_are_not_there_the_first_window_is_replayed_not_lost(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """window_histogram=True on a provider without inference_views(): the first window counts as one
    0 s value (the SDK took it as a number), but its own requests are replayed, not dropped."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])  # no views
    metrics = InferenceMetrics(provider.get_meter("test"), model="tiny-llama", window_histogram=True)
    for _ in range(3):
        with metrics.request("a1") as req:
            clock.sleep(0.5)
            req.first_token()
            req.tokens(input=2, output=1)
    with caplog.at_level(logging.WARNING):
        data = reader.get_metrics_data()
    duration = point(data, DURATION, base_attrs("a1"))
    assert duration.count == 3 + 1 and duration.sum == pytest.approx(1.5)
    assert point(data, TTFT, base_attrs("a1")).count == 3
    assert any("inference_views()" in r.getMessage() for r in caplog.records)
    metrics.request("a1").end()
    assert point(reader.get_metrics_data(), DURATION, base_attrs("a1")).count == 3 + 1 + 1


def test_adapters_loaded_past_the_cap_share_other_until_the_last_is_unloaded() -> None:
    rig = Rig(True, max_adapters=1)
    metrics = rig.metrics
    for name in ("a1", "a2", "a3"):
        metrics.adapter_loaded(name)
    other = {"openlora.adapter.name": "other"}

    def loaded() -> float:
        found = [p for p in points(rig.collect(), LOADED) if dict(p.attributes) == other]
        return found[-1].value

    assert loaded() == 1
    metrics.adapter_unloaded("a2")
    assert loaded() == 1  # a3 is still loaded, recorded as "other"
    assert set(metrics.loaded_adapters) == {"a1", "other"}
    metrics.adapter_unloaded("a2")  # twice: still a3
    assert loaded() == 1
    metrics.adapter_unloaded("a3")
    assert loaded() == 0
    assert metrics.loaded_adapters == ("a1",)


def test_an_empty_adapter_name_is_the_base_model(rig: Rig) -> None:
    rig.metrics.request("").end()
    assert point(rig.collect(), DURATION, base_attrs("base")).count == 1


def test_request_model_is_the_name_asked_for_bounded_as_adapters_and_response_model_the_served_base() -> None:
    """The conventions: a fine-tuned model's gen_ai.request.model is more specific than its base's name."""
    rig = Rig(True, max_adapters=2)
    rig.metrics.request("a1").end()
    rig.metrics.request("a2", operation="chat").end()
    rig.metrics.request("a3").end()  # past the cap: "other", as its adapter attribute
    rig.metrics.request(None).end()
    data = rig.collect()
    seen = {
        (p.attributes["openlora.adapter.name"], p.attributes["gen_ai.request.model"],
         p.attributes["gen_ai.response.model"], p.attributes["gen_ai.operation.name"])
        for p in points(data, DURATION)
    }  # fmt: skip
    assert seen == {
        ("a1", "a1", "tiny-llama", "text_completion"),
        ("a2", "a2", "tiny-llama", "chat"),
        ("other", "other", "tiny-llama", "text_completion"),
        ("base", "tiny-llama", "tiny-llama", "text_completion"),
    }


def warnings_in_a_forked_child(action: Callable[[], object]) -> list[str] | None:
    """The warnings the inference metrics log while ``action`` runs in a forked child (None: the child
    reported nothing); the child's exit status checked."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child, which reports through the pipe
        status = 1
        try:
            messages: list[str] = []
            handler = logging.Handler(logging.WARNING)
            handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
            logging.getLogger(inference_module.__name__).addHandler(handler)
            action()
            os.write(write, json.dumps(messages).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        messages = json.loads(pipe.read() or b"null")
    assert os.waitpid(child, 0)[1] == 0
    return messages


@pytest.mark.process
def test_a_request_in_a_forked_child_warns_once_that_it_is_lost(caplog: pytest.LogCaptureFixture) -> None:
    """gunicorn --preload sets up in the master and forks the workers, which export nothing: the
    first request a worker records says so, once, naming what to do instead; the parent stays quiet."""
    inference = InferenceMetrics(MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("test"))

    def record() -> None:
        for _ in range(3):
            inference.request("a1").end()

    messages = warnings_in_a_forked_child(record)
    assert messages is not None and len(messages) == 1, messages
    assert f"forked from process {os.getpid()}" in messages[0] and "is lost" in messages[0]
    assert "app factory" in messages[0] and "--preload" in messages[0]
    with caplog.at_level(logging.WARNING):
        inference.request("a1").end()
    assert not [r for r in caplog.records if "forked" in r.getMessage()]


@pytest.mark.process
def test_telemetry_inference_first_used_in_a_forked_child_warns_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set up in the master, ``telemetry.inference`` first touched in a worker (a middleware built in a
    post_fork hook on a telemetry made before the fork): the readers are the master's, so the worker's
    requests are lost and it says so."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry(metric_readers=[InMemoryMetricReader()])
    try:
        messages = warnings_in_a_forked_child(lambda: telemetry.inference.request("a1").end())
    finally:
        telemetry.shutdown()
    assert messages is not None and len(messages) == 1 and f"forked from process {os.getpid()}" in messages[0], messages

"""OpenAIMetricsServerInterceptor on a real grpcio server and client on loopback (in process, threads):
unary and server-streaming inference calls, adapters from metadata or the request, status codes,
a client that cancels mid-stream; other methods untouched."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from openlora_otel.inference import InferenceMetrics  # noqa: E402
from openlora_otel.inference.grpc_interceptor import OpenAIMetricsServerInterceptor  # noqa: E402
from openlora_otel.names import CLIENT_ERROR_PATTERN  # noqa: E402
from tests.support.polling import wait_until  # noqa: E402
from tests.support.readings import points  # noqa: E402

DURATION = "gen_ai.server.request.duration"
TTFT = "gen_ai.server.time_to_first_token"
TOKENS = "openlora.inference.token.usage"
RUNNING = "openlora.inference.requests.running"
SERVICE = "llm.Generator"


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def decode(data: bytes) -> Any:
    return json.loads(data)


class Rig:
    """A grpc server with the interceptor (``Generate``: unary, ``Stream``: server-streaming, ``Health``:
    not measured) and a channel to it."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.inference = InferenceMetrics(MeterProvider(metric_readers=[self.reader]).get_meter("test"), model="base")
        self.release = threading.Event()
        interceptor = OpenAIMetricsServerInterceptor(
            self.inference,
            methods={f"/{SERVICE}/Generate": "text_completion", f"/{SERVICE}/Stream": "chat"},
            adapter_metadata_key="x-adapter",
            adapter_from_request=lambda request: request.get("model"),
            adapter=lambda name: None if name == "base" else name,
            input_tokens=lambda request: len(request.get("prompt", "").split()),
            output_tokens=lambda message: len(message.get("text", "").split()),
        )
        handlers = {
            "Generate": grpc.unary_unary_rpc_method_handler(self.generate, request_deserializer=decode, response_serializer=encode),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream, request_deserializer=decode, response_serializer=encode),
            "Health": grpc.unary_unary_rpc_method_handler(lambda r, c: {"ok": True}, request_deserializer=decode, response_serializer=encode),
        }  # fmt: skip
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[interceptor])
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def held(self, context: Any) -> None:
        """Until the test releases the call or the server knows its client left (10 s at most)."""
        for _ in range(1000):
            if self.release.wait(0.01) or not context.is_active():
                return

    def generate(self, request: dict, context: Any) -> dict:
        if request.get("model") == "slow":
            self.held(context)
        if request.get("prompt") == "":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        if request.get("model") == "busy":
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            return {}
        if request.get("model") == "bug":
            raise KeyError("bug")
        return {"text": " ".join(request["prompt"].split()[:3])}

    def stream(self, request: dict, context: Any) -> Iterator[dict]:
        for word in request["prompt"].split():
            if request.get("model") in ("slow", "stops"):
                self.held(context)
            if request.get("model") == "deaf":  # blind to its client: only the test releases it
                self.release.wait(10)
            if request.get("model") == "stops" and not context.is_active():
                return  # a server that stops generating when its client leaves
            yield {"text": word}

    def call(self, method: str, request: dict, metadata: tuple = ()) -> Any:
        if method == "Stream":
            return list(self.channel.unary_stream(f"/{SERVICE}/{method}", request_serializer=encode,
                                                  response_deserializer=decode)(request, metadata=metadata))  # fmt: skip
        return self.channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=encode, response_deserializer=decode)(
            request, metadata=metadata
        )

    def by(self, name: str, key: str) -> dict:
        counts: dict = {}
        for point in points(self.reader.get_metrics_data(), name):
            label = (point.attributes.get("openlora.adapter.name"), point.attributes.get(key))
            counts[label] = counts.get(label, 0) + (point.count if hasattr(point, "count") else point.value)
        return counts

    def close(self) -> None:
        self.release.set()
        self.channel.close()
        self.server.stop(None)


@pytest.fixture
def rig() -> Iterator[Rig]:
    rig = Rig()
    yield rig
    rig.close()


def test_unary_and_streamed_calls_record_adapter_first_message_and_tokens(rig: Rig) -> None:
    assert rig.call("Generate", {"model": "a1", "prompt": "one two three four"}) == {"text": "one two three"}
    assert rig.call("Stream", {"model": "base", "prompt": "x y z"}, metadata=(("x-adapter", "a2"),)) == [
        {"text": "x"}, {"text": "y"}, {"text": "z"}
    ]  # fmt: skip
    assert rig.call("Stream", {"model": "base", "prompt": "p q"}) == [{"text": "p"}, {"text": "q"}]
    assert rig.call("Health", {}) == {"ok": True}  # not measured
    assert rig.by(DURATION, "gen_ai.operation.name") == {("a1", "text_completion"): 1, ("a2", "chat"): 1, ("base", "chat"): 1}
    assert rig.by(TTFT, "gen_ai.operation.name") == rig.by(DURATION, "gen_ai.operation.name")
    tokens = {(p.attributes["openlora.adapter.name"], p.attributes["gen_ai.token.type"]): p.sum
              for p in points(rig.reader.get_metrics_data(), TOKENS)}  # fmt: skip
    assert tokens == {("a1", "input"): 4, ("a1", "output"): 3, ("a2", "input"): 3, ("a2", "output"): 3,
                      ("base", "input"): 2, ("base", "output"): 2}  # fmt: skip


def test_status_codes_and_exceptions_are_the_error_type(rig: Rig) -> None:
    for request in ({"model": "a1", "prompt": ""}, {"model": "busy", "prompt": "x"}, {"model": "bug", "prompt": "x"}):
        with pytest.raises(grpc.RpcError):
            rig.call("Generate", request)
    assert rig.by(DURATION, "error.type") == {
        ("a1", "INVALID_ARGUMENT"): 1, ("busy", "RESOURCE_EXHAUSTED"): 1, ("bug", "KeyError"): 1
    }  # fmt: skip
    assert not points(rig.reader.get_metrics_data(), TTFT)


def stream_of(rig: Rig, model: str, timeout: float | None = None) -> Any:
    return rig.channel.unary_stream(f"/{SERVICE}/Stream", request_serializer=encode, response_deserializer=decode)(
        {"model": model, "prompt": "a b c"}, timeout=timeout
    )


def running(rig: Rig) -> int:
    return sum(p.value for p in points(rig.reader.get_metrics_data(), RUNNING))


@pytest.mark.parametrize("model", ["slow", "stops"], ids=["closed-mid-stream", "handler-returns"])
def test_a_client_that_cancels_mid_stream_makes_it_cancelled(rig: Rig, model: str) -> None:
    """The handler waits until the server knows the client left: then it yields on (the stream is
    closed under it) or stops and returns (as a server that checks context.is_active())."""
    call = stream_of(rig, model, timeout=60)
    wait_until(lambda: running(rig) == 1, 10, "the call running")
    call.cancel()
    wait_until(lambda: rig.by(DURATION, "error.type"), 10, "the cancelled call recorded")
    assert rig.by(DURATION, "error.type") == {(model, "CANCELLED"): 1}
    assert running(rig) == 0


@pytest.mark.parametrize("model", ["slow", "stops"], ids=["closed-mid-stream", "handler-returns"])
def test_a_stream_past_its_deadline_is_the_servers_deadline_exceeded_not_a_cancel(rig: Rig, model: str) -> None:
    """A server too slow for its clients' deadlines must reach the error-ratio alert: CANCELLED is
    the client's (left out), DEADLINE_EXCEEDED the server's. The handler goes on as soon as the server
    knows the call is over: often by the client's cancel at its own deadline, which reaches the server
    before the server's copy of the deadline passes (a CI run once counted it CANCELLED)."""
    with pytest.raises(grpc.RpcError) as caught:
        list(stream_of(rig, model, timeout=2.0))
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: rig.by(DURATION, "error.type"), 10, "the call recorded")
    assert rig.by(DURATION, "error.type") == {(model, "DEADLINE_EXCEEDED"): 1}
    assert re.fullmatch(CLIENT_ERROR_PATTERN, "DEADLINE_EXCEEDED") is None


@pytest.mark.parametrize("timeout", [None, 1.0], ids=["no-deadline", "deadline"])
def test_a_cancel_is_judged_by_when_the_client_left_not_when_the_handler_noticed(rig: Rig, timeout: float | None) -> None:
    """A handler blind to its client, released after the deadline its client had: the client cancelled
    long before that deadline, so CANCELLED (not the server's DEADLINE_EXCEEDED)."""
    call = stream_of(rig, "deaf", timeout=timeout)
    wait_until(lambda: running(rig) == 1, 10, "the call running")
    call.cancel()
    time.sleep(1.2)
    rig.release.set()
    wait_until(lambda: rig.by(DURATION, "error.type"), 10, "the cancelled call recorded")
    assert rig.by(DURATION, "error.type") == {("deaf", "CANCELLED"): 1}


def test_a_unary_call_whose_client_left_is_not_an_answer(rig: Rig) -> None:
    """A unary handler still at work when its client cancels (or its deadline passes) returns an answer
    nobody gets: CANCELLED (DEADLINE_EXCEEDED), no first token, no tokens."""
    generate = rig.channel.unary_unary(f"/{SERVICE}/Generate", request_serializer=encode, response_deserializer=decode)
    future = generate.future({"model": "slow", "prompt": "a b c"}, timeout=60)
    wait_until(lambda: running(rig) == 1, 10, "the call running")
    future.cancel()
    wait_until(lambda: rig.by(DURATION, "error.type"), 10, "the cancelled call recorded")
    with pytest.raises(grpc.RpcError) as caught:
        generate({"model": "slow", "prompt": "a b c"}, timeout=2.0)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: len(rig.by(DURATION, "error.type")) == 2, 10, "the call past its deadline recorded")
    assert rig.by(DURATION, "error.type") == {("slow", "CANCELLED"): 1, ("slow", "DEADLINE_EXCEEDED"): 1}
    assert not points(rig.reader.get_metrics_data(), TTFT)
    assert not points(rig.reader.get_metrics_data(), TOKENS)


@pytest.mark.parametrize(
    ("budget", "remaining", "passed"),
    [
        (2.0, 0.0, True),
        (2.0, 0.15, True),  # the client's cancel at its deadline, 150 ms ahead of the server's copy
        (2.0, 0.3, False),
        (0.1, 0.015, True),  # at least 20 ms
        (0.1, 0.05, False),
        (600.0, 0.9, True),  # at most 1 s
        (600.0, 5.0, False),
        (None, 0.0, False),  # no deadline known when the call started
    ],
)
def test_a_call_closed_near_its_deadline_is_past_it(budget: float | None, remaining: float, passed: bool) -> None:
    from openlora_otel.inference.grpc_interceptor import _deadline_passed

    assert _deadline_passed(remaining, budget) is passed
    assert _deadline_passed(None, budget) is False


def test_the_interceptor_refuses_what_cannot_work() -> None:
    with pytest.raises(TypeError, match="InferenceMetrics"):
        OpenAIMetricsServerInterceptor(object(), methods={"/a.B/C": "chat"})  # type: ignore[arg-type]
    reader = InMemoryMetricReader()
    inference = InferenceMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    with pytest.raises(ValueError, match="methods"):
        OpenAIMetricsServerInterceptor(inference, methods={})

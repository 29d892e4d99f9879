"""OpenAIMetricsMiddleware on ASGI apps driven in process: what each kind of answer records, that the app
sees its request unchanged and the client every piece, and the reader of the traffic under arbitrary
bytes (property-based)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import openlora_otel.inference.asgi as asgi_module
import openlora_otel.inference.metrics as metrics_module
import openlora_otel.inference.openai_traffic as traffic_module
from openlora_otel import names, setup_telemetry
from openlora_otel.inference import InferenceMetrics
from openlora_otel.inference.asgi import STATE_KEY, OpenAIMetricsMiddleware
from openlora_otel.inference.openai_traffic import MAX_REQUEST_BYTES, ResponseReader, read_request
from openlora_otel.names.inference import is_client_error_status
from tests.support.clock import FakeClock
from tests.support.readings import points
from tests.support.serving import asgi_call

DURATION = "gen_ai.server.request.duration"
TTFT = "gen_ai.server.time_to_first_token"
TOKENS = "openlora.inference.token.usage"
RUNNING = "openlora.inference.requests.running"
WAITING = "openlora.inference.requests.waiting"
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for module in (metrics_module, asgi_module, traffic_module):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def inference(reader: InMemoryMetricReader) -> InferenceMetrics:
    return InferenceMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"), model="tiny-llama")


def one(reader: InMemoryMetricReader, name: str, **attributes: str):
    found = [p for p in points(reader.get_metrics_data(), name) if all(p.attributes.get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, [dict(p.attributes) for p in points(reader.get_metrics_data(), name)]
    return found[0]


def event(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def chat_chunk(content: str | None = None, role: str | None = None, finish: str | None = None) -> dict:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class Exchange:
    """One request through an ASGI app: what the app received, what the client got."""

    def __init__(self) -> None:
        self.app_body = b""
        self.sent: list[dict] = []


def run(app: Callable, body: bytes, *, path: str = "/v1/chat/completions", method: str = "POST", pieces: int = 1) -> Exchange:
    """One request to ``app`` in process (tests/support/serving.py's asgi_call)."""
    exchange = Exchange()
    exchange.sent = asgi_call(app, path, body, method=method, pieces=pieces)
    return exchange


def streaming_app(events: list[bytes], clock: FakeClock | None = None, *, status: int = 200, step: float = 0.1,
                  end: bool = True, seen: Exchange | None = None) -> Callable:  # fmt: skip
    """An app that reads its whole body, then sends ``events`` one per message, ``step`` s apart."""

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if seen is not None:
            seen.app_body = body
        await send({"type": "http.response.start", "status": status, "headers": SSE})
        for piece in events:
            if clock is not None:
                clock.sleep(step)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        if end:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def json_app(answer: dict, clock: FakeClock | None = None, *, status: int = 200, delay: float = 0.25) -> Callable:
    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        while (await receive()).get("more_body"):
            pass
        if clock is not None:
            clock.sleep(delay)
        await send({"type": "http.response.start", "status": status, "headers": JSON})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    return app


def request_body(model: str = "alpaca", **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


# -- what each answer records ---------------------------------------------------------------------------


def test_a_plain_answer_records_duration_first_byte_and_the_usage_it_returns(clock, reader, inference) -> None:
    answer = {"object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}
    app = OpenAIMetricsMiddleware(json_app(answer, clock), inference)
    sent = run(app, request_body()).sent
    assert json.loads(sent[1]["body"]) == answer  # the client got it unchanged
    duration = one(reader, DURATION, **{"openlora.adapter.name": "alpaca", "gen_ai.operation.name": "chat"})
    assert duration.count == 1 and duration.sum == pytest.approx(0.25) and "error.type" not in duration.attributes
    assert one(reader, TTFT).sum == pytest.approx(0.25)  # the answer's first byte
    assert one(reader, TOKENS, **{"gen_ai.token.type": "input"}).sum == 7
    assert one(reader, TOKENS, **{"gen_ai.token.type": "output"}).sum == 5


def test_a_stream_with_usage_records_the_first_content_not_the_role_chunk(clock, reader, inference) -> None:
    events = [
        event(chat_chunk(role="assistant", content="")),
        event(chat_chunk(content="Hel")),
        event(chat_chunk(content="lo")),
        event(chat_chunk(finish="stop")),
        event({"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}),
        event("[DONE]"),
    ]
    app = OpenAIMetricsMiddleware(streaming_app(events, clock), inference)
    sent = run(app, request_body(stream=True, stream_options={"include_usage": True})).sent
    assert [m.get("body") for m in sent[1:-1]] == events  # every piece, unchanged and in order
    assert one(reader, TTFT).sum == pytest.approx(0.2)  # the second event: the first with content
    assert one(reader, DURATION).sum == pytest.approx(0.6)
    assert one(reader, TOKENS, **{"gen_ai.token.type": "input"}).sum == 9
    assert one(reader, TOKENS, **{"gen_ai.token.type": "output"}).sum == 2


def test_a_stream_without_usage_counts_its_content_chunks_as_output_tokens(clock, reader, inference) -> None:
    events = [event({"object": "text_completion", "choices": [{"index": 0, "text": t}]}) for t in ("a", "b", "", "c")]
    app = OpenAIMetricsMiddleware(streaming_app([*events, event("[DONE]")], clock), inference)
    run(app, json.dumps({"model": "alpaca", "prompt": "x", "stream": True}).encode(), path="/v1/completions")
    assert one(reader, TOKENS, **{"gen_ai.token.type": "output", "gen_ai.operation.name": "text_completion"}).sum == 3
    assert not [p for p in points(reader.get_metrics_data(), TOKENS) if p.attributes["gen_ai.token.type"] == "input"]


def test_events_split_anywhere_across_messages_read_the_same(clock, reader, inference) -> None:
    stream = b"".join(
        [event(chat_chunk(content="x")), b"data: " + json.dumps(chat_chunk(content="y")).encode() + b"\r\n\r\n",
         event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}), event("[DONE]")]
    )  # fmt: skip
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    run(OpenAIMetricsMiddleware(streaming_app(pieces, clock, step=0.01), inference), request_body(stream=True))
    assert one(reader, TOKENS, **{"gen_ai.token.type": "output"}).sum == 2
    assert one(reader, TOKENS, **{"gen_ai.token.type": "input"}).sum == 4


def test_an_error_answer_records_its_code_as_error_type(clock, reader, inference) -> None:
    error = {"error": {"message": "no such model", "type": "server_error", "param": "model", "code": "model_failed"}}
    run(OpenAIMetricsMiddleware(json_app(error, clock, status=500), inference), request_body("nope"))
    duration = one(reader, DURATION)
    assert duration.attributes["error.type"] == "model_failed"
    assert not points(reader.get_metrics_data(), TTFT)  # an error is no first token
    # Without an error body: the status. A client's fault (404 here) as a name the alert knows: its type.
    run(OpenAIMetricsMiddleware(json_app({}, clock, status=503), inference), request_body("nope"))
    error = {"error": {"message": "no such model", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    run(OpenAIMetricsMiddleware(json_app(error, clock, status=404), inference), request_body("nope"))
    recorded = {p.attributes.get("error.type") for p in points(reader.get_metrics_data(), DURATION)}
    assert recorded == {"model_failed", "503", "invalid_request_error"}


def test_a_stream_that_ends_in_an_error_event_records_it(clock, reader, inference) -> None:
    events = [event(chat_chunk(content="a")), event({"error": {"message": "boom", "type": "server_error", "code": "cancelled"}})]
    run(OpenAIMetricsMiddleware(streaming_app(events, clock), inference), request_body(stream=True))
    assert one(reader, DURATION).attributes["error.type"] == "cancelled"


def test_an_answer_the_client_abandoned_is_cancelled_and_an_app_error_is_its_type(clock, reader, inference) -> None:
    run(OpenAIMetricsMiddleware(streaming_app([event(chat_chunk(content="a"))], clock, end=False), inference), request_body(stream=True))
    assert one(reader, DURATION).attributes["error.type"] == "cancelled"

    async def failing(scope: dict, receive: Callable, send: Callable) -> None:
        raise LookupError("bug")

    with pytest.raises(LookupError):
        run(OpenAIMetricsMiddleware(failing, inference), request_body())
    assert {p.attributes["error.type"] for p in points(reader.get_metrics_data(), DURATION)} == {"cancelled", "LookupError"}
    assert all(p.value == 0 for p in points(reader.get_metrics_data(), RUNNING))


def test_the_app_gets_the_body_as_sent_and_other_requests_pass_untouched(clock, reader, inference) -> None:
    body = request_body(messages=[{"role": "user", "content": "é" * 5000}])
    seen = Exchange()
    run(OpenAIMetricsMiddleware(streaming_app([], seen=seen), inference), body, pieces=4)
    assert seen.app_body == body
    for path, method in (("/v1/models", "POST"), ("/v1/chat/completions", "GET"), ("/health", "POST")):
        seen = Exchange()
        run(OpenAIMetricsMiddleware(streaming_app([], seen=seen), inference), body, path=path, method=method)
        assert seen.app_body == body
    assert one(reader, DURATION).count == 1  # the one POST to an OpenAI route


def test_the_adapter_hook_names_the_adapter_and_what_it_cannot_is_other(clock, reader, inference) -> None:
    def adapter(model: str) -> str | None:
        if model == "tiny-llama":
            return None  # the base model
        if model == "crash":
            raise ValueError(model)
        return model.removeprefix("lora/")

    app = OpenAIMetricsMiddleware(json_app({"choices": []}), inference, adapter=adapter)
    for model in ("tiny-llama", "lora/alpaca", "crash"):
        run(app, request_body(model))
    run(app, b'{"messages": []}')  # no model
    run(app, b"not json")
    run(app, request_body(messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]))  # too long to read
    counts = {p.attributes["openlora.adapter.name"]: p.count for p in points(reader.get_metrics_data(), DURATION)}
    assert counts == {"base": 1, "alpaca": 1, "other": 4}


def test_queued_requests_wait_until_the_app_starts_them(clock, reader, inference) -> None:
    states: list[tuple[float, float]] = []

    def gauge(name: str) -> float:
        return sum(p.value for p in points(reader.get_metrics_data(), name))

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        await receive()
        states.append((gauge(WAITING), gauge(RUNNING)))
        scope["state"][STATE_KEY].start()
        states.append((gauge(WAITING), gauge(RUNNING)))
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": b"{}"})

    run(OpenAIMetricsMiddleware(app, inference, queued=True), request_body())
    assert states == [(1, 0), (0, 1)]
    with pytest.raises(TypeError, match="InferenceMetrics"):
        OpenAIMetricsMiddleware(app, object())  # type: ignore[arg-type]



@pytest.mark.parametrize("given_telemetry", [True, False], ids=["telemetry", "inference"])
def test_given_the_telemetry_it_shuts_it_down_when_the_server_shuts_the_app_down(
    monkeypatch: pytest.MonkeyPatch, given_telemetry: bool
) -> None:
    """uvicorn ends a process it was asked to stop (SIGTERM) by that signal once the app is shut down,
    so atexit never runs: the middleware given the Telemetry ends it in the lifespan's shutdown,
    after the app's own and before the server hears it is complete; given only the inference, never."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry("lifespan", metric_readers=[InMemoryMetricReader()])
    seen: list[str] = []

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            kind = message["type"].removeprefix("lifespan.")
            seen.append(f"app {kind}")
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return

    async def lifespan(middleware: Callable) -> None:
        incoming = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

        async def receive() -> dict:
            return next(incoming)

        async def send(message: dict) -> None:
            seen.append(f"server {message['type']} (telemetry {'shut' if telemetry.is_shutdown else 'open'})")

        await middleware({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)

    try:
        middleware = OpenAIMetricsMiddleware(app, telemetry if given_telemetry else telemetry.inference)
        assert middleware.inference is telemetry.inference
        asyncio.run(lifespan(middleware))
        closed_by_middleware = telemetry.is_shutdown
    finally:
        telemetry.shutdown()
    assert seen == [
        "app startup",
        "server lifespan.startup.complete (telemetry open)",
        "app shutdown",
        f"server lifespan.shutdown.complete (telemetry {'shut' if given_telemetry else 'open'})",
    ]
    assert closed_by_middleware is given_telemetry

# -- the reader under arbitrary input --------------------------------------------------------------------


class _Record:
    """What a ResponseReader tells an InferenceRequest."""

    output_tokens = None

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def first_token(self, at: float | None = None) -> None:
        self.calls.append(("first",))

    def tokens(self, input: int | None = None, output: int | None = None) -> None:
        self.calls.append(("tokens", input, output))

    def fail(self, error: str | None) -> None:
        self.calls.append(("fail", error))


def read(pieces: list[bytes], status: int = 200, content_type: str = "text/event-stream") -> list[tuple]:
    record = _Record()
    reader = ResponseReader(record)  # type: ignore[arg-type]
    reader.start(status, content_type)
    for piece in pieces:
        reader.body(piece, 0.0)
    reader.finish()
    return record.calls


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=20), st.integers(100, 599), st.sampled_from(["text/event-stream", "application/json", ""]))
def test_the_reader_never_raises_on_any_bytes(pieces: list[bytes], status: int, content_type: str) -> None:
    read(pieces, status, content_type)


stream_events = st.lists(
    st.one_of(
        st.builds(lambda t: chat_chunk(content=t), st.text(max_size=5)),
        st.builds(lambda i, o: {"choices": [], "usage": {"prompt_tokens": i, "completion_tokens": o}}, st.integers(0, 99), st.integers(0, 99)),
        st.just({"error": {"code": "cancelled"}}),
    ),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(stream_events, st.lists(st.integers(1, 200), max_size=10), st.booleans())
def test_where_a_stream_is_cut_into_pieces_changes_nothing(events: list[dict], cuts: list[int], crlf: bool) -> None:
    end = b"\r\n\r\n" if crlf else b"\n\n"
    stream = b"".join(b"data: " + json.dumps(e).encode() + end for e in events) + b"data: [DONE]" + end
    points_ = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points_], [*points_, len(stream)], strict=True)]
    assert read(pieces) == read([stream])


@given(st.binary(max_size=300) | st.text(max_size=100).map(str.encode))
def test_reading_a_request_body_never_raises(body: bytes) -> None:
    facts = read_request(body)
    assert facts.model is None or isinstance(facts.model, str)


def test_a_request_body_says_model_stream_and_usage() -> None:
    facts = read_request(request_body("m", stream=True, stream_options={"include_usage": True}))
    assert (facts.model, facts.stream, facts.include_usage) == ("m", True, True)
    facts = read_request(b'{"model": 3, "stream": "yes", "stream_options": []}')
    assert (facts.model, facts.stream, facts.include_usage) == (None, False, False)


def failed_as(status: int, error: object) -> str:
    """The error.type the reader records for a JSON error answer ``{"error": error}`` with ``status``."""
    calls = read([json.dumps({"error": error}).encode()], status, "application/json")
    (fail,) = [call for call in calls if call[0] == "fail"]
    return fail[1]


@pytest.mark.parametrize(
    ("status", "error", "recorded"),
    [
        # serve's own refusals keep their names
        (404, {"type": "not_found_error", "code": "unknown_adapter"}, "unknown_adapter"),
        (400, {"type": "invalid_request_error", "code": "invalid_request"}, "invalid_request"),
        (413, {"type": "invalid_request_error", "code": "request_too_large"}, "request_too_large"),
        # an OpenAI-style app: its specific code is no name the alert knows, its type is
        (400, {"type": "invalid_request_error", "code": "context_length_exceeded"}, "invalid_request_error"),
        (401, {"type": "authentication_error", "code": "invalid_api_key"}, "authentication_error"),
        # vLLM-style (an int code) or no name at all: the status
        (400, {"type": "BadRequestError", "code": 400}, "400"),
        (422, {"message": "bad"}, "422"),
        (404, "not an object", "404"),
        # the server's: as the app says
        (429, {"type": "rate_limit_error", "code": "rate_limited"}, "rate_limited"),
        (500, {"type": "server_error", "code": "model_crashed"}, "model_crashed"),
        # ... unless the app names a client's fault for it: then the status, which the alert counts
        (500, {"type": "server_error", "code": "invalid_request"}, "500"),
        (502, {"code": 404}, "502"),
        (504, {"type": "server_error", "code": "request_timeout"}, "504"),
        (503, {"type": "server_error", "code": "overloaded"}, "overloaded"),
        (502, {}, "502"),
    ],
)
def test_a_clients_error_is_recorded_as_a_name_the_alert_leaves_out(status: int, error: object, recorded: str) -> None:
    assert failed_as(status, error) == recorded


@settings(max_examples=300, deadline=None)
@given(
    st.integers(400, 599),
    st.dictionaries(
        st.sampled_from(["code", "type", "message"]),
        st.one_of(st.text(max_size=12), st.integers(-5, 999), st.sampled_from(names.CLIENT_ERROR_TYPES), st.none()),
        max_size=3,
    ),
)
def test_every_client_status_is_left_out_by_the_alert_and_every_server_status_is_counted(status: int, error: dict) -> None:
    """Whatever an app puts in its error body: a 4xx answer but 429 is recorded as a name
    CLIENT_ERROR_PATTERN matches (the rule's and the dashboard's), a 429 or 5xx as one it does not."""
    recorded = failed_as(status, error)
    client = re.fullmatch(names.CLIENT_ERROR_PATTERN, recorded) is not None
    assert client == is_client_error_status(status), (status, error, recorded)

"""OpenAIMetricsWSGIMiddleware on WSGI apps called in process, as a WSGI server calls them: what each
kind of answer records, that the app reads its body as sent and the server gets every piece."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import openlora_otel.inference.metrics as metrics_module
import openlora_otel.inference.openai_traffic as traffic_module
import openlora_otel.inference.wsgi as wsgi_module
from openlora_otel.inference import InferenceMetrics
from openlora_otel.inference.openai_traffic import MAX_REQUEST_BYTES
from openlora_otel.inference.wsgi import ENVIRON_KEY, OpenAIMetricsWSGIMiddleware
from tests.support.clock import FakeClock
from tests.support.readings import points

DURATION = "gen_ai.server.request.duration"
TTFT = "gen_ai.server.time_to_first_token"
TOKENS = "openlora.inference.token.usage"
RUNNING = "openlora.inference.requests.running"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for module in (metrics_module, wsgi_module, traffic_module):
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


def call(app: Callable, body: bytes, *, path: str = "/v1/chat/completions", method: str = "POST",
         length: bool = True, take: int | None = None) -> tuple[str, list[bytes]]:  # fmt: skip
    """As a WSGI server: the status and the pieces it took (``take``: it stops after that many, as when
    the client went away), then ``close()``."""
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "wsgi.input": io.BytesIO(body)}
    if length:
        environ["CONTENT_LENGTH"] = str(len(body))
    status: list[str] = []
    answer = app(environ, lambda s, headers, exc_info=None: status.append(s))
    pieces: list[bytes] = []
    try:
        for piece in answer:
            pieces.append(piece)
            if take is not None and len(pieces) >= take:
                break
    finally:
        getattr(answer, "close", lambda: None)()
    return status[0], pieces


def event(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def chat_chunk(content: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


def streaming(events: list[bytes], clock: FakeClock, seen: list[bytes] | None = None) -> Callable:
    def app(environ: dict, start_response: Callable) -> Iterator[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or -1))
        if seen is not None:
            seen.append(body)
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def pieces() -> Iterator[bytes]:
            for piece in events:
                clock.sleep(0.1)
                yield piece

        return pieces()

    return app


def body(model: str = "alpaca", **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def test_a_streamed_answer_records_first_content_usage_and_duration(clock, reader, inference) -> None:
    events = [event(chat_chunk("")), event(chat_chunk("a")), event(chat_chunk("b")),
              event({"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2}}), event("[DONE]")]  # fmt: skip
    status, pieces = call(OpenAIMetricsWSGIMiddleware(streaming(events, clock), inference), body(stream=True))
    assert status == "200 OK" and pieces == events
    assert one(reader, TTFT).sum == pytest.approx(0.2)
    assert one(reader, DURATION, **{"openlora.adapter.name": "alpaca"}).sum == pytest.approx(0.5)
    assert one(reader, TOKENS, **{"gen_ai.token.type": "input"}).sum == 6
    assert one(reader, TOKENS, **{"gen_ai.token.type": "output"}).sum == 2


def test_a_plain_answer_and_an_error_answer(clock, reader, inference) -> None:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        model = json.loads(environ["wsgi.input"].read())["model"]
        clock.sleep(0.3)
        if model == "nope":
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [json.dumps({"error": {"type": "invalid_request_error", "code": "model_not_found"}}).encode()]
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()]

    middleware = OpenAIMetricsWSGIMiddleware(app, inference)
    call(middleware, body(), length=False)  # no Content-Length: read to the end
    call(middleware, body("nope"))
    ok = one(reader, DURATION, **{"openlora.adapter.name": "alpaca"})
    assert ok.sum == pytest.approx(0.3) and "error.type" not in ok.attributes
    assert one(reader, TTFT).sum == pytest.approx(0.3)
    assert one(reader, TOKENS, **{"gen_ai.token.type": "output"}).sum == 4
    # A client's fault (404), as a name the alert leaves out: the body's type (its code is no such name).
    assert one(reader, DURATION, **{"openlora.adapter.name": "nope"}).attributes["error.type"] == "invalid_request_error"


def test_a_server_that_stops_taking_the_answer_makes_it_cancelled(clock, reader, inference) -> None:
    closed: list[bool] = []

    class Answer:
        def __iter__(self) -> Iterator[bytes]:
            yield event(chat_chunk("a"))
            yield event(chat_chunk("b"))

        def close(self) -> None:
            closed.append(True)

    def app(environ: dict, start_response: Callable) -> Answer:
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return Answer()

    call(OpenAIMetricsWSGIMiddleware(app, inference), body(stream=True), take=1)
    assert closed == [True]  # the app's close() still runs
    assert one(reader, DURATION).attributes["error.type"] == "cancelled"
    assert all(p.value == 0 for p in points(reader.get_metrics_data(), RUNNING))


def test_an_app_that_raises_records_the_exception_before_or_during_its_answer(clock, reader, inference) -> None:
    def raises_at_once(environ: dict, start_response: Callable) -> list[bytes]:
        raise KeyError("bug")

    def raises_later(environ: dict, start_response: Callable) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        yield event(chat_chunk("a"))
        raise OSError("disk")

    with pytest.raises(KeyError):
        call(OpenAIMetricsWSGIMiddleware(raises_at_once, inference), body())
    with pytest.raises(OSError):
        call(OpenAIMetricsWSGIMiddleware(raises_later, inference), body(stream=True))
    assert {p.attributes["error.type"] for p in points(reader.get_metrics_data(), DURATION)} == {"KeyError", "OSError"}


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "to-the-end"])
def test_the_app_reads_its_body_as_sent_however_long(clock, reader, inference, length: bool) -> None:
    long = body(messages=[{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 100)}])
    for sent in (body(), long):
        seen: list[bytes] = []

        def app(environ: dict, start_response: Callable, seen: list[bytes] = seen) -> list[bytes]:
            stream = environ["wsgi.input"]
            seen.append(stream.readline(5) + stream.read(10) + stream.read())
            assert environ[ENVIRON_KEY] is not None
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b"{}"]

        call(OpenAIMetricsWSGIMiddleware(app, inference), sent, length=length)
        assert seen == [sent]
    adapters = {p.attributes["openlora.adapter.name"]: p.count for p in points(reader.get_metrics_data(), DURATION)}
    assert adapters == {"alpaca": 1, "other": 1}  # the long body is not read for its model


def test_other_routes_and_methods_pass_untouched(clock, reader, inference) -> None:
    seen: list[bytes] = []
    middleware = OpenAIMetricsWSGIMiddleware(streaming([], clock, seen), inference)
    call(middleware, body(), path="/v1/models")
    call(middleware, body(), method="GET")
    assert seen == [body(), body()]
    assert not points(reader.get_metrics_data(), DURATION)


def test_it_takes_the_telemetry_or_its_inference_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    from openlora_otel import setup_telemetry

    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry("wsgi", metric_readers=[InMemoryMetricReader()])
    try:
        for given in (telemetry, telemetry.inference):
            assert OpenAIMetricsWSGIMiddleware(lambda environ, start: [], given).inference is telemetry.inference
    finally:
        telemetry.shutdown()
    with pytest.raises(TypeError, match=r"Telemetry setup_telemetry\(\) returned or its telemetry\.inference"):
        OpenAIMetricsWSGIMiddleware(lambda environ, start: [], object())

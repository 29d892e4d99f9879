"""``serve`` measured by the ASGI middleware: with its routes' hints (queue, first token, exact tokens)
and without them (the middleware reading the traffic alone, as around any app), the same requests
give the same request counts, outcomes and tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tests.support.readings import points
from tests.support.serving import InProcessServe, asgi_call

DURATION = "gen_ai.server.request.duration"
TTFT = "gen_ai.server.time_to_first_token"
TOKENS = "openlora.inference.token.usage"
RUNNING = "openlora.inference.requests.running"
WAITING = "openlora.inference.requests.waiting"

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "abc"}]
# (path, body): answers of every kind: plain and streamed, with usage asked for or not, n = 2, and
# refusals (an unknown model, an unknown parameter, a body that is not JSON).
REQUESTS = [
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "abc", "max_tokens": 3}),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "ab", "max_tokens": 4, "stream": True}),
    (CHAT, {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2}),
    (CHAT, {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}),
    (CHAT, {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}),
    (CHAT, {"model": "made-up", "messages": MESSAGES}),
    (CHAT, {"model": "tiny-llama", "messages": MESSAGES, "frobnicate": 1}),
    (COMPLETIONS, "not json"),
]  # fmt: skip


def serve_and_read(directory: Path, route_hints: bool) -> tuple[dict, list[bytes]]:
    reader = InMemoryMetricReader()
    served = InProcessServe(directory, route_hints=route_hints, reader=reader)
    try:
        answers = []
        for path, body in REQUESTS:
            raw = body.encode() if isinstance(body, str) else json.dumps({**body, "temperature": 0}).encode()
            sent = asgi_call(served.app, path, raw)
            answers.append(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        data = reader.get_metrics_data()
    finally:
        served.close()
    key = ("gen_ai.operation.name", "openlora.adapter.name", "error.type")
    recorded: dict = {}
    for point in points(data, DURATION):
        recorded[("requests", *(point.attributes.get(k) for k in key))] = point.count
    for point in points(data, TOKENS):
        recorded[(point.attributes["gen_ai.token.type"], *(point.attributes.get(k) for k in key))] = point.sum
    recorded["first tokens"] = sum(point.count for point in points(data, TTFT))
    recorded["in flight"] = sum(p.value for name in (RUNNING, WAITING) for p in points(data, name))
    return recorded, answers


@pytest.mark.parametrize("route_hints", [True, False], ids=["with-route-hints", "traffic-alone"])
def test_serve_records_every_request_once_with_its_outcome_and_tokens(tmp_path: Path, route_hints: bool) -> None:
    recorded, _ = serve_and_read(tmp_path, route_hints)
    assert recorded[("requests", "text_completion", "base", None)] == 2
    assert recorded[("requests", "chat", "base", None)] == 3
    assert recorded[("requests", "chat", "other", "unknown_adapter")] == 1
    assert recorded[("requests", "chat", "base", "invalid_request")] == 1
    assert recorded[("requests", "text_completion", "other", "invalid_request")] == 1
    assert recorded["first tokens"] == 5 and recorded["in flight"] == 0
    # The plain chat answer's 2 tokens and the two streamed chats' 4 and 2 x 3 (usage asked for).
    assert recorded[("output", "chat", "base", None)] == 2 + 4 + 6


def test_the_middleware_alone_agrees_with_the_routes_hints_request_for_request_and_token_for_token(tmp_path: Path) -> None:
    hinted, _ = serve_and_read(tmp_path / "hints", True)
    alone, _ = serve_and_read(tmp_path / "alone", False)
    # One difference, by design: a stream without usage says nothing of its prompt, so the traffic
    # alone has no input tokens for it (its output is counted from its chunks: the same here).
    prompt_of_the_stream_without_usage = 2  # "ab": one token per character
    key = ("input", "text_completion", "base", None)
    assert hinted[key] - alone[key] == prompt_of_the_stream_without_usage
    assert {k: v for k, v in alone.items() if k != key} == {k: v for k, v in hinted.items() if k != key}

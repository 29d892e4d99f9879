"""The OpenAI protocol of ``openlora-otel serve`` (openlora_otel/serving/protocol.py), in-process: parsing, the chat
template, the shapes of answers, chunks and errors. The HTTP side is in tests/serving/test_serve.py and tests/serving/test_openai_client.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openlora_otel.model.corpus import CharTokenizer
from openlora_otel.serving import protocol
from openlora_otel.serving.protocol import CHAT, COMPLETION, MAX_N, ProtocolError, parse, render_chat


class Served:
    base_model = "tiny-llama"
    adapters = ["a1"]

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)


def chat(**fields: Any) -> protocol.Parsed:
    body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse(json.dumps(body).encode(), CHAT, Served(), 512)


def refused(operation: str, **fields: Any) -> ProtocolError:
    body = {"model": "a1", **fields}
    with pytest.raises(ProtocolError) as caught:
        parse(json.dumps(body).encode(), operation, Served(), 512)
    return caught.value


def test_the_chat_template_is_role_and_content_per_line_then_the_assistant_cue() -> None:
    messages = [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "hi."},
        {"role": "user", "content": "how are you?"},
    ]
    assert render_chat(messages, None) == (
        "system\nbe brief.\nuser\nhello there\nassistant\nhi.\nuser\nhow are you?\nassistant\n"
    )
    parsed = chat(messages=messages)
    assert parsed.prompt_ids == CharTokenizer().encode(render_chat(messages, None))


def test_defaults_are_greedy_one_choice_up_to_the_limit() -> None:
    parsed = chat()
    assert (parsed.operation, parsed.model, parsed.adapter) == (CHAT, "a1", "a1")
    # A chat's max_tokens: the server's limit (chat() parses under 512), as OpenAI's is the model's.
    assert (parsed.n, parsed.temperature, parsed.top_p, parsed.seed, parsed.max_tokens) == (1, 0.0, 1.0, None, 512)
    assert not parsed.stream and not parsed.include_usage and parsed.stop == ()
    # null is every parameter's default
    assert (
        chat(n=None, temperature=None, top_p=None, seed=None, max_tokens=None, stop=None, stream=None)
        == parsed
    )
    # Lowered to a limit under it.
    body = json.dumps({"model": "a1", "prompt": "hi"}).encode()
    assert parse(body, COMPLETION, Served(), 4).max_tokens == 4


def test_what_openais_spec_lets_a_client_send_at_its_default_is_accepted() -> None:
    """Parameters clients and frameworks send at their defaults, with no effect here (issue 33, part 4)."""
    plain = chat()
    for fields in ({"store": False}, {"store": None}, {"metadata": {"team": "search"}}, {"metadata": None},
                   {"service_tier": "auto"}, {"service_tier": "default"}, {"parallel_tool_calls": True},
                   {"parallel_tool_calls": False}, {"user": "user-1234"}, {"logprobs": False}, {"functions": None}):  # fmt: skip
        assert chat(**fields) == plain, fields
    # The developer role is the system role (newer SDKs send it in its place).
    as_developer = chat(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    as_system = chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert as_developer == as_system


@pytest.mark.parametrize(
    ("operation", "fields", "param"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "user": 7}, "user"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1}}, "metadata"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "metadata": "tag"}, "metadata"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "stop": []}, "stop"),
        (CHAT, {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "service_tier": "flex"}, "service_tier"),
        (COMPLETION, {"prompt": "x", "logprobs": False}, "logprobs"),
        (COMPLETION, {"prompt": "x", "logprobs": 0}, "logprobs"),
    ],
)
def test_what_openais_spec_forbids_or_what_would_change_the_answer_is_refused(operation: str, fields: dict, param: str) -> None:
    error = refused(operation, **fields)
    assert (error.status, error.code, error.param) == (400, "invalid_request", param), error.message


def test_sampling_parameters_and_max_completion_tokens() -> None:
    parsed = chat(temperature=0.7, top_p=0.9, seed=-3, n=MAX_N, max_completion_tokens=5, stop="x", stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    assert (parsed.temperature, parsed.top_p, parsed.seed, parsed.n, parsed.max_tokens) == (
        0.7,
        0.9,
        -3,
        MAX_N,
        5,
    )
    assert parsed.stop == ("x",) and parsed.stream and parsed.include_usage


@pytest.mark.parametrize(
    ("operation", "fields", "param", "code"),
    [
        (CHAT, {"messages": []}, "messages", "invalid_request"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_request"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
            "messages[0].name",
            "invalid_request",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
            "invalid_request",
        ),
        (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content", "invalid_request"),
        (CHAT, {"messages": [{"role": "user", "content": "Hello"}]}, "messages", "invalid_request"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * 4000}]}, "messages", "invalid_request"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2},
            "max_tokens",
            "invalid_request",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": MAX_N + 1}, "n", "invalid_request"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
            "temperature",
            "invalid_request",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p", "invalid_request"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed", "invalid_request"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_request",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
            "logprobs",
            "invalid_request",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            "tool_choice",
            "invalid_request",
        ),
        (COMPLETION, {"prompt": "x", "messages": []}, "messages", "invalid_request"),
        (COMPLETION, {"prompt": "x", "best_of": 3}, "best_of", "invalid_request"),
    ],
)
def test_refusals_name_the_parameter(operation, fields, param, code) -> None:
    error = refused(operation, **fields)
    assert (error.status, error.param, error.code, error.adapter) == (400, param, code, "a1")


def test_an_unknown_model_is_404_counted_as_other() -> None:
    error = refused(CHAT, model="nope", messages=[])
    assert (error.status, error.code, error.param, error.adapter) == (
        404,
        "unknown_adapter",
        "model",
        "other",
    )
    assert protocol.error_body(404, error.code, error.message, error.param) == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "unknown_adapter",
        }
    }
    assert protocol.error_body(503, "overloaded", "busy")["error"]["type"] == "server_error"


def test_chat_answers_and_chunks_have_openais_shapes() -> None:
    parsed = chat(n=2)
    used = protocol.usage(3, 4)
    answer = protocol.response(parsed, "chatcmpl-1", 5, [("ab", "length"), ("c", "stop")], used)
    assert answer == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 5,
        "model": "a1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ab", "refusal": None},
                "finish_reason": "length",
                "logprobs": None,
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "c", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            },
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }

    def data(event: bytes) -> dict[str, Any]:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        return json.loads(event[len(b"data: ") :])

    first = data(protocol.chunk(parsed, "chatcmpl-1", 5, 1, "a", first=True))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None,
                                 "logprobs": None}]  # fmt: skip
    assert data(protocol.chunk(parsed, "chatcmpl-1", 5, 1, "b"))["choices"][0]["delta"] == {"content": "b"}
    assert data(protocol.chunk(parsed, "chatcmpl-1", 5, 1, "", "stop"))["choices"][0]["delta"] == {}
    last = data(protocol.usage_chunk(parsed, "chatcmpl-1", 5, used))
    assert last["choices"] == [] and last["usage"] == used


def test_a_model_entry_names_its_base() -> None:
    assert protocol.model_entry("a1", "tiny-llama", 9) == {
        "id": "a1", "object": "model", "created": 9, "owned_by": "openlora", "root": "a1", "parent": "tiny-llama",
        "adapter": True,
    }  # fmt: skip
    assert protocol.model_entry("tiny-llama", "tiny-llama", 9)["parent"] is None


def test_a_failure_no_route_caught_answers_in_the_openai_shape_without_its_text() -> None:
    """An exception escaping a route is a 500 whose body clients parse (``error``), never its message."""
    pytest.importorskip("fastapi")
    pytest.importorskip("opentelemetry.instrumentation.fastapi")
    import asyncio
    from types import SimpleNamespace

    from openlora_otel import TelemetryConfig, setup_telemetry
    from openlora_otel.serving.server import ServeOptions, build_app

    class Crashing:
        models = Served()
        options = ServeOptions()
        created = 0

        async def complete(self, request: Any, operation: str = COMPLETION) -> Any:
            raise RuntimeError("/secret/path and the user's prompt")

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), handle_sigterm=False))
    try:
        app = build_app(Crashing(), telemetry)  # type: ignore[arg-type]
        body = json.dumps({"model": "a1", "prompt": "x"}).encode()
        sent: list[dict[str, Any]] = []
        incoming = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = SimpleNamespace(
            type="http", asgi={"version": "3.0"}, http_version="1.1", method="POST", scheme="http",
            path="/v1/completions", raw_path=b"/v1/completions", root_path="", query_string=b"",
            headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            client=("127.0.0.1", 5000), server=("127.0.0.1", 8000),
        ).__dict__  # fmt: skip
        with pytest.raises(RuntimeError):  # Starlette re-raises after the response, for the server's log
            asyncio.run(app(scope, receive, send))
    finally:
        telemetry.shutdown()
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 500
    answer = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert answer["error"]["type"] == "server_error" and answer["error"]["code"] == "internal_error"
    assert "secret" not in json.dumps(answer) and "prompt" not in answer["error"]["message"]


def test_the_default_max_tokens_is_openais_within_the_limit() -> None:
    """Without max_tokens: a completion gets 16 (OpenAI's default), a chat the server's limit (OpenAI's
    is the model's) or --chat-default-max-tokens; a lower --max-new-tokens-limit holds for both."""
    body = json.dumps({"model": "a1", "prompt": "x"}).encode()
    assert parse(body, COMPLETION, Served(), 8).max_tokens == 8
    assert parse(body, COMPLETION, Served(), 512).max_tokens == protocol.DEFAULT_MAX_TOKENS == 16
    assert parse(body, COMPLETION, Served(), 512, 40).max_tokens == 16  # the chat default is a chat's only
    chat_body = json.dumps({"model": "a1", "messages": [{"role": "user", "content": "x"}]}).encode()
    assert parse(chat_body, CHAT, Served(), 3).max_tokens == 3
    assert parse(chat_body, CHAT, Served(), 512).max_tokens == 512
    assert parse(chat_body, CHAT, Served(), 512, 40).max_tokens == 40
    assert parse(chat_body, CHAT, Served(), 30, 40).max_tokens == 30
    asked = json.dumps({"model": "a1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 7}).encode()
    assert parse(asked, CHAT, Served(), 512, 40).max_tokens == 7

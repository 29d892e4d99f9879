"""``serve``'s answers as OpenAI's spec describes them: every plain answer and every streamed chunk
validated by the ``openai`` package's own types in strict mode, plus the fields the spec
(openai/openai-openapi) marks required, which the package's types leave optional."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

openai_types = pytest.importorskip("openai.types")
pytest.importorskip("torch")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from tests.support.serving import InProcessServe, asgi_call  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "abc"}]
# The spec's required fields (components.schemas), per object.
REQUIRED = {
    "chat.completion": {"id", "choices", "created", "model", "object"},
    "chat.completion.choice": {"finish_reason", "index", "message", "logprobs"},
    "chat.completion.message": {"content", "refusal", "role"},
    "chat.completion.chunk": {"id", "choices", "created", "model", "object"},
    "chat.completion.chunk.choice": {"delta", "finish_reason", "index"},
    "text_completion": {"id", "object", "created", "model", "choices"},
    "text_completion.choice": {"finish_reason", "index", "logprobs", "text"},
    "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServe]:
    serve = InProcessServe(tmp_path_factory.mktemp("conformance"), max_new_tokens_limit=6)
    yield serve
    serve.close()


def post(served: InProcessServe, path: str, body: dict) -> tuple[int, bytes]:
    sent = asgi_call(served.app, path, json.dumps(body).encode())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def events(raw: bytes) -> list[dict]:
    datas = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(data) for data in datas[:-1]]


def has_required(obj: dict, kind: str) -> None:
    missing = REQUIRED[kind] - set(obj)
    assert not missing, f"{kind} lacks {missing}: {obj}"


@pytest.mark.parametrize("n", [1, 2])
def test_a_plain_chat_answer(served: InProcessServe, n: int) -> None:
    status, raw = post(served, CHAT, {"model": "tiny-llama", "messages": MESSAGES, "n": n, "max_completion_tokens": 3})
    assert status == 200
    answer = json.loads(raw)
    ChatCompletion.model_validate(answer, strict=True)
    has_required(answer, "chat.completion")
    has_required(answer["usage"], "usage")
    assert len(answer["choices"]) == n
    for choice in answer["choices"]:
        has_required(choice, "chat.completion.choice")
        has_required(choice["message"], "chat.completion.message")
        assert choice["message"]["refusal"] is None


def test_without_max_tokens_a_chat_runs_to_the_servers_limit(served: InProcessServe) -> None:
    """OpenAI's chat default is the model's limit: here the server's limit on max_tokens (6 in this
    module's server), not a completion's 16."""
    status, raw = post(served, CHAT, {"model": "tiny-llama", "messages": MESSAGES})
    assert status == 200
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["finish_reason"] == "length", answer


@pytest.mark.parametrize("include_usage", [True, False])
def test_every_chunk_of_a_streamed_chat(served: InProcessServe, include_usage: bool) -> None:
    body = {"model": "tiny-llama", "messages": MESSAGES, "stream": True, "n": 2}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    status, raw = post(served, CHAT, body)
    assert status == 200
    chunks = events(raw)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk, strict=True)
        has_required(chunk, "chat.completion.chunk")
        for choice in chunk["choices"]:
            has_required(choice, "chat.completion.chunk.choice")
    if include_usage:
        # The spec: "usage" on every chunk, null on all but the last, which has no choices.
        assert all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1])
        assert chunks[-1]["choices"] == [] and set(chunks[-1]["usage"]) >= REQUIRED["usage"]
    else:
        assert all("usage" not in chunk for chunk in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_plain_and_streamed(served: InProcessServe, stream: bool) -> None:
    body = {"model": "tiny-llama", "prompt": "abc", "max_tokens": 3, "stream": stream}
    status, raw = post(served, COMPLETIONS, body)
    assert status == 200
    for answer in events(raw) if stream else [json.loads(raw)]:
        # The spec has no chunk type for streamed completions: its one Completion (and the package's)
        # wants a finish_reason, where OpenAI's own stream, and ours, send null until the last chunk.
        checked = {**answer, "choices": [{**c, "finish_reason": c["finish_reason"] or "length"} for c in answer["choices"]]}
        Completion.model_validate(checked, strict=True)
        has_required(answer, "text_completion")
        for choice in answer["choices"]:
            has_required(choice, "text_completion.choice")

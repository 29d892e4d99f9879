"""What ``openlora-otel serve`` answers to any request body, in process (the app over ASGI on a tiny
untrained base, tests/support/serving.py): a 200 or a 4xx in OpenAI's error shape, never a 500, for
arbitrary JSON (lone surrogates, odd numbers and types); and tiny temperatures, which are greedy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.serving import SERVE_MODULES

for _module in SERVE_MODULES:
    pytest.importorskip(_module)

from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from openlora_otel.model.corpus import ALPHABET  # noqa: E402
from openlora_otel.serving.model import Sampling, _draw  # noqa: E402
from openlora_otel.serving.protocol import OFF_VALUES  # noqa: E402
from tests.support.fuzz import fuzz  # noqa: E402
from tests.support.serving import InProcessServe  # noqa: E402

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE = "tiny-llama"
# The smallest temperatures the protocol accepts: each overflowed the softmax (a 500, RuntimeError).
TINY_TEMPERATURES = (1e-40, 1e-300, 5e-324)
LIMIT = 4  # the app's --max-new-tokens-limit: the default max_tokens, 16, is over it


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServe]:
    app = InProcessServe(tmp_path_factory.mktemp("serve-requests"), max_new_tokens_limit=LIMIT)
    try:
        yield app
    finally:
        app.close()


def check_answer(path: str, status: int, headers: dict[str, str], body: bytes) -> dict[str, Any] | None:
    """Assert that the answer is a 200 (a whole completion, or a stream that ends with [DONE]) or a 4xx in
    OpenAI's error shape; the JSON answer, or None for a stream."""
    assert status == 200 or 400 <= status < 500, (status, body[:500])
    if status == 200 and headers["content-type"].startswith("text/event-stream"):
        events = [line[len(b"data: ") :] for line in body.split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", body[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
        return None
    answer = json.loads(body.decode("utf-8"))  # strict UTF-8: no lone surrogate can be in an answer
    if status == 200:
        assert answer["object"] == ("text_completion" if path == COMPLETIONS else "chat.completion")
        assert answer["choices"], answer
        # Within the server's --max-new-tokens-limit (4 here), asked for or not.
        assert answer["usage"]["completion_tokens"] <= LIMIT * len(answer["choices"]), answer
    else:
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}, answer
        assert error["type"] == "invalid_request_error" and isinstance(error["message"], str), answer
        assert isinstance(error["code"], str) and (error["param"] is None or isinstance(error["param"], str))
    return answer


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "\\ud800": 1}'),
        (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}'),
        (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi", "\\udc00x": 1}]}'),
        (
            COMPLETIONS,
            b'{"model": "tiny-llama", "prompt": "hi", "stream": true, "stream_options": {"\\ud83d": 1}}',
        ),
    ],
)
def test_a_key_with_a_lone_surrogate_is_a_400_in_openais_shape(
    serve: InProcessServe, path: str, body: bytes
) -> None:
    status, headers, answer = serve.post(path, body)
    error = check_answer(path, status, headers, answer)["error"]  # type: ignore[index]
    assert status == 400 and error["code"] == "invalid_request"
    # The key is named, as its escape.
    assert "\\ud" in error["message"] and "\\ud" in error["param"], error


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_tiny_temperature_is_greedy(serve: InProcessServe, temperature: float, stream: bool) -> None:
    def text(**fields: Any) -> str:
        body = json.dumps({"model": BASE, "prompt": "the ", "max_tokens": 4, "stream": stream, **fields})
        status, headers, answer = serve.post(COMPLETIONS, body.encode())
        check_answer(COMPLETIONS, status, headers, answer)
        assert status == 200
        if not stream:
            return json.loads(answer)["choices"][0]["text"]
        chunks = [json.loads(line[6:]) for line in answer.split(b"\n\n") if line.startswith(b"data: {")]
        return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])

    assert text(temperature=temperature, seed=1) == text() == text(temperature=temperature, seed=2)


def test_a_draw_at_a_tiny_temperature_is_the_top_token_and_ties_share_it() -> None:
    import torch

    logits = torch.tensor([1.0, 3.0, -2.0, 3.0 - 1e-6, float("-inf")])
    for temperature in TINY_TEMPERATURES:
        generator = torch.Generator().manual_seed(0)
        draws = {_draw(torch, logits, Sampling(temperature, 1.0, generator)) for _ in range(20)}
        assert draws == {1}, (temperature, draws)
    tied = torch.tensor([2.0, 5.0, 5.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = {_draw(torch, tied, Sampling(5e-324, 1.0, generator)) for _ in range(40)}
    assert draws == {1, 2}


# -- property: any JSON body -----------------------------------------------------------------------------

# Text with lone surrogates among the characters (JSON can carry them; UTF-8 cannot).
_text = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)
_prompt = st.text(ALPHABET, min_size=1, max_size=12)
_numbers = (
    st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities too: json.loads reads NaN and Infinity
    | st.sampled_from([0, 1, 2, 4, 5, 0.0, -0.0, 1e-40, 1e-300, 5e-324, 2.0, 2.0000000000000004, 1e308])
)
_json = st.recursive(
    st.none() | st.booleans() | _numbers | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def _mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any] = _json) -> st.SearchStrategy[Any]:
    """``valid`` three times in four, else ``other``: enough requests get past the first check."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda pick: valid if pick else other)


_message = _mostly(
    st.fixed_dictionaries(
        {"role": _mostly(st.sampled_from(["user", "system", "assistant"])), "content": _mostly(_prompt)},
    ),
    st.dictionaries(st.sampled_from(["role", "content", "name"]) | _text, _json, max_size=3),
)
_fields = {
    "max_tokens": _mostly(st.integers(0, 5)),
    "max_completion_tokens": _mostly(st.integers(0, 5)),
    "temperature": _mostly(st.floats(0, 2) | st.sampled_from(TINY_TEMPERATURES), _numbers | _json),
    "top_p": _mostly(st.floats(0, 1), _numbers | _json),
    "n": _mostly(st.integers(0, 5)),
    "seed": _mostly(st.integers(-(2**64), 2**64)),
    "stop": _mostly(_text | st.lists(_text, max_size=5)),
    "stream": _mostly(st.booleans()),
    "stream_options": _mostly(st.fixed_dictionaries({}, optional={"include_usage": _mostly(st.booleans())})),
    "user": _json,
    **{name: _mostly(st.sampled_from([*offs, None])) for name, offs in OFF_VALUES.items()},
}
_prompt_fields = {
    COMPLETIONS: st.fixed_dictionaries({"prompt": _mostly(_prompt)}),
    CHAT: st.fixed_dictionaries({"messages": _mostly(st.lists(_message, min_size=1, max_size=3))}),
}


def _request(path: str) -> st.SearchStrategy[Any]:
    """A body for ``path``: mostly a request that gets far, else any JSON."""
    return _mostly(
        st.builds(
            lambda model, prompt, fields, extra: {"model": model, **prompt, **fields, **extra},
            model=_mostly(st.just(BASE), _text | _json),
            # The other path's prompt field, or both, now and then: an unknown parameter there.
            prompt=_mostly(
                _prompt_fields[path], st.dictionaries(st.sampled_from(["prompt", "messages"]), _json)
            ),
            fields=st.lists(st.sampled_from(sorted(_fields)), max_size=4, unique=True).flatmap(
                lambda names: st.fixed_dictionaries({name: _fields[name] for name in names})
            ),
            extra=_mostly(st.just({}), st.dictionaries(_text, _json, min_size=1, max_size=2)),
        )
    )


_requests = st.sampled_from([COMPLETIONS, CHAT]).flatmap(
    lambda path: st.tuples(st.just(path), _request(path))
)


@fuzz
@given(request=_requests)
@example(request=(COMPLETIONS, {"model": BASE, "prompt": "hi", "\ud800": 1}))
@example(request=(CHAT, {"model": BASE, "messages": [{"role": "user", "content": "x", "\udc00": 0}]}))
@example(request=(CHAT, {"model": BASE, "messages": [{"role": "user", "content": "x"}], "\udfff": None}))
@example(request=(COMPLETIONS, {"model": BASE, "prompt": "hi"}))  # 16 tokens past a limit of 4
@example(request=(COMPLETIONS, {"model": BASE, "prompt": "hi", "temperature": 1e-40}))
@example(request=(COMPLETIONS, {"model": BASE, "prompt": "hi", "temperature": 1e-300, "stream": True}))
@example(
    request=(CHAT, {"model": BASE, "messages": [{"role": "user", "content": "x"}], "temperature": 5e-324})
)
def test_fuzz_any_json_body_is_a_200_or_a_4xx_in_openais_shape(
    serve: InProcessServe, request: tuple[str, Any]
) -> None:
    """Bounded by tests/support/fuzz.py; about 3 s at the default 150 examples."""
    path, payload = request
    # Lone surrogates go as \udXXX escapes and NaN as NaN: as a client may send them.
    body = json.dumps(payload).encode()
    check_answer(path, *serve.post(path, body))

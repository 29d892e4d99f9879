"""The OpenAI protocol of ``openlora-otel serve``: request parsing, the chat template, response, chunk and error shapes.

Pure (no FastAPI, no torch): :func:`parse` turns a body into a :class:`Parsed` request or raises
:class:`ProtocolError`, answered in OpenAI's error shape so the ``openai`` client raises its own
classes. Parameters are an explicit set per endpoint: one not implemented is refused with 400 unless
it holds its "off" value (:data:`OFF_VALUES`). See docs/how-to/serving.md (The protocol).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHAT",
    "CHAT_PARAMS",
    "COMPLETION",
    "COMPLETION_PARAMS",
    "DEFAULT_MAX_TOKENS",
    "IGNORED_PARAMS",
    "MAX_N",
    "MAX_PROMPT_CHARS",
    "MAX_TOKENS_LIMIT",
    "OFF_VALUES",
    "Parsed",
    "ProtocolError",
    "error_body",
    "parse",
    "render_chat",
]

COMPLETION = "text_completion"  # gen_ai.operation.name of POST /v1/completions
CHAT = "chat"  # gen_ai.operation.name of POST /v1/chat/completions
MAX_PROMPT_CHARS = 4000  # the prompt, or the rendered chat prompt
MAX_TOKENS_LIMIT = 512  # the protocol's ceiling for max_tokens; --max-new-tokens-limit may lower it
DEFAULT_MAX_TOKENS = 16
# OpenAI's limits for "stop"; ours are characters (one token each).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 32
# Choices per request: n generations run one after another in the request's slot, so n multiplies
# its time; 4 keeps one request from holding a slot for long.
MAX_N = 4
MAX_MESSAGES = 256
MAX_TEMPERATURE = 2.0
ROLES = ("system", "developer", "user", "assistant")
# The developer role is what newer clients send in place of system (OpenAI's reasoning models read it
# so): the model sees it as a system message.
ROLE_AS = {"developer": "system"}

_COMMON = frozenset(
    {"model", "stream", "stream_options", "max_tokens", "stop", "n", "temperature", "top_p", "seed"}
)
COMPLETION_PARAMS = _COMMON | {"prompt"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens"}
# Accepted with no effect, when of the type OpenAI's spec gives: an end-user id for abuse monitoring
# (`user`, a string), and what only OpenAI's platform keeps (`metadata`: string keys and values).
IGNORED_PARAMS = frozenset({"user", "metadata"})
# Parameters this server does not implement, accepted only with a value that turns them off or has no
# effect here (null always): `store` (nothing is stored), `service_tier` (one tier),
# `parallel_tool_calls` (no tools, so either value changes nothing).
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),  # chat's is a boolean; a completion's an integer 0-5 (see COMPLETION_OFF_VALUES)
    "top_logprobs": (0,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "functions": (),  # at least one function when given (the spec's minItems): only null is off
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
}
# Where a completion's differ: its logprobs is an integer (0 still asks for the chosen token's).
COMPLETION_OFF_VALUES = {**OFF_VALUES, "logprobs": ()}


class ProtocolError(Exception):
    """A request the server refuses: ``status``, ``code`` (also its metrics' ``error.type``), the
    ``param`` at fault (None: the body), and the adapter its metrics count it under."""

    def __init__(
        self, status: int, code: str, message: str, param: str | None = None, adapter: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.adapter = adapter


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; ``type`` from the status as OpenAI names them.

    ``message`` and ``param`` may quote the request (a parameter's name), and JSON lets a request
    hold a lone surrogate (``"\\ud800"``), which no UTF-8 answer can carry: each is written as its
    escape (``\\ud800``), so the refusal is still a 400, not a 500 while encoding it.
    """
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": _encodable(message), "type": kind, "param": _encodable(param), "code": code}}


def _encodable(text: str | None) -> str | None:
    """``text`` with any lone surrogate written as its backslash escape (valid UTF-8 throughout)."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Parsed:
    operation: str  # COMPLETION or CHAT
    model: str  # as the client named it
    adapter: str | None  # None: the base model
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    stop: tuple[str, ...]
    n: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int | None


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
    # Types compared too: 0 == False in Python, and "logprobs": 0 still asks for log-probabilities.
    return value is None or any(type(value) is type(off) and value == off for off in offs)


def _check_ignored(name: str, value: Any, adapter: str | None) -> None:
    """An ignored parameter must still be of the type the spec gives it (or null)."""
    if value is None:
        return
    if name == "user" and not isinstance(value, str):
        raise ProtocolError(400, "invalid_request", "'user' must be a string", name, adapter)
    if name == "metadata" and not (
        isinstance(value, dict)
        and len(value) <= 16
        and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items())
    ):
        raise ProtocolError(
            400,
            "invalid_request",
            "'metadata' must be an object of at most 16 string keys (64 characters) and string values (512)",
            name,
            adapter,
        )


def _number(
    payload: dict[str, Any], name: str, default: float, low: float, high: float, adapter: str | None
) -> float:
    value = payload.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolError(
            400,
            "invalid_request",
            f"'{name}' must be a number from {low} to {high}, got {value!r}",
            name,
            adapter,
        )
    return float(value)


def _integer(
    payload: dict[str, Any], name: str, default: int, low: int, high: int, adapter: str | None
) -> int:
    value = payload.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(
            400,
            "invalid_request",
            f"'{name}' must be an integer from {low} to {high}, got {value!r}",
            name,
            adapter,
        )
    return value


def render_chat(messages: Any, adapter: str | None) -> str:
    """The model's prompt for ``messages``: ``"<role>\\n<content>\\n"`` each, then ``"assistant\\n"``."""
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise ProtocolError(
            400,
            "invalid_request",
            f"'messages' must be a list of 1 to {MAX_MESSAGES} messages",
            "messages",
            adapter,
        )
    parts: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ProtocolError(400, "invalid_request", f"'{where}' must be an object", where, adapter)
        for key in message:
            if key not in ("role", "content"):
                raise ProtocolError(
                    400,
                    "invalid_request",
                    f"'{where}.{key}' is not supported by this server",
                    f"{where}.{key}",
                    adapter,
                )
        role = message.get("role")
        if role not in ROLES:
            raise ProtocolError(
                400,
                "invalid_request",
                f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}",
                f"{where}.role",
                adapter,
            )
        content = message.get("content")
        if isinstance(content, list) and not content:
            raise ProtocolError(
                400,
                "invalid_request",
                f"'{where}.content' must hold at least one text part",
                f"{where}.content",
                adapter,
            )
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                    and len(part) == 2
                ):
                    raise ProtocolError(
                        400,
                        "invalid_request",
                        f'\'{where}.content[{j}]\' must be a text part {{"type": "text", "text": str}}: '
                        "this server has no other kinds of content",
                        f"{where}.content[{j}]",
                        adapter,
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ProtocolError(
                400,
                "invalid_request",
                f"'{where}.content' must be a string or a list of text parts",
                f"{where}.content",
                adapter,
            )
        parts.append(f"{ROLE_AS.get(role, role)}\n{content}\n")
    parts.append("assistant\n")
    return "".join(parts)


def parse(
    body: bytes, operation: str, served: Any, max_tokens_limit: int, chat_default_max_tokens: int | None = None
) -> Parsed:
    """The request in ``body`` for ``operation`` (:data:`COMPLETION` or :data:`CHAT`); :class:`ProtocolError` if refused.

    ``max_tokens_limit``: the most a request may ask for; ``chat_default_max_tokens``: a chat's
    ``max_tokens`` when it gives none (None: ``max_tokens_limit``, as OpenAI's is the model's limit).
    """
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(400, "invalid_request", f"the body is not JSON ({exc})", None, _OTHER) from None
    if not isinstance(payload, dict):
        raise ProtocolError(400, "invalid_request", "the body must be a JSON object", None, _OTHER)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError(
            400,
            "invalid_request",
            f"'model' must be a non-empty string: an adapter name or {served.base_model!r}",
            "model",
            _OTHER,
        )
    if model == served.base_model:
        adapter = None
    elif served.has_adapter(model):
        adapter = model
    else:
        names = ", ".join([served.base_model, *served.adapters])
        # A made-up name is recorded as "other": it must not take one of the capped adapter slots.
        raise ProtocolError(
            404,
            "unknown_adapter",
            f"model {model[:100]!r} is not served here (served: {names})",
            "model",
            _OTHER,
        )
    accepted = COMPLETION_PARAMS if operation == COMPLETION else CHAT_PARAMS
    off_values = COMPLETION_OFF_VALUES if operation == COMPLETION else OFF_VALUES
    for name, value in payload.items():
        if name in accepted:
            continue
        if name in IGNORED_PARAMS:
            _check_ignored(name, value, adapter)
            continue
        offs = off_values.get(name)
        if offs is None:
            raise ProtocolError(400, "invalid_request", f"unknown parameter '{name}'", name, adapter)
        if not _is_off(value, offs):
            allowed = " or ".join([*(json.dumps(off) for off in offs), "null"])
            raise ProtocolError(
                400,
                "invalid_request",
                f"'{name}' is not supported by this server (only {allowed})",
                name,
                adapter,
            )

    if operation == COMPLETION:
        prompt = payload.get("prompt")
        if not isinstance(prompt, str) or not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise ProtocolError(
                400,
                "invalid_request",
                f"'prompt' must be a string of 1 to {MAX_PROMPT_CHARS} characters",
                "prompt",
                adapter,
            )
        where = "prompt"
    else:
        prompt = render_chat(payload.get("messages"), adapter)
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ProtocolError(
                400,
                "invalid_request",
                f"'messages' make a prompt of {len(prompt)} characters, over {MAX_PROMPT_CHARS}",
                "messages",
                adapter,
            )
        where = "messages"

    token_param = "max_tokens"
    if operation == CHAT and payload.get("max_completion_tokens") is not None:
        if payload.get("max_tokens") is not None:
            raise ProtocolError(
                400,
                "invalid_request",
                "give 'max_tokens' or 'max_completion_tokens', not both",
                "max_tokens",
                adapter,
            )
        token_param = "max_completion_tokens"
    # OpenAI's defaults: a completion's is 16, a chat's the model's limit, which here is the server's
    # limit on max_tokens (--max-new-tokens-limit) unless --chat-default-max-tokens says less. The
    # limit holds for every request.
    if operation == CHAT:
        default = max_tokens_limit if chat_default_max_tokens is None else chat_default_max_tokens
    else:
        default = DEFAULT_MAX_TOKENS
    default = min(default, max_tokens_limit)
    max_tokens = _integer(payload, token_param, default, 1, max_tokens_limit, adapter)

    stop = payload.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, list) and not stop:
        stop = None  # the spec wants at least one string in a list
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(text, str) and 1 <= len(text) <= MAX_STOP_CHARS for text in stop)
    ):
        raise ProtocolError(
            400,
            "invalid_request",
            f"'stop' must be a string or a list of 1 to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters",
            "stop",
            adapter,
        )

    stream = payload.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError(
            400, "invalid_request", f"'stream' must be true or false, got {stream!r}", "stream", adapter
        )
    include_usage = _stream_options(payload.get("stream_options"), stream, adapter)

    n = _integer(payload, "n", 1, 1, MAX_N, adapter)
    temperature = _number(payload, "temperature", 0.0, 0.0, MAX_TEMPERATURE, adapter)
    top_p = _number(payload, "top_p", 1.0, 0.0, 1.0, adapter)
    seed = (
        _integer(payload, "seed", 0, -(2**63), 2**63 - 1, adapter)
        if payload.get("seed") is not None
        else None
    )

    try:
        prompt_ids = served.encode(prompt)
    except ValueError as exc:  # PromptError: a character outside the model's alphabet
        raise ProtocolError(400, "invalid_request", f"'{where}': {exc}", where, adapter) from None
    return Parsed(
        operation=operation,
        model=model,
        adapter=adapter,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        stop=tuple(stop),
        n=n,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )


_OTHER = "other"  # the adapter a request is counted under before its model is known (ADAPTER_OTHER)


def _stream_options(options: Any, stream: bool, adapter: str | None) -> bool:
    if options is None:
        return False
    if not stream:
        raise ProtocolError(
            400,
            "invalid_request",
            "'stream_options' is only allowed with 'stream': true",
            "stream_options",
            adapter,
        )
    if not isinstance(options, dict):
        raise ProtocolError(
            400, "invalid_request", "'stream_options' must be an object", "stream_options", adapter
        )
    for key in options:
        if key != "include_usage":
            raise ProtocolError(
                400,
                "invalid_request",
                f"'stream_options.{key}' is not supported by this server",
                f"stream_options.{key}",
                adapter,
            )
    include = options.get("include_usage")
    if include is None:
        return False
    if not isinstance(include, bool):
        raise ProtocolError(
            400,
            "invalid_request",
            "'stream_options.include_usage' must be true or false",
            "stream_options.include_usage",
            adapter,
        )
    return include


# -- answers -------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    parsed: Parsed, request_id: str, created: int, choices: list[tuple[str, str]], used: dict[str, int]
) -> dict[str, Any]:
    """The whole answer; ``choices``: (text, finish_reason) per choice, in order."""
    if parsed.operation == COMPLETION:
        items = [
            {"index": i, "text": text, "finish_reason": finish, "logprobs": None}
            for i, (text, finish) in enumerate(choices)
        ]
        kind = "text_completion"
    else:
        items = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": finish,
                "logprobs": None,
            }
            for i, (text, finish) in enumerate(choices)
        ]
        kind = "chat.completion"
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": parsed.model,
        "choices": items,
        "usage": used,
    }


def request_id(operation: str, make: Callable[[], str]) -> str:
    return f"{'cmpl' if operation == COMPLETION else 'chatcmpl'}-{make()}"


def event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def chunk(
    parsed: Parsed,
    request_id: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None = None,
    *,
    first: bool = False,
) -> bytes:
    """A stream event for choice ``index``: new ``text`` (chat: a ``delta``, with the role on the first)."""
    if parsed.operation == COMPLETION:
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        kind = "text_completion"
    else:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text or first:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        kind = "chat.completion.chunk"
    body = {"id": request_id, "object": kind, "created": created, "model": parsed.model, "choices": [choice]}
    if parsed.include_usage:
        body["usage"] = None  # the spec: null on every chunk but the last, which carries it
    return event(body)


def usage_chunk(parsed: Parsed, request_id: str, created: int, used: dict[str, int]) -> bytes:
    """``stream_options.include_usage``: the usage in its own last chunk, with no choices (as the API defines it)."""
    kind = "text_completion" if parsed.operation == COMPLETION else "chat.completion.chunk"
    return event(
        {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": parsed.model,
            "choices": [],
            "usage": used,
        }
    )


def model_entry(name: str, base: str, created: int) -> dict[str, Any]:
    """A ``GET /v1/models`` item; an adapter's says which base it runs on (``parent``, as vLLM's do)."""
    adapter = name != base
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "openlora",
        "root": name,
        "parent": base if adapter else None,
        "adapter": adapter,
    }

"""The serving metrics of one OpenAI-style request, read from the bytes on the wire.

What the HTTP middlewares (:mod:`openlora_otel.inference.asgi`, :mod:`openlora_otel.inference.wsgi`)
share: which routes are OpenAI's, what a request body says (``model``, ``stream``,
``stream_options.include_usage``), and a reader of the response that feeds an
:class:`~openlora_otel.inference.metrics.InferenceRequest` as the bytes go by: the first token (the
first server-sent event that carries content, or the first byte of an answer that is not streamed),
the token counts (the ``usage`` the app returns, streamed or not; without one, and unless the app
gave them to the request itself, the streamed chunks that carry content, counted as one token each), and ``error.type`` (an error status, or a stream's
error event: the error's ``code``, else its ``type``, else the status).

Every read is bounded: a request body past :data:`MAX_REQUEST_BYTES` is not parsed (the model is
then unknown), an answer that is not streamed is parsed only up to :data:`MAX_RESPONSE_BYTES`, an
event only up to :data:`MAX_EVENT_BYTES`. Nothing here raises for what an app or a client sends.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openlora_otel.inference.metrics import ADAPTER_OTHER, InferenceMetrics, InferenceRequest
from openlora_otel.names.inference import CLIENT_ERROR_TYPES, is_client_error, is_client_error_status

_CLIENT_ERRORS = frozenset(CLIENT_ERROR_TYPES)

__all__ = [
    "MAX_EVENT_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "OPENAI_ROUTES",
    "AdapterLookup",
    "RequestFacts",
    "ResponseReader",
    "read_request",
]

_logger = logging.getLogger(__name__)

# POST path -> gen_ai.operation.name (the GenAI conventions' values).
OPENAI_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
MAX_REQUEST_BYTES = 1 << 20
MAX_RESPONSE_BYTES = 1 << 22
MAX_EVENT_BYTES = 1 << 20
# The fields of a streamed chat delta that are output: text, a refusal, tool calls, and the reasoning
# text some servers stream before the answer.
_DELTA_OUTPUT = ("content", "refusal", "tool_calls", "function_call", "reasoning_content", "reasoning")


@dataclass(frozen=True)
class RequestFacts:
    """What a request body says: the ``model`` asked for (``None``: absent, not a string, or the body
    was not JSON or too long to read), whether the answer is streamed, whether usage is asked for."""

    model: str | None = None
    stream: bool = False
    include_usage: bool = False


def read_request(body: bytes) -> RequestFacts:
    """The facts of a request body (never raises)."""
    if len(body) > MAX_REQUEST_BYTES:
        return RequestFacts()
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return RequestFacts()
    if not isinstance(parsed, dict):
        return RequestFacts()
    model = parsed.get("model")
    options = parsed.get("stream_options")
    return RequestFacts(
        model=model if isinstance(model, str) else None,
        stream=parsed.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _error_type(error: Any, status: int | None) -> str:
    """``error.type`` of an OpenAI error object answered with ``status`` (None: a stream's error event,
    after a 200), so that the server-error ratio counts exactly the server's faults, whatever the app
    calls them:

    - a client's status (4xx but 429): the body's ``code`` if it is one of
      :data:`~openlora_otel.names.inference.CLIENT_ERROR_TYPES`, else its ``type`` if that is, else
      the status;
    - a server's status (5xx, 429): its ``code``, else its ``type``, unless that names a client's fault
      (a 502 whose code is 404): then the status;
    - a stream's error event: its ``code``, else its ``type``, as the app says (no status to go by),
      else ``"500"``.
    """
    names = []
    if isinstance(error, dict):
        for key in ("code", "type"):
            value = error.get(key)
            if isinstance(value, str) and value:
                names.append(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                names.append(str(value))
    if status is None:
        return names[0] if names else "500"
    if is_client_error_status(status):
        return next((name for name in names if name in _CLIENT_ERRORS), str(status))
    if names and not is_client_error(names[0]):
        return names[0]
    return str(status)


class ResponseReader:
    """Reads one response for ``record``: :meth:`start` with its status and content type, :meth:`body`
    with each piece of its body as it is sent, :meth:`finish` at its end (which sets the tokens and
    the error on ``record`` and leaves ending it to the caller). ``clock``: the time of a piece when
    the caller has none."""

    __slots__ = (
        "_buffer",
        "_chunks",
        "_clock",
        "_error",
        "_events",
        "_first",
        "_input",
        "_output",
        "_overflow",
        "_status",
        "_streamed",
        "record",
    )

    def __init__(self, record: InferenceRequest, clock: Callable[[], float] = time.perf_counter) -> None:
        self.record = record
        self._clock = clock
        self._status = 200
        self._streamed = False
        self._buffer = bytearray()
        self._overflow = False
        self._first = False
        self._chunks = 0  # streamed events that carried output
        self._input: int | None = None
        self._output: int | None = None
        self._error: str | None = None
        self._events = 0

    def start(self, status: int, content_type: str) -> None:
        """The response's status line and headers: ``content_type`` as sent (``text/event-stream`` is a stream)."""
        self._status = status
        self._streamed = content_type.split(";", 1)[0].strip().lower() == "text/event-stream"

    def body(self, data: bytes, at: float | None = None) -> None:
        """A piece of the body, sent at ``at`` (a ``time.perf_counter()`` value; now if ``None``)."""
        if not data:
            return
        if not self._streamed:
            if not self._first and self._status < 400:
                self._first = True
                self.record.first_token(at=self._clock() if at is None else at)
            if not self._overflow:
                if len(self._buffer) + len(data) > MAX_RESPONSE_BYTES:
                    self._overflow = True
                    self._buffer.clear()
                else:
                    self._buffer += data
            return
        self._buffer += data
        while True:
            end, size = _event_end(self._buffer)
            if end < 0:
                break
            event = bytes(self._buffer[:end])
            del self._buffer[: end + size]
            self._event(event, at)
        if len(self._buffer) > MAX_EVENT_BYTES:
            self._buffer.clear()  # an event too long to read: skipped (its end is never found)

    def _event(self, event: bytes, at: float | None) -> None:
        data = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]":
            return
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return
        if not isinstance(parsed, dict):
            return
        self._events += 1
        if "error" in parsed:
            self._error = _error_type(parsed["error"], None if self._status < 400 else self._status)
            return
        usage = parsed.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        if _carries_output(parsed.get("choices")):
            self._chunks += 1
            if not self._first:
                self._first = True
                self.record.first_token(at=self._clock() if at is None else at)

    def _usage(self, usage: dict) -> None:
        self._input = _count(usage.get("prompt_tokens"))
        self._output = _count(usage.get("completion_tokens"))

    def finish(self) -> None:
        """The response ended: its tokens and error go to the record (not ended here)."""
        if self._streamed:
            if self._buffer.strip():
                self._event(bytes(self._buffer), None)  # a last event without its blank line
                self._buffer.clear()
        elif not self._overflow and self._buffer:
            try:
                parsed = json.loads(bytes(self._buffer))
            except (ValueError, UnicodeDecodeError, RecursionError):
                parsed = None
            self._buffer.clear()
            if isinstance(parsed, dict):
                if self._status >= 400:
                    self._error = _error_type(parsed.get("error"), self._status)
                elif isinstance(parsed.get("usage"), dict):
                    self._usage(parsed["usage"])
        if self._status >= 400 and self._error is None:
            self._error = str(self._status)
        if self._streamed and self._output is None and self._chunks and self.record.output_tokens is None:
            self._output = self._chunks  # no usage, and the app said none itself: one token per chunk
        if self._input is not None or self._output is not None:
            self.record.tokens(input=self._input, output=self._output)
        if self._error is not None:
            self.record.fail(self._error)


def _event_end(buffer: bytearray) -> tuple[int, int]:
    """Where the first complete server-sent event in ``buffer`` ends, and the length of the blank line
    that ends it; ``(-1, 0)`` when none is complete yet."""
    ends = [(i, n) for i, n in ((buffer.find(b"\n\n"), 2), (buffer.find(b"\r\n\r\n"), 4)) if i >= 0]
    return min(ends) if ends else (-1, 0)


def _carries_output(choices: Any) -> bool:
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):  # a completion's
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(key) for key in _DELTA_OUTPUT):
            return True
    return False


def inference_of(given: Any) -> tuple[InferenceMetrics, Any]:
    """A middleware's ``inference`` argument: ``setup_telemetry()``'s ``Telemetry`` (its ``inference``,
    and the Telemetry itself, for a middleware that ends it with the server) or an
    :class:`InferenceMetrics` (and None); anything else is a TypeError."""
    from openlora_otel.telemetry import Telemetry  # here: the telemetry module imports this package

    if isinstance(given, Telemetry):
        return given.inference, given
    if isinstance(given, InferenceMetrics):
        return given, None
    raise TypeError(
        "inference must be the Telemetry setup_telemetry() returned or its telemetry.inference (an"
        f" InferenceMetrics), got {type(given).__name__}"
    )


def same_name(model: str) -> str | None:
    """The default adapter hook: a model name is the adapter's."""
    return model


class AdapterLookup:
    """The adapter a request's model name is recorded under, through the user's ``hook`` (a name ->
    the adapter, ``None`` for the base model), shared by the integrations: no name is ``other``, and
    so is a name the hook raises on (it warns once)."""

    def __init__(self, hook: Callable[[str], str | None]) -> None:
        self._hook = hook
        self._warned: set[str] = set()

    def __call__(self, model: str | None) -> str | None:
        if model is None:
            return ADAPTER_OTHER  # no model said (or a body too long or not JSON): never the base's
        try:
            return self._hook(model)
        except Exception:
            self.warn_once("adapter", "openlora-otel: the adapter hook raised; such requests are recorded as 'other'")
            return ADAPTER_OTHER

    def warn_once(self, key: str, message: str) -> None:
        """Log ``message`` (with the exception being handled) the first time ``key`` comes."""
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning(message, exc_info=True)


def finish_quietly(reader: ResponseReader) -> None:
    """``reader.finish()``, logging instead of raising: the app's answer is never broken by it."""
    try:
        reader.finish()
    except Exception:
        _logger.warning("openlora-otel: reading an answer's end failed", exc_info=True)

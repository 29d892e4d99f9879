"""gRPC server interceptor: the serving metrics of inference RPCs, unary and server-streaming.

For a ``grpc.server`` (the synchronous server of ``grpcio``, which this module imports; the
``otlp`` extra brings it)::

    telemetry = setup_telemetry("my-server")
    server = grpc.server(executor, interceptors=[OpenAIMetricsServerInterceptor(
        telemetry.inference, methods={"/llm.Generator/Generate": "text_completion"},
        adapter_metadata_key="x-adapter")])

Each call of a method in ``methods`` (full method name -> ``gen_ai.operation.name``) is one
request: its duration from the call to the last message; the first response message as the first
token (a unary call's one message, a stream's first); ``error.type`` the call's status code name
(``RESOURCE_EXHAUSTED``, ``INVALID_ARGUMENT``: what ``context.abort()`` or ``context.set_code()``
set), ``CANCELLED`` when the client left before its answer was sent (mid-stream, or with the
handler still at work), ``DEADLINE_EXCEEDED`` when that was its deadline (passed, or under a tenth
of the call's time away: the client's cancel at its own deadline arrives before the server's copy
passes), else the exception's type; the adapter from a metadata key, or from the request by a
function (a field of the request message), mapped as the HTTP middlewares map a model name (the
default keeps it; none said is the base model). Token counts come from functions of the request and
of each response message, when given. Other methods pass through untouched. The asyncio server
(``grpc.aio``) is not covered.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from openlora_otel._deps import require

require("grpc", "The gRPC server interceptor")

import grpc  # noqa: E402

from openlora_otel.inference.metrics import (  # noqa: E402
    ADAPTER_OTHER,
    InferenceRequest,
    exception_error_type,
)
from openlora_otel.inference.openai_traffic import inference_of  # noqa: E402

if TYPE_CHECKING:
    from openlora_otel.inference.metrics import InferenceMetrics
    from openlora_otel.telemetry import Telemetry

__all__ = ["OpenAIMetricsServerInterceptor"]

_logger = logging.getLogger(__name__)


class OpenAIMetricsServerInterceptor(grpc.ServerInterceptor):
    """Record each call of ``methods`` in ``inference`` (the Telemetry, or its ``telemetry.inference``).

    ``adapter_metadata_key``: the invocation metadata key that names the adapter; ``adapter_from_request``:
    a function of the request message that does (either or both; the metadata wins when both give
    one; neither: the base model). ``adapter``: maps the name found to the adapter recorded (``None``
    for the base, ``ADAPTER_OTHER`` for a name not served). ``input_tokens(request)`` and
    ``output_tokens(message)`` (summed over a stream's messages): token counts, when given.
    """

    def __init__(
        self,
        inference: Telemetry | InferenceMetrics,
        *,
        methods: Mapping[str, str],
        adapter_metadata_key: str | None = None,
        adapter_from_request: Callable[[Any], str | None] | None = None,
        adapter: Callable[[str], str | None] = lambda name: name,
        input_tokens: Callable[[Any], int | None] | None = None,
        output_tokens: Callable[[Any], int | None] | None = None,
    ) -> None:
        if not methods:
            raise ValueError("methods must name at least one full method name, e.g. {'/pkg.Service/Method': 'text_completion'}")
        self.inference, _ = inference_of(inference)
        self._methods = dict(methods)
        self._key = adapter_metadata_key.lower() if adapter_metadata_key else None
        self._from_request = adapter_from_request
        self._adapter = adapter
        self._input = input_tokens
        self._output = output_tokens
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning(message, exc_info=True)

    def _adapter_of(self, metadata: Any, request: Any) -> str | None:
        name = None
        try:
            if self._key is not None:
                name = next((value for key, value in metadata or () if key.lower() == self._key), None)
            if name is None and self._from_request is not None:
                name = self._from_request(request)
            if name is None:
                return None
            return self._adapter(str(name))
        except Exception:
            self._warn_once("adapter", "openlora-otel: finding a call's adapter failed; such calls are recorded as 'other'")
            return ADAPTER_OTHER

    def _tokens(self, record: InferenceRequest, request: Any, output: int | None) -> None:
        try:
            record.tokens(input=self._input(request) if self._input is not None else None, output=output)
        except Exception:
            self._warn_once("tokens", "openlora-otel: counting a call's tokens failed")

    def _count(self, message: Any) -> int:
        if self._output is None:
            return 0
        try:
            return int(self._output(message) or 0)
        except Exception:
            self._warn_once("output", "openlora-otel: counting a message's tokens failed")
            return 0

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        operation = self._methods.get(handler_call_details.method)
        if handler is None or operation is None or handler.request_streaming:
            return handler  # not measured (client-streaming calls are not inference calls here)
        metadata = handler_call_details.invocation_metadata
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._streamed(handler.unary_stream, operation, metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, operation, metadata),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _unary(self, behavior: Callable[[Any, Any], Any], operation: str, metadata: Any) -> Callable[[Any, Any], Any]:
        def measured(request: Any, context: grpc.ServicerContext) -> Any:
            record = self.inference.request(self._adapter_of(metadata, request), operation=operation)
            budget = _Deadline(context)
            try:
                response = behavior(request, context)
            except BaseException as exc:
                record.end(error=_status(context) or exception_error_type(type(exc)))
                raise
            error = _status(context) or _gone(context, budget)
            if error is None:
                record.first_token()
                self._tokens(record, request, self._count(response) if self._output is not None else None)
            record.end(error=error)
            return response

        return measured

    def _streamed(
        self, behavior: Callable[[Any, Any], Iterator[Any]], operation: str, metadata: Any
    ) -> Callable[[Any, Any], Iterator[Any]]:
        def measured(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            record = self.inference.request(self._adapter_of(metadata, request), operation=operation)
            budget = _Deadline(context)
            error: str | None = "CANCELLED"  # unless the stream runs to its end
            produced = 0
            try:
                for message in behavior(request, context):
                    record.first_token()
                    produced += self._count(message)
                    yield message
                # A handler that stopped when its client left (context.is_active()) is the client's
                # cancel (or the deadline), not a whole answer.
                error = _status(context) or _gone(context, budget)
            except GeneratorExit:
                # Closed before its end: the client cancelled, or its deadline passed (the server's
                # fault, not the client's: a server too slow for its clients must reach the alert).
                if budget.passed():
                    error = "DEADLINE_EXCEEDED"
                raise
            except BaseException as exc:
                error = _status(context) or exception_error_type(type(exc))
                raise
            finally:
                if error is None:
                    self._tokens(record, request, produced if self._output is not None else None)
                record.end(error=error)

        return measured


# How near its deadline a closed call counts as past it (see _deadline_passed).
_DEADLINE_SLACK_MIN_S = 0.02
_DEADLINE_SLACK_MAX_S = 1.0


def _time_remaining(context: Any) -> float | None:
    """Seconds to the call's deadline (``None``: the call has none, or the context cannot say)."""
    try:
        remaining = context.time_remaining()
    except Exception:
        return None
    return None if remaining is None else float(remaining)


def _deadline_passed(remaining: float | None, budget: float | None) -> bool:
    """Whether a call with ``remaining`` seconds to its deadline when it ended was past it, or as good as.

    The client's deadline passes first: the server's copy runs from the request's arrival (the
    ``grpc-timeout`` header), so the client's cancel at its own deadline reaches the server a
    request's transit before the server's timer. Within a tenth of the call's time (``budget``,
    what remained when the handler started), between 20 ms and 1 s, of its deadline, a call that
    ended is counted as past it. A call without a deadline never passes it.
    """
    if remaining is None or budget is None:
        return False
    return remaining <= min(_DEADLINE_SLACK_MAX_S, max(_DEADLINE_SLACK_MIN_S, 0.1 * budget))


class _Deadline:
    """A call's deadline: the time it had when its handler started, and what was left when the call
    ended for the server (``add_callback`` runs then: a client's cancel, the deadline, the status
    sent). A handler that notices a cancel only later (blocked past the deadline) is judged by when the
    call ended, not by when it noticed."""

    __slots__ = ("_context", "budget", "ended")

    def __init__(self, context: Any) -> None:
        self._context = context
        self.budget = _time_remaining(context)
        self.ended: list[float | None] = []
        # A context without add_callback: judged by when the handler noticed.
        with contextlib.suppress(Exception):
            context.add_callback(lambda: self.ended.append(_time_remaining(context)))

    def passed(self) -> bool:
        remaining = self.ended[0] if self.ended else _time_remaining(self._context)
        return _deadline_passed(remaining, self.budget)


def _gone(context: Any, budget: _Deadline) -> str | None:
    """``CANCELLED`` or ``DEADLINE_EXCEEDED`` when the call is over for its client (``None`` while it
    is active, or when the context cannot say)."""
    try:
        active = context.is_active()
    except Exception:
        return None
    if active:
        return None
    return "DEADLINE_EXCEEDED" if budget.passed() else "CANCELLED"


def _status(context: Any) -> str | None:
    """The name of the call's status code when the handler set one other than OK (``None`` otherwise)."""
    try:
        code = context.code()
    except Exception:  # a context without code() (grpcio before 1.38)
        return None
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return None if code is grpc.StatusCode.OK else code.name
    try:
        status = grpc.StatusCode(code) if not isinstance(code, int) else next(s for s in grpc.StatusCode if s.value[0] == code)
    except (ValueError, StopIteration):
        return str(code)
    return None if status is grpc.StatusCode.OK else status.name

"""The limits a public endpoint needs: body size, JSON depth, body and header read times, connections.

Installed by ``openlora-otel serve``, since uvicorn lacks them: :class:`RequestLimits`, a pure ASGI
middleware for the body limits (it never reads the body for the app); :func:`http_protocol`,
uvicorn's HTTP protocol with a header timeout and a connection cap; :class:`AcceptErrorLog`, one
warning instead of a traceback per failed ``accept()``. Every refusal is counted.
See docs/how-to/serving.md (Limits).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openlora_otel.inference.asgi import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "CONNECTIONS_CLOSED",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_JSON_DEPTH",
    "AcceptErrorLog",
    "DepthScanner",
    "Limits",
    "RequestLimits",
    "error_body",
    "http_protocol",
    "inference_recorder",
]

_logger = logging.getLogger(__name__)

# (scope, error code) for each refused request: how the caller records it.
OnRefusal = Callable[[Scope, str], None]

DEFAULT_MAX_BODY_BYTES = 1024 * 1024  # a 4000-character prompt is ~4 KB: 1 MiB leaves room for chat
DEFAULT_MAX_JSON_DEPTH = 64  # our requests nest 3 deep; json.loads recurses per level (RecursionError near 1000)
DEFAULT_BODY_TIMEOUT_S = 30.0  # for the whole body: 1 MiB at 35 KB/s
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1000
# File descriptors kept free under the connection cap: model files, metric exporters, the listener.
FD_RESERVE = 64
CONNECTIONS_CLOSED = "openlora.serve.connections.closed"
WARN_EVERY_S = 10.0

TOO_LARGE = "request_too_large"
TOO_DEEP = "json_too_deep"
TIMEOUT = "request_timeout"
CANCELLED = "cancelled"  # the client went away: the same error.type as a stream whose client left
INVALID_HTTP = "invalid_http"  # bytes uvicorn's HTTP parser refused: no request for the app to see


@dataclass(frozen=True)
class Limits:
    """The limits; ``None`` turns one off."""

    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int | None = DEFAULT_MAX_JSON_DEPTH
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    header_timeout_s: float | None = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS

    def connection_cap(self) -> int | None:
        """``max_connections``, lowered to fit the process's file descriptor limit (what it guards)."""
        if self.max_connections is None:
            return None
        try:
            import resource  # POSIX only: elsewhere the flag's value stands
        except ImportError:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - FD_RESERVE))


DEFAULT_LIMITS = Limits()


def error_body(message: str, code: str, error_type: str = "invalid_request_error") -> bytes:
    """An error in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()


# -- JSON depth -------------------------------------------------------------------------------
# In a string only '"' and '\' matter; '\' escapes the next byte (the regex skips whole runs in C).
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _open in b"[{":
    _STEP[_open] = 1
for _close in b"]}":
    _STEP[_close] = -1


class DepthScanner:
    """The deepest bracket nesting outside JSON strings of a body fed in chunks (no parsing).

    Cheap: strings are skipped by a regex, and between strings the brackets are kept by
    ``bytes.translate`` and summed by ``itertools.accumulate`` (C loops: about 20 ms for 1 MiB of
    brackets). A chunk may end anywhere, inside a string or after a backslash.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.deepest = 0
        self._in_string = False
        self._escaped = False

    def feed(self, chunk: bytes) -> int:
        """Scan ``chunk``; the deepest nesting so far."""
        pos, end = 0, len(chunk)
        while pos < end:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    pos += 1
                    continue
                match = _STRING_REST.match(chunk, pos)
                pos = match.end() if match else pos
                if pos == end:
                    break
                if chunk[pos] == 0x22:  # '"': the string ends
                    self._in_string = False
                else:  # a backslash at the chunk's end: it escapes the next chunk's first byte
                    self._escaped = True
                pos += 1
            else:
                quote = chunk.find(b'"', pos)
                stop = end if quote < 0 else quote
                brackets = chunk[pos:stop].translate(None, _NOT_BRACKETS)
                if brackets:
                    peak = max(itertools.accumulate(map(_STEP.__getitem__, brackets), initial=self.depth))
                    self.deepest = max(self.deepest, peak)
                    self.depth += len(brackets) - 2 * (brackets.count(b"]") + brackets.count(b"}"))
                if quote < 0:
                    break
                self._in_string = True
                pos = quote + 1
        return self.deepest


def json_depth(body: bytes) -> int:
    """The deepest bracket nesting outside strings of ``body`` (a whole body: see :class:`DepthScanner`)."""
    return DepthScanner().feed(body)


# -- the ASGI middleware ----------------------------------------------------------------------
class _Refused(Exception):
    """Raised into the app from ``receive`` once the refusal has been answered."""


@dataclass
class _Refusal:
    status: int
    code: str
    message: str


class RequestLimits:
    """The body limits of every HTTP request (size, JSON depth, read time), as an ASGI middleware."""

    def __init__(self, app: ASGIApp, limits: Limits = DEFAULT_LIMITS, on_refusal: OnRefusal | None = None) -> None:
        self.app = app
        self.limits = limits
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        declared = _content_length(scope)
        if limits.max_body_bytes is not None and declared is not None and declared > limits.max_body_bytes:
            # Refused on the headers: the app never runs and not a byte of the body is read.
            await self._answer(scope, send, self._too_large(declared))
            return
        state = _Body(limits, time.monotonic())
        answered = False

        async def limited_receive() -> Message:
            nonlocal answered
            if state.complete:
                return await receive()  # after the body: the app listens for a disconnect, no limit
            refusal: _Refusal | None = None
            try:
                if state.deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), max(0.0, state.deadline - time.monotonic()))
            except TimeoutError:
                refusal = _Refusal(
                    408,
                    TIMEOUT,
                    f"the request body did not arrive within {limits.body_timeout_s:g} s "
                    f"({state.received} bytes received)",
                )
            else:
                if message["type"] == "http.disconnect":
                    state.gone = True
                    return message
                refusal = state.take(message.get("body", b""), more=message.get("more_body", False))
                if refusal is None:
                    return message
            if not state.response_started:
                await self._answer(scope, send, refusal)
            answered = True
            raise _Refused(refusal.message)

        async def guarded_send(message: Message) -> None:
            if answered:
                return  # the app's answer after ours (its request.body() raised): dropped
            if message["type"] == "http.response.start":
                state.response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception as exc:
            if answered:
                return
            if state.gone and not state.response_started:
                # The client hung up mid-body: the app's ClientDisconnect is the consequence, not a bug.
                client = scope.get("client")
                where = f"{client[0]}:{client[1]}" if client else "a client"
                _logger.warning(
                    "openlora-otel serve: %s disconnected while sending its body (%d of %s bytes) to %s %s (%s)",
                    where,
                    state.received,
                    declared if declared is not None else "chunked",
                    scope.get("method"),
                    scope.get("path"),
                    type(exc).__name__,
                )
                self._record(scope, CANCELLED)
                return
            raise

    def _too_large(self, size: int) -> _Refusal:
        return _Refusal(
            413, TOO_LARGE, f"the request body is {size} bytes; this server takes at most {self.limits.max_body_bytes}"
        )

    def _record(self, scope: Scope, code: str) -> None:
        if self.on_refusal is not None:
            try:
                self.on_refusal(scope, code)
            except Exception:  # a metrics problem must not turn a refusal into a 500
                _logger.exception("recording a refused request failed")

    async def _answer(self, scope: Scope, send: Send, refusal: _Refusal) -> None:
        _logger.info("refused %s %s: %d %s", scope.get("method"), scope.get("path"), refusal.status, refusal.message)
        self._record(scope, refusal.code)
        body = error_body(refusal.message, refusal.code)
        await send(
            {
                "type": "http.response.start",
                "status": refusal.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # The rest of the body is never read: the connection ends with the answer.
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _Body:
    """One request's body as it arrives: bytes, depth, deadline."""

    def __init__(self, limits: Limits, started: float) -> None:
        self.limits = limits
        self.deadline = None if limits.body_timeout_s is None else started + limits.body_timeout_s
        self.received = 0
        self.complete = False
        self.gone = False
        self.response_started = False
        self.depth = DepthScanner() if limits.max_json_depth is not None else None

    def take(self, chunk: bytes, *, more: bool) -> _Refusal | None:
        limits = self.limits
        self.received += len(chunk)
        if limits.max_body_bytes is not None and self.received > limits.max_body_bytes:
            return _Refusal(
                413,
                TOO_LARGE,
                f"the request body is over {limits.max_body_bytes} bytes (the limit of this server)",
            )
        if (
            self.depth is not None
            and limits.max_json_depth is not None
            and chunk
            and self.depth.feed(chunk) > limits.max_json_depth
        ):
            return _Refusal(400, TOO_DEEP, f"the request body nests JSON deeper than {limits.max_json_depth} levels")
        if not more:
            self.complete = True
        return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 and httptools refuse a bad Content-Length before the app runs
    return None


def inference_recorder(inference: Any, operations: Mapping[str, str]) -> OnRefusal:
    """Record a refused request on an inference route (path -> operation) in ``telemetry.inference``.

    Under the adapter ``other`` (the body, and so the model, was never read), with the error's code
    as ``error.type``. Other routes are in the HTTP metrics only.
    """
    from openlora_otel.inference.metrics import ADAPTER_OTHER

    def record(scope: Scope, code: str) -> None:
        operation = operations.get(scope.get("path", ""))
        if operation is not None and scope.get("method") == "POST":
            inference.request(adapter=ADAPTER_OTHER, operation=operation).end(error=code)

    return record


# -- the HTTP protocol: header timeout and connection cap -----------------------------------------
def http_protocol(
    limits: Limits, meter_provider: Any = None, base: type[asyncio.Protocol] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``base``, else the one uvicorn's ``http="auto"`` picks) with the
    header timeout and the connection cap of ``limits``; pass it as ``uvicorn.Config(http=...)``.

    One class per server: it holds that server's connections waiting for headers.
    """
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    header_timeout = limits.header_timeout_s
    cap = limits.connection_cap()
    closed = None
    if meter_provider is not None:
        closed = meter_provider.get_meter("openlora_otel.serving").create_counter(
            CONNECTIONS_CLOSED,
            unit="{connection}",
            description="Connections the server closed before they made a request: header_timeout, "
            "connection_limit, invalid_http.",
        )
    # Connections waiting for a request's headers, oldest first (a dict keeps insertion order).
    waiting: dict[Any, None] = {}
    # A flood of connections is one warning per WARN_EVERY_S, with the count since the last one.
    evicted = {"since_warning": 0, "warned_at": -WARN_EVERY_S}

    def count(error_type: str) -> None:
        if closed is not None:
            closed.add(1, {"error.type": error_type})

    class LimitedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _waited_cycle: Any = None
        _partial = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if cap is not None and len(self.connections) > cap:
                # Over the cap: the connection that has waited longest for its headers makes room.
                oldest = next(iter(waiting), None)
                victim = oldest if oldest is not None else self
                evicted["since_warning"] += 1
                now = time.monotonic()
                if now - evicted["warned_at"] >= WARN_EVERY_S:
                    _logger.warning(
                        "openlora-otel serve: over %d open connections (--max-connections): closed %d "
                        "connection(s) since the last warning, the ones waiting longest for request headers "
                        "(else the new one)",
                        cap,
                        evicted["since_warning"],
                    )
                    evicted["since_warning"], evicted["warned_at"] = 0, now
                victim._close_waiting()
                count("connection_limit")
                if victim is self:
                    return
            self._wait_for_headers()

        def data_received(self, data: bytes) -> None:
            is_waiting = self in waiting
            if is_waiting:
                self._partial = True
            super().data_received(data)
            # uvicorn makes a new cycle when a request's headers are complete.
            if is_waiting and self.cycle is not self._waited_cycle:
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # The next request's headers are due too (a pipelined one may already have started).
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._wait_for_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def _wait_for_headers(self) -> None:
            self._stop_waiting()
            self._waited_cycle = self.cycle
            self._partial = False
            waiting[self] = None
            if header_timeout is not None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _stop_waiting(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            _logger.info("closing a connection whose request headers did not arrive within %g s", header_timeout)
            count("header_timeout")
            self._close_waiting(timed_out=True)

        def send_400_response(self, msg: str) -> None:
            # uvicorn's HTTP parser refused the bytes (a bad or repeated Content-Length, a bad chunk size,
            # a NUL or space in the path, headers over 16 KiB): uvicorn answers text/plain "Invalid HTTP
            # request received."; this is the OpenAI error shape every other refusal has.
            self._stop_waiting()
            count(INVALID_HTTP)
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                body = error_body(
                    "the request is not valid HTTP/1.1 (refused by the server's HTTP parser: a bad or "
                    "repeated Content-Length, a bad chunk size, a control character or space in the "
                    "request line, headers over 16 KiB, ...)",
                    INVALID_HTTP,
                )
                self.transport.write(
                    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
            self.transport.close()

        def _close_waiting(self, timed_out: bool = False) -> None:
            self._stop_waiting()
            if self.transport.is_closing():
                return
            if timed_out and self._partial:
                # Part of a request arrived: say why it ends (no request exists for the app to answer).
                body = error_body(
                    f"the request headers did not arrive within {header_timeout:g} s", TIMEOUT
                )
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
            self.transport.close()

    LimitedHTTPProtocol.__name__ = LimitedHTTPProtocol.__qualname__ = f"Limited{base.__name__}"
    return LimitedHTTPProtocol


# -- accept() past the open files limit -------------------------------------------------------------
# What asyncio's selector loop reports as "socket.accept() out of system resource".
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptErrorLog:
    """The event loop's exception handler while serving (``loop.set_exception_handler``): an
    ``accept()`` that fails for want of resources (``EMFILE``: the open files limit) is one warning per
    ``interval`` seconds (:data:`WARN_EVERY_S`) with the count since the last; anything else goes to
    the loop's default handler, as before.

    Past the limit, asyncio's selector loop (Python 3.11) logged a traceback for every failed
    ``accept()``, up to the listen backlog (2048) of them per turn of the loop: under ``ulimit -n
    1024``, 1,100 half-open connections and a connection cap lowered to 960 made about 8,000
    tracebacks (3.2 MB) in 5 s. The connections it could not accept wait in the backlog, and are
    accepted as descriptors free up (the connection cap and the header timeout close the idle ones).
    """

    def __init__(self, interval: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = WARN_EVERY_S if interval is None else interval
        self.clock = clock
        self.since_warning = 0
        self.warned_at: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (
            isinstance(exc, OSError)
            and exc.errno in ACCEPT_RESOURCE_ERRNOS
            and "accept" in context.get("message", "")
        ):
            loop.default_exception_handler(context)
            return
        self.since_warning += 1
        now = self.clock()
        if self.warned_at is not None and now - self.warned_at < self.interval:
            return
        _logger.warning(
            "openlora-otel serve: cannot accept new connections: %s (%d failed accept(s) since the last "
            "warning; the open files limit is %s); they wait until descriptors free up (--max-connections, "
            "--header-timeout)",
            exc.strerror or exc,
            self.since_warning,
            _open_files_limit(),
        )
        self.since_warning, self.warned_at = 0, now


def _open_files_limit() -> str:
    """The soft limit on open files (``ulimit -n``), as text; "unknown" where there is none to read."""
    try:
        import resource
    except ImportError:
        return "unknown"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)

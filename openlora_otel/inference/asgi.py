"""ASGI middleware: the serving metrics of an OpenAI-compatible app, read from its own traffic.

One line around any ASGI app (FastAPI, Starlette, an OpenAI-compatible server written in Python)::

    telemetry = setup_telemetry("my-server")
    app = OpenAIMetricsMiddleware(app, telemetry)

Given the ``Telemetry`` (not only its ``inference``), the middleware also shuts it down when the
server shuts the app down (the ASGI lifespan's shutdown, before it is reported complete): uvicorn,
after a SIGTERM, ends the process by that signal once the app is shut down, so ``atexit`` never runs
and, without this, what was recorded since the last export or scrape would be lost.
Each lifespan shutdown ends it: an app whose lifespan runs more than once in one process, or that
runs without the lifespan protocol, is given ``telemetry.inference`` and shuts the telemetry down itself.

Each ``POST`` to one of OpenAI's routes (:data:`~openlora_otel.inference.openai_traffic.OPENAI_ROUTES`)
is one request in ``telemetry.inference``: the body is read first (up to 1 MiB, then handed to the
app unchanged) for its ``model``, which the ``adapter`` hook maps to the adapter recorded (default:
the name itself; ``None`` for the base model; past the cap of adapter names, ``other``); then the
answer is read as it is sent, after each piece has gone to the client (never delaying one): time to
first token, tokens, ``error.type`` (:mod:`openlora_otel.inference.openai_traffic`). A request the
client abandons mid-answer is ``cancelled``; one the app raises on has the exception's type. Every
other request passes through untouched.

The app may refine what the traffic cannot show: the request's
:class:`~openlora_otel.inference.metrics.InferenceRequest` is ``scope["state"]["openlora_inference"]``
(``request.state.openlora_inference`` in Starlette and FastAPI). With ``queued=True`` a request counts
as waiting until the app calls its ``start()`` (or its first token comes), for an app with a queue of
its own that may answer a stream's headers before a request leaves it. See docs/how-to/serving.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from openlora_otel.inference.metrics import exception_error_type
from openlora_otel.inference.openai_traffic import (
    MAX_REQUEST_BYTES,
    OPENAI_ROUTES,
    AdapterLookup,
    RequestFacts,
    ResponseReader,
    finish_quietly,
    inference_of,
    read_request,
    same_name,
)

if TYPE_CHECKING:
    from openlora_otel.inference.metrics import InferenceMetrics
    from openlora_otel.telemetry import Telemetry

__all__ = ["STATE_KEY", "OpenAIMetricsMiddleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_KEY = "openlora_inference"  # scope["state"][STATE_KEY]: the request's InferenceRequest



class OpenAIMetricsMiddleware:
    """Wrap ``app`` (ASGI 3); record each OpenAI request in ``inference`` (a ``Telemetry``, which the
    lifespan's shutdown then shuts down, or its ``telemetry.inference``). ``adapter``: the adapter of a
    request's ``model``, ``None`` for the base model (a request that names no model is ``other``); ``routes``: path -> ``gen_ai.operation.name`` of the routes to measure; ``queued``: the app
    queues requests and calls ``start()`` on the request in its scope when one leaves the queue."""

    def __init__(
        self,
        app: ASGIApp,
        inference: Telemetry | InferenceMetrics,
        *,
        adapter: Callable[[str], str | None] = same_name,
        routes: Mapping[str, str] = OPENAI_ROUTES,
        queued: bool = False,
    ) -> None:
        self.app = app
        self.inference, self._telemetry = inference_of(inference)
        self._adapter = AdapterLookup(adapter)
        self._routes = dict(routes)
        self._queued = queued

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "lifespan" and self._telemetry is not None:
            await self.app(scope, receive, self._shutting_down_after(send))
            return
        operation = self._routes.get(scope.get("path", "")) if scope.get("type") == "http" else None
        if operation is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        # The body first (bounded), to be handed to the app as it came.
        read: deque[Message] = deque()
        body = bytearray()
        while True:
            message = await receive()
            read.append(message)
            if message.get("type") != "http.request":
                break  # the client left before sending it all: not a request
            body += message.get("body", b"")
            if not message.get("more_body", False) or len(body) > MAX_REQUEST_BYTES:
                break
        complete = read[-1].get("type") == "http.request" and not read[-1].get("more_body", False)
        if read[-1].get("type") != "http.request":
            await self.app(scope, _replay(read, receive), send)
            return
        facts = read_request(bytes(body)) if complete else RequestFacts()
        record = self.inference.request(self._adapter(facts.model), operation=operation, queued=self._queued)
        scope.setdefault("state", {})[STATE_KEY] = record
        reader = ResponseReader(record)
        ended = [False]  # the last piece of the answer went out

        async def send_measured(message: Message) -> None:
            kind = message.get("type")
            if kind == "http.response.body":
                at = time.perf_counter()
                await send(message)
                try:
                    reader.body(message.get("body", b""), at)
                except Exception:
                    self._adapter.warn_once("body", "openlora-otel: reading an answer failed; its metrics may be incomplete")
                if not message.get("more_body", False):
                    ended[0] = True
                return
            if kind == "http.response.start":
                try:
                    reader.start(int(message.get("status", 200)), _content_type(message.get("headers", ())))
                except Exception:
                    self._adapter.warn_once("start", "openlora-otel: reading an answer's headers failed")
            await send(message)

        try:
            await self.app(scope, _replay(read, receive), send_measured)
        except BaseException as exc:
            finish_quietly(reader)
            record.end(error=exception_error_type(type(exc)))
            raise
        finish_quietly(reader)
        record.end(error=None if ended[0] else "cancelled")

    def _shutting_down_after(self, send: Send) -> Send:
        """``send`` for the lifespan: the app's shutdown done (or failed), the telemetry's final
        export or scrape (bounded), off the event loop where there is an asyncio one; then the server
        hears of it."""
        telemetry = self._telemetry

        async def sent(message: Message) -> None:
            if telemetry is not None and message.get("type") in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # another event loop (trio): the bounded shutdown here
                    telemetry.shutdown()
                else:
                    await loop.run_in_executor(None, telemetry.shutdown)
            await send(message)

        return sent



def _replay(read: deque[Message], receive: Receive) -> Receive:
    """``receive`` for the app: the messages already read, then the server's own."""

    async def replayed() -> Message:
        if read:
            return read.popleft()
        return await receive()

    return replayed


def _content_type(headers: Any) -> str:
    for name, value in headers:
        if bytes(name).lower() == b"content-type":
            return bytes(value).decode("latin-1")
    return ""


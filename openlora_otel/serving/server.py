"""``openlora-otel serve``: the saved demo model and its adapters over HTTP, every request measured.

FastAPI on uvicorn, on loopback by default. The protocol (the ``load`` command speaks it):

- ``POST /v1/completions`` with JSON ``{"model": <adapter name, or the base model's name>,
  "prompt": str (1..4000 characters), "max_tokens": int (1..limit, default 16), "stream": bool,
  "stop": str or up to 4 str (optional, as OpenAI's)}``; greedy decoding, to ``max_tokens``
  unless a stop string ends the text (the demo model has no end-of-text token). Answer: ``{"id", "object": "text_completion", "created", "model", "choices":
  [{"index": 0, "text", "finish_reason": "length"|"stop"}], "usage": {"prompt_tokens",
  "completion_tokens", "total_tokens"}}``. With ``"stream": true``: ``text/event-stream``, one
  ``data: <chunk>`` event per token (the chunk is the answer's shape with the new text), the
  last one with ``finish_reason`` and ``usage``, then ``data: [DONE]``.
- Errors: ``{"error": {"type", "message"}}``; 404 ``unknown_adapter``, 400 ``invalid_request``,
  503 ``overloaded`` (with ``Retry-After``), 500 with the exception's class name.
- ``GET /v1/models``: ``{"data": [{"id", "object": "model", "adapter": bool}]}``; ``GET /health``.

Concurrency: at most ``max_concurrency`` requests generate at once, each on a worker thread
(never on the event loop); up to ``max_queue`` more wait in FIFO order; beyond that a request is
refused at once with 503. A streaming client that disconnects cancels its request (counted as
``cancelled``) within one token. Every request goes through ``telemetry.inference`` (waiting,
running, time to first token, tokens, ``error.type``), every adapter load through
``inference.loading_adapter``; HTTP server metrics come from opentelemetry-instrumentation-fastapi
on the telemetry's meter provider.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from openlora_otel.demo.layout import SavedAdapter, SavedBase
from openlora_otel.inference.metrics import ADAPTER_OTHER, InferenceRequest
from openlora_otel.serving.limits import (
    DEFAULT_LIMITS,
    Limits,
    RequestLimits,
    http_protocol,
    inference_recorder,
)
from openlora_otel.serving.model import Cancelled, Completion, PromptError, ServedModels
from openlora_otel.telemetry import Telemetry

__all__ = [
    "MAX_PROMPT_CHARS",
    "MAX_TOKENS_LIMIT",
    "Admission",
    "Overloaded",
    "ServeOptions",
    "build_app",
    "serve",
]

_logger = logging.getLogger(__name__)

OPERATION = "text_completion"
MAX_PROMPT_CHARS = 4000
MAX_TOKENS_LIMIT = 512  # the protocol's ceiling for max_tokens; --max-new-tokens-limit may lower it
DEFAULT_MAX_TOKENS = 16
# OpenAI's limits for "stop"; ours are characters (one token each).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 32
# Seconds a 503 asks the client to wait: about one short completion on the demo model.
RETRY_AFTER_S = 1
# opentelemetry-instrumentation-fastapi 0.66b2 reports the old HTTP conventions unless this
# variable opts in: http.server.duration in ms with the client's Host header as a label (any
# client can mint new series), not http.server.request.duration in s by route. The serve
# command sets it to "http" when unset; "http/dup" reports both.
HTTP_SEMCONV_VARIABLE = "OTEL_SEMCONV_STABILITY_OPT_IN"
# After the shutdown grace, how long uvicorn still waits for connections before it cancels them.
SHUTDOWN_BACKSTOP_S = 5
HTTP_SEMCONV_DEFAULT = "http"


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_concurrency: int = 4
    max_queue: int = 64
    max_new_tokens_limit: int = MAX_TOKENS_LIMIT
    # After SIGTERM/SIGINT: how long in-flight requests may take to finish before they are cancelled.
    shutdown_timeout_s: float = 10.0
    # Body size, JSON depth, body and header read times, open connections (serving/limits.py).
    limits: Limits = DEFAULT_LIMITS


class Overloaded(Exception):
    """Every generation slot is busy and the queue is full."""


class Admission:
    """At most ``max_running`` requests run; up to ``max_waiting`` more wait (first come, first served).

    Used from the event loop only (no lock): :meth:`enter` decides at once (a slot, a place in
    the queue, or :class:`Overloaded`), so a streaming request can be refused with 503 before
    its response starts, and wait for its slot afterwards.
    """

    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: collections.deque[Ticket] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def enter(self) -> Ticket:
        ticket = Ticket(self)
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            ticket._granted.set()
        elif len(self._waiters) >= self.max_waiting:
            raise Overloaded()
        else:
            self._waiters.append(ticket)
        return ticket

    def _leave(self, ticket: Ticket) -> None:
        if ticket._granted.is_set():
            # The slot goes straight to the next waiter: no newcomer can overtake the queue.
            if self._waiters:
                self._waiters.popleft()._granted.set()
            else:
                self.running -= 1
        else:
            self._waiters.remove(ticket)


class Ticket:
    """One request's place: granted a slot, or waiting for one. :meth:`release` exactly once, when done."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._granted = asyncio.Event()
        self._released = False
        # The generation running on a worker thread, if it started: the slot is free when it ends.
        self.job: concurrent.futures.Future[Completion] | None = None

    async def wait(self) -> None:
        await self._granted.wait()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._leave(self)

    def release_when_done(self) -> None:
        """Release now, or when the worker thread ends (a cancelled request's thread runs up to one more token)."""
        job = self.job
        if job is None or job.done():
            self.release()
        # else: the job's done-callback releases it (see CompletionService._submit)


class _BadRequest(Exception):
    def __init__(self, status: int, error_type: str, message: str, adapter: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.adapter = adapter  # the metric's adapter value for the failed request


@dataclass(frozen=True)
class _Parsed:
    model: str
    adapter: str | None  # None: the base model
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    stop: tuple[str, ...]


def _error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": error_type, "message": message}}, status_code=status, headers=headers
    )


class CompletionService:
    """The completions endpoint's work: validation, admission, generation on worker threads, records."""

    def __init__(self, models: ServedModels, telemetry: Telemetry, options: ServeOptions) -> None:
        self.models = models
        self.inference = telemetry.inference
        self.options = options
        self.admission = Admission(options.max_concurrency, options.max_queue)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=options.max_concurrency, thread_name_prefix="openlora-serve-generate"
        )
        self._cancels: set[threading.Event] = set()
        self._stopping = False
        self._cancels_lock = threading.Lock()

    # -- request parsing ------------------------------------------------------------
    def parse(self, body: bytes) -> _Parsed:
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadRequest(
                400, "invalid_request", f"the body is not JSON ({exc})", ADAPTER_OTHER
            ) from None
        if not isinstance(payload, dict):
            raise _BadRequest(400, "invalid_request", "the body must be a JSON object", ADAPTER_OTHER)
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise _BadRequest(
                400,
                "invalid_request",
                f"'model' must be a non-empty string: an adapter name or {self.models.base_model!r}",
                ADAPTER_OTHER,
            )
        if model == self.models.base_model:
            adapter = None
        elif self.models.has_adapter(model):
            adapter = model
        else:
            served = ", ".join([self.models.base_model, *self.models.adapters])
            # A made-up name is recorded as "other": it must not take one of the capped adapter slots.
            raise _BadRequest(
                404,
                "unknown_adapter",
                f"model {model[:100]!r} is not served here (served: {served})",
                ADAPTER_OTHER,
            )
        prompt = payload.get("prompt")
        if not isinstance(prompt, str) or not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise _BadRequest(
                400,
                "invalid_request",
                f"'prompt' must be a string of 1 to {MAX_PROMPT_CHARS} characters",
                adapter,
            )
        limit = self.options.max_new_tokens_limit
        max_tokens = payload.get("max_tokens", DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= limit:
            raise _BadRequest(
                400,
                "invalid_request",
                f"'max_tokens' must be an integer from 1 to {limit}, got {max_tokens!r}",
                adapter,
            )
        stop = payload.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if (
            not isinstance(stop, list)
            or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(text, str) and 1 <= len(text) <= MAX_STOP_CHARS for text in stop)
        ):
            raise _BadRequest(
                400,
                "invalid_request",
                f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings of 1 to "
                f"{MAX_STOP_CHARS} characters",
                adapter,
            )
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise _BadRequest(
                400, "invalid_request", f"'stream' must be true or false, got {stream!r}", adapter
            )
        try:
            prompt_ids = self.models.encode(prompt)
        except PromptError as exc:
            raise _BadRequest(400, "invalid_request", f"'prompt': {exc}", adapter) from None
        return _Parsed(
            model=model,
            adapter=adapter,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stream=stream,
            stop=tuple(stop),
        )

    # -- generation -----------------------------------------------------------------
    def _submit(
        self,
        ticket: Ticket,
        record: InferenceRequest,
        parsed: _Parsed,
        on_piece: Callable[[str | None], object] | None,
    ) -> tuple[concurrent.futures.Future[Completion], threading.Event]:
        """Start the generation on a worker thread. ``on_piece`` (from that thread) gets each piece of
        text, then None when the generation has ended, however it ended."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        first = True

        def on_token(piece: str) -> None:
            nonlocal first
            if first:
                first = False
                record.first_token()
            if on_piece is not None and piece:
                on_piece(piece)

        def job() -> Completion:
            try:
                return self.models.generate(
                    parsed.adapter,
                    parsed.prompt_ids,
                    parsed.max_tokens,
                    stop=parsed.stop,
                    on_token=on_token,
                    cancelled=cancel.is_set,
                )
            finally:
                with self._cancels_lock:
                    self._cancels.discard(cancel)
                if on_piece is not None:
                    on_piece(None)

        def done(_: object) -> None:
            # The slot is free once the thread is: a cancelled generation runs to its next token.
            with contextlib.suppress(RuntimeError):  # the loop is gone: the process is stopping
                loop.call_soon_threadsafe(ticket.release)

        with self._cancels_lock:
            self._cancels.add(cancel)
            if self._stopping:
                cancel.set()  # a queued request that got its slot after the grace time: it ends at once
        record.start()
        ticket.job = self._executor.submit(job)
        ticket.job.add_done_callback(done)
        return ticket.job, cancel

    def _response(
        self, parsed: _Parsed, request_id: str, created: int, completion: Completion
    ) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": parsed.model,
            "choices": [{"index": 0, "text": completion.text, "finish_reason": completion.finish_reason}],
            "usage": _usage(completion),
        }

    async def complete(self, request: Request) -> Response:
        body = await request.body()
        try:
            parsed = self.parse(body)
        except _BadRequest as bad:
            self.inference.request(adapter=bad.adapter, operation=OPERATION).end(error=bad.error_type)
            return _error(bad.status, bad.error_type, bad.message)
        record = self.inference.request(adapter=parsed.adapter, operation=OPERATION, queued=True)
        try:
            ticket = self.admission.enter()
        except Overloaded:
            record.end(error="overloaded")
            return _error(
                503,
                "overloaded",
                f"{self.admission.max_running} requests are running and {self.admission.max_waiting} waiting; "
                f"retry in {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if parsed.stream:
            return _EventStream(self._stream(parsed, record, ticket, request_id, created))
        cancel: threading.Event | None = None
        try:
            await ticket.wait()
            job, cancel = self._submit(ticket, record, parsed, on_piece=None)
            completion = await asyncio.wrap_future(job)
        except BaseException as exc:
            # Cancelled: the server is stopping (uvicorn cancels what outlived its grace time, and
            # close() cancels the generations); a client that disconnects is not noticed before the end.
            if cancel is not None:
                cancel.set()
            cancelled = isinstance(exc, (asyncio.CancelledError, Cancelled))
            record.end(error="cancelled" if cancelled else type(exc).__name__)
            ticket.release_when_done()
            if isinstance(exc, Cancelled):
                return _error(503, "cancelled", "the server is stopping")
            if not isinstance(exc, Exception):
                raise
            _logger.error("generation failed", exc_info=exc)
            return _error(500, type(exc).__name__, f"generation failed: {exc}")
        record.tokens(input=completion.prompt_tokens, output=completion.completion_tokens)
        record.end()
        return JSONResponse(self._response(parsed, request_id, created, completion))

    async def _stream(
        self, parsed: _Parsed, record: InferenceRequest, ticket: Ticket, request_id: str, created: int
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        cancel: threading.Event | None = None
        finished = False

        def chunk(text: str, finish_reason: str | None = None, completion: Completion | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": parsed.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
            }
            if completion is not None:
                data["usage"] = _usage(completion)
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        try:
            await ticket.wait()
            job, cancel = self._submit(
                ticket,
                record,
                parsed,
                on_piece=lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece),
            )
            # The worker's pieces arrive in order, then None when it has ended (see _submit).
            while (piece := await pieces.get()) is not None:
                yield chunk(piece)
            try:
                completion = await asyncio.wrap_future(job)
            except Cancelled:
                # The server is stopping and the grace time is over: say so, and end the stream cleanly.
                record.fail("cancelled")
                error = {"error": {"type": "cancelled", "message": "the server is stopping"}}
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
                finished = True
                return
            except Exception as exc:
                _logger.error("generation failed", exc_info=exc)
                record.fail(type(exc).__name__)
                error = {"error": {"type": type(exc).__name__, "message": f"generation failed: {exc}"}}
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
                finished = True
                return
            record.tokens(input=completion.prompt_tokens, output=completion.completion_tokens)
            yield chunk("", completion.finish_reason, completion)
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                # The client went away (or the server is stopping) before the last event.
                if cancel is not None:
                    cancel.set()
                record.fail("cancelled")
            record.end()
            ticket.release_when_done()

    def cancel_all(self) -> None:
        """Stop every generation at its next token, and any that would start later (the server is stopping).

        Safe from any thread. Their requests end with ``cancelled``: a 503, or an error event in the stream.
        """
        with self._cancels_lock:
            self._stopping = True
            for cancel in self._cancels:
                cancel.set()

    def close(self) -> None:
        """Cancel every generation still running and wait for the worker threads (each stops within a token)."""
        self.cancel_all()
        self._executor.shutdown(wait=True, cancel_futures=True)


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends.

    Starlette stops iterating when the client disconnects, but a generator suspended at a
    ``yield`` at that moment would only be finalized by the garbage collector: closing it here
    runs its ``finally`` (cancel the generation, record ``cancelled``, free the slot) at once.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


def build_app(service: CompletionService, telemetry: Telemetry) -> FastAPI:
    """The FastAPI application, with the ASGI HTTP metrics on ``telemetry``'s meter provider."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.trace import NoOpTracerProvider

    app = FastAPI(title="openlora-otel serve", docs_url=None, redoc_url=None, openapi_url=None)
    models = service.models

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.complete(request)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [{"id": models.base_model, "object": "model", "adapter": False}]
        data += [{"id": name, "object": "model", "adapter": True} for name in models.adapters]
        return {"data": data}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # Inside the HTTP instrumentation's middleware: refusals made before the route runs are measured.
    app.add_middleware(
        RequestLimits,
        limits=service.options.limits,
        on_refusal=inference_recorder(telemetry.inference, {"/v1/completions": OPERATION}),
    )
    # Metrics only: spans would go to no tracer. Even no-op spans cost: the per-message "send" and
    # "receive" spans are a fifth of the instrumentation's CPU per streamed request
    # (benchmarks/bench_inference_request.py), so they are not made at all.
    FastAPIInstrumentor.instrument_app(
        app,
        meter_provider=telemetry.meter_provider,
        tracer_provider=NoOpTracerProvider(),
        exclude_spans=["receive", "send"],
    )
    return app


def load_models(
    base: SavedBase, adapters: list[SavedAdapter], telemetry: Telemetry, err: TextIO, *, device: str = "auto"
) -> ServedModels:
    """The base model and every adapter that loads, on ``device``; a failed adapter is recorded, said, and left out."""
    inference = telemetry.inference
    inference.set_model(base.base_model, operation=OPERATION)
    models = ServedModels(base, device=device)
    for adapter in adapters:
        try:
            with inference.loading_adapter(adapter.name):
                models.load_adapter(adapter)
        except Exception as exc:
            print(
                f"openlora-otel serve: adapter {adapter.name!r} from {adapter.path} did not load "
                f"({type(exc).__name__}: {exc}); serving without it",
                file=err,
                flush=True,
            )
    return models


class _Server:
    """uvicorn's server whose SIGINT/SIGTERM only ask it to stop: the signal is not raised again afterwards.

    (uvicorn re-raises a captured signal once it has stopped, which would end the process before
    the in-flight generations are joined and the telemetry's final values are delivered.)
    """

    def __init__(self, config: Any, on_stop: Callable[[], object]) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            stopped_by: str | None = None

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {
                    sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
                }
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

            def handle_exit(self, sig: int, frame: Any) -> None:
                if self.stopped_by is None:
                    self.stopped_by = signal.Signals(sig).name
                    on_stop()
                super().handle_exit(sig, frame)

        self.server = Server(config)

    def run(self, sockets: list[socket.socket]) -> str | None:
        self.server.run(sockets=sockets)
        return self.server.stopped_by


def listen(host: str, port: int) -> socket.socket:
    """The listening socket (bound before the models load, so a busy port fails fast); OSError as it comes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    # Nagle off for every connection accepted from it (they inherit the option). asyncio turns it off
    # only on sockets made with proto IPPROTO_TCP, and create_server leaves proto 0: a streamed
    # response's first small event on a kept-alive connection waited for the ACK of the last one, so
    # clients saw a first token later than the server's own time-to-first-token said.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(
    base: SavedBase,
    adapters: list[SavedAdapter],
    telemetry: Telemetry,
    options: ServeOptions,
    sock: socket.socket,
    *,
    out: TextIO = sys.stderr,
    device: str = "auto",
) -> int:
    """Load the models on ``device``, serve until SIGINT/SIGTERM, then finish or cancel what runs (bounded).

    0 when stopped. The caller owns ``telemetry`` (and shuts it down after this returns) and ``sock``.
    """
    import uvicorn

    started = time.perf_counter()
    models = load_models(base, adapters, telemetry, out, device=device)
    service = CompletionService(models, telemetry, options)
    app = build_app(service, telemetry)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        # uvicorn's protocol plus a header timeout and a cap on open connections (serving/limits.py).
        http=http_protocol(options.limits, telemetry.meter_provider),
        # A backstop only: our own timer cancels the generations at shutdown_timeout_s (below), and
        # their responses then end cleanly; uvicorn cancels what is still open (a client that does
        # not read) a few seconds later.
        timeout_graceful_shutdown=math.ceil(options.shutdown_timeout_s) + SHUTDOWN_BACKSTOP_S,
    )

    def on_stop() -> None:
        # After SIGINT/SIGTERM in-flight requests have shutdown_timeout_s to finish.
        timer = threading.Timer(options.shutdown_timeout_s, service.cancel_all)
        timer.daemon = True
        timer.start()

    server = _Server(config, on_stop)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    served = ", ".join(models.adapters) or "none"
    print(
        f"openlora-otel serve: {models.base_model} with adapters: {served} on {models.placement.name} "
        f"({models.placement.precision}); loaded in "
        f"{time.perf_counter() - started:.1f} s; listening on http://{where}:{port} "
        f"(POST /v1/completions, GET /v1/models, GET /health); metrics: "
        f"{telemetry.where_metrics_go()}; Ctrl-C or SIGTERM stops",
        file=out,
        flush=True,
    )
    try:
        stopped_by = server.run([sock])
    finally:
        service.close()
    print(f"openlora-otel serve: stopped{f' by {stopped_by}' if stopped_by else ''}", file=out, flush=True)
    return 0

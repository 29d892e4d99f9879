"""``openlora-otel serve``: the saved demo model and its adapters over HTTP, every request measured.

FastAPI on uvicorn, on loopback by default, speaking OpenAI's protocol (:mod:`.protocol`). At most
``max_concurrency`` requests generate at once, each on a worker thread (never on the event loop), up
to ``max_queue`` more wait, and beyond that a request gets 503 at once. Every request is measured
in ``telemetry.inference`` by the ASGI middleware any server can use
(:class:`~openlora_otel.inference.asgi.OpenAIMetricsMiddleware`), from the traffic itself; the routes
add what only they know (when a request leaves the queue, when its first token is generated, its
exact tokens) to the request the middleware made. Every adapter load goes through
``inference.loading_adapter``.
See docs/how-to/serving.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import secrets
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
from starlette.exceptions import HTTPException as StarletteHTTPException

from openlora_otel.inference.asgi import STATE_KEY, OpenAIMetricsMiddleware
from openlora_otel.inference.metrics import ADAPTER_OTHER, InferenceRequest
from openlora_otel.model.layout import SavedAdapter, SavedBase
from openlora_otel.serving import protocol
from openlora_otel.serving.limits import (
    DEFAULT_LIMITS,
    AcceptErrorLog,
    Limits,
    RequestLimits,
    http_protocol,
    inference_recorder,
)
from openlora_otel.serving.model import Cancelled, Completion, Sampling, ServedModels
from openlora_otel.serving.protocol import (
    CHAT,
    COMPLETION,
    MAX_PROMPT_CHARS,
    MAX_TOKENS_LIMIT,
    Parsed,
    ProtocolError,
)
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
    # A chat's max_tokens when it gives none; None: max_new_tokens_limit (OpenAI's is the model's limit).
    chat_default_max_tokens: int | None = None
    # After SIGTERM/SIGINT: how long in-flight requests may take to finish before they are cancelled.
    shutdown_timeout_s: float = 10.0
    # Body size, JSON depth, body and header read times, open connections (serving/limits.py).
    limits: Limits = DEFAULT_LIMITS
    # The routes tell the middleware's request what only they know (queue, first token, tokens); off:
    # the middleware measures from the traffic alone, as around an app that says nothing (a test and
    # the benchmark compare the two).
    route_hints: bool = True


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
        self.job: concurrent.futures.Future[list[Completion]] | None = None

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


class _Unmeasured:
    """Takes the routes' hints and keeps none (``route_hints`` off, or no middleware in front)."""

    def start(self) -> None: ...

    def first_token(self, at: float | None = None) -> None: ...

    def tokens(self, input: int | None = None, output: int | None = None) -> None: ...

    def fail(self, error_type: str | None) -> None: ...


_UNMEASURED = _Unmeasured()


class CompletionService:
    """The generation endpoints' work: validation, admission, generation on worker threads, records."""

    def __init__(self, models: ServedModels, telemetry: Telemetry, options: ServeOptions) -> None:
        self.models = models
        self.options = options
        self.created = int(time.time())  # the models' "created": when this server loaded them
        self.admission = Admission(options.max_concurrency, options.max_queue)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=options.max_concurrency, thread_name_prefix="openlora-serve-generate"
        )
        self._cancels: set[threading.Event] = set()
        self._stopping = False
        self._cancels_lock = threading.Lock()

    def parse(self, body: bytes, operation: str = COMPLETION) -> Parsed:
        return protocol.parse(
            body, operation, self.models, self.options.max_new_tokens_limit, self.options.chat_default_max_tokens
        )

    # -- generation -----------------------------------------------------------------
    def _sampling(self, parsed: Parsed) -> Sampling | None:
        """None (greedy) at temperature 0; else a CPU generator seeded by the request's seed (or at random)."""
        if parsed.temperature == 0:
            return None
        generator = self.models.torch.Generator()
        seed = secrets.randbits(63) if parsed.seed is None else parsed.seed
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # torch takes 64-bit seeds; negative ones wrap
        return Sampling(temperature=parsed.temperature, top_p=parsed.top_p, generator=generator)

    def _submit(
        self,
        ticket: Ticket,
        record: InferenceRequest | _Unmeasured,
        parsed: Parsed,
        on_piece: Callable[[tuple[int, str] | None], object] | None,
    ) -> tuple[concurrent.futures.Future[list[Completion]], threading.Event]:
        """Start the generation of the request's ``n`` choices, one after another, on a worker thread.
        ``on_piece`` (from that thread) gets (choice index, text) for each piece of text, then None when
        the generation has ended, however it ended."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        first = True
        sampling = self._sampling(parsed)

        def job() -> list[Completion]:
            completions = []
            try:
                for index in range(parsed.n):

                    def on_token(piece: str, index: int = index) -> None:
                        nonlocal first
                        if first:
                            first = False
                            record.first_token()
                        if on_piece is not None and piece:
                            on_piece((index, piece))

                    completions.append(
                        self.models.generate(
                            parsed.adapter,
                            parsed.prompt_ids,
                            parsed.max_tokens,
                            stop=parsed.stop,
                            sampling=sampling,
                            on_token=on_token,
                            cancelled=cancel.is_set,
                        )
                    )
                return completions
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

    def _record(self, request: Request) -> InferenceRequest | _Unmeasured:
        """The request the middleware measures (the routes' hints go to it), or a stand-in that takes
        none (``route_hints`` off)."""
        if not self.options.route_hints:
            return _UNMEASURED
        return request.scope.get("state", {}).get(STATE_KEY) or _UNMEASURED

    async def complete(self, request: Request, operation: str = COMPLETION) -> Response:
        """POST /v1/completions (``operation`` COMPLETION) or /v1/chat/completions (CHAT). Every answer,
        refusals too, is measured by the middleware from what it says (an error's ``code`` is its
        ``error.type``)."""
        record = self._record(request)
        body = await request.body()
        try:
            parsed = self.parse(body, operation)
        except ProtocolError as bad:
            return _error(bad.status, bad.code, bad.message, bad.param)
        try:
            ticket = self.admission.enter()
        except Overloaded:
            return _error(
                503,
                "overloaded",
                f"{self.admission.max_running} requests are running and {self.admission.max_waiting} waiting; "
                f"retry in {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        request_id = protocol.request_id(operation, lambda: uuid.uuid4().hex[:24])
        created = int(time.time())
        if parsed.stream:
            return _EventStream(self._stream(parsed, record, ticket, request_id, created))
        cancel: threading.Event | None = None
        try:
            await ticket.wait()
            job, cancel = self._submit(ticket, record, parsed, on_piece=None)
            completions = await asyncio.wrap_future(job)
        except BaseException as exc:
            # Cancelled: the server is stopping (uvicorn cancels what outlived its grace time, and
            # close() cancels the generations); a client that disconnects is not noticed before the end.
            if cancel is not None:
                cancel.set()
            ticket.release_when_done()
            if isinstance(exc, Cancelled):
                return _error(503, "cancelled", "the server is stopping")
            if not isinstance(exc, Exception):
                raise
            _logger.error("generation failed", exc_info=exc)
            return _error(500, type(exc).__name__, f"generation failed: {exc}")
        used = _usage(parsed, completions)
        record.tokens(input=used["prompt_tokens"], output=used["completion_tokens"])
        choices = [(c.text, c.finish_reason) for c in completions]
        return JSONResponse(protocol.response(parsed, request_id, created, choices, used))

    async def _stream(
        self, parsed: Parsed, record: InferenceRequest | _Unmeasured, ticket: Ticket, request_id: str, created: int
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        cancel: threading.Event | None = None
        finished = False
        chat = parsed.operation == CHAT
        started: set[int] = set()  # choices whose first chunk (a chat one carries the role) is out

        def chunk(index: int, text: str, finish_reason: str | None = None) -> bytes:
            first = index not in started
            started.add(index)
            return protocol.chunk(parsed, request_id, created, index, text, finish_reason, first=first)

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
                yield chunk(*piece)
            try:
                completions = await asyncio.wrap_future(job)
            except Exception as exc:
                # Cancelled: the server is stopping and the grace time is over: say so, and end the stream cleanly.
                if isinstance(exc, Cancelled):
                    code, message = "cancelled", "the server is stopping"
                else:
                    _logger.error("generation failed", exc_info=exc)
                    code, message = type(exc).__name__, f"generation failed: {exc}"
                record.fail(code)
                yield protocol.event(protocol.error_body(503 if code == "cancelled" else 500, code, message))
                finished = True
                return
            used = _usage(parsed, completions)
            record.tokens(input=used["prompt_tokens"], output=used["completion_tokens"])
            for index, completion in enumerate(completions):
                if chat and index not in started:
                    yield chunk(index, "")  # a chat choice that said nothing still gets its role
                yield chunk(index, "", completion.finish_reason)
            if parsed.include_usage:
                yield protocol.usage_chunk(parsed, request_id, created, used)
            yield protocol.event("[DONE]")
            finished = True
        finally:
            if not finished:
                # The client went away (or the server is stopping) before the last event.
                if cancel is not None:
                    cancel.set()
                record.fail("cancelled")
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


def _usage(parsed: Parsed, completions: list[Completion]) -> dict[str, int]:
    # The prompt is read once for all n choices (as OpenAI counts it); every choice's tokens count.
    return protocol.usage(len(parsed.prompt_ids), sum(c.completion_tokens for c in completions))


def _error(
    status: int, code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(protocol.error_body(status, code, message, param), status_code=status, headers=headers)


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


def _adapter_of(models: ServedModels) -> Callable[[str], str | None]:
    """The middleware's adapter hook: the base model's name is the base, a served adapter's is itself,
    any other name ``other`` (a made-up name never takes one of the capped adapter slots)."""

    def adapter(model: str) -> str | None:
        if model == models.base_model:
            return None
        return model if models.has_adapter(model) else ADAPTER_OTHER

    return adapter


def build_app(service: CompletionService, telemetry: Telemetry) -> FastAPI:
    """The FastAPI application, with the ASGI HTTP metrics on ``telemetry``'s meter provider."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.trace import NoOpTracerProvider

    app = FastAPI(title="openlora-otel serve", docs_url=None, redoc_url=None, openapi_url=None)
    models = service.models

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.complete(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.complete(request, CHAT)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        names = [models.base_model, *models.adapters]
        return {"object": "list", "data": [protocol.model_entry(n, models.base_model, service.created) for n in names]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> Response:
        if name != models.base_model and not models.has_adapter(name):
            return _error(404, "unknown_adapter", f"model {name[:100]!r} is not served here", "model")
        return JSONResponse(protocol.model_entry(name, models.base_model, service.created))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # An unknown path or method answers in OpenAI's error shape too, not FastAPI's {"detail"}.
        return _error(exc.status_code, f"http_{exc.status_code}", str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        # A failure no route caught still answers in OpenAI's error shape (clients parse `error`), and
        # says nothing of the exception: its text may hold a path or the prompt. Starlette logs the
        # traceback after this response is sent.
        return _error(500, "internal_error", "the server failed on this request; its log says why")

    # The serving metrics, from the traffic (and the routes' hints), inside the limits below: a body is
    # read under their size and time limits, and what they refuse is recorded by on_refusal.
    app.add_middleware(
        OpenAIMetricsMiddleware,
        inference=telemetry.inference,
        adapter=_adapter_of(models),
        routes={"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT},
        queued=service.options.route_hints,
    )
    # Inside the HTTP instrumentation's middleware: refusals made before the route runs are measured.
    app.add_middleware(
        RequestLimits,
        limits=service.options.limits,
        on_refusal=inference_recorder(
            telemetry.inference, {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
        ),
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
    inference.set_model(base.base_model, operation=COMPLETION)
    models = ServedModels(base, device=device)
    for adapter in adapters:
        try:
            with inference.loading_adapter(adapter.name, trained_by=adapter.origin(base)):
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
    """uvicorn's server whose SIGINT/SIGTERM only ask it to stop: the signal is not raised again afterwards,
    and whose event loop logs accept() failures past the open files limit once per interval
    (:class:`~openlora_otel.serving.limits.AcceptErrorLog`).

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

            async def serve(self, sockets: list[socket.socket] | None = None) -> None:
                # Past the open files limit: one warning per interval, not a traceback per failed accept().
                asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
                await super().serve(sockets)

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
        f"(POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health); metrics: "
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

"""WSGI middleware: the serving metrics of an OpenAI-compatible WSGI app (Flask, Django, any WSGI
callable), read from its own traffic; the twin of :mod:`openlora_otel.inference.asgi`::

    telemetry = setup_telemetry("my-server")
    app.wsgi_app = OpenAIMetricsWSGIMiddleware(app.wsgi_app, telemetry.inference)   # Flask

Each ``POST`` to one of OpenAI's routes is one request: the body is read first (up to 1 MiB; the app
then reads the same bytes from ``wsgi.input``, the rest of a longer body after them), its ``model``
mapped to the adapter by the ``adapter`` hook; the answer is read as the server takes each piece of
it (a streamed answer is a generator: each piece is read after the server has written it, never
before). A server that closes the answer before its end (the client went away) makes it
``cancelled``; an app that raises, the exception's type. What is read, and the bounds, are those of
:mod:`openlora_otel.inference.openai_traffic`. The request is ``environ["openlora.inference"]`` for an
app that wants to add to it (``start()``, ``first_token()``, ``tokens()``).

Under a server with several worker processes each worker has its own ``telemetry``: see
docs/how-to/serving.md for the pull endpoint per worker and the OTLP push.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from openlora_otel.inference.metrics import (
    InferenceRequest,
    exception_error_type,
)
from openlora_otel.inference.openai_traffic import (
    MAX_REQUEST_BYTES,
    OPENAI_ROUTES,
    AdapterLookup,
    ResponseReader,
    finish_quietly,
    inference_of,
    read_request,
    same_name,
)

if TYPE_CHECKING:
    from openlora_otel.inference.metrics import InferenceMetrics
    from openlora_otel.telemetry import Telemetry

__all__ = ["ENVIRON_KEY", "OpenAIMetricsWSGIMiddleware"]

ENVIRON_KEY = "openlora.inference"  # environ[ENVIRON_KEY]: the request's InferenceRequest
WSGIApp = Callable[[dict, Callable[..., Any]], Iterable[bytes]]



class _Prefixed(io.RawIOBase):
    """``wsgi.input`` for the app: the bytes already read, then the rest of the server's stream."""

    def __init__(self, head: bytes, rest: Any, remaining: int | None) -> None:
        self._head = io.BytesIO(head)
        self._rest = rest
        self._remaining = remaining  # bytes the server still holds (None: unknown, read to its end)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        data = self._head.read(size if size is not None and size >= 0 else -1)
        if size is not None and 0 <= size <= len(data):
            return data
        want = -1 if size is None or size < 0 else size - len(data)
        if self._remaining is not None:
            want = self._remaining if want < 0 else min(want, self._remaining)
            if want == 0:
                return data
        more = self._rest.read(want) if want >= 0 else self._rest.read()
        if self._remaining is not None:
            self._remaining -= len(more)
        return data + more

    def readline(self, size: int | None = -1) -> bytes:
        line = self._head.readline(size if size is not None and size >= 0 else -1)
        if line.endswith(b"\n") or (size is not None and 0 <= size <= len(line)):
            return line
        rest = self._rest.readline() if self._remaining is None else self._rest.readline(self._remaining)
        if self._remaining is not None:
            self._remaining -= len(rest)
        return line + rest


class OpenAIMetricsWSGIMiddleware:
    """Wrap the WSGI ``app``; record each OpenAI request in ``inference`` (``setup_telemetry()``'s
    Telemetry or its ``telemetry.inference``: WSGI has no lifespan, and a gunicorn worker ends
    through ``atexit``, which shuts the telemetry down). ``adapter``, ``routes``: as
    :class:`~openlora_otel.inference.asgi.OpenAIMetricsMiddleware`'s."""

    def __init__(
        self,
        app: WSGIApp,
        inference: Telemetry | InferenceMetrics,
        *,
        adapter: Callable[[str], str | None] = same_name,
        routes: Mapping[str, str] = OPENAI_ROUTES,
    ) -> None:
        self.app = app
        self.inference, _ = inference_of(inference)
        self._adapter = AdapterLookup(adapter)
        self._routes = dict(routes)

    def __call__(self, environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:
        operation = self._routes.get(environ.get("PATH_INFO", ""))
        if operation is None or environ.get("REQUEST_METHOD") != "POST":
            return self.app(environ, start_response)
        stream = environ["wsgi.input"]
        try:
            length: int | None = int(environ.get("CONTENT_LENGTH") or "")
        except ValueError:
            length = None  # chunked, or not said: read to the stream's end
        head = stream.read(min(length, MAX_REQUEST_BYTES + 1) if length is not None else MAX_REQUEST_BYTES + 1)
        remaining = None if length is None else max(0, length - len(head))
        environ["wsgi.input"] = io.BufferedReader(_Prefixed(head, stream, remaining))
        facts = read_request(head) if len(head) <= MAX_REQUEST_BYTES else read_request(b"")
        record = self.inference.request(self._adapter(facts.model), operation=operation)
        environ[ENVIRON_KEY] = record
        reader = ResponseReader(record)

        def start_measured(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            try:
                content_type = next((v for k, v in headers if k.lower() == "content-type"), "")
                reader.start(int(status.split(" ", 1)[0]), content_type)
            except Exception:
                self._adapter.warn_once("start", "openlora-otel: reading an answer's status failed")
            return start_response(status, headers, exc_info) if exc_info is not None else start_response(status, headers)

        try:
            result = self.app(environ, start_measured)
        except BaseException as exc:
            finish_quietly(reader)
            record.end(error=exception_error_type(type(exc)))
            raise
        return _Answer(result, reader, record, self._adapter.warn_once)


class _Answer:
    """The app's answer, passed to the server piece by piece, each read after the server took it."""

    def __init__(self, result: Iterable[bytes], reader: ResponseReader, record: InferenceRequest, warn: Any) -> None:
        self._result = result
        self._reader = reader
        self._record = record
        self._warn = warn
        self._ended = False

    def __iter__(self) -> Iterator[bytes]:
        error: str | None = "cancelled"  # unless the answer runs to its end
        try:
            for piece in self._result:
                at = time.perf_counter()
                yield piece
                try:
                    self._reader.body(piece, at)
                except Exception:
                    self._warn("body", "openlora-otel: reading an answer failed; its metrics may be incomplete")
            error = None
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exception_error_type(type(exc))
            raise
        finally:
            self._end(error)

    def _end(self, error: str | None) -> None:
        if not self._ended:
            self._ended = True
            finish_quietly(self._reader)
            self._record.end(error=error)

    def close(self) -> None:
        """The server is done with the answer (WSGI): the app's ``close()``, then the request ends
        (``cancelled`` if the answer was not read to its end)."""
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            self._end("cancelled")


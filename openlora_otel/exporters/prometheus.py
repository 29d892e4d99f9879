"""Prometheus pull endpoint: a ``/metrics`` HTTP server on a background thread.

The reader (:class:`~openlora_otel.exporters.exposition.PullReader`) collects at each scrape and
writes the text formats itself, so the endpoint shows this run's metrics alone and can be rebuilt in
one process. The server is ours, not ``start_http_server``, to behave at a run's
edges: bounded connections, a ``close()`` that joins its threads, a count of completed scrapes for
the final-scrape wait (:meth:`PrometheusEndpoint.wait_for_scrape`), sockets dropped in forked
children. See docs/concepts/lifecycle.md (The pull endpoint).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import gzip
import itertools
import logging
import os
import selectors
import socket
import socketserver
import threading
import time
import weakref
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from prometheus_client.exposition import gzip_accepted

from openlora_otel.config import (
    DEFAULT_PROMETHEUS_PORT,
    PROMETHEUS_PORT_VARIABLE,
    ConfigError,
    TelemetryConfig,
)
from openlora_otel.exporters.exposition import PullReader
from openlora_otel.names import LOCAL_RANK_ATTRIBUTE

if TYPE_CHECKING:
    from openlora_otel.exporters.discovery import FileSdRegistration

__all__ = [
    "CONNECTION_TIMEOUT_S",
    "IDLE_THREADS",
    "IDLE_WAIT_S",
    "KEEP_ALIVE_IDLE_S",
    "KEEP_ALIVE_MAX",
    "MAX_CONNECTIONS",
    "PortInUseError",
    "PrometheusEndpoint",
    "build_prometheus",
]

_logger = logging.getLogger(__name__)

# A scrape request arrives within milliseconds of connecting; anything slower is
# a stuck or idle client, and holding its thread longer buys nothing.
CONNECTION_TIMEOUT_S = 10.0
# Prometheus 2 and 3 and vmagent keep a target's connection open between scrapes (HTTP/1.1
# keep-alive), which halves what a scrape costs the endpoint's process (docs/benchmarks.md). A kept
# connection waits this long for the next request (Prometheus's default interval is 1 min; vmagent
# keeps its connections two intervals), on a thread of its own that sleeps meanwhile...
KEEP_ALIVE_IDLE_S = 120.0
# ...and at most this many are kept: with more connections open, each answer closes its connection,
# so idle ones can never hold every slot below.
KEEP_ALIVE_MAX = 8
# A few scrapers, curl and a browser fit well within this. Connections beyond it are closed at once.
MAX_CONNECTIONS = 32
# A thread that served a connection waits this long for the next one, and at most this many wait:
# a scraper's next scrape (every 15 s or so) then finds one; more threads end with their connection.
IDLE_WAIT_S = 60.0
IDLE_THREADS = 2

class PortInUseError(ConfigError):
    """The Prometheus port cannot be bound; the message says which setting chose it and what to do."""

    def __init__(self, config: TelemetryConfig, error: OSError) -> None:
        host, port = config.prometheus_host, config.prometheus_port
        offset = config.prometheus_port_offset
        if config.prometheus_port_explicit:
            origin = f"{offset.setting if offset else PROMETHEUS_PORT_VARIABLE}={port}"
        elif offset:
            origin = (
                f"port {port}, the default {DEFAULT_PROMETHEUS_PORT} + {offset.variable} "
                f"({PROMETHEUS_PORT_VARIABLE} is not set)"
            )
        else:
            origin = f"the default port {port} ({PROMETHEUS_PORT_VARIABLE} is not set)"
        super().__init__("OTEL_EXPORTER_PROMETHEUS_PORT", port, "a port that is free on " + host)
        message = f"cannot serve metrics on {host}:{port}, chosen by {origin}: {error.strerror or error}. "
        if error.errno == errno.EADDRINUSE:
            message += (
                "Another process holds that port (an earlier run still exiting, or another rank or node "
                "on this host). "
            )
            under_torchrun = LOCAL_RANK_ATTRIBUTE in config.resource_attributes
            if under_torchrun and not (offset and offset.variable == "RANK"):
                message += (
                    "Several torchrun nodes on one host repeat the same LOCAL_RANK numbers: give each node "
                    f"its own base port ({PROMETHEUS_PORT_VARIABLE}={DEFAULT_PROMETHEUS_PORT} on node 0, "
                    f"{DEFAULT_PROMETHEUS_PORT + 8} on node 1, ...: {DEFAULT_PROMETHEUS_PORT} + 8 x node rank with up to 8 "
                    "ranks a node) or set OPENLORA_PROMETHEUS_PORT_OFFSET=rank (base port + global "
                    "RANK). "
                )
        elif error.errno == errno.EACCES:
            message += "Ports below 1024 need privileges. "
        message += (
            "Set OTEL_EXPORTER_PROMETHEUS_PORT to a free port, or to 0 for any free port "
            "(telemetry.prometheus_url then says which)"
        )
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0])


class _Handler(BaseHTTPRequestHandler):
    """Serves the metrics on every GET path, as prometheus_client's handler does."""

    server: _Server
    # StreamRequestHandler applies it to the socket: every read waits at most this long (between
    # requests on a kept connection, KEEP_ALIVE_IDLE_S).
    timeout = CONNECTION_TIMEOUT_S
    server_version = "openlora-otel"
    # Persistent connections, as HTTP/1.1 clients expect; HTTP/1.0 clients are answered and closed.
    protocol_version = "HTTP/1.1"

    def handle(self) -> None:
        """Answer requests until the connection closes, waiting up to KEEP_ALIVE_IDLE_S for each next one."""
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection and self._next_request_came():
            self.handle_one_request()

    def _next_request_came(self) -> bool:
        try:
            self.connection.settimeout(KEEP_ALIVE_IDLE_S)
            came = bool(self.rfile.peek(1))  # b"" when the client closed
            self.connection.settimeout(self.timeout)  # the rest of the request: as the first
        except OSError:  # timed out, reset, or shut by close()
            return False
        return came

    def do_GET(self) -> None:
        started = time.monotonic()
        try:
            names = parse_qs(urlparse(self.path).query).get("name[]") if "?" in self.path else None
            output, content_type = self.server.reader.scrape(self.headers.get("Accept"), names)
        except Exception:
            # A collection that fails must not take the server down or print a
            # traceback per scrape: answer 500 and say why once.
            self.server.collection_failed()
            self._send(500, "text/plain; charset=utf-8", b"collecting metrics failed; see the process log\n")
            return
        headers = []
        if gzip_accepted(self.headers.get("Accept-Encoding")):
            output = gzip.compress(output)
            headers.append(("Content-Encoding", "gzip"))
        scraper = _is_scraper(self.headers)
        if scraper:
            # Counted before the answer goes out: a scraper that has read it must never find
            # the count still at zero (shutdown would then skip the final-scrape wait).
            self.server.scrape_started(started)
        if self._send(200, content_type, output, headers) and scraper:
            self.server.scraped(started)

    def _send(self, status: int, content_type: str, body: bytes, headers: list[tuple[str, str]] = ()) -> bool:  # type: ignore[assignment]
        """The status line, the headers and the body in one write (``send_response`` and ``end_headers``
        would send the headers and the body in two system calls); False when the client went away.

        The connection stays open for the client's next request only after a 200, to a request without
        a body (none is read), while the server holds at most KEEP_ALIVE_MAX connections."""
        try:
            if self.request_version == "HTTP/0.9":  # no status line, no headers
                self.wfile.write(body)
                return True
            if (
                status != 200
                or self.request_version == "HTTP/1.0"  # closed unless told otherwise: told nothing
                or self.headers.get("Content-Length", "0") != "0"
                or "Transfer-Encoding" in self.headers
                or not self.server.keeps_connections()
            ):
                self.close_connection = True
            if self.close_connection:  # said whatever the version: an HTTP/1.1 answer is kept otherwise
                headers = [*headers, ("Connection", "close")]
            head = [
                f"{self.protocol_version} {status} {self.responses[status][0]}",
                f"Server: {self.version_string()}",
                f"Date: {self.date_time_string()}",
                f"Content-Type: {content_type}",
                f"Content-Length: {len(body)}",
                *(f"{name}: {value}" for name, value in headers),
                "",
                "",
            ]
            self.wfile.write("\r\n".join(head).encode("latin-1") + body)
            return True
        except OSError:  # the client went away or timed out: nothing to tell anyone
            # Part of the answer may have gone out: nothing more may follow it on this connection.
            self.close_connection = True
            return False

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing per request."""


# What scrapers send and people's tools (curl, a browser, a liveness probe) do not: the
# Prometheus text or OpenMetrics media types in Accept, or a scraper's User-Agent.
_SCRAPER_ACCEPT = ("application/openmetrics-text", "version=0.0.4")
_SCRAPER_AGENTS = ("prometheus/", "vm_promscrape", "opentelemetry collector", "grafanaagent", "alloy/")


def _is_scraper(headers: Any) -> bool:
    """Whether a request comes from a metrics scraper (what the final-scrape wait waits for)."""
    accept = (headers.get("Accept") or "").lower()
    agent = (headers.get("User-Agent") or "").lower()
    return any(token in accept for token in _SCRAPER_ACCEPT) or agent.startswith(_SCRAPER_AGENTS)


class _Server(HTTPServer):
    """An HTTP server that serves each connection on a thread of its own, bounded in number, time and
    lifetime; a thread that finished a connection waits a while for the next one (a scraper's next
    scrape), since a scrape on a fresh thread costs more CPU (docs/benchmarks.md, the scrape benchmark)."""

    daemon_threads = True
    # socketserver's default backlog of 5 drops SYNs from a burst of connections while
    # the accept loop waits for the GIL; clients then retry only after a second.
    request_queue_size = 128

    def __init__(self, address: tuple[Any, ...], family: int, reader: PullReader) -> None:
        self.address_family = family
        self.reader = reader
        self._lock = threading.Lock()
        # Connections accepted and not finished: the thread serving each (None while it waits for one).
        self._active: dict[socket.socket, threading.Thread | None] = {}
        self._pending: collections.deque[tuple[socket.socket, Any]] = collections.deque()
        self._work = threading.Condition(self._lock)
        self._idle = 0  # threads waiting for a connection
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._scrapes = 0
        self._accepted = 0  # connections taken (not rejected), for the keep-alive tests
        self._last_scrape_started: float | None = None
        self._scrape_starts: list[float] = []
        self._scraped = threading.Condition(self._lock)
        self._warned_collection = False
        # The accept loop sleeps until a connection or shutdown() (which writes to this pair) wakes it.
        self._stop_requested = False
        self._loop_done = threading.Event()
        self._wake_reader, self._wake_writer = socket.socketpair()
        try:
            super().__init__(address, _Handler)
        except BaseException:
            self._close_wake()
            raise

    def server_bind(self) -> None:
        # HTTPServer.server_bind also resolves the host's FQDN, a DNS lookup that can
        # take seconds on a misconfigured node; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = self.server_address[1]

    # -- the accept loop -------------------------------------------------------
    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Accept connections until :meth:`shutdown`; sleeps in between (socketserver's loop wakes every
        ``poll_interval`` to check for shutdown: at 50 ms that cost about 2 ms of CPU a second, idle).
        Called once, on the endpoint's thread."""
        try:
            if self._stop_requested:
                return
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake_reader, selectors.EVENT_READ)
                while not self._stop_requested:
                    ready = selector.select()
                    if self._stop_requested:
                        break
                    if any(key.fileobj is self for key, _ in ready):
                        self._handle_request_noblock()
        finally:
            self._loop_done.set()

    def shutdown(self) -> None:
        """Stop the accept loop and wait until it has returned (at once: it is woken, not polled).

        As socketserver's, only once :meth:`serve_forever` has been started: the wake byte stays in the
        pair until the loop reads its selector, so a loop that starts after this call returns at once.
        """
        self._stop_requested = True
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")
        self._loop_done.wait()

    def server_close(self) -> None:
        super().server_close()
        self._close_wake()

    def _close_wake(self) -> None:
        for sock in (self._wake_reader, self._wake_writer):
            with contextlib.suppress(OSError):
                sock.close()

    # -- connections ---------------------------------------------------------
    def process_request(self, request: Any, client_address: Any) -> None:
        thread = None
        with self._lock:
            # Threads that ended may still be finishing: keep them until they are gone, so close()
            # can join every one.
            self._threads = [t for t in self._threads if t.is_alive()]
            if self._closing or len(self._active) >= MAX_CONNECTIONS:
                reject = True
            else:
                reject = False
                self._accepted += 1
                self._active[request] = None
                self._pending.append((request, client_address))
                if len(self._pending) <= self._idle:
                    self._work.notify()
                else:
                    thread = threading.Thread(target=self._work_loop, name="openlora-otel-prometheus-conn", daemon=True)
                    self._threads.append(thread)
        if reject:
            self.shutdown_request(request)
            return
        if thread is None:
            return
        try:
            thread.start()
        except RuntimeError:  # no more threads can be started: drop this connection, not the server
            with self._lock:
                self._threads = [t for t in self._threads if t is not thread]
                dropped = [p for p in self._pending if p[0] is request]
                for item in dropped:
                    self._pending.remove(item)
                if dropped:
                    self._active.pop(request, None)
            if dropped:
                self.shutdown_request(request)

    def _work_loop(self) -> None:
        """Serve connections until none came for IDLE_WAIT_S, enough others wait, or the server closes."""
        while True:
            with self._lock:
                while not self._pending:
                    if self._closing or self._idle >= IDLE_THREADS:
                        return
                    self._idle += 1
                    woken = self._work.wait(IDLE_WAIT_S)
                    self._idle -= 1
                    if not woken and not self._pending:
                        return
                if self._closing:
                    return
                request, client_address = self._pending.popleft()
                self._active[request] = threading.current_thread()
            self._serve_one(request, client_address)

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            _logger.debug("serving a /metrics request failed", exc_info=True)
        finally:
            self.shutdown_request(request)
            with self._lock:
                self._active.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        _logger.debug("error on a /metrics connection", exc_info=True)

    def drop_connections(self) -> list[threading.Thread]:
        """Stop accepting, shut every open connection so its thread returns; the threads to join."""
        with self._lock:
            self._closing = True
            threads = list(self._threads)
            # Accepted, never taken by a thread: closed here, as nothing else will.
            waiting = [request for request, _ in self._pending]
            self._pending.clear()
            for request in waiting:
                self._active.pop(request, None)
            active = list(self._active)
            self._work.notify_all()
        for request in waiting:
            self.shutdown_request(request)
        for request in active:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        return threads

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of every socket, touching nothing shared."""
        # No lock: a thread of the parent may have held it at fork time, and that thread
        # does not exist here to release it. The child has only the forking thread.
        self._lock = threading.Lock()
        self._scraped = threading.Condition(self._lock)
        self._work = threading.Condition(self._lock)
        self._closing = True
        active = list(self._active)
        self._active.clear()
        self._pending = collections.deque()
        self._idle = 0
        self._threads = []
        for sock in (self.socket, self._wake_reader, self._wake_writer, *active):
            # close(), never shutdown(): the parent's sockets must keep working.
            with contextlib.suppress(OSError):
                sock.close()

    # -- scrapes ---------------------------------------------------------------
    def keeps_connections(self) -> bool:
        """Whether a connection may stay open after its answer: at most KEEP_ALIVE_MAX are open."""
        return len(self._active) <= KEEP_ALIVE_MAX

    def scrape_started(self, started: float) -> None:
        """A scraper's collection is done and its answer about to be sent."""
        with self._lock:
            self._scrapes += 1
            self._scrape_starts = [*self._scrape_starts[-7:], started]

    def scraped(self, started: float) -> None:
        """That answer was sent: what the final-scrape wait waits for."""
        with self._scraped:
            self._last_scrape_started = started
            self._scraped.notify_all()

    def collection_failed(self) -> None:
        with self._lock:
            first = not self._warned_collection
            self._warned_collection = True
        if first:
            _logger.warning(
                "openlora-otel: collecting metrics for a scrape failed (answered HTTP 500); "
                "later failures are logged at debug level",
                exc_info=True,
            )
        else:
            _logger.debug("collecting metrics for a scrape failed", exc_info=True)


class PrometheusEndpoint:
    """A bound, serving ``/metrics`` endpoint and the reader behind it."""

    def __init__(self, reader: PullReader, server: _Server, host: str) -> None:
        self.reader = reader
        self.host = host
        self.port: int = server.server_address[1]
        self._server: _Server | None = server
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=server.serve_forever,
            name="openlora-otel-prometheus",
            daemon=True,
        )
        self._thread.start()
        self._registration: FileSdRegistration | None = None
        _LIVE.add(self)

    def register_file_sd(self, directory: str) -> None:
        """Register this endpoint in a Prometheus file_sd directory until :meth:`close`.

        Raises :class:`ConfigError` (``OPENLORA_PROMETHEUS_FILE_SD_DIR``) when the
        directory cannot be created or written.
        """
        from openlora_otel.exporters.discovery import FileSdRegistration

        self._registration = FileSdRegistration.register(directory, self.host, self.port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def scrapes(self) -> int:
        """Scrapes answered (or being answered) with HTTP 200 so far."""
        server = self._server
        return server._scrapes if server is not None else 0

    def scrape_interval(self) -> float | None:
        """The median time between the scrapes seen so far (None before two)."""
        server = self._server
        if server is None:
            return None
        with server._lock:
            starts = list(server._scrape_starts)
        gaps = sorted(b - a for a, b in itertools.pairwise(starts))
        return gaps[len(gaps) // 2] if gaps else None

    def wait_for_scrape(self, after: float, timeout_s: float) -> bool:
        """Wait until a scrape that started at or after ``after`` (monotonic) was answered; False on timeout."""
        server = self._server
        if server is None:
            return False
        deadline = time.monotonic() + timeout_s
        with server._scraped:
            while server._last_scrape_started is None or server._last_scrape_started < after:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                server._scraped.wait(remaining)
        return True

    def close(self, timeout_s: float = 1.0) -> bool:
        """Stop serving, release the port and join every thread within ``timeout_s``; idempotent.

        True when every thread ended in time. In a forked child it only drops the child's sockets.
        """
        server, self._server = self._server, None
        if server is None:
            return True
        registration, self._registration = self._registration, None
        if registration is not None:
            # First, so the scraper stops looking for this endpoint before it closes.
            registration.remove()
        _LIVE.discard(self)
        if os.getpid() != self._pid:
            server.forget_in_child()
            return True
        deadline = time.monotonic() + timeout_s
        try:
            server.shutdown()  # returns as soon as the accept loop has woken and returned
        except Exception:  # pragma: no cover - defensive: closing must never raise
            _logger.debug("stopping the Prometheus accept loop failed", exc_info=True)
        threads = server.drop_connections()
        try:
            server.server_close()
        except OSError:  # pragma: no cover
            _logger.debug("closing the Prometheus socket failed", exc_info=True)
        ok = True
        for thread in (self._thread, *threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            ok = ok and not thread.is_alive()
        return ok


# Endpoints alive in this process, for the fork hook (weak: a dropped endpoint is not kept alive).
_LIVE: weakref.WeakSet[PrometheusEndpoint] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for endpoint in list(_LIVE):
        endpoint.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


def build_prometheus(config: TelemetryConfig) -> PrometheusEndpoint:
    """Bind the endpoint on ``config.prometheus_host:config.prometheus_port`` and start serving.

    Raises :class:`ConfigError` naming the variable when the address cannot be
    bound (port in use, unknown host); nothing is left running in that case.
    """
    reader = PullReader()
    host, port = config.prometheus_host, config.prometheus_port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            "OTEL_EXPORTER_PROMETHEUS_HOST", host, "a resolvable host name or IP address", str(exc)
        ) from None
    try:
        server = _Server(sockaddr, family, reader)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                "OTEL_EXPORTER_PROMETHEUS_HOST",
                host,
                "an address of this machine (localhost, 127.0.0.1, ::1, 0.0.0.0 or one of its interfaces)",
                f"binding {host}:{port} failed: {exc.strerror or exc}",
            ) from None
        raise PortInUseError(config, exc) from None
    return PrometheusEndpoint(reader, server, host)

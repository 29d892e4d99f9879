"""The limits of ``openlora-otel serve`` (openlora_otel/serving/limits.py) over real sockets.

In process: a small FastAPI app behind :class:`RequestLimits` on uvicorn with :func:`http_protocol`,
on a loopback port, every byte sent by hand. In a subprocess (``process``): ``serve`` itself, for
the server's memory, its metrics and its log.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel.serving import limits as limits_module
from openlora_otel.serving.limits import (
    CONNECTIONS_CLOSED,
    DepthScanner,
    Limits,
    RequestLimits,
    http_protocol,
    json_depth,
)
from openlora_otel.serving.server import _Server
from tests.support.polling import wait_until

DEEP = b"[" * 100_000 + b"]" * 100_000


# -- the depth scan -----------------------------------------------------------------------------


def _reference_depth(body: bytes) -> int:
    """Byte by byte, as a JSON parser sees brackets: outside strings, with backslash escapes."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def test_the_depth_scan_counts_brackets_outside_strings_wherever_the_chunks_end() -> None:
    assert json_depth(b'{"model": "a1", "prompt": "[[[[[[", "stop": ["]"]}') == 2
    assert json_depth(json.dumps({"p": '\\"[[[' + "[" * 100}).encode()) == 1
    assert json_depth(DEEP) == 100_000
    rng = random.Random(7)
    alphabet = b'[]{}"\\a, '
    for _ in range(3000):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        cuts = sorted(rng.sample(range(len(body) + 1), min(len(body) + 1, rng.randint(0, 6))))
        scanner, start = DepthScanner(), 0
        for cut in [*cuts, len(body)]:
            scanner.feed(body[start:cut])
            start = cut
        assert scanner.deepest == _reference_depth(body), (body, cuts)


def test_the_depth_scan_of_a_mebibyte_of_brackets_is_cheap() -> None:
    body = b"[]" * (512 * 1024)
    started = time.perf_counter()
    assert json_depth(body) == 1
    # About 25 ms on a busy 2-core machine; a byte-by-byte Python loop takes ten times that.
    assert time.perf_counter() - started < 1.0


# -- a real server in process ------------------------------------------------------------------


class LocalServer:
    """uvicorn on a loopback port in a thread: an app that reads and parses bodies, behind the limits."""

    def __init__(self, limits: Limits, reader: InMemoryMetricReader) -> None:
        self.refused: list[tuple[str, str]] = []
        self.parsed = 0
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> dict[str, Any]:
            body = await request.body()
            json.loads(body)  # a RecursionError for deep nesting, were it not refused first
            self.parsed += 1
            return {"bytes": len(body)}

        @app.post("/slow-stream")
        async def slow_stream(request: Request) -> StreamingResponse:
            await request.body()

            async def events() -> Any:
                yield b"first\n"
                await asyncio.sleep(1.0)  # past the body timeout: the body is complete, no 408
                yield b"second\n"

            return StreamingResponse(events())

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        app.add_middleware(RequestLimits, limits=limits, on_refusal=lambda scope, code: self.refused.append((scope["path"], code)))
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=2048)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            http=http_protocol(limits, MeterProvider(metric_readers=[reader])),
            log_config=None,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=30,  # longer than the header timeouts below: theirs is the one tested
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn started", interval=0.05)

    def connect(self, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response (to the end of the connection or of its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection ended before a response's headers: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "-1"))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes the connection within ``timeout`` (what it still sends is read and dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _health(server: LocalServer) -> int:
    with server.connect(timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        return _answer(sock)[0]


def _post(length: int | None, body: bytes = b"", path: str = "/v1/completions") -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode() + body


def _closed_connections(reader: InMemoryMetricReader) -> dict[str, float]:
    counts: dict[str, float] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == CONNECTIONS_CLOSED:
                    for point in metric.data.data_points:
                        counts[str(point.attributes["error.type"])] = point.value
    return counts


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def server(reader: InMemoryMetricReader) -> Iterator[LocalServer]:
    limits = Limits(max_body_bytes=64 * 1024, max_json_depth=64, body_timeout_s=1.0, header_timeout_s=1.0, max_connections=20)
    local = LocalServer(limits, reader)
    try:
        yield local
    finally:
        local.close()


def test_a_body_within_the_limits_is_served(server: LocalServer) -> None:
    body = json.dumps({"model": "a1", "prompt": "x" * 60_000, "nested": [[[[1]]]]}).encode()
    with server.connect() as sock:
        sock.sendall(_post(len(body), body))
        status, _, answer = _answer(sock)
    assert status == 200 and json.loads(answer) == {"bytes": len(body)}
    assert server.refused == []


def test_a_content_length_over_the_limit_is_413_before_the_body_is_sent(server: LocalServer) -> None:
    with server.connect() as sock:
        sock.sendall(_post(200_000_000, b'{"model": "a1", "prompt": "' + b"x" * 1000))
        # The answer comes now, with 199.99 MB still unsent.
        status, headers, body = _answer(sock)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body) == {
            "error": {
                "message": "the request body is 200000000 bytes; this server takes at most 65536",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
        assert _closed(sock), "the connection stays open"
    assert server.refused == [("/v1/completions", "request_too_large")] and server.parsed == 0


def test_a_chunked_body_is_413_at_the_first_chunk_over_the_limit(server: LocalServer) -> None:
    chunk = b"%x\r\n%s\r\n" % (16 * 1024, b" " * 16 * 1024)
    with server.connect() as sock:
        sock.sendall(_post(None))
        sent = 0
        while sent < 64 * 1024:  # up to the limit: nothing to refuse yet
            sock.sendall(chunk)
            sent += 16 * 1024
        sock.sendall(chunk)
        status, _, body = _answer(sock)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        with pytest.raises(OSError):  # the server is gone: the rest of the body cannot be sent
            for _ in range(1000):
                sock.sendall(chunk)
    assert server.refused == [("/v1/completions", "request_too_large")] and server.parsed == 0


def test_json_nested_deeper_than_the_limit_is_400_before_it_is_parsed(server: LocalServer) -> None:
    deep = b"[" * 30_000 + b"]" * 30_000  # under the 64 KiB limit
    with server.connect() as sock:
        sock.sendall(_post(len(deep), deep))
        status, _, body = _answer(sock)
    # Refused before json.loads: its RecursionError (a plain-text 500) never happens.
    assert status == 400
    assert json.loads(body)["error"] == {
        "message": "the request body nests JSON deeper than 64 levels",
        "type": "invalid_request_error",
        "param": None,
        "code": "json_too_deep",
    }
    ok = json.dumps({"a": json.loads("[" * 63 + "]" * 63), "prompt": "[" * 1000}).encode()
    with server.connect() as sock:
        sock.sendall(_post(len(ok), ok))
        assert _answer(sock)[0] == 200  # 64 levels, and brackets in a string are text
    assert server.refused == [("/v1/completions", "json_too_deep")] and server.parsed == 1


def test_a_body_that_never_comes_is_408_after_the_body_timeout_and_health_answers(server: LocalServer) -> None:
    with server.connect() as sock:
        started = time.monotonic()
        sock.sendall(_post(100, b'{"model": '))
        assert _health(server) == 200  # meanwhile
        status, _, body = _answer(sock)
        waited = time.monotonic() - started
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert "did not arrive within 1 s (10 bytes received)" in json.loads(body)["error"]["message"]
        assert 0.9 < waited < 5, waited
        assert _closed(sock), "the connection stays open"
    assert server.refused == [("/v1/completions", "request_timeout")]


def test_after_the_body_the_timeout_no_longer_applies(server: LocalServer) -> None:
    """A streamed answer listens for the client's disconnect on receive(): that wait is not timed out."""
    with server.connect() as sock:
        sock.sendall(_post(2, b"{}", path="/slow-stream").replace(b"Host: t\r\n", b"Host: t\r\nConnection: close\r\n"))
        status, _, body = _answer(sock)
    assert status == 200 and b"second" in body
    assert server.refused == []


def test_headers_that_never_complete_are_closed_after_the_header_timeout(
    server: LocalServer, reader: InMemoryMetricReader
) -> None:
    with server.connect() as silent, server.connect() as partial, server.connect() as kept:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        # A kept-alive connection: its first request is answered, its second never completes.
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _answer(kept)[0] == 200
        kept.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _health(server) == 200
        started = time.monotonic()
        status, _, body = _answer(partial)  # part of a request came: it is told why it ends
        assert status == 408 and "headers did not arrive within 1 s" in json.loads(body)["error"]["message"]
        assert _closed(silent) and _closed(kept), "connections left open"
        assert time.monotonic() - started < 8  # one header timeout, then the reads
    assert _closed_connections(reader) == {"header_timeout": 3}


def test_past_the_connection_cap_half_open_connections_make_room_for_health(reader: InMemoryMetricReader) -> None:
    """--max-connections 20: 60 connections that never finish their headers cannot keep /health out."""
    server = LocalServer(Limits(header_timeout_s=60.0, max_connections=20), reader)
    held = []
    try:
        for _ in range(60):
            sock = server.connect()
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            held.append(sock)
        for _ in range(5):
            assert _health(server) == 200
        closed = _closed_connections(reader)
        assert closed.get("connection_limit", 0) >= 40 and "header_timeout" not in closed, closed
        # The oldest went first: the newest are still open.
        for sock in held[-10:]:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in held:
            sock.close()
        server.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        _post(2, b"{}").replace(b"Content-Length: 2", b"Content-Length: 2\r\nContent-Length: 3"),
        _post(2, b"{}").replace(b"Content-Length: 2", b"Content-Length: 2x"),
        _post(None, b"zz\r\n{}\r\n0\r\n\r\n"),
        b"GET /hea\x00lth HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET /hea lth HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"x" * 20_000,  # no end in 16 KiB
    ],
    ids=[
        "two-content-lengths",
        "bad-content-length",
        "bad-chunk-size",
        "nul-in-the-path",
        "space-in-the-path",
        "headers-over-16k",
    ],
)
def test_what_uvicorns_parser_refuses_is_a_400_in_the_openai_shape(
    server: LocalServer, reader: InMemoryMetricReader, request_bytes: bytes
) -> None:
    """uvicorn answered these text/plain "Invalid HTTP request received."; the app never reads a body (a bad
    chunk size comes after the headers: the app sees the client leave)."""
    with server.connect() as sock:
        sock.sendall(request_bytes)
        status, headers, body = _answer(sock)
        assert _closed(sock)
    assert status == 400 and headers["content-type"] == "application/json", (status, headers, body)
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http" and error["type"] == "invalid_request_error"
    assert "not valid HTTP/1.1" in error["message"] and error["param"] is None
    assert server.parsed == 0
    assert _closed_connections(reader) == {"invalid_http": 1}
    assert _health(server) == 200


class _NoDescriptorsLeft(socket.socket):
    """A listening socket whose accept() fails as it does past the open files limit (EMFILE)."""

    def accept(self) -> tuple[socket.socket, Any]:
        raise OSError(errno.EMFILE, "Too many open files")


def test_past_the_open_files_limit_a_failed_accept_is_one_warning_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio logged a traceback per failed accept(), up to the backlog each turn of the loop: about
    8,000 (3.2 MB) in 5 s under `ulimit -n 1024`. Now: one warning per interval (1 s here), counted."""
    monkeypatch.setattr(limits_module, "WARN_EVERY_S", 1.0)
    caplog.set_level(logging.WARNING)
    app = FastAPI()
    listener = _NoDescriptorsLeft(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    config = uvicorn.Config(
        app, http=http_protocol(Limits()), log_config=None, log_level="warning", lifespan="off"
    )
    server = _Server(config, on_stop=lambda: None)
    thread = threading.Thread(target=server.run, args=([listener],), daemon=True)
    thread.start()
    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.WARNING]

    try:
        wait_until(lambda: server.server.started, 10, "uvicorn started", interval=0.05)
        # Waits in the backlog: the listener stays readable and every accept() fails.
        with socket.create_connection(listener.getsockname(), timeout=5):
            started = time.monotonic()
            # Until the second interval's warning (bounded): a loaded machine may turn the loop slowly.
            wait_until(lambda: len(warnings()) >= 2, 15, "two warnings", interval=0.05)
            elapsed = time.monotonic() - started
            # What was logged while serving: at shutdown asyncio's pending accept retries fire on the
            # closed listener and log on their own, which is not what this test is about.
            records = warnings()
    finally:
        server.server.should_exit = True
        thread.join(10)
        listener.close()
    # One warning per interval at most, whatever the thousands of failed accepts in between.
    assert 2 <= len(records) <= elapsed / 1.0 + 2, (len(records), elapsed, [r.getMessage()[:200] for r in records[:3]])
    gaps = [later.created - earlier.created for earlier, later in itertools.pairwise(records)]
    assert all(gap >= 0.95 for gap in gaps), gaps
    counts = []
    for record in records:
        assert record.name == "openlora_otel.serving.limits" and record.exc_info is None, record.getMessage()
        message = record.getMessage()
        assert "cannot accept new connections: Too many open files" in message, message
        counts.append(int(re.search(r"\((\d+) failed accept\(s\) since the last warning", message)[1]))
    assert counts[0] == 1 and all(count > 1 for count in counts[1:]), counts


def test_other_loop_errors_still_go_to_the_default_handler(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    loop = asyncio.new_event_loop()
    try:
        handler = limits_module.AcceptErrorLog()
        no_descriptors = OSError(errno.EMFILE, "Too many open files")
        handler(loop, {"message": "something else", "exception": no_descriptors})
        handler(loop, {"message": "socket.accept() failed", "exception": OSError(errno.ECONNRESET, "reset")})
    finally:
        loop.close()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("asyncio", "something else"),
        ("asyncio", "socket.accept() failed"),
    ]
    assert handler.since_warning == 0 and handler.warned_at is None


def test_a_client_that_hangs_up_mid_body_is_one_log_line(server: LocalServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with server.connect() as sock:
        sock.sendall(_post(10_000, b'{"model": "a1", "prompt": "'))
        time.sleep(0.2)  # the app is reading the body when the client hangs up, not yet to start
    wait_until(lambda: server.refused, 5, "the hang-up recorded", interval=0.05)
    time.sleep(0.2)  # room for a second log line, were there one: the check is that there is not
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "disconnected while sending its body (27 of 10000 bytes) to POST /v1/completions" in message
    assert records[0].exc_info is None
    assert server.refused == [("/v1/completions", "cancelled")]
    assert _health(server) == 200


def test_limits_follow_the_open_files_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert Limits(max_connections=10).connection_cap() == min(10, max(1, soft - 64))
    assert Limits(max_connections=None).connection_cap() is None
    if soft != resource.RLIM_INFINITY:
        assert Limits(max_connections=10**9).connection_cap() == soft - 64


# -- serve itself ------------------------------------------------------------------------------


def test_the_serve_flags_set_the_limits_and_0_turns_one_off() -> None:
    from openlora_otel.cli import build_parser
    from openlora_otel.commands.serve import limits_from

    parse = build_parser().parse_args
    assert limits_from(parse(["serve", "d"])) == Limits()
    assert Limits() == Limits(1024 * 1024, 64, 30.0, 10.0, 1000)
    args = ["--max-body-bytes", "2048", "--max-json-depth", "0", "--body-timeout", "2.5", "--header-timeout", "0"]
    assert limits_from(parse(["serve", "d", *args, "--max-connections", "50"])) == Limits(2048, None, 2.5, None, 50)
    with pytest.raises(SystemExit):
        parse(["serve", "d", "--body-timeout", "-1"])



@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.support.serving import save_demo

    directory = tmp_path_factory.mktemp("limits") / "demo"
    save_demo(directory, "a1", seed=0)
    return directory


@pytest.mark.process
def test_serve_refuses_what_is_too_large_too_deep_or_too_slow_and_records_it(saved: Path, tmp_path: Path) -> None:
    import psutil

    from tests.support.serving import ServeProcess, requests_by, total

    serve = ServeProcess(saved, "--body-timeout", "1", "--header-timeout", "1", workdir=tmp_path)
    try:
        serve.wait_ready()
        process = psutil.Process(serve.process.pid)
        before = process.memory_info().rss
        # 200 MB announced, 1 MiB sent: the 413 comes before the rest, and nothing of it is kept.
        with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
            sock.sendall(_post(200_000_000, b" " * (1 << 20)))
            status, _, body = _answer(sock)
            assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        # A chunked body over 1 MiB: refused as it arrives.
        with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
            sock.sendall(_post(None))
            with pytest.raises(OSError):
                for _ in range(200):  # 200 MB if it were all read
                    sock.sendall(b"100000\r\n" + b" " * (1 << 20) + b"\r\n")
            assert _answer(sock)[0] == 413
        assert process.memory_info().rss - before < 32 * 2**20
        # 100,000 nested arrays: 400 in the OpenAI shape, not a RecursionError.
        status, _, answer = serve.complete(DEEP)
        assert status == 400 and answer["error"]["code"] == "json_too_deep" and answer["error"]["param"] is None
        # The same on the chat endpoint, recorded as a chat request.
        status, _, answer = serve.request("POST", "/v1/chat/completions", DEEP)
        assert status == 400 and answer["error"]["code"] == "json_too_deep"
        # Headers sent, the body never: 408 after --body-timeout, while /health answers.
        with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
            sock.sendall(_post(50))
            assert serve.request("GET", "/health")[0] == 200
            assert _answer(sock)[0] == 408
        # A connection that never sends its headers: closed after --header-timeout, and counted.
        with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as silent:
            assert _closed(silent, timeout=10)
        # A client that hangs up mid-body.
        with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
            sock.sendall(_post(1000, b'{"model": "a1"'))
            time.sleep(0.3)  # the server is reading the body when the client hangs up
        expected = {
            ("other", "request_too_large"): 2,
            ("other", "json_too_deep"): 2,
            ("other", "request_timeout"): 1,
            ("other", "cancelled"): 1,
        }

        def recorded() -> str | None:
            text = serve.metrics()
            return text if all(requests_by(text).get(k, 0) == v for k, v in expected.items()) else None

        text = wait_until(
            recorded,
            15,
            f"{expected} in the request metrics",
            interval=0.2,
        )
        http = {"http_route": "/v1/completions", "http_request_method": "POST"}
        for code, count in (("413", 2), ("400", 1), ("408", 1)):
            assert total(text, "http_server_request_duration_seconds_count", http_response_status_code=code, **http) == count
        assert total(text, "openlora_serve_connections_closed_total", error_type="header_timeout") >= 1
        assert (
            total(text, "gen_ai_server_request_duration_seconds_count", gen_ai_operation_name="chat", error_type="json_too_deep")
            == 1
        )
    finally:
        assert serve.stop() == 0
    log = serve.log()
    assert "Traceback" not in log and "RecursionError" not in log, log[-3000:]
    assert log.count("disconnected while sending its body") == 1, log[-3000:]

"""What the ASGI middleware (OpenAIMetricsMiddleware) adds to an OpenAI-compatible app, side by side.

One bare ASGI app answers ``POST /v1/chat/completions`` with OpenAI's chat chunks (streamed: 8 or 64
content chunks, the usage chunk, ``[DONE]``; or one JSON answer), called in process (no sockets, so
the middleware's cost is not lost in the network's); the same app wrapped in the middleware, on a
provider built as ``setup_telemetry`` builds it (window views). Interleaved in rounds, per variant:

- CPU per request (``time.process_time``), median over the rounds; the extra per request, and per
  chunk (the slope between 8 and 64 chunks);
- latency added to each chunk: from the app's ``send()`` of a piece to the server's receiving it,
  wrapped minus bare (the middleware reads a piece after passing it on, so this is its forwarding).

    python benchmarks/bench_asgi_middleware.py [--requests 3000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel.inference import InferenceMetrics, inference_views
from openlora_otel.inference.asgi import OpenAIMetricsMiddleware
from openlora_otel.views import observable_views

BODY = json.dumps({"model": "support-v2", "messages": [{"role": "user", "content": "hello " * 20}], "stream": True,
                   "stream_options": {"include_usage": True}}).encode()  # fmt: skip
SCOPE = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
    "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
    "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
    "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
}  # fmt: skip


def chunk(content: str) -> bytes:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "support-v2",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def make_app(chunks: int, streamed: bool, stamps: list[float]) -> Any:
    pieces = [chunk(f"tok{i} ") for i in range(chunks)]
    usage = b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 25, "completion_tokens": chunks}}).encode()
    answer = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
                         "content": "x" * chunks}}], "usage": {"prompt_tokens": 25, "completion_tokens": chunks}}).encode()  # fmt: skip

    async def app(scope: dict, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        if not streamed:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": answer})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for piece in pieces:
            stamps.append(time.perf_counter())
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": usage + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def measured(app: Any) -> Any:
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], views=[*inference_views(), *observable_views()])
    inference = InferenceMetrics(provider.get_meter("bench"), model="base", window_histogram=True)
    return OpenAIMetricsMiddleware(app, inference)


async def run(app: Any, requests: int, stamps: list[float], received: list[float]) -> float:
    async def call() -> None:
        messages = [{"type": "http.request", "body": BODY, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message.get("more_body") and message["body"].startswith(b"data: {\"id\""):
                received.append(time.perf_counter())

        await app(dict(SCOPE), receive, send)

    for _ in range(100):
        await call()
    stamps.clear()
    received.clear()
    started = time.process_time()
    for _ in range(requests):
        await call()
    return (time.process_time() - started) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shapes = {"streamed, 8 chunks": (8, True), "streamed, 64 chunks": (64, True), "not streamed": (8, False)}
    cpu: dict[tuple[str, bool], list[float]] = {}
    latency: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for shape, (chunks, streamed) in shapes.items():
            for wrapped in (False, True):
                stamps: list[float] = []
                received: list[float] = []
                app = make_app(chunks, streamed, stamps)
                per_request = asyncio.run(run(measured(app) if wrapped else app, args.requests, stamps, received))
                cpu.setdefault((shape, wrapped), []).append(per_request)
                if streamed:
                    gaps = [r - s for s, r in zip(stamps, received, strict=True)]
                    latency.setdefault((shape, wrapped), []).append(statistics.median(gaps))
    median = {key: statistics.median(values) * 1e6 for key, values in cpu.items()}
    print(f"CPU per request, median of {args.rounds} rounds x {args.requests} requests (in process, no sockets)")
    for shape in shapes:
        bare, wrapped = median[(shape, False)], median[(shape, True)]
        print(f"  {shape:<22} bare {bare:8.1f} us   with the middleware {wrapped:8.1f} us   "
              f"extra {wrapped - bare:6.1f} us   ratio {wrapped / bare:.2f}")  # fmt: skip
    slope = (
        (median[("streamed, 64 chunks", True)] - median[("streamed, 64 chunks", False)])
        - (median[("streamed, 8 chunks", True)] - median[("streamed, 8 chunks", False)])
    ) / 56
    print(f"  extra CPU per streamed chunk (slope 8 -> 64 chunks): {slope:.2f} us")
    for shape in ("streamed, 8 chunks", "streamed, 64 chunks"):
        bare = statistics.median(latency[(shape, False)]) * 1e6
        wrapped = statistics.median(latency[(shape, True)]) * 1e6
        print(f"  latency added to each chunk ({shape}): {wrapped - bare:.2f} us (bare {bare:.2f} us, wrapped {wrapped:.2f} us)")


if __name__ == "__main__":
    main()

"""Per-request CPU cost of the serving metrics, side by side in one run.

- prometheus_client, one observe: the issue's yardstick, a bare ``Histogram.observe``.
- prometheus_client, the same set: what a hand-rolled exporter needs for what
  ``InferenceMetrics`` records per request: per-adapter labels, queue and running
  gauges moved three times, and five observes (duration, time to first token,
  time per output token, input and output tokens).
- naive OpenTelemetry: the same set as SDK synchronous instrument calls.
- openlora-otel: one request through ``InferenceMetrics`` (``request(queued=True)``,
  ``start()``, ``first_token()``, ``tokens()``, end), on a provider built as
  ``setup_telemetry`` builds it (``inference_views()``: windows merged per
  collection), and on a plain provider (any foreign meter: values recorded one by one).

Then the HTTP server metrics ``openlora-otel serve`` adds through
opentelemetry-instrumentation-fastapi (with the serve command's settings): the
extra CPU per streamed request of 8 chunks, through a FastAPI app called
in-process (no sockets), instrumented vs not (needs the ``serve`` extra).

Each variant runs in the same process, interleaved in rounds, measured with
``time.process_time``; the median per-request cost over the rounds is reported,
plus ratios. A reader collects every 10,000 requests in the OpenTelemetry
variants, as a scrape would (timed apart, off the request path). Then RSS growth
over one million requests.

    python benchmarks/bench_inference_request.py [--requests 100000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

from bench_record_step import rss_mb, time_variant  # the same loop and RSS reading, side by side
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, Gauge, Histogram

from openlora_otel.inference import InferenceMetrics, inference_views
from openlora_otel.names import REQUEST_DURATION_BUCKETS, TOKEN_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from openlora_otel.views import observable_views

ADAPTERS = ("support-v2", "sql-v1", "base")


def prometheus_one_observe():
    registry = CollectorRegistry()
    duration = Histogram("request_seconds", "d", buckets=REQUEST_DURATION_BUCKETS, registry=registry)

    def request(i: int) -> None:
        duration.observe(0.2)

    return request, lambda: None


def prometheus_full_set():
    registry = CollectorRegistry()
    labels = ["adapter"]
    duration = Histogram("d", "d", labels, buckets=REQUEST_DURATION_BUCKETS, registry=registry)
    ttft = Histogram("t", "t", labels, buckets=TTFT_BUCKETS, registry=registry)
    tpot = Histogram("p", "p", labels, buckets=TPOT_BUCKETS, registry=registry)
    tokens = Histogram("k", "k", ["adapter", "type"], buckets=TOKEN_BUCKETS, registry=registry)
    running = Gauge("r", "r", labels, registry=registry)
    waiting = Gauge("w", "w", labels, registry=registry)

    def request(i: int) -> None:
        adapter = ADAPTERS[i % 3]
        waiting.labels(adapter).inc()
        waiting.labels(adapter).dec()
        running.labels(adapter).inc()
        running.labels(adapter).dec()
        duration.labels(adapter).observe(0.2)
        ttft.labels(adapter).observe(0.05)
        tpot.labels(adapter).observe(0.01)
        tokens.labels(adapter, "input").observe(12)
        tokens.labels(adapter, "output").observe(16)

    return request, lambda: None


def naive_otel():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("bench")
    duration = meter.create_histogram("d", explicit_bucket_boundaries_advisory=list(REQUEST_DURATION_BUCKETS))
    ttft = meter.create_histogram("t", explicit_bucket_boundaries_advisory=list(TTFT_BUCKETS))
    tpot = meter.create_histogram("p", explicit_bucket_boundaries_advisory=list(TPOT_BUCKETS))
    tokens = meter.create_histogram("k", explicit_bucket_boundaries_advisory=list(TOKEN_BUCKETS))
    running = meter.create_up_down_counter("r")
    waiting = meter.create_up_down_counter("w")
    attrs = [
        {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "openlora",
            "gen_ai.request.model": "tiny-llama",
            "openlora.adapter.name": a,
        }
        for a in ADAPTERS
    ]
    token_attrs = [({**a, "gen_ai.token.type": "input"}, {**a, "gen_ai.token.type": "output"}) for a in attrs]

    def request(i: int) -> None:
        a = attrs[i % 3]
        waiting.add(1, a)
        waiting.add(-1, a)
        running.add(1, a)
        duration.record(0.2, a)
        ttft.record(0.05, a)
        tpot.record(0.01, a)
        tokens.record(12, token_attrs[i % 3][0])
        tokens.record(16, token_attrs[i % 3][1])
        running.add(-1, a)

    return request, reader.collect


def openlora(merged: bool = True):
    reader = InMemoryMetricReader()
    views = [*inference_views(), *observable_views()] if merged else []
    provider = MeterProvider(metric_readers=[reader], views=views)
    metrics = InferenceMetrics(provider.get_meter("bench"), model="tiny-llama", window_histogram=merged)
    for adapter in ADAPTERS[:2]:
        metrics.adapter_loaded(adapter)
    names = (*ADAPTERS[:2], None)

    def request(i: int) -> None:
        req = metrics.request(names[i % 3], queued=True)
        req.start()
        req.first_token()
        req.tokens(input=12, output=16)
        req.end()

    return request, reader.collect


def asgi_extra_per_request(requests: int, rounds: int) -> tuple[float, float] | None:
    """Median CPU seconds per streamed request of a bare FastAPI app, and with serve's instrumentation."""
    try:
        import asyncio

        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.trace import NoOpTracerProvider
    except ImportError:
        return None
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")  # what serve sets

    def make(instrumented: bool) -> Any:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions() -> StreamingResponse:
            async def events() -> Any:
                for _ in range(8):
                    yield b"data: {}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        if instrumented:
            FastAPIInstrumentor.instrument_app(
                app,
                meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
                tracer_provider=NoOpTracerProvider(),
                exclude_spans=["receive", "send"],
            )
        return app

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
        "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
    }  # fmt: skip

    async def call(app: Any) -> None:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            return None

        await app(dict(scope), receive, send)

    async def timed(app: Any) -> float:
        for _ in range(200):
            await call(app)
        started = time.process_time()
        for _ in range(requests):
            await call(app)
        return (time.process_time() - started) / requests

    plain, instrumented = [], []
    for _ in range(rounds):
        plain.append(asyncio.run(timed(make(False))))
        instrumented.append(asyncio.run(timed(make(True))))
    return statistics.median(plain), statistics.median(instrumented)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000, help="requests per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-requests", type=int, default=1_000_000)
    args = parser.parse_args()

    variants = {
        "prometheus_client, one observe": prometheus_one_observe(),
        "prometheus_client, the same set": prometheus_full_set(),
        "naive OpenTelemetry, the same set": naive_otel(),
        "openlora-otel InferenceMetrics": openlora(),
        "openlora-otel, any meter (1 by 1)": openlora(merged=False),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    collecting: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (request, collect) in variants.items():
            per_request, per_collect = time_variant(request, collect, args.requests, collect_every=10_000)
            results[name].append(per_request)
            collecting[name].append(per_collect)
    medians = {name: statistics.median(v) * 1e6 for name, v in results.items()}
    collect_medians = {name: statistics.median(v) * 1e6 for name, v in collecting.items()}
    print(f"CPU time per request, median of {args.rounds} rounds x {args.requests} requests")
    print(f"  {'':<36}{'request':>10}{'collection':>12}  (collection: per request, off the request path)")
    for name, micros in medians.items():
        print(f"  {name:<36}{micros:8.3f} us{collect_medians[name]:9.3f} us")
    ours = medians["openlora-otel InferenceMetrics"]
    print(
        f"ratio openlora-otel / prometheus_client one observe: {ours / medians['prometheus_client, one observe']:.2f}"
    )
    print(
        f"ratio openlora-otel / prometheus_client same set: {ours / medians['prometheus_client, the same set']:.2f}"
        "  (target <= 1.0)"
    )
    print(
        f"ratio openlora-otel / naive OpenTelemetry: {ours / medians['naive OpenTelemetry, the same set']:.2f}"
    )

    asgi = asgi_extra_per_request(max(1000, args.requests // 20), args.rounds)
    if asgi is not None:
        plain, instrumented = (seconds * 1e6 for seconds in asgi)
        print(
            f"HTTP server metrics (opentelemetry-instrumentation-fastapi, serve's settings), one streamed "
            f"request of 8 chunks: bare FastAPI {plain:.0f} us, instrumented {instrumented:.0f} us, "
            f"extra {instrumented - plain:.0f} us"
        )

    request, collect = openlora()
    for i in range(10_000):
        request(i)
    collect()
    gc.collect()
    before = rss_mb()
    for i in range(args.memory_requests):
        request(i)
        if i % 100_000 == 99_999:
            collect()
    gc.collect()
    after = rss_mb()
    print(
        f"RSS over {args.memory_requests} requests: {before:.1f} MB -> {after:.1f} MB, "
        f"growth {after - before:.2f} MB (target < 5 MB)"
    )


if __name__ == "__main__":
    main()

"""``openlora-otel load`` against a small stdlib server that speaks the serve command's protocol.

The server (a ThreadingHTTPServer on loopback) answers POST /v1/completions as the contract says:
JSON, or SSE over chunked transfer encoding as uvicorn sends it, with ``usage`` in the last chunk and
``data: [DONE]``; errors as ``{"error": {"type", "message"}}`` with 404 / 400 / 503. Knobs make it
slow, hold requests, or break streams, so the generator's accounting can be checked against what
the server saw. Every wait is bounded (request timeouts, a held request's own limit).
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from openlora_otel.cli import main as cli_main
from openlora_otel.serving.load import (
    LoadOptions,
    LoadUsageError,
    Unreachable,
    parse_mix,
    percentile,
    plan,
    render,
    run_load,
    summarize,
)
from tests.support.processes import free_port


class FakeServe:
    """The serve command's HTTP protocol, with knobs; ``arrivals`` records (monotonic time, model)."""

    def __init__(self, models: tuple[str, ...] = ("tiny-llama", "a1", "a2")) -> None:
        self.models = models
        self.hold_s = 0.0  # each request waits this long before answering
        self.token_delay_s = 0.0  # between streamed chunks
        self.first_token_delay_s = 0.0  # before the first streamed chunk
        self.overloaded = False  # answer 503 to everything
        self.stream_end = "done"  # "done" | "no_done" (chunked end, no [DONE]) | "cut" (connection dropped)
        self.arrivals: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    body = {
                        "data": [
                            {"id": m, "object": "model", "adapter": m != "tiny-llama"} for m in fake.models
                        ]
                    }
                    self._json(200, body)
                else:
                    self._json(404, {"error": {"type": "not_found", "message": self.path}})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    request = json.loads(raw)
                    model = request["model"]
                except (ValueError, KeyError):
                    self._json(400, {"error": {"type": "invalid_request", "message": "bad body"}})
                    return
                with fake.lock:
                    fake.arrivals.append((time.monotonic(), model))
                if fake.overloaded:
                    self._json(
                        503, {"error": {"type": "overloaded", "message": "queue full"}}, retry_after=True
                    )
                    return
                if model not in fake.models:
                    self._json(404, {"error": {"type": "unknown_adapter", "message": model}})
                    return
                time.sleep(fake.hold_s)
                tokens = int(request.get("max_tokens", 16))
                usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}
                if not request.get("stream"):
                    choice = {"index": 0, "text": "x" * tokens, "finish_reason": "length"}
                    self._json(
                        200,
                        {
                            "id": "c",
                            "object": "text_completion",
                            "model": model,
                            "choices": [choice],
                            "usage": usage,
                        },
                    )
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                time.sleep(fake.first_token_delay_s)
                for index in range(tokens):
                    chunk = {
                        "id": "c",
                        "object": "text_completion",
                        "model": model,
                        "choices": [{"index": 0, "text": "x"}],
                    }
                    if index == tokens - 1:
                        chunk["choices"][0]["finish_reason"] = "length"
                        chunk["usage"] = usage
                    if index == 2 and fake.stream_end == "cut":
                        self.wfile.flush()
                        self.connection.shutdown(2)  # the server dies mid-answer
                        self.close_connection = True
                        return
                    self._chunk(f"data: {json.dumps(chunk)}\n\n")
                    time.sleep(fake.token_delay_s)
                if fake.stream_end == "done":
                    self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True

            def _chunk(self, text: str) -> None:
                data = text.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _json(self, status: int, body: dict, retry_after: bool = False) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry_after:
                    self.send_header("Retry-After", "1")
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up (its timeout) breaks the pipe: expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def serve() -> Iterator[FakeServe]:
    server = FakeServe()
    yield server
    server.close()


def options(url: str, **overrides: object) -> LoadOptions:
    base = {"url": url, "rate": 50.0, "requests": 10, "timeout": 5.0, "max_tokens": 4}
    return LoadOptions(**{**base, **overrides})


# -- the mix and the schedule ----------------------------------------------------------------------------


def test_parse_mix() -> None:
    assert parse_mix("a1=3,a2=1,tiny-llama=1") == (("a1", 3.0), ("a2", 1.0), ("tiny-llama", 1.0))
    assert parse_mix(" a1 = 0.5 , base") == (("a1", 0.5), ("base", 1.0))
    for bad in ("", "a1,,a2", "=3", "a1=0", "a1=-1", "a1=x", "a1=nan", "a1=inf", "a1,a1=2"):
        with pytest.raises(LoadUsageError):
            parse_mix(bad)


def test_plan_slots_are_evenly_spaced_and_bounded_by_duration_or_requests() -> None:
    mix = (("a", 1.0),)
    assert [p.at_s for p in plan(LoadOptions(rate=5, duration=2), mix)] == [i / 5 for i in range(10)]
    assert len(plan(LoadOptions(rate=2.5, duration=1), mix)) == 3  # slots 0, 0.4, 0.8
    assert len(plan(LoadOptions(rate=0.1, duration=1), mix)) == 1
    assert len(plan(LoadOptions(rate=10, duration=60, requests=7), mix)) == 7  # the first bound wins
    assert len(plan(LoadOptions(rate=10, duration=0.5, requests=70), mix)) == 5
    with pytest.raises(LoadUsageError):
        plan(LoadOptions(rate=10), mix)  # no bound
    with pytest.raises(LoadUsageError):
        plan(LoadOptions(rate=1e6, duration=10), mix)  # past MAX_REQUESTS


def test_the_mix_follows_its_weights_and_repeats_with_its_seed() -> None:
    mix = parse_mix("a1=3,a2=1,tiny-llama=1")
    first = [p.model for p in plan(LoadOptions(rate=100, requests=5000, seed=7), mix)]
    again = [p.model for p in plan(LoadOptions(rate=100, requests=5000, seed=7), mix)]
    other = [p.model for p in plan(LoadOptions(rate=100, requests=5000, seed=8), mix)]
    assert first == again
    assert first != other
    counts = Counter(first)
    assert set(counts) == {"a1", "a2", "tiny-llama"}
    assert abs(counts["a1"] / 5000 - 0.6) < 0.03
    assert abs(counts["a2"] / 5000 - 0.2) < 0.03
    assert abs(counts["tiny-llama"] / 5000 - 0.2) < 0.03


def test_percentiles_interpolate_between_the_closest_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([0.7], 99) == 0.7
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    assert percentile([1, 2, 3, 4, 5], 0) == 1
    assert percentile([1, 2, 3, 4, 5], 100) == 5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)


# -- against the server ----------------------------------------------------------------------------------


def test_streaming_run_counts_per_model_what_the_server_saw(serve: FakeServe) -> None:
    serve.first_token_delay_s = 0.05
    serve.token_delay_s = 0.01
    result = run_load(options(serve.url, requests=12, mix=parse_mix("a1=2,tiny-llama=1,nope=1"), seed=3))
    # The server saw the planned models in the planned order (one at a time: 20 ms apart, each ~90 ms,
    # so arrivals can interleave; the multiset is exact).
    planned = [
        p.model for p in plan(options(serve.url, requests=12, seed=3), parse_mix("a1=2,tiny-llama=1,nope=1"))
    ]
    assert Counter(m for _, m in serve.arrivals) == Counter(planned)
    summary = result.summary
    overall = summary["overall"]
    assert overall["scheduled"] == overall["sent"] == overall["answered"] == 12
    assert overall["not_sent"] == {}
    for model, counts in Counter(planned).items():
        per_model = summary["models"][model]
        assert per_model["sent"] == counts
        if model == "nope":
            assert per_model["by_status"] == {"404": counts}
            assert per_model["by_error"] == {"unknown_adapter": counts}
            assert per_model["ok"] == 0
            assert per_model["latency_s"]["count"] == 0
        else:
            assert per_model["by_status"] == {"200": counts}
            assert per_model["by_error"] == {}
            assert per_model["ok"] == counts
            assert per_model["output_tokens"] == 4 * counts
            assert per_model["latency_s"]["count"] == per_model["ttft_s"]["count"] == counts
    assert overall["by_error"] == {"unknown_adapter": Counter(planned)["nope"]}
    ok = [o for o in result.outcomes if o.error is None]
    for outcome in ok:
        # The first text chunk comes after the server's first-token delay, the end after 3 more tokens.
        assert 0.05 <= outcome.ttft_s < outcome.latency_s
        assert outcome.latency_s >= outcome.ttft_s + 0.03
    assert overall["output_tokens"] == 4 * len(ok)
    assert overall["output_tokens_per_s"] == pytest.approx(4 * len(ok) / result.elapsed_s, rel=1e-3)
    text = render(result)
    assert text.splitlines()[0].split()[:4] == ["model", "sent", "not", "sent"]
    assert any(
        line.startswith("nope") and "HTTP 404: " in line and "unknown_adapter: " in line
        for line in text.splitlines()
    )
    assert any(line.startswith("all ") for line in text.splitlines())


def test_non_streaming_has_no_time_to_first_token(serve: FakeServe) -> None:
    result = run_load(options(serve.url, requests=3, stream=False, mix=(("a1", 1.0),)))
    overall = result.summary["overall"]
    assert overall["ok"] == 3
    assert overall["output_tokens"] == 12
    assert overall["ttft_s"]["count"] == 0
    assert overall["latency_s"]["count"] == 3


def test_default_mix_is_every_model_the_server_lists(serve: FakeServe) -> None:
    result = run_load(options(serve.url, requests=30))
    assert [name for name, _ in result.mix] == ["tiny-llama", "a1", "a2"]
    assert set(result.summary["models"]) == {"tiny-llama", "a1", "a2"}
    assert result.summary["overall"]["ok"] == 30


def test_open_loop_requests_start_on_their_slots_not_after_earlier_answers(serve: FakeServe) -> None:
    # Each answer takes 0.4 s; slots are 50 ms apart. A closed loop would start request i after
    # i answers (>= 2 s for the sixth); the open loop starts it at its slot.
    serve.hold_s = 0.4
    before = time.monotonic()  # the schedule's start is later than this
    result = run_load(options(serve.url, rate=20, requests=6, mix=(("a1", 1.0),)))
    arrivals = sorted(t for t, _ in serve.arrivals)
    assert len(arrivals) == 6
    for index, arrived in enumerate(arrivals):
        # Never ahead of its slot: the rate is a bound (the i-th arrival is at or after slot i).
        assert arrived >= before + index / 20
    # ...and not held back by the slow answers.
    assert arrivals[-1] - arrivals[0] < 1.5
    assert result.summary["overall"]["ok"] == 6
    assert all(o.start_lag_s is not None and o.start_lag_s >= 0 for o in result.outcomes)


def test_concurrency_cap_counts_the_requests_it_did_not_send(serve: FakeServe) -> None:
    # 10 slots within 45 ms, each answer held 1.5 s, at most 2 in flight: 2 sent, 8 not sent.
    serve.hold_s = 1.5
    result = run_load(options(serve.url, rate=200, requests=10, concurrency=2, mix=parse_mix("a1,a2")))
    overall = result.summary["overall"]
    assert overall["scheduled"] == 10
    assert overall["sent"] == 2 == len(serve.arrivals)
    assert overall["not_sent"] == {"concurrency_cap": 8}
    assert overall["ok"] == 2
    assert [o.sent for o in result.outcomes] == [True, True] + [False] * 8
    models = result.summary["models"]
    assert sum(m["scheduled"] for m in models.values()) == 10
    assert sum(sum(m["not_sent"].values()) for m in models.values()) == 8
    assert "8 (--concurrency cap reached at its slot)" in render(result)


def test_errors_by_status_and_type(serve: FakeServe) -> None:
    serve.overloaded = True
    result = run_load(options(serve.url, requests=3, mix=(("a1", 1.0),)))
    overall = result.summary["overall"]
    assert overall["by_status"] == {"503": 3}
    assert overall["by_error"] == {"overloaded": 3}
    assert overall["ok"] == 0
    assert result.reached


@pytest.mark.parametrize(("end", "error"), [("no_done", "incomplete_stream"), ("cut", "incomplete_stream")])
def test_a_stream_that_ends_without_done_is_not_a_success(serve: FakeServe, end: str, error: str) -> None:
    serve.stream_end = end
    result = run_load(options(serve.url, requests=2, max_tokens=6, mix=(("a1", 1.0),)))
    overall = result.summary["overall"]
    assert overall["by_status"] == {"200": 2}
    assert overall["by_error"] == {error: 2}
    assert overall["ok"] == 0
    assert overall["output_tokens"] == 0


def test_a_slow_stream_is_cut_at_the_request_timeout(serve: FakeServe) -> None:
    # Chunks every 0.2 s keep every single read under the timeout; the whole request is still bounded.
    serve.token_delay_s = 0.2
    started = time.monotonic()
    result = run_load(options(serve.url, requests=1, max_tokens=20, timeout=0.5, mix=(("a1", 1.0),)))
    assert time.monotonic() - started < 3.0
    outcome = result.outcomes[0]
    assert outcome.status == 200
    assert outcome.error == "timeout"
    assert 0.5 <= outcome.latency_s < 1.0
    assert outcome.ttft_s is not None  # the first chunk came


def test_a_server_that_never_answers_times_out(serve: FakeServe) -> None:
    serve.hold_s = 3.0
    result = run_load(options(serve.url, requests=1, timeout=0.3, mix=(("a1", 1.0),)))
    outcome = result.outcomes[0]
    assert (outcome.status, outcome.error) == (None, "timeout")
    assert outcome.connected
    assert outcome.latency_s < 1.0
    assert result.summary["overall"]["by_status"] == {}
    assert result.summary["overall"]["by_error"] == {"timeout": 1}


def test_unreachable_server() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unreachable):
        run_load(options(url, mix=(("a1", 1.0),)))


def test_summarize_lists_every_model_of_the_mix_even_without_requests() -> None:
    summary = summarize([], 1.0, ["a1", "a2"])
    assert list(summary["models"]) == ["a1", "a2"]
    assert summary["models"]["a1"]["sent"] == 0
    assert summary["overall"]["latency_s"]["p50"] is None


# -- the command -----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli_main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_json_output(serve: FakeServe, tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    code, out, err = run_cli(
        ["load", "--url", serve.url, "--rate", "40", "--requests", "8", "--adapters", "a1=3,nope=1", "--seed", "1",
         "--max-tokens", "3", "--timeout", "5", "--json", str(path)]
    )  # fmt: skip
    assert code == 0, err
    assert "openlora-otel load: 8 requests at 40/s" in err
    document = json.loads(path.read_text())
    assert document["options"] == {
        "url": serve.url,
        "rate": 40.0,
        "duration_s": None,
        "requests": 8,
        "concurrency": 32,
        "mix": {"a1": 3.0, "nope": 1.0},
        "seed": 1,
        "max_tokens": 3,
        "stream": True,
        "prompt_chars": len("the quick brown fox"),
        "timeout_s": 5.0,
    }
    assert document["reached"] is True and document["interrupted"] is False
    assert set(document) == {
        "options",
        "mix",
        "elapsed_s",
        "interrupted",
        "reached",
        "overall",
        "models",
        "requests",
    }
    assert len(document["requests"]) == 8
    assert set(document["requests"][0]) == {
        "model", "scheduled_s", "sent", "not_sent", "start_lag_s", "status", "error", "latency_s", "ttft_s", "output_tokens",
    }  # fmt: skip
    sent = Counter(r["model"] for r in document["requests"])
    assert Counter(m for _, m in serve.arrivals) == sent
    assert document["models"]["nope"]["by_error"] == {"unknown_adapter": sent["nope"]}
    assert document["models"]["a1"]["ok"] == sent["a1"]
    assert document["overall"]["output_tokens"] == 3 * sent["a1"]
    latency = document["models"]["a1"]["latency_s"]
    assert set(latency) == {"count", "mean", "min", "max", "p50", "p95", "p99"}
    assert latency["min"] <= latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    # The printed table has the same numbers.
    row = next(line for line in out.splitlines() if line.startswith("a1 "))
    assert row.split()[1:4] == [str(sent["a1"]), "0", str(sent["a1"])]


def test_cli_unreachable_exits_1_and_says_so_in_the_json(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = run_cli(
        ["load", "--url", url, "--requests", "2", "--adapters", "a1", "--json", str(path)]
    )
    assert code == 1
    assert f"openlora-otel load: cannot connect to 127.0.0.1:{url.rsplit(':', 1)[1]} (" in err
    assert out == ""
    assert "cannot connect" in json.loads(path.read_text())["error"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--rate", "0"],
        ["--rate", "nan"],
        ["--requests", "0"],
        ["--duration", "-1"],
        ["--concurrency", "0"],
        ["--adapters", "a1=0"],
        ["--adapters", "a1,,a2"],
        ["--url", "ftp://127.0.0.1:8000"],
        ["--url", "http://127.0.0.1:99999"],
        ["--rate", "100000", "--duration", "100"],
        ["--json", "/nonexistent-dir/x.json"],
    ],
)
def test_cli_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        run_cli(["load", "--adapters", "a1", *argv] if "--adapters" not in argv else ["load", *argv])
    assert stopped.value.code == 2


def test_cli_without_adapters_uses_the_servers_list_and_a_server_without_it_is_a_usage_error(
    serve: FakeServe,
) -> None:
    code, _, err = run_cli(
        ["load", "--url", serve.url, "--rate", "50", "--requests", "3", "--max-tokens", "2"]
    )
    assert code == 0, err
    assert "mix tiny-llama=1,a1=1,a2=1" in err
    code, _, err = run_cli(["load", "--url", serve.url + "/nothing-here", "--requests", "1"])
    assert code == 2
    assert f"GET {serve.url}/nothing-here/v1/models answered 404; pass --adapters" in err

"""The load generator behind ``openlora-otel load``: bounded and open-loop, for ``serve``'s HTTP protocol.

Request ``i`` goes out ``i / rate`` seconds after the start whatever the earlier ones are doing, so a
slow server shows as latency and errors, not as a lower rate; ``concurrency`` caps the requests in
flight (a request past it is counted as not sent). It reports what the clients saw, to hold the
server's metrics against. Standard library only; every wait is bounded.
See docs/how-to/load-testing.md.
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from openlora_otel.redaction import redact, redact_url, url_secrets

__all__ = [
    "LoadOptions",
    "LoadResult",
    "Outcome",
    "Planned",
    "Unreachable",
    "check_options",
    "parse_mix",
    "percentile",
    "plan",
    "run_load",
    "summarize",
]

DEFAULT_URL = "http://127.0.0.1:8000"
# Lower case and plain punctuation: the demo model (`openlora-otel serve`) knows no other characters.
DEFAULT_PROMPT = "the quick brown fox"
# The plan is built up front (one small object per request): this bounds its memory.
MAX_REQUESTS = 1_000_000
# An error body is read for its error.type only; a server that sends megabytes there is not our concern.
_ERROR_BODY_LIMIT = 64 * 1024
# Why a request was not sent.
NOT_SENT_CONCURRENCY = "concurrency_cap"


class Unreachable(Exception):
    """Nothing answers at the URL: not one connection could be made."""


class LoadUsageError(ValueError):
    """The options cannot make a run (or the server cannot say which models to use)."""


@dataclass(frozen=True)
class LoadOptions:
    """One run of the load generator. ``duration`` and ``requests`` bound it; the first reached wins."""

    url: str = DEFAULT_URL
    rate: float = 1.0
    duration: float | None = None
    requests: int | None = None
    concurrency: int = 32
    # (model name, weight); empty: every model GET /v1/models lists, weight 1 each.
    mix: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    max_tokens: int = 16
    stream: bool = True
    prompt: str = DEFAULT_PROMPT
    timeout: float = 30.0

    def planned_count(self) -> int:
        """How many request slots the schedule has: slots at 0, 1/rate, ... before ``duration``, at most ``requests``."""
        if self.duration is None and self.requests is None:
            raise LoadUsageError("give --duration or --requests (or both): the run needs a bound")
        counts = []
        if self.requests is not None:
            counts.append(self.requests)
        if self.duration is not None:
            # Slots i/rate < duration; the epsilon keeps rate*duration = 10.000000001 at 10 slots.
            counts.append(max(1, math.ceil(self.rate * self.duration - 1e-9)))
        return min(counts)

    @property
    def shown_url(self) -> str:
        """``url`` as printed and written: without its user info, query values and fragment."""
        return redact_url(self.url)

    def as_json(self) -> dict[str, Any]:
        return {
            "url": self.shown_url,
            "rate": self.rate,
            "duration_s": self.duration,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "mix": dict(self.mix),
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "prompt_chars": len(self.prompt),
            "timeout_s": self.timeout,
        }


@dataclass(frozen=True)
class Planned:
    """One slot of the schedule: request ``index`` starts ``at_s`` seconds after the run's start."""

    index: int
    at_s: float
    model: str


@dataclass
class Outcome:
    """What happened to one planned request (times in seconds)."""

    model: str
    scheduled_s: float
    sent: bool = False
    # Why it was not sent (NOT_SENT_CONCURRENCY), else None.
    not_sent: str | None = None
    # How much later than its slot it started: the generator's own lag, 0 when it keeps up.
    start_lag_s: float | None = None
    # A TCP connection was made (the server was reached, whatever it answered).
    connected: bool = False
    status: int | None = None
    # None: a complete, successful answer. Else the server's error.type (4xx/5xx bodies), http_<status>
    # without one, or the client-side kind: timeout, connection_refused, connection_error,
    # disconnected, incomplete_stream, bad_response.
    error: str | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int | None = None
    # When it finished, from the run's start.
    end_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "scheduled_s": _round(self.scheduled_s),
            "sent": self.sent,
            "not_sent": self.not_sent,
            "start_lag_s": _round(self.start_lag_s),
            "status": self.status,
            "error": self.error,
            "latency_s": _round(self.latency_s),
            "ttft_s": _round(self.ttft_s),
            "output_tokens": self.output_tokens,
        }


@dataclass
class LoadResult:
    options: LoadOptions
    mix: tuple[tuple[str, float], ...]
    outcomes: list[Outcome]
    elapsed_s: float
    interrupted: bool = False
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def reached(self) -> bool:
        """Whether any request connected (or nothing was sent, so there was nothing to reach)."""
        sent = [o for o in self.outcomes if o.sent]
        return not sent or any(o.connected for o in sent)

    def as_json(self) -> dict[str, Any]:
        return {
            "options": self.options.as_json(),
            "mix": dict(self.mix),
            "elapsed_s": _round(self.elapsed_s),
            "interrupted": self.interrupted,
            "reached": self.reached,
            **self.summary,
            "requests": [o.as_json() for o in self.outcomes],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


# -- the mix and the schedule ----------------------------------------------------------------------------


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``a1=3,a2=1,tiny-llama`` -> ((a1, 3.0), (a2, 1.0), (tiny-llama, 1.0)); a name alone weighs 1."""
    mix: list[tuple[str, float]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise LoadUsageError(f"empty entry in {text!r}; expected NAME[=WEIGHT],NAME[=WEIGHT],...")
        name, equals, weight_text = part.partition("=")
        name = name.strip()
        if not name:
            raise LoadUsageError(f"{part!r} has no model name; expected NAME[=WEIGHT]")
        weight = 1.0
        if equals:
            try:
                weight = float(weight_text)
            except ValueError:
                raise LoadUsageError(f"{part!r}: the weight must be a number > 0") from None
            if not (weight > 0 and math.isfinite(weight)):
                raise LoadUsageError(f"{part!r}: the weight must be a number > 0")
        if name in dict(mix):
            raise LoadUsageError(f"{name!r} is named twice in {text!r}")
        mix.append((name, weight))
    return tuple(mix)


def plan(options: LoadOptions, mix: Sequence[tuple[str, float]]) -> list[Planned]:
    """The run's schedule: evenly spaced slots, each with a model drawn from ``mix`` (seeded)."""
    count = options.planned_count()
    if count > MAX_REQUESTS:
        raise LoadUsageError(f"{count:,} requests planned; at most {MAX_REQUESTS:,} per run")
    if not mix:
        raise LoadUsageError("no model to send requests to")
    names = [name for name, _ in mix]
    picks = random.Random(options.seed).choices(names, weights=[w for _, w in mix], k=count)
    return [Planned(index, index / options.rate, model) for index, model in enumerate(picks)]


# -- one request -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> _Target:
        """``url`` checked as every URL argument is (:func:`openlora_otel.config.checks.check_url`); LoadUsageError,
        which never shows its password, if it cannot be used."""
        from openlora_otel.config import ConfigError
        from openlora_otel.config.checks import check_url

        try:
            parts = check_url("--url", url)
        except ConfigError as exc:
            raise LoadUsageError(str(exc)) from None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname or "", port, parts.path.rstrip("/"))

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def check_reachable(self, timeout: float) -> None:
        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
        except OSError as exc:
            raise Unreachable(
                f"cannot connect to {self.host}:{self.port} ({_describe(exc)}); is the server running?"
            ) from None


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _client_error(exc: BaseException) -> str:
    """The kind of a failure seen on the client side (no HTTP answer, or a broken one)."""
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError since 3.10
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(exc, ConnectionError | http.client.RemoteDisconnected | http.client.IncompleteRead):
        return "disconnected"
    if isinstance(exc, http.client.HTTPException | ValueError):
        return "bad_response"
    return "connection_error"


class _Deadline:
    """The request's time limit, applied to every socket operation so the whole request is bounded."""

    def __init__(self, timeout: float) -> None:
        self.end = time.monotonic() + timeout

    def arm(self, sock: socket.socket | None) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("request timeout")
        if sock is not None:
            sock.settimeout(left)


def _error_type(status: int, body: bytes) -> str:
    """The server's error.type from a contract error body (OpenAI's ``code``, else its ``type``), else http_<status>."""
    try:
        error = json.loads(body)["error"]
        kind = error.get("code") or error["type"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"http_{status}"
    return kind if isinstance(kind, str) and kind else f"http_{status}"


def _read(
    response: http.client.HTTPResponse, sock: socket.socket | None, deadline: _Deadline, limit: int
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        deadline.arm(sock)
        chunk = response.read1(min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _usage_tokens(document: Any) -> int | None:
    try:
        tokens = document["usage"]["completion_tokens"]
    except (KeyError, TypeError):
        return None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def _chunk_text(document: Any) -> str:
    try:
        text = document["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return ""
    return text if isinstance(text, str) else ""


def _read_stream(
    response: http.client.HTTPResponse,
    sock: socket.socket | None,
    deadline: _Deadline,
    started: float,
    outcome: Outcome,
) -> None:
    """Read an SSE stream to ``data: [DONE]``: the first chunk with text, the last usage, the end."""
    data: list[str] = []
    while True:
        deadline.arm(sock)
        try:
            raw = response.readline(1 << 20)
        except (http.client.IncompleteRead, ConnectionError):  # the server went away mid-answer
            raw = b""
        if not raw:  # closed before [DONE]
            outcome.error = "incomplete_stream"
            return
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            # A field's value loses one leading space (the SSE spec); lines of one event join with \n.
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
            continue
        if line or not data:  # another field, a comment (":"), or a blank line with no event
            continue
        payload = "\n".join(data)
        data = []
        if payload.strip() == "[DONE]":
            return
        document = json.loads(payload)  # ValueError -> bad_response
        if isinstance(document, dict) and isinstance(document.get("error"), dict):
            error = document["error"]
            outcome.error = str(error.get("code") or error.get("type") or "stream_error")
            return
        if outcome.ttft_s is None and _chunk_text(document):
            outcome.ttft_s = time.monotonic() - started
        tokens = _usage_tokens(document)
        if tokens is not None:
            outcome.output_tokens = tokens


def _send(target: _Target, options: LoadOptions, body: bytes, outcome: Outcome) -> None:
    """Send one request and fill ``outcome`` in; never raises."""
    started = time.monotonic()
    deadline = _Deadline(options.timeout)
    connection = target.connection(options.timeout)
    try:
        connection.connect()
        outcome.connected = True
        # getresponse() hands the socket to the response and clears connection.sock: keep it to arm reads.
        sock = connection.sock
        deadline.arm(sock)
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if options.stream else "application/json",
            "Connection": "close",
        }
        connection.request("POST", f"{target.prefix}/v1/completions", body=body, headers=headers)
        deadline.arm(sock)
        response = connection.getresponse()
        outcome.status = response.status
        if not 200 <= response.status < 300:
            outcome.error = _error_type(response.status, _read(response, sock, deadline, _ERROR_BODY_LIMIT))
        elif response.getheader("Content-Type", "").startswith("text/event-stream"):
            _read_stream(response, sock, deadline, started, outcome)
        else:
            document = json.loads(_read(response, sock, deadline, 1 << 30))
            if isinstance(document, dict) and isinstance(document.get("choices"), list):
                outcome.output_tokens = _usage_tokens(document)
            else:
                outcome.error = "bad_response"
    except Exception as exc:  # every failure is an outcome, counted by kind
        if outcome.error is None:
            outcome.error = _client_error(exc)
    finally:
        connection.close()
        outcome.latency_s = time.monotonic() - started


# -- the run ---------------------------------------------------------------------------------------------


def list_models(url: str, timeout: float) -> tuple[tuple[str, float], ...]:
    """Every model id GET /v1/models lists, weight 1 each (the default mix)."""
    target = _Target.parse(url)
    models_url = redact_url(url.rstrip("/") + "/v1/models")
    deadline = _Deadline(timeout)
    connection = target.connection(timeout)
    try:
        connection.connect()
        sock = connection.sock
        connection.request("GET", f"{target.prefix}/v1/models", headers={"Connection": "close"})
        deadline.arm(sock)
        response = connection.getresponse()
        body = _read(response, sock, deadline, 1 << 24)
    except (OSError, http.client.HTTPException) as exc:
        raise Unreachable(redact(f"GET {models_url} failed: {_describe(exc)}", url_secrets(url))) from None
    finally:
        connection.close()
    if response.status != 200:
        raise LoadUsageError(f"GET {models_url} answered {response.status}; pass --adapters")
    try:
        names = [entry["id"] for entry in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise LoadUsageError(
            "GET /v1/models did not list models as {data: [{id}]}; pass --adapters"
        ) from None
    if not names or not all(isinstance(name, str) and name for name in names):
        raise LoadUsageError("GET /v1/models listed no model; pass --adapters")
    return tuple((name, 1.0) for name in names)


def run_load(options: LoadOptions, *, log: TextIO | None = None) -> LoadResult:
    """Run the schedule to its end (or Ctrl-C) and return every request's outcome with the summary.

    Raises Unreachable when no connection can be made to the URL, LoadUsageError for options that make
    no run. Bounded: the schedule's length plus one request ``timeout`` (and a little slack).
    """
    target = _Target.parse(options.url)
    options.planned_count()  # the bound is checked before anything touches the network
    target.check_reachable(min(options.timeout, 5.0))
    mix = options.mix or list_models(options.url, min(options.timeout, 10.0))
    schedule = plan(options, mix)
    if log is not None:
        print(
            f"openlora-otel load: {len(schedule)} requests at {options.rate:g}/s "
            f"(over {schedule[-1].at_s:.1f} s) to {options.shown_url}, "
            f"{'streaming' if options.stream else 'not streaming'}, max_tokens {options.max_tokens}, "
            f"at most {options.concurrency} in flight; mix "
            + ",".join(f"{name}={weight:g}" for name, weight in mix),
            file=log,
        )
    outcomes: list[Outcome] = []
    jobs: queue.SimpleQueue[tuple[Planned, Outcome] | None] = queue.SimpleQueue()
    lock = threading.Lock()
    in_flight = 0
    start = time.monotonic()

    def work() -> None:
        nonlocal in_flight
        while (job := jobs.get()) is not None:
            planned, outcome = job
            outcome.start_lag_s = time.monotonic() - (start + planned.at_s)
            body = json.dumps(
                {
                    "model": planned.model,
                    "prompt": options.prompt,
                    "max_tokens": options.max_tokens,
                    "stream": options.stream,
                    # The usage (output tokens) comes in a last chunk only when asked for, as in OpenAI's API.
                    **({"stream_options": {"include_usage": True}} if options.stream else {}),
                }
            ).encode()
            _send(target, options, body, outcome)
            outcome.end_s = time.monotonic() - start
            with lock:
                in_flight -= 1

    # As many workers as requests may be in flight: a request admitted under the cap never waits for one.
    workers = [
        threading.Thread(target=work, name=f"openlora-load-{n}", daemon=True)
        for n in range(min(options.concurrency, len(schedule)))
    ]
    for worker in workers:
        worker.start()
    interrupted = False
    try:
        for planned in schedule:
            delay = start + planned.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            outcome = Outcome(model=planned.model, scheduled_s=planned.at_s)
            outcomes.append(outcome)
            with lock:
                admitted = in_flight < options.concurrency
                if admitted:
                    in_flight += 1
            if admitted:
                outcome.sent = True
                jobs.put((planned, outcome))
            else:
                outcome.not_sent = NOT_SENT_CONCURRENCY
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for _ in workers:
            jobs.put(None)
        # Every request ends by its own timeout; the slack covers thread start and the last writes.
        until = time.monotonic() + options.timeout + 5.0
        for worker in workers:
            worker.join(max(0.0, until - time.monotonic()))
    for outcome in outcomes:
        if outcome.sent and outcome.latency_s is None:  # a worker still stuck past every deadline
            outcome.error = outcome.error or "unfinished"
    ends = [o.end_s for o in outcomes if o.end_s is not None]
    elapsed = max(ends) if ends else time.monotonic() - start
    result = LoadResult(
        options=options, mix=tuple(mix), outcomes=outcomes, elapsed_s=elapsed, interrupted=interrupted
    )
    result.summary = summarize(outcomes, elapsed, [name for name, _ in mix])
    return result


# -- the numbers -----------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between the closest ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "mean": _round(sum(values) / len(values)) if values else None,
        "min": _round(min(values)) if values else None,
        "max": _round(max(values)) if values else None,
        **{f"p{q}": _round(percentile(values, q)) for q in (50, 95, 99)},
    }


def _summary(outcomes: Sequence[Outcome], elapsed_s: float) -> dict[str, Any]:
    sent = [o for o in outcomes if o.sent]
    ok = [o for o in sent if o.error is None]
    tokens = sum(o.output_tokens or 0 for o in ok)
    lags = [o.start_lag_s for o in sent if o.start_lag_s is not None]
    return {
        "scheduled": len(outcomes),
        "sent": len(sent),
        "not_sent": dict(sorted(Counter(o.not_sent for o in outcomes if not o.sent).items())),
        "answered": sum(1 for o in sent if o.status is not None),
        "ok": len(ok),
        "by_status": dict(sorted(Counter(str(o.status) for o in sent if o.status is not None).items())),
        "by_error": dict(sorted(Counter(o.error for o in sent if o.error is not None).items())),
        # Over the successful requests only: a fast 404 is not a fast completion.
        "latency_s": _stats([o.latency_s for o in ok if o.latency_s is not None]),
        "ttft_s": _stats([o.ttft_s for o in ok if o.ttft_s is not None]),
        "output_tokens": tokens,
        "output_tokens_per_s": _round(tokens / elapsed_s) if elapsed_s > 0 else None,
        "max_start_lag_s": _round(max(lags)) if lags else None,
    }


def summarize(outcomes: Sequence[Outcome], elapsed_s: float, models: Sequence[str] = ()) -> dict[str, Any]:
    """``{"overall": {...}, "models": {name: {...}}}``: every model of ``models`` (in that order), then any other."""
    names = list(dict.fromkeys([*models, *(o.model for o in outcomes)]))
    return {
        "overall": _summary(outcomes, elapsed_s),
        "models": {name: _summary([o for o in outcomes if o.model == name], elapsed_s) for name in names},
    }


def _ms(stats: dict[str, Any]) -> str:
    if not stats["count"]:
        return "-"
    return "/".join(f"{stats[key] * 1000:.0f}" for key in ("p50", "p95", "p99"))


def _failures(summary: dict[str, Any]) -> str:
    parts = [
        f"HTTP {status}: {count}"
        for status, count in summary["by_status"].items()
        if not status.startswith("2")
    ]
    parts += [f"{error}: {count}" for error, count in summary["by_error"].items()]
    return ", ".join(parts) or "-"


def render(result: LoadResult) -> str:
    """The report as a text table: one row per model, then ``all``."""
    header = (
        "model",
        "sent",
        "not sent",
        "ok",
        "latency ms p50/95/99",
        "ttft ms p50/95/99",
        "out tok/s",
        "failures",
    )
    rows = []
    for name, summary in [*result.summary["models"].items(), ("all", result.summary["overall"])]:
        not_sent = sum(summary["not_sent"].values())
        rate = summary["output_tokens_per_s"]
        rows.append(
            (
                name,
                str(summary["sent"]),
                str(not_sent),
                str(summary["ok"]),
                _ms(summary["latency_s"]),
                _ms(summary["ttft_s"]),
                "-" if rate is None else f"{rate:.1f}",
                _failures(summary),
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    overall = result.summary["overall"]
    notes = [f"{overall['scheduled']} scheduled in {result.elapsed_s:.1f} s"]
    if overall["not_sent"]:
        notes.append(
            "not sent: "
            + ", ".join(
                f"{count} ({'--concurrency cap reached at its slot' if why == NOT_SENT_CONCURRENCY else why})"
                for why, count in overall["not_sent"].items()
            )
        )
    if overall["max_start_lag_s"] is not None and overall["max_start_lag_s"] > 0.05:
        notes.append(f"the generator started a request up to {overall['max_start_lag_s'] * 1000:.0f} ms late")
    if result.interrupted:
        notes.append("interrupted: the schedule was cut short")
    return "\n".join([*lines, "; ".join(notes)])


def check_options(options: LoadOptions) -> None:
    """Refuse, before anything is sent, a URL that is not http(s)://host[:port] and a schedule of more than
    :data:`MAX_REQUESTS` requests (LoadUsageError)."""
    _Target.parse(options.url)
    if options.planned_count() > MAX_REQUESTS:
        raise LoadUsageError(
            f"--rate x --duration plans more than {MAX_REQUESTS:,} requests; at most {MAX_REQUESTS:,}"
        )

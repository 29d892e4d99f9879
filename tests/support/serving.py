"""``openlora-otel serve`` for tests: a saved demo directory and a real serve process on loopback ports.

Shared by tests/serving/test_serve.py and the serve + load end-to-end tests. Every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import child_env, free_port, reap

ROOT = Path(__file__).resolve().parent.parent.parent
# What the serve process needs: the `serve` extra (tests/serving/test_serve.py skips on the same list, written out: its
# imports follow the skips).
SERVE_MODULES = ("torch", "transformers", "peft", "fastapi", "uvicorn", "opentelemetry.instrumentation.fastapi")


def needs_serve() -> None:
    """Skip unless the `serve` extra is installed."""
    for module in SERVE_MODULES:
        pytest.importorskip(module)


def save_demo(
    directory: Path,
    name: str,
    *,
    seed: int = 0,
    steps: int = 4,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> str:
    """Train a tiny adapter with ``openlora-otel demo --save directory --run-name name`` (more ``env`` for
    the demo: a history directory, say); its output."""
    argv = [
        sys.executable,
        "-m",
        "openlora_otel",
        "demo",
        *("--steps", str(steps), "--batch-size", "2", "--eval-every", "0", "--exporter", "none", "-q"),
        *("--save", str(directory), "--run-name", name, "--seed", str(seed)),
    ]
    done = subprocess.run(argv, env=child_env(**(env or {})), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class EventStream:
    """One streaming completion read event by event over its own connection (close() disconnects)."""

    def __init__(self, port: int, body: dict[str, Any], timeout: float = 60.0) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.connection.request(
            "POST", "/v1/completions", body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"}
        )
        self.response = self.connection.getresponse()
        self.status = self.response.status

    def next(self) -> Any:
        """The next event's data: a dict, or the string "[DONE]"; None when the stream ended."""
        data = None
        for _ in range(10000):  # lines of one event: bounded
            line = self.response.readline()
            if not line:
                return data
            text = line.decode().rstrip("\n")
            if text.startswith("data: "):
                payload = text[len("data: ") :]
                data = payload if payload == "[DONE]" else json.loads(payload)
            elif text == "" and data is not None:
                return data
        raise AssertionError("an event longer than 10000 lines")

    def rest(self) -> list[Any]:
        """Every remaining event up to and including "[DONE]" (or the end of the stream)."""
        events = []
        for _ in range(100000):
            event = self.next()
            if event is None:
                return events
            events.append(event)
            if event == "[DONE]":
                return events
        raise AssertionError("more than 100000 events")

    def close(self) -> None:
        self.response.close()
        self.connection.close()


class ServeProcess:
    """``python -m openlora_otel serve DIR ...`` on free loopback ports (HTTP and Prometheus)."""

    def __init__(self, directory: Path, *args: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = workdir / f"serve-{self.port}.log"
        argv = [sys.executable, "-m", "openlora_otel", "serve", str(directory), "--port", str(self.port), *args]
        environment = child_env(
            OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(self.metrics_port),
            **(env or {}),
        )
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(argv, env=environment, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 240.0) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve not ready within {timeout} s:\n{self.log()[-3000:]}")

    def request(self, method: str, path: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any, Any]:
        """Status, headers (case-insensitive) and decoded JSON body (raw text when it is not JSON)."""
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, headers, raw = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, headers, raw = error.code, error.headers, error.read()
        try:
            return status, headers, json.loads(raw)
        except ValueError:
            return status, headers, raw.decode()

    def complete(self, body: Any, timeout: float = 120.0) -> tuple[int, Any, Any]:
        return self.request("POST", "/v1/completions", body, timeout)

    def stream(self, body: dict[str, Any], timeout: float = 60.0) -> EventStream:
        return EventStream(self.port, body, timeout)

    def metrics(self, *, scraper: bool = False) -> str:
        """The Prometheus exposition; ``scraper``: ask as Prometheus does, which the final-scrape wait counts."""
        headers = {"Accept": "text/plain;version=0.0.4"} if scraper else {}
        request = urllib.request.Request(self.metrics_url, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed past ``timeout``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        reap(self.process, timeout)
        return self.process.returncode


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), sample.value


def total(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    return sum(
        value
        for sample, sample_labels, value in samples(text)
        if sample == name and all(sample_labels.get(k, "") == v for k, v in labels.items())
    )


def has(text: str, name: str, **labels: str) -> bool:
    return any(
        sample == name and all(sample_labels.get(k, "") == v for k, v in labels.items())
        for sample, sample_labels, _ in samples(text)
    )


def requests_by(text: str) -> dict[tuple[str, str], float]:
    """Request counts by (adapter, error_type) from ``gen_ai_server_request_duration_seconds_count``."""
    counts: dict[tuple[str, str], float] = {}
    for sample, labels, value in samples(text):
        if sample == "gen_ai_server_request_duration_seconds_count":
            key = (labels.get("openlora_adapter_name", ""), labels.get("error_type", ""))
            counts[key] = counts.get(key, 0) + value
    return counts


# -- in process: the app on an untrained base, called over ASGI ------------------------------------------


class InProcessServe:
    """``build_app`` on a freshly drawn, tiny (untrained) demo base saved under ``directory``: no child
    process, the real protocol, service, limits and generation. Each ``post`` is one ASGI call;
    ``close()`` stops the worker threads and the telemetry."""

    def __init__(
        self, directory: Path, *, max_new_tokens_limit: int = 4, route_hints: bool = True, reader: Any = None
    ) -> None:
        """``route_hints``: as ServeOptions'; ``reader``: a metric reader for the telemetry (in-memory)."""
        import torch
        import transformers

        from openlora_otel import TelemetryConfig, setup_telemetry
        from openlora_otel.model.corpus import ALPHABET
        from openlora_otel.model.layout import save_base
        from openlora_otel.serving.model import ServedModels
        from openlora_otel.serving.server import CompletionService, ServeOptions, build_app

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=len(ALPHABET),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )
        base = save_base(
            directory,
            transformers.LlamaForCausalLM(config),
            alphabet=ALPHABET,
            base_model="tiny-llama",
            context_length=16,
        )
        self.models = ServedModels(base, device="cpu")
        self.telemetry = setup_telemetry(
            config=TelemetryConfig(exporters=("none",), handle_sigterm=False),
            metric_readers=[reader] if reader is not None else (),
        )
        self.service = CompletionService(
            self.models,
            self.telemetry,
            ServeOptions(max_new_tokens_limit=max_new_tokens_limit, route_hints=route_hints),
        )
        self.app = build_app(self.service, self.telemetry)

    def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of ``POST path`` with ``body`` (see :func:`asgi_post`)."""
        return asgi_post(self.app, path, body)

    def close(self) -> None:
        self.service.close()
        self.telemetry.shutdown()


def asgi_call(
    app: Any, path: str, body: bytes, *, method: str = "POST", pieces: int = 1, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """The messages the ASGI ``app`` sends for one request (``body`` in ``pieces`` messages), called in
    process within ``timeout`` seconds. The client stays until the whole answer is sent (a stream ends
    early when it disconnects); an exception the app raises (Starlette re-raises a 500's) is raised here."""
    import asyncio

    sent: list[dict[str, Any]] = []
    size = max(1, -(-len(body) // pieces))
    incoming = [
        {"type": "http.request", "body": body[i : i + size], "more_body": i + size < len(body)}
        for i in range(0, max(len(body), 1), size)
    ]
    answered: asyncio.Event | None = None

    async def receive() -> dict[str, Any]:
        nonlocal answered
        if incoming:
            return incoming.pop(0)
        answered = answered or asyncio.Event()
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal answered
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            answered = answered or asyncio.Event()
            answered.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout))
    return sent


def asgi_post(app: Any, path: str, body: bytes, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one ``POST path`` with a JSON ``body``, sent to the ASGI ``app`` in process
    (:func:`asgi_call`)."""
    sent = asgi_call(app, path, body, timeout=timeout)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {name.decode().lower(): value.decode() for name, value in start.get("headers", [])}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, body

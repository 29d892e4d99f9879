"""The middlewares under real multi-worker servers: a Flask app (tests/support/flask_openai_app.py,
OpenAIMetricsWSGIMiddleware) under gunicorn and a FastAPI app (tests/support/openai_app.py,
OpenAIMetricsMiddleware) under ``uvicorn --workers``, four workers each, every worker setting up its
own telemetry in the app factory the server calls in it.

Each worker is restarted by its master mid-run (gunicorn ``--max-requests``, uvicorn
``--limit-max-requests``) and the server is stopped with SIGTERM at the end, as a deployment ends it.
On both paths, every request the official ``openai`` client made is counted exactly once, by adapter
and ``error.type``, with the tokens and first tokens the client saw:

- pull: each worker's own port (``OTEL_EXPORTER_PROMETHEUS_PORT=0``), registered for Prometheus 2.42's
  file_sd (``OPENLORA_PROMETHEUS_FILE_SD_DIR``), kept open at a worker's exit for one more scrape
  (``OPENLORA_PROMETHEUS_EXPECT_SCRAPE=true``: even a worker never scraped yet); every file removed at the end;
- push: OTLP every second to Prometheus 3.16's OTLP receiver, the final push at a worker's exit.

A worker's counters are its own series (its ``instance``: the port it was given, or its
``service.instance.id``), so the total is the sum over workers of each series' last value.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("flask")
pytest.importorskip("gunicorn")

import openai

from tests.support.metrics_paths import push_env
from tests.support.polling import wait_until
from tests.support.processes import child_env, free_port, reap
from tests.support.prometheus_server import Prometheus

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
REQUESTS = 150  # five kinds, 30 each
MAX_REQUESTS = 15  # per worker before its master restarts it: each worker restarts at least once, early enough
# that the restarted ones get requests too (at 25 a loaded CI machine once gave them none: 4 instances seen)
RUN_ID = "multi-worker"
PROMPT = "one two three four five six seven"
DURATION_COUNT = "gen_ai_server_request_duration_seconds_count"
TTFT_COUNT = "gen_ai_server_time_to_first_token_seconds_count"
TOKENS = "openlora_inference_token_usage_sum"

SERVERS = {
    "gunicorn-flask": lambda port: [
        sys.executable, "-m", "gunicorn", "--workers", str(WORKERS), "--bind", f"127.0.0.1:{port}",
        "--max-requests", str(MAX_REQUESTS), "--no-control-socket", "--log-level", "warning",
        "tests.support.flask_openai_app:measured_app()",
    ],
    "uvicorn-asgi": lambda port: [
        sys.executable, "-m", "uvicorn", "--factory", "tests.support.openai_app:measured_app",
        "--workers", str(WORKERS), "--host", "127.0.0.1", "--port", str(port),
        "--limit-max-requests", str(MAX_REQUESTS), "--log-level", "warning",
    ],
}  # fmt: skip


def one_request(client: openai.OpenAI, index: int) -> tuple[tuple[str, str], int, int, bool]:
    """Request ``index`` of the mix, as the client saw it: (adapter, error.type), input and output
    tokens, whether its time to first token is recorded (a successful request's)."""
    kind, max_tokens = index % 5, index % 7 + 1
    messages = [{"role": "user", "content": PROMPT}]
    if kind == 0:  # plain chat
        answer = client.chat.completions.create(model="a1", messages=messages, max_completion_tokens=max_tokens)
        return ("a1", ""), answer.usage.prompt_tokens, answer.usage.completion_tokens, True
    if kind == 1:  # streamed chat, usage asked for
        stream = client.chat.completions.create(
            model="a2", messages=messages, max_completion_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]
        return ("a2", ""), usage.prompt_tokens, usage.completion_tokens, True
    if kind == 2:  # streamed completion without usage: its content chunks count, no input tokens
        stream = client.completions.create(model="a3", prompt=PROMPT, max_tokens=max_tokens, stream=True)
        return ("a3", ""), 0, sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text), True
    if kind == 3:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="refuse", messages=messages)
        return ("refuse", "invalid_request_error"), 0, 0, False
    with pytest.raises(openai.APIError) as caught:
        for _ in client.chat.completions.create(model="breaks", messages=messages, stream=True):
            pass
    if isinstance(caught.value, openai.APIConnectionError):
        raise caught.value  # not the stream's error event: the connection (retried())
    return ("breaks", "generation_failed"), 0, 0, False  # a failed request has no time to first token


def retried(client: openai.OpenAI, index: int) -> tuple[tuple[str, str], int, int, bool]:
    """:func:`one_request`, sent again (up to twice) only when the connection failed before an answer:
    a uvicorn worker that reaches its request limit closes the connections it accepted but has not
    read a request from yet, and a client whose request went out on one just then gets "Server
    disconnected without sending a response" (the app never saw it: counted once). Nothing else is
    retried (a timeout, a 5xx or an error inside a stream would be counted twice)."""
    for attempt in range(3):
        try:
            return one_request(client, index)
        except openai.APIConnectionError as exc:
            if isinstance(exc, openai.APITimeoutError) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# Each worker's series joined to its target_info (last seen in the window: a restarted worker's is
# stale by now), for the run: the same on the pull path and over OTLP.
JOIN = f' * on (job, instance) group_left last_over_time(target_info{{openlora_run_id="{RUN_ID}"}}[10m])'


def last_sum(prometheus: Prometheus, name: str, selector: str = "", by: str = "") -> dict[tuple[str, ...], float]:
    """The sum, over every worker's series of ``name`` (``selector``: more label matchers), of its last
    value, by the comma-separated labels ``by``."""
    expr = f"sum by ({by}) (last_over_time({name}{{{selector}}}[10m]){JOIN})"
    labels = [label.strip() for label in by.split(",") if label.strip()]
    return {
        tuple(series["metric"].get(label, "") for label in labels): float(series["value"][1])
        for series in prometheus.query(expr)
    }


@pytest.mark.parametrize("path", ["pull", "push"])
@pytest.mark.parametrize("server", sorted(SERVERS))
def test_every_request_is_counted_once_across_workers_restarts_and_the_stop(
    tmp_path: Path, server: str, path: str
) -> None:
    sd = tmp_path / "sd"
    env = {"OPENLORA_RUN_ID": RUN_ID, "OPENLORA_HOST_METRICS": "false", "OPENLORA_QUIET": "true"}
    if path == "pull":
        prometheus = Prometheus(tmp_path, [], file_sd=[f"{sd}/*.json"], major=2)
        env |= {
            "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
            "OPENLORA_PROMETHEUS_FILE_SD_DIR": str(sd),
            "OPENLORA_PROMETHEUS_EXPECT_SCRAPE": "true",
        }
    else:
        shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "otlp.yml").read_text())
        prometheus = Prometheus(
            tmp_path, [], major=3, extra_args=("--web.enable-otlp-receiver",),
            blocks={"otlp": shipped["otlp"], "storage": shipped["storage"]},
        )  # fmt: skip
        env |= push_env(f"{prometheus.url}/api/v1/otlp")
    port = free_port()
    process = None
    try:
        # A session of its own: its workers go with it if the test has to kill it (uvicorn's spawned
        # workers outlive a killed master).
        process = subprocess.Popen(
            SERVERS[server](port), cwd=ROOT, env=child_env(**env),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        assert wait_until(lambda: healthy(port) or process.poll() is not None, 60) and process.poll() is None, (
            process.communicate()[0] if process.poll() is not None else "not healthy in 60 s"
        )
        seen: Counter = Counter()
        tokens: Counter = Counter()
        first_tokens = 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        with client, ThreadPoolExecutor(8) as pool:
            for key, input_tokens, output_tokens, first in pool.map(lambda i: retried(client, i), range(REQUESTS)):
                seen[key] += 1
                tokens["input"] += input_tokens
                tokens["output"] += output_tokens
                first_tokens += first
        process.send_signal(signal.SIGTERM)  # as a deployment stops it: each worker exits gracefully
        output, _ = process.communicate(timeout=90)
        assert process.returncode == 0, output
        assert "openlora_otel/" not in output, output  # no traceback through our code in any worker
        assert wait_until(lambda: not group_alive(process.pid), 10), "a worker outlived its master"
        if path == "pull":
            assert list(sd.glob("*.json")) == []  # every worker removed its file after its final scrape

        expected = {key: float(count) for key, count in seen.items()}

        def counted() -> dict[tuple[str, ...], float]:
            return last_sum(prometheus, DURATION_COUNT, by="openlora_adapter_name, error_type")

        assert wait_until(lambda: counted() == expected, 30), (counted(), expected)
        assert last_sum(prometheus, TOKENS, 'gen_ai_token_type="input"') == {(): tokens["input"]}
        assert last_sum(prometheus, TOKENS, 'gen_ai_token_type="output"') == {(): tokens["output"]}
        assert last_sum(prometheus, TTFT_COUNT) == {(): first_tokens}
        # Every worker process its own series, the restarted ones included: more than the workers.
        (workers,) = prometheus.query(f'count(last_over_time(target_info{{openlora_run_id="{RUN_ID}"}}[10m]))')
        assert int(workers["value"][1]) > WORKERS, workers
        print(f"{server} {path}: {REQUESTS} requests over {workers['value'][1]} worker processes, all counted")
    finally:
        if process is not None:
            if group_alive(process.pid):
                os.killpg(process.pid, signal.SIGKILL)
            reap(process, 10)
        prometheus.stop()


def group_alive(group: int) -> bool:
    """Whether any process of process group ``group`` is still running."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True

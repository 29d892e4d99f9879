"""OpenAIMetricsMiddleware around a plain FastAPI app that knows nothing of metrics
(tests/support/openai_app.py), under uvicorn, driven by the official ``openai`` client: the requests,
outcomes and tokens on its pull endpoint are exactly what the client saw."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai

from tests.support.processes import child_env, free_port, reap
from tests.support.serving import total

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "tests" / "support" / "openai_app.py"
DURATION_COUNT = "gen_ai_server_request_duration_seconds_count"
TTFT_COUNT = "gen_ai_server_time_to_first_token_seconds_count"
TOKENS = "openlora_inference_token_usage_sum"
PROMPT = "one two three four five six seven"


@pytest.mark.process
def test_the_middleware_counts_what_the_openai_client_saw(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    app = subprocess.Popen(
        [sys.executable, str(APP), "--port", str(port)],
        env=child_env(OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port), OPENLORA_HOST_METRICS="false", OPENLORA_QUIET="true"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert app.stdout is not None and app.stdout.readline().strip() == "ready", "the app did not start"
        seen: Counter = Counter()  # (adapter, error.type) -> requests
        tokens = Counter()  # input / output, as the client counted them
        first_tokens = 0
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            for max_tokens in (2, 5, 9):  # plain chat
                answer = client.chat.completions.create(
                    model="a1", messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=max_tokens
                )
                tokens["input"] += answer.usage.prompt_tokens
                tokens["output"] += answer.usage.completion_tokens
                seen[("a1", "")] += 1
                first_tokens += 1
            for max_tokens in (3, 6):  # streamed chat, usage asked for
                stream = client.chat.completions.create(
                    model="a1", messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=max_tokens,
                    stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                usage = [chunk.usage for chunk in stream if chunk.usage is not None]
                tokens["input"] += usage[0].prompt_tokens
                tokens["output"] += usage[0].completion_tokens
                seen[("a1", "")] += 1
                first_tokens += 1
            for max_tokens in (4, 7):  # streamed completion, no usage: its content chunks count
                stream = client.completions.create(model="a2", prompt=PROMPT, max_tokens=max_tokens, stream=True)
                tokens["output"] += sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)
                seen[("a2", "")] += 1
                first_tokens += 1
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="refuse", messages=[{"role": "user", "content": PROMPT}])
            seen[("refuse", "invalid_request_error")] += 1  # a 400: its type, a name the alert leaves out
            with pytest.raises(openai.APIError):
                for _ in client.chat.completions.create(
                    model="breaks", messages=[{"role": "user", "content": PROMPT}], stream=True
                ):
                    pass
            seen[("breaks", "generation_failed")] += 1
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        app.terminate()
        reap(app, 30)
    for (adapter, error), count in seen.items():
        recorded = total(text, DURATION_COUNT, openlora_adapter_name=adapter, error_type=error)
        assert recorded == count, (adapter, error, recorded, count)
    assert total(text, DURATION_COUNT) == sum(seen.values())
    assert total(text, TOKENS, gen_ai_token_type="input") == tokens["input"]
    # A failed request counts in the duration only: "breaks"'s one chunk is no output token.
    assert total(text, TOKENS, gen_ai_token_type="output") == tokens["output"]
    assert total(text, TTFT_COUNT) == first_tokens
    assert total(text, DURATION_COUNT, gen_ai_operation_name="text_completion") == 2

"""`openlora-otel demo --save` and `openlora-otel serve`: a real server on loopback, real HTTP, its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("opentelemetry.instrumentation.fastapi")

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.cli import main
from openlora_otel.demo.options import DemoOptions
from openlora_otel.demo.train import run_demo
from openlora_otel.model.corpus import ALPHABET
from openlora_otel.model.layout import LayoutError, SavedBase, read_adapter, read_saved
from openlora_otel.serving.model import AdapterMismatchError, Cancelled, Sampling, ServedModels, _held_back
from openlora_otel.serving.server import Admission, Overloaded
from tests.support.polling import wait_until
from tests.support.serving import ServeProcess, has, requests_by, samples, save_demo, total

PROMPT = "the engineer trains "


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved demo with adapters a1 (the CLI, which also saves the base) and a2 (run_demo, on that base)."""
    directory = tmp_path_factory.mktemp("saved") / "demo"
    output = save_demo(directory, "a1", seed=0)
    assert f"adapter saved to {directory / 'adapters' / 'a1'}" in output
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), handle_sigterm=False))
    try:
        options = DemoOptions(
            steps=4, batch_size=2, eval_every=0, quiet=True, seed=1, save_dir=str(directory), adapter_name="a2"
        )
        result = run_demo(options, telemetry, where="memory")
    finally:
        telemetry.shutdown()
    assert result.saved == str(directory / "adapters" / "a2")
    return directory


@pytest.fixture(scope="module")
def server(saved: Path, tmp_path_factory: pytest.TempPathFactory):
    """One generation at a time and one waiting: the queue is easy to fill."""
    serve = ServeProcess(saved, "--max-concurrency", "1", "--max-queue", "1", workdir=tmp_path_factory.mktemp("serve"))
    try:
        yield serve.wait_ready()
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def models(saved: Path) -> ServedModels:
    base, adapters = read_saved(saved)
    served = ServedModels(base)
    for adapter in adapters:
        served.load_adapter(adapter)
    return served


# -- the saved directory ------------------------------------------------------------------


@pytest.mark.process
def test_demo_save_writes_the_base_once_and_one_adapter_per_run(saved: Path) -> None:
    base, adapters = read_saved(saved)
    assert base.base_model == "tiny-llama" and base.alphabet == ALPHABET and base.context_length == 64
    assert {p.name for p in base.path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "openlora.json"}
    assert [a.name for a in adapters] == ["a1", "a2"]
    # a2 was trained on the base a1's run saved, not on a base drawn from its own seed.
    assert {a.base_fingerprint for a in adapters} == {base.fingerprint}
    for adapter in adapters:
        assert (adapter.path / "adapter_model.safetensors").is_file()
    info = json.loads((saved / "adapters" / "a2" / "openlora.json").read_text())
    assert info["seed"] == 1 and info["steps"] == 4
    # The training run, for the served adapter's info series: a1 was named, a2's name is its run id.
    a1 = json.loads((saved / "adapters" / "a1" / "openlora.json").read_text())
    assert a1["run_name"] == "a1" and a1["run_id"] and a1["run_id"] != info["run_id"]
    assert info["run_name"] == info["run_id"] and math.isfinite(info["final_eval_loss"])
    # Small: the 0.7 M parameter base in float32, the adapters a tenth of it.
    assert (base.path / "model.safetensors").stat().st_size < 4_000_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run-name", "base"], "'base' is reserved"),
        (["--run-name", "tiny-llama"], "is the base model's name"),
        (["--run-name", "has space"], "is not a valid adapter name"),
    ],
)
def test_demo_save_refuses_a_bad_adapter_name_before_training(tmp_path, args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--exporter", "none", "--save", str(tmp_path / "d"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_demo_save_into_a_broken_directory_is_a_usage_error(tmp_path, capsys) -> None:
    (tmp_path / "base").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--exporter", "none", "--save", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "not a directory saved by `openlora-otel demo --save`" in capsys.readouterr().err


# -- the model, in process ------------------------------------------------------------------


@pytest.mark.process
def test_each_adapter_is_its_own_merged_model(models: ServedModels) -> None:
    torch = models.torch
    ids = torch.tensor([models.encode(PROMPT)])
    with torch.inference_mode():
        logits = {name: models._adapters[name](input_ids=ids).logits for name in models.adapters}
        logits["base"] = models._base_module(input_ids=ids).logits
    # Trained LoRA weights (B starts at zero: any step moves it) change every adapter's output.
    assert not torch.allclose(logits["a1"], logits["base"])
    assert not torch.allclose(logits["a2"], logits["base"])
    assert not torch.allclose(logits["a1"], logits["a2"])


@pytest.mark.process
def test_generation_is_greedy_deterministic_and_calls_back_once_per_token(models: ServedModels) -> None:
    pieces: list[str] = []
    completion = models.generate("a1", models.encode(PROMPT), 12, on_token=pieces.append)
    assert completion.finish_reason == "length" and completion.completion_tokens == 12
    assert completion.prompt_tokens == len(PROMPT) and len(pieces) == 12
    assert "".join(pieces) == completion.text and len(completion.text) == 12
    assert models.generate("a1", models.encode(PROMPT), 12).text == completion.text


@pytest.mark.process
def test_sampling_is_reproducible_per_seed_and_top_p_zero_is_greedy(models: ServedModels) -> None:
    torch = models.torch

    def sampled(seed: int, temperature: float = 1.5, top_p: float = 1.0) -> str:
        generator = torch.Generator()
        generator.manual_seed(seed)
        sampling = Sampling(temperature=temperature, top_p=top_p, generator=generator)
        return models.generate("a1", models.encode(PROMPT), 24, sampling=sampling).text

    greedy = models.generate("a1", models.encode(PROMPT), 24).text
    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in range(4)}) > 1  # a barely trained model: its draws differ
    assert sampled(7, top_p=0.0) == greedy == sampled(8, top_p=0.0)  # the nucleus holds the top token alone


@pytest.mark.process
def test_a_stop_string_ends_the_text_and_is_held_back_while_it_may_complete(models: ServedModels) -> None:
    full = models.generate(None, models.encode(PROMPT), 16).text
    stop = full[5:7]
    expected = full[: full.index(stop)]
    pieces: list[str] = []
    completion = models.generate(None, models.encode(PROMPT), 16, stop=("zzzz", stop), on_token=pieces.append)
    assert completion.finish_reason == "stop" and completion.text == expected
    assert "".join(pieces) == expected  # nothing of the stop string was handed out
    assert completion.completion_tokens == len(expected) + len(stop)


def test_held_back_is_the_longest_start_of_a_stop_string() -> None:
    assert _held_back("abc", ()) == 0
    assert _held_back("xab", ("abz",)) == 2
    assert _held_back("xab", ("bq", "abz")) == 2
    assert _held_back("xa", ("ab", "q")) == 1
    assert _held_back("xa", ("a",)) == 0  # a whole stop string is a hit, not a start


@pytest.mark.process
def test_generation_stops_when_cancelled(models: ServedModels) -> None:
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) > 3

    with pytest.raises(Cancelled):
        models.generate("a2", models.encode(PROMPT), 100, cancelled=cancelled)
    assert len(calls) == 4


@pytest.mark.process
def test_an_adapter_trained_on_another_base_is_refused(models: ServedModels, saved: Path, tmp_path) -> None:
    from openlora_otel.model.layout import read_adapter

    other = tmp_path / "other"
    shutil.copytree(saved / "adapters" / "a1", other)
    info = json.loads((other / "openlora.json").read_text())
    (other / "openlora.json").write_text(json.dumps({**info, "base_fingerprint": "0000000000000000"}))
    with pytest.raises(AdapterMismatchError, match="was trained on base 0000000000000000"):
        models.load_adapter(read_adapter("stranger", other))
    assert not models.has_adapter("stranger")


# -- admission ----------------------------------------------------------------------------


def test_admission_runs_n_queues_m_refuses_the_rest_first_come_first_served() -> None:
    async def scenario() -> list[str]:
        admission = Admission(max_running=1, max_waiting=2)
        first = admission.enter()
        second, third = admission.enter(), admission.enter()
        with pytest.raises(Overloaded):
            admission.enter()
        order: list[str] = []

        async def run(name: str, ticket) -> None:
            await ticket.wait()
            order.append(name)
            ticket.release()

        tasks = [asyncio.create_task(run("third", third)), asyncio.create_task(run("second", second))]
        await asyncio.sleep(0)
        assert order == [] and admission.running == 1 and admission.waiting == 2
        first.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert admission.running == 0 and admission.waiting == 0
        return order

    assert asyncio.run(scenario()) == ["second", "third"]


def test_a_waiter_that_gives_up_leaves_the_queue() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_waiting=1)
        running = admission.enter()
        waiting = admission.enter()
        waiter = asyncio.create_task(waiting.wait())
        await asyncio.sleep(0)
        waiter.cancel()
        waiting.release_when_done()
        assert admission.waiting == 0
        admission.enter().release_when_done()  # the place is free again
        running.release()
        assert admission.running == 0

    asyncio.run(scenario())


# -- the server over HTTP ---------------------------------------------------------------


@pytest.mark.process
def test_models_lists_the_base_and_every_adapter(server: ServeProcess) -> None:
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200
    assert body["object"] == "list"
    created = body["data"][0]["created"]
    assert isinstance(created, int) and created > 0
    entry = {"object": "model", "created": created, "owned_by": "openlora"}
    assert body["data"] == [
        {"id": "tiny-llama", **entry, "root": "tiny-llama", "parent": None, "adapter": False},
        {"id": "a1", **entry, "root": "a1", "parent": "tiny-llama", "adapter": True},
        {"id": "a2", **entry, "root": "a2", "parent": "tiny-llama", "adapter": True},
    ]
    assert server.request("GET", "/v1/models/a2") == (200, mock.ANY, body["data"][2])
    status, _, missing = server.request("GET", "/v1/models/nope")
    assert status == 404 and missing["error"]["code"] == "unknown_adapter" and missing["error"]["param"] == "model"
    status, _, missing = server.request("GET", "/v1/no-such-route")
    assert status == 404 and missing["error"]["type"] == "invalid_request_error"
    assert server.request("GET", "/health")[0] == 200


@pytest.mark.process
def test_completions_per_adapter_match_the_model_in_process(server: ServeProcess, models: ServedModels) -> None:
    for model, adapter in (("tiny-llama", None), ("a1", "a1"), ("a2", "a2")):
        status, _, body = server.complete({"model": model, "prompt": PROMPT, "max_tokens": 7})
        assert status == 200, body
        expected = models.generate(adapter, models.encode(PROMPT), 7).text
        assert body["object"] == "text_completion" and body["model"] == model and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": expected, "finish_reason": "length", "logprobs": None}]
        assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 7, "total_tokens": len(PROMPT) + 7}
    status, _, body = server.complete({"model": "a1", "prompt": PROMPT})
    assert body["usage"]["completion_tokens"] == 16  # the default max_tokens


@pytest.mark.process
def test_streaming_sends_one_event_per_token_then_usage_then_done(server: ServeProcess) -> None:
    _, _, whole = server.complete({"model": "a2", "prompt": PROMPT, "max_tokens": 9})
    plain = server.stream({"model": "a2", "prompt": PROMPT, "max_tokens": 9})
    try:
        without_usage = plain.rest()
    finally:
        plain.close()
    # No usage in the stream unless stream_options.include_usage asks for it.
    assert len(without_usage) == 11 and not any("usage" in e for e in without_usage[:-1])
    stream = server.stream(
        {"model": "a2", "prompt": PROMPT, "max_tokens": 9, "stream_options": {"include_usage": True}}
    )
    try:
        assert stream.status == 200
        assert stream.response.getheader("Content-Type").startswith("text/event-stream")
        events = stream.rest()
    finally:
        stream.close()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 11  # nine tokens, the finish reason, then the usage in a chunk of its own
    assert all(c["id"] == chunks[0]["id"] and c["model"] == "a2" for c in chunks)
    # Every chunk before the last says "usage": null (OpenAI's spec, with include_usage).
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in chunks[:-2])
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0] == {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
    assert chunks[-2]["usage"] is None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.process
def test_a_stop_string_over_http(server: ServeProcess) -> None:
    _, _, whole = server.complete({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12})
    text = whole["choices"][0]["text"]
    stop = text[4:6]
    status, _, body = server.complete({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "stop": [stop]})
    assert status == 200
    assert body["choices"][0] == {"index": 0, "text": text[: text.index(stop)], "finish_reason": "stop", "logprobs": None}
    stream = server.stream({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "stop": stop})
    try:
        events = stream.rest()
    finally:
        stream.close()
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[: text.index(stop)]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.process
def test_an_unknown_adapter_is_404_and_counted_as_other(server: ServeProcess) -> None:
    before = requests_by(server.metrics())
    status, _, body = server.complete({"model": "no-such-adapter", "prompt": PROMPT})
    assert status == 404
    assert body["error"]["code"] == "unknown_adapter" and body["error"]["type"] == "invalid_request_error"
    assert "no-such-adapter" in body["error"]["message"] and "a1" in body["error"]["message"]
    after = wait_until(
        lambda: (m := requests_by(server.metrics())).get(("other", "unknown_adapter"), 0)
        > before.get(("other", "unknown_adapter"), 0)
        and m,
        10,
        "the 404 counted",
        interval=0.1,
    )
    assert after[("other", "unknown_adapter")] == before.get(("other", "unknown_adapter"), 0) + 1
    assert not any(adapter == "no-such-adapter" for adapter, _ in after)


@pytest.mark.process
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the body is not JSON"),
        ([1, 2], "must be a JSON object"),
        ({"prompt": PROMPT}, "'model' must be a non-empty string"),
        ({"model": "a1", "prompt": ""}, "'prompt' must be a string of 1 to 4000"),
        ({"model": "a1", "prompt": "x" * 4001}, "'prompt' must be a string of 1 to 4000"),
        ({"model": "a1", "prompt": 5}, "'prompt' must be a string"),
        ({"model": "a1", "prompt": "Hello"}, "character 'H' is not in the demo alphabet"),
        ({"model": "a1", "prompt": PROMPT, "max_tokens": 0}, "'max_tokens' must be an integer from 1 to 512"),
        ({"model": "a1", "prompt": PROMPT, "max_tokens": 513}, "from 1 to 512, got 513"),
        ({"model": "a1", "prompt": PROMPT, "max_tokens": True}, "'max_tokens' must be an integer"),
        ({"model": "a1", "prompt": PROMPT, "stream": "yes"}, "'stream' must be true or false"),
        ({"model": "a1", "prompt": PROMPT, "stop": ["a"] * 5}, "'stop' must be a string or a list"),
        ({"model": "a1", "prompt": PROMPT, "stop": 3}, "'stop' must be a string or a list"),
    ],
)
def test_bad_input_is_400_with_a_clear_message(server: ServeProcess, body, message) -> None:
    status, _, answer = server.complete(body)
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_request" and answer["error"]["type"] == "invalid_request_error"
    assert message in answer["error"]["message"]


@pytest.mark.process
@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"logprobs": 0}, "logprobs"),  # 0 still asks for the chosen token's
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/completions", {"max_completion_tokens": 4}, "max_completion_tokens"),  # chat's name
        ("/v1/completions", {"no_such_field": 1}, "no_such_field"),
        ("/v1/chat/completions", {"presence_penalty": -1}, "presence_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ],
)
def test_an_unsupported_parameter_is_400_naming_it(server: ServeProcess, path, extra, param) -> None:
    body = {"model": "a1", "max_tokens": 2, **extra}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    status, _, answer = server.request("POST", path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["code"] == "invalid_request"
    assert param.split(".")[-1] in answer["error"]["message"]


@pytest.mark.process
def test_parameters_at_their_off_value_and_user_are_accepted(server: ServeProcess) -> None:
    off = {"echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "user": "u"}
    status, _, answer = server.complete({"model": "a1", "prompt": PROMPT, "max_tokens": 2, **off})
    assert status == 200, answer


@pytest.mark.process
def test_bad_input_is_counted_under_its_adapter_or_other(server: ServeProcess) -> None:
    before = requests_by(server.metrics())
    server.complete({"model": "a2", "prompt": PROMPT, "max_tokens": -1})
    server.complete(b"[")
    expected = {
        ("a2", "invalid_request"): before.get(("a2", "invalid_request"), 0) + 1,
        ("other", "invalid_request"): before.get(("other", "invalid_request"), 0) + 1,
    }
    wait_until(
        lambda: all(requests_by(server.metrics()).get(k, 0) == v for k, v in expected.items()),
        10,
        str(expected),
        interval=0.1,
    )


@pytest.mark.process
def test_past_the_queue_503_and_a_disconnected_stream_is_cancelled(server: ServeProcess) -> None:
    """--max-concurrency 1 --max-queue 1: one runs, one waits, the third is refused."""
    before = requests_by(server.metrics())
    running = server.stream({"model": "a1", "prompt": PROMPT, "max_tokens": 512})
    waiting = None
    try:
        assert running.next()["model"] == "a1"  # generating
        waiting = server.stream({"model": "a2", "prompt": PROMPT, "max_tokens": 512})
        assert waiting.status == 200  # headers first; its events wait for the slot
        wait_until(
            lambda: total(server.metrics(), "openlora_inference_requests_waiting", openlora_adapter_name="a2") == 1,
            10,
            "a2 waiting",
            interval=0.1,
        )
        status, headers, body = server.complete({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1})
        assert status == 503
        assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "server_error"
        assert headers["Retry-After"] == "1"
        running.close()  # the client goes away: its generation stops, the waiting one gets the slot
        assert waiting.next()["model"] == "a2"
        assert total(server.metrics(), "openlora_inference_requests_running", openlora_adapter_name="a2") == 1
    finally:
        running.close()
        if waiting is not None:
            waiting.close()
    expected = {
        ("base", "overloaded"): before.get(("base", "overloaded"), 0) + 1,
        ("a1", "cancelled"): before.get(("a1", "cancelled"), 0) + 1,
        ("a2", "cancelled"): before.get(("a2", "cancelled"), 0) + 1,
    }
    wait_until(
        lambda: all(requests_by(server.metrics()).get(k, 0) == v for k, v in expected.items()),
        30,
        f"{expected} in {requests_by(server.metrics())}",
        interval=0.1,
    )
    text = server.metrics()
    assert total(text, "openlora_inference_requests_running") == 0
    assert total(text, "openlora_inference_requests_waiting") == 0
    # The slot is free again.
    assert server.complete({"model": "a1", "prompt": PROMPT, "max_tokens": 2})[0] == 200


@pytest.mark.process
def test_metrics_per_adapter_ttft_tokens_loaded_and_http(server: ServeProcess) -> None:
    def ok(text: str, adapter: str) -> float:
        return total(text, "gen_ai_server_request_duration_seconds_count", openlora_adapter_name=adapter, error_type="")

    def settled() -> str | None:
        # A request is counted once its last piece went out, after the client may have read it: the
        # earlier test's last request must be counted before, not after (it ends running and counts at once).
        text = server.metrics()
        return text if total(text, "openlora_inference_requests_running") == 0 else None

    before = wait_until(settled, 10, "the earlier requests counted", interval=0.05)
    for model in ("a1", "a1", "a2", "tiny-llama"):
        assert server.complete({"model": model, "prompt": PROMPT, "max_tokens": 3})[0] == 200
    assert server.complete({"model": "nope", "prompt": PROMPT})[0] == 404
    stream = server.stream({"model": "a2", "prompt": PROMPT, "max_tokens": 4})
    try:
        assert stream.rest()[-1] == "[DONE]"
    finally:
        stream.close()
    def counted() -> str | None:
        text = server.metrics()
        return text if ok(text, "a2") == ok(before, "a2") + 2 else None

    after = wait_until(counted, 10, "a2's requests", interval=0.1)
    assert ok(after, "a1") == ok(before, "a1") + 2
    assert ok(after, "base") == ok(before, "base") + 1
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert total(after, ttft, openlora_adapter_name="a2") == total(before, ttft, openlora_adapter_name="a2") + 2
    usage = "openlora_inference_token_usage_sum"
    out = {"openlora_adapter_name": "a1", "gen_ai_token_type": "output"}
    assert total(after, usage, **out) == total(before, usage, **out) + 6
    prompt = {"openlora_adapter_name": "a1", "gen_ai_token_type": "input"}
    assert total(after, usage, **prompt) == total(before, usage, **prompt) + 2 * len(PROMPT)
    for name in ("a1", "a2"):
        assert total(after, "openlora_inference_adapter_loaded", openlora_adapter_name=name) == 1
        assert total(after, "openlora_inference_adapter_load_duration_seconds_count", openlora_adapter_name=name) == 1
    # gen_ai.request.model: the name asked for (the adapter's; "other" for one not served); the response: the base.
    bucket = "gen_ai_server_request_duration_seconds_bucket"
    common = {"gen_ai_response_model": "tiny-llama", "gen_ai_provider_name": "openlora",
              "gen_ai_operation_name": "text_completion"}  # fmt: skip
    for adapter, model in (("a1", "a1"), ("a2", "a2"), ("base", "tiny-llama"), ("other", "other")):
        assert has(after, bucket, openlora_adapter_name=adapter, gen_ai_request_model=model, **common), adapter
    # The generic HTTP series come from opentelemetry-instrumentation-fastapi, under the stable HTTP conventions.
    http = {"http_route": "/v1/completions", "http_request_method": "POST", "url_scheme": "http"}
    assert total(after, "http_server_request_duration_seconds_count", http_response_status_code="200", **http) >= 5
    assert has(after, "http_server_request_duration_seconds_count", http_response_status_code="404", **http)
    assert has(after, "http_server_active_requests", http_request_method="POST", url_scheme="http")
    assert not has(after, "http_server_duration_milliseconds_count")  # the old conventions' name
    assert has(after, "target_info", service_name="openlora-serve")


# -- the command: lifecycle and usage -------------------------------------------------------------


@pytest.mark.process
def test_sigterm_lets_the_stream_finish_delivers_the_final_values_and_exits_0(saved: Path, tmp_path) -> None:
    stranger = tmp_path / "stranger"  # an adapter of another base: its load fails, the server goes on
    shutil.copytree(saved / "adapters" / "a2", stranger)
    info = json.loads((stranger / "openlora.json").read_text())
    (stranger / "openlora.json").write_text(json.dumps({**info, "base_fingerprint": "0000000000000000"}))
    serve = ServeProcess(
        saved,
        *("--adapter", f"again={saved / 'adapters' / 'a1'}", "--adapter", f"broken={stranger}"),
        workdir=tmp_path,
        env={"OTEL_SEMCONV_STABILITY_OPT_IN": "http/dup"},  # the user's choice wins: both conventions
    )
    try:
        serve.wait_ready()
        assert "adapter 'broken'" in serve.log() and "did not load (AdapterMismatchError" in serve.log()
        ids = [m["id"] for m in serve.request("GET", "/v1/models")[2]["data"]]
        assert ids == ["tiny-llama", "a1", "a2", "again"]
        text = serve.metrics(scraper=True)  # scraped: shutdown() will wait for one more scrape
        assert total(text, "openlora_inference_adapter_load_duration_seconds_count", openlora_adapter_name="broken",
                     error_type="AdapterMismatchError") == 1  # fmt: skip
        assert total(text, "openlora_inference_adapter_loaded", openlora_adapter_name="broken") == 0
        assert has(text, "http_server_request_duration_seconds_count", http_route="/health")
        assert has(text, "http_server_duration_milliseconds_count", http_target="/health")
        stream = serve.stream(
            {"model": "again", "prompt": PROMPT, "max_tokens": 60, "stream_options": {"include_usage": True}}
        )
        assert stream.next()["choices"][0]["finish_reason"] is None
        serve.process.send_signal(signal.SIGTERM)
        # New connections are refused once the server stops listening.
        wait_until(lambda: not _accepts(serve.port), 20, "the listening socket closed", interval=0.1)
        scrapes: list[str] = []

        def scrape_until_exit() -> bool:
            with contextlib.suppress(OSError):
                scrapes.append(serve.metrics(scraper=True))
            return serve.process.poll() is not None

        events = stream.rest()
        stream.close()
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 60
        wait_until(scrape_until_exit, 60, "serve exits", interval=0.2)
    finally:
        status = serve.stop()
    assert status == 0, serve.log()[-3000:]
    assert "stopped by SIGTERM" in serve.log()
    # The last scrape, the one shutdown() waited for, holds the request that finished after the signal.
    ok = {"openlora_adapter_name": "again", "error_type": ""}
    assert total(scrapes[-1], "gen_ai_server_request_duration_seconds_count", **ok) == 1


@pytest.mark.process
def test_past_the_shutdown_timeout_a_stream_ends_with_a_cancelled_event(saved: Path, tmp_path) -> None:
    serve = ServeProcess(saved, "--shutdown-timeout", "0.2", workdir=tmp_path)
    try:
        serve.wait_ready()
        serve.metrics(scraper=True)
        stream = serve.stream({"model": "a1", "prompt": PROMPT, "max_tokens": 512})
        assert stream.next()["model"] == "a1"
        serve.process.send_signal(signal.SIGTERM)
        scrapes: list[str] = []

        def scrape_until_exit() -> bool:
            with contextlib.suppress(OSError):
                scrapes.append(serve.metrics(scraper=True))
            return serve.process.poll() is not None

        events = stream.rest()
        stream.close()
        wait_until(scrape_until_exit, 60, "serve exits", interval=0.2)
    finally:
        status = serve.stop()
    assert status == 0, serve.log()[-3000:]
    # Cut off at the next token after the grace time, with a last event that says why.
    assert events[-1] == {
        "error": {"message": "the server is stopping", "type": "server_error", "param": None, "code": "cancelled"}
    }
    assert len(events) < 512
    assert "Traceback" not in serve.log()
    assert total(scrapes[-1], "gen_ai_server_request_duration_seconds_count", openlora_adapter_name="a1",
                 error_type="cancelled") == 1  # fmt: skip


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "is not a directory"),
        (["{empty}"], "is not a directory saved by `openlora-otel demo --save`"),
        (["{saved}", "--adapter", "nameonly"], "expected NAME=PATH"),
        (["{saved}", "--adapter", "base={saved}/adapters/a1"], "'base' is reserved"),
        (["{saved}", "--adapter", "tiny-llama={saved}/adapters/a1"], "is the base model's name"),
        (["{saved}", "--adapter", "a1={saved}/adapters/a2"], "an adapter named 'a1' is already served"),
        (["{saved}", "--adapter", "x={missing}"], "is not a directory"),
        (["{saved}", "--adapter", "x={saved}/base"], "holds no adapter_config.json"),
        (["{saved}", "--max-new-tokens-limit", "513"], "at most 512"),
        (["{saved}", "--chat-default-max-tokens", "600"], "--chat-default-max-tokens: at most --max-new-tokens-limit (512), got 600"),
        (["{saved}", "--max-new-tokens-limit", "8", "--chat-default-max-tokens", "9"], "at most --max-new-tokens-limit (8)"),
        (["{saved}", "--port", "70000"], "is not a TCP port"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(saved: Path, tmp_path, args, message, capsys) -> None:
    (tmp_path / "empty").mkdir()
    places = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "saved": saved}
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *(arg.format(**places) for arg in args)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.process
def test_a_port_in_use_is_a_clear_error(saved: Path, capsys) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", str(saved), "--port", str(port), "--exporter", "none"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.process
def test_each_served_adapter_has_one_info_series_naming_its_training_run(server: ServeProcess, saved: Path) -> None:
    text = server.metrics()
    base, adapters = read_saved(saved)
    for adapter in adapters:
        manifest = json.loads((adapter.path / "openlora.json").read_text())
        found = [
            labels
            for name, labels, value in samples(text)
            if name == "openlora_inference_adapter_info" and labels.get("openlora_adapter_name") == adapter.name
        ]
        assert len(found) == 1, found
        assert {k: v for k, v in found[0].items() if not k.startswith("otel_scope_")} == {
            "openlora_adapter_name": adapter.name,
            "openlora_training_run_id": manifest["run_id"],
            "openlora_training_run_name": manifest["run_name"],
            "openlora_adapter_base_model": "tiny-llama",
            "openlora_adapter_base_fingerprint": base.fingerprint,
            "openlora_training_final_eval_loss": f"{manifest['final_eval_loss']:.6g}",
        }, found
    infos = [labels for name, labels, _ in samples(text) if name == "openlora_inference_adapter_info"]
    assert len(infos) == len(adapters) == 2
    # The server's own run id stays in target_info: the training run's never takes its label.
    assert not [labels for labels in infos if "openlora_run_id" in labels]


def test_an_adapter_without_a_manifest_or_an_older_one_gives_what_is_known(tmp_path: Path) -> None:
    base = SavedBase(tmp_path / "base", "tiny-llama", 64, ALPHABET, "0123456789abcdef")
    bare = tmp_path / "bare"  # a PEFT adapter from elsewhere: no openlora.json
    bare.mkdir()
    (bare / "adapter_config.json").write_text("{}")
    assert read_adapter("bare", bare).origin(base).attributes() == {"openlora.adapter.base_model": "tiny-llama"}
    older = tmp_path / "older"  # written before the demo saved the run's name
    older.mkdir()
    (older / "adapter_config.json").write_text("{}")
    manifest = {"format": 1, "base_fingerprint": base.fingerprint, "seed": 0, "steps": 4, "final_eval_loss": 3.25,
                "run_id": "4f1c0a2b"}  # fmt: skip
    (older / "openlora.json").write_text(json.dumps(manifest))
    assert read_adapter("older", older).origin(base).attributes() == {
        "openlora.training.run.id": "4f1c0a2b",
        "openlora.adapter.base_model": "tiny-llama",
        "openlora.adapter.base_fingerprint": base.fingerprint,
        "openlora.training.final_eval_loss": "3.25",
    }


def test_read_saved_names_what_is_wrong(tmp_path) -> None:
    with pytest.raises(LayoutError, match="is not a directory"):
        read_saved(tmp_path / "nothing")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "openlora.json").write_text('{"format": 99}')
    with pytest.raises(LayoutError, match="format 99, this version reads 1"):
        read_saved(tmp_path)


@pytest.mark.process
def test_importing_the_package_imports_no_server_stack() -> None:
    code = (
        "import sys, openlora_otel, openlora_otel.cli, openlora_otel.inference; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_replaced_directory_is_never_deleted_while_it_is_the_one_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old adapter is moved aside before the new one moves in: at no moment is half of one in place."""
    from openlora_otel.model import layout

    target = tmp_path / "adapters" / "a1"

    def writer(text: str):
        def write(directory: Path) -> None:
            (directory / "weights").write_text(text)

        return write

    assert layout._replace_dir(target, writer("old"), keep_existing=False)
    deleted_while_in_place = []
    real_rmtree = shutil.rmtree

    def watching_rmtree(path, *args, **kwargs):
        if Path(path) == target:
            deleted_while_in_place.append(path)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(layout.shutil, "rmtree", watching_rmtree)
    assert layout._replace_dir(target, writer("new"), keep_existing=False)
    assert deleted_while_in_place == []
    assert (target / "weights").read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a1"]  # nothing left aside
    # keep_existing: the one in place wins and the written one is dropped.
    assert not layout._replace_dir(target, writer("other"), keep_existing=True)
    assert (target / "weights").read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a1"]


def test_connections_accepted_by_serve_have_nagle_off() -> None:
    """A kept-alive client's first streamed event must not wait for the previous response's ACK."""
    import socket

    from openlora_otel.serving.server import listen

    sock = listen("127.0.0.1", 0)
    try:
        client = socket.create_connection(sock.getsockname()[:2])
        accepted, _ = sock.accept()
        with client, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()

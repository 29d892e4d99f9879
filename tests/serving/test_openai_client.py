"""The official ``openai`` client (2.x or later) against a real ``openlora-otel serve`` process: chat and completions,
sync and async, streaming and not, sampling, models, and the error classes the client raises for our errors."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openai")
pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("fastapi")

import openai

from tests.support.polling import wait_until
from tests.support.serving import ServeProcess, save_demo, total

USER = [{"role": "user", "content": "the engineer trains "}]
PROMPT = "the engineer trains "
DURATION_COUNT = "gen_ai_server_request_duration_seconds_count"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("saved") / "demo"
    save_demo(directory, "a1", seed=0)
    serve = ServeProcess(directory, workdir=tmp_path_factory.mktemp("serve"))
    try:
        yield serve.wait_ready()
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.mark.process
def test_models_list_and_retrieve(client) -> None:
    models = {m.id: m for m in client.models.list()}
    assert list(models) == ["tiny-llama", "a1"]
    assert models["a1"].object == "model" and models["a1"].owned_by == "openlora" and models["a1"].created > 0
    assert models["a1"].parent == "tiny-llama" and models["tiny-llama"].parent is None  # extra fields, kept
    assert client.models.retrieve("a1").id == "a1"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.status_code == 404 and caught.value.code == "unknown_adapter"


@pytest.mark.process
def test_chat_whole_and_streamed_agree_and_usage_is_a_last_chunk_of_its_own(
    client, server: ServeProcess
) -> None:
    whole = client.chat.completions.create(model="a1", messages=USER, max_completion_tokens=8)
    assert whole.object == "chat.completion" and whole.model == "a1" and whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert (
        choice.message.role == "assistant"
        and len(choice.message.content) == 8
        and choice.finish_reason == "length"
    )
    prompt_tokens = len("user\n" + USER[0]["content"] + "\nassistant\n")  # the documented template
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 8)

    chunks = list(client.chat.completions.create(model="a1", messages=USER, max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)

    chunks = list(
        client.chat.completions.create(
            model="a1", messages=USER, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    # The chat requests are measured as such: gen_ai.operation.name "chat".
    wait_until(
        lambda: (
            total(server.metrics(), DURATION_COUNT, gen_ai_operation_name="chat", openlora_adapter_name="a1")
            >= 3
        ),
        10,
        "three chat requests counted",
        interval=0.1,
    )


@pytest.mark.process
def test_completions_whole_and_streamed(client) -> None:
    whole = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6)
    assert (
        whole.object == "text_completion"
        and len(whole.choices[0].text) == 6
        and whole.usage.completion_tokens == 6
    )
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.process
def test_the_async_client_streams_and_not(server: ServeProcess) -> None:
    async def scenario() -> tuple[str, str, str, str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            chat = await client.chat.completions.create(model="a1", messages=USER, max_tokens=5)
            stream = await client.chat.completions.create(
                model="a1", messages=USER, max_tokens=5, stream=True
            )
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
            text = await client.completions.create(model="a1", prompt=PROMPT, max_tokens=5)
            stream = await client.completions.create(model="a1", prompt=PROMPT, max_tokens=5, stream=True)
            streamed_text = "".join([c.choices[0].text async for c in stream])
            return chat.choices[0].message.content, streamed, text.choices[0].text, streamed_text

    chat, streamed, text, streamed_text = asyncio.run(scenario())
    assert chat == streamed and len(chat) == 5
    assert text == streamed_text and len(text) == 5


@pytest.mark.process
def test_a_seed_reproduces_the_sample_and_n_gives_that_many_choices(client) -> None:
    def sample(seed: int, n: int = 3) -> list[str]:
        answer = client.chat.completions.create(
            model="a1", messages=USER, max_tokens=12, temperature=1.5, top_p=0.95, seed=seed, n=n
        )
        assert [c.index for c in answer.choices] == list(
            range(n)
        ) and answer.usage.completion_tokens == 12 * n
        return [c.message.content for c in answer.choices]

    first = sample(11)
    assert sample(11) == first and len(set(first)) > 1
    assert sample(12) != first
    streamed = client.completions.create(
        model="a1", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=11, n=2, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(model="a1", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=11, n=2)
    assert texts == [c.text for c in whole.choices]


@pytest.mark.process
def test_a_stop_string_ends_the_chat_answer(client) -> None:
    text = (
        client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=12)
        .choices[0]
        .message.content
    )
    stop = text[3:5]
    choice = client.chat.completions.create(
        model="tiny-llama", messages=USER, max_tokens=12, stop=[stop]
    ).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == text[: text.index(stop)]


@pytest.mark.process
def test_errors_raise_the_clients_classes(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=USER)
    assert caught.value.code == "unknown_adapter" and caught.value.param == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="a1", messages=USER, logprobs=True)
    assert caught.value.param == "logprobs" and "logprobs" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="a1", prompt=PROMPT, best_of=2)
    assert caught.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "Hi"}])
    assert "'H' is not in the demo alphabet" in caught.value.message

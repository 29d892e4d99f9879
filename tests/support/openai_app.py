"""A small OpenAI-compatible FastAPI app of the kind people already run, measured by nothing but
OpenAIMetricsMiddleware: for the end-to-end tests of the middleware under a real server and client.

It answers ``POST /v1/chat/completions`` and ``/v1/completions`` by echoing the prompt's words, one
word a token (``max_tokens`` at most), streamed as server-sent events when asked (with the usage
chunk when ``stream_options.include_usage`` is set), and plain otherwise. ``model`` picks the
behaviour: ``refuse`` gets a 400 in OpenAI's error shape, ``breaks`` a stream that ends in an error
event after its first chunk; any other name is an adapter. It knows nothing of metrics.

Run as a script, it serves on ``--port`` under uvicorn, with the telemetry from the environment
(``OTEL_*``: the pull endpoint by default) and prints ``ready`` once listening. Under a multi-worker
server, :func:`measured_app` is the factory each worker calls (``uvicorn --factory
tests.support.openai_app:measured_app --workers 4``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402


def _words(body: dict[str, Any]) -> tuple[list[str], int]:
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    words = text.split()
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return words[:limit], len(words)


def reply(body: dict[str, Any], chat: bool) -> tuple[int, dict[str, Any] | list[bytes]]:
    """What the app answers ``body`` with, whatever the framework: the status and either the JSON
    body or, for a streamed answer, its server-sent events in order (the Flask twin,
    tests/support/flask_openai_app.py, answers from this too)."""
    model = body.get("model", "")
    if model == "refuse":
        error = {"message": "refused", "type": "invalid_request_error", "param": "model", "code": "refused_model"}
        return 400, {"error": error}
    words, prompt_tokens = _words(body)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words), "total_tokens": prompt_tokens + len(words)}
    kind = "chat.completion" if chat else "text_completion"
    base = {"id": "cmpl-1", "created": int(time.time()), "model": model}
    if not body.get("stream"):
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": " ".join(words), "refusal": None},
                      "finish_reason": "length", "logprobs": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": " ".join(words), "finish_reason": "length", "logprobs": None}
        return 200, {**base, "object": kind, "choices": [choice], "usage": usage}
    include_usage = (body.get("stream_options") or {}).get("include_usage") is True
    kind += ".chunk" if chat else ""

    def event(data: dict[str, Any] | str) -> bytes:
        return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"

    def piece(text: str | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        chunk = {**base, "object": kind, "choices": [choice]}
        return {**chunk, "usage": None} if include_usage else chunk

    events = [event(piece("", first=True))] if chat else []
    for i, word in enumerate(words):
        events.append(event(piece(word if i == 0 else " " + word)))
        if model == "breaks":
            events.append(event({"error": {"message": "the generation failed", "type": "server_error", "code": "generation_failed"}}))
            return 200, events
    events.append(event(piece(None, finish="length")))
    if include_usage:
        events.append(event({**base, "object": kind, "choices": [], "usage": usage}))
    events.append(event("[DONE]"))
    return 200, events


# Between two events of a stream: a token's time, so that the first token comes after the headers.
EVENT_GAP_S = 0.001


def build_app() -> FastAPI:
    app = FastAPI()

    async def answer(request: Request, chat: bool) -> Response:
        status, answer = reply(await request.json(), chat)
        if isinstance(answer, dict):
            return JSONResponse(answer, status_code=status)

        async def events() -> Any:
            for index, event in enumerate(answer):
                if index:
                    await asyncio.sleep(EVENT_GAP_S)
                yield event

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def measured_app() -> Any:
    """The app measured by the middleware, on a telemetry set up from the environment here: the
    factory a multi-worker server calls in each worker, so that each sets up its own (its pull port
    and file_sd file, or its push; tests/serving/test_multiworker.py). Shut down at exit."""
    from openlora_otel import setup_telemetry
    from openlora_otel.inference.asgi import OpenAIMetricsMiddleware

    telemetry = setup_telemetry("openai-app")
    return OpenAIMetricsMiddleware(build_app(), telemetry)


def main() -> None:
    import uvicorn

    from openlora_otel import setup_telemetry
    from openlora_otel.inference.asgi import OpenAIMetricsMiddleware

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    telemetry = setup_telemetry("openai-app")
    app = OpenAIMetricsMiddleware(build_app(), telemetry.inference)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        print("ready", flush=True)
        await task

    try:
        asyncio.run(run())
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()

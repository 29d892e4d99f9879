"""A small OpenAI-compatible FastAPI app of the kind people already run, measured by nothing but
OpenAIMetricsMiddleware: for the end-to-end tests of the middleware under a real server and client.

It answers ``POST /v1/chat/completions`` and ``/v1/completions`` by echoing the prompt's words, one
word a token (``max_tokens`` at most), streamed as server-sent events when asked (with the usage
chunk when ``stream_options.include_usage`` is set), and plain otherwise. ``model`` picks the
behaviour: ``refuse`` gets a 400 in OpenAI's error shape, ``breaks`` a stream that ends in an error
event after its first chunk; any other name is an adapter. It knows nothing of metrics.

Run as a script, it serves on ``--port`` under uvicorn, with the telemetry from the environment
(``OTEL_*``: the pull endpoint by default) and prints ``ready`` once listening.
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


def build_app() -> FastAPI:
    app = FastAPI()

    async def answer(request: Request, chat: bool) -> Response:
        body = await request.json()
        model = body.get("model", "")
        if model == "refuse":
            error = {"message": "refused", "type": "invalid_request_error", "param": "model", "code": "refused_model"}
            return JSONResponse({"error": error}, status_code=400)
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
            return JSONResponse({**base, "object": kind, "choices": [choice], "usage": usage})
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

        async def events() -> Any:
            if chat:
                yield event(piece("", first=True))
            for i, word in enumerate(words):
                await asyncio.sleep(0.001)
                yield event(piece(word if i == 0 else " " + word))
                if model == "breaks":
                    yield event({"error": {"message": "the generation failed", "type": "server_error", "code": "generation_failed"}})
                    return
            yield event(piece(None, finish="length"))
            if include_usage:
                yield event({**base, "object": kind, "choices": [], "usage": usage})
            yield event("[DONE]")

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

"""The OpenAI-compatible app of tests/support/openai_app.py on Flask (WSGI), measured by nothing but
OpenAIMetricsWSGIMiddleware: for the multi-worker tests under gunicorn (tests/serving/test_multiworker.py).

It answers as that app does (:func:`~tests.support.openai_app.reply`), a stream as a generator.
:func:`measured_app` is the factory gunicorn calls in each worker (``gunicorn
'tests.support.flask_openai_app:measured_app()' --workers 4``, no ``--preload``), so that each worker
sets up its own telemetry from the environment.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flask import Flask, Response, jsonify, request  # noqa: E402

from tests.support.openai_app import EVENT_GAP_S, reply  # noqa: E402


def build_app() -> Flask:
    app = Flask(__name__)

    def answer(chat: bool) -> Response | tuple[Response, int]:
        status, answer = reply(request.get_json(force=True), chat)
        if isinstance(answer, dict):
            return jsonify(answer), status

        def events() -> Iterator[bytes]:
            for index, event in enumerate(answer):
                if index:
                    time.sleep(EVENT_GAP_S)
                yield event

        return Response(events(), status=status, mimetype="text/event-stream")

    app.add_url_rule("/v1/chat/completions", "chat", lambda: answer(chat=True), methods=["POST"])
    app.add_url_rule("/v1/completions", "completions", lambda: answer(chat=False), methods=["POST"])
    app.add_url_rule("/health", "health", lambda: {"status": "ok"})
    return app


def measured_app() -> Flask:
    """The Flask app with the middleware around its WSGI app, on a telemetry set up from the
    environment here (shut down at exit): the factory each gunicorn worker calls."""
    from openlora_otel import setup_telemetry
    from openlora_otel.inference.wsgi import OpenAIMetricsWSGIMiddleware

    telemetry = setup_telemetry("openai-app")
    app = build_app()
    app.wsgi_app = OpenAIMetricsWSGIMiddleware(app.wsgi_app, telemetry.inference)  # type: ignore[method-assign]
    return app

"""A real Alertmanager on loopback, and a webhook receiver for the notifications it sends: for the tests
that follow an alert from the rules to a person."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.processes import free_port
from tests.support.prometheus_server import ServerProcess

# The shipped Alertmanager configuration; its receivers post to this webhook URL.
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "collector" / "alertmanager.yml"
SHIPPED_WEBHOOK = "http://127.0.0.1:9095/alerts"


class Webhook:
    """A webhook receiver on loopback that keeps every notification Alertmanager POSTs (or every message
    a chat webhook gets: ``path`` as a Slack URL's; ``answers``: the status codes and headers of the first
    answers, 200 after them; ``hold_s``: how long each answer waits)."""

    def __init__(self, path: str = "/hook", answers: Sequence[tuple[int, dict[str, str]]] = (), hold_s: float = 0.0) -> None:
        self.notifications: list[dict] = []
        self.refused = 0
        self._lock = threading.Lock()
        self._answers = list(answers)
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(hold_s)
                with received._lock:
                    code, headers = received._answers.pop(0) if received._answers else (200, {})
                    if code == 200 and self.path == path:
                        received.notifications.append(json.loads(body))
                    else:
                        received.refused += 1
                self.send_response(code if self.path == path else 404)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{path}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def alerts(self) -> list[dict]:
        with self._lock:
            return [dict(alert, receiver=n["receiver"]) for n in self.notifications for alert in n["alerts"]]

    def wait_for(self, predicate, timeout: float) -> list[dict]:
        """Alerts received so far that match ``predicate``, polling (bounded) until there is one."""
        deadline = time.monotonic() + timeout
        while True:
            found = [a for a in self.alerts() if predicate(a)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.25)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Alertmanager(ServerProcess):
    """``binary`` (Debian's 0.25 or build/bin's 0.35) on ``config``, on 127.0.0.1 (``port``, or a free
    one), its data in ``workdir``, no cluster gossip port. Ready when ``/-/ready`` answers."""

    def __init__(self, workdir: Path, binary: str, config: Path, port: int | None = None) -> None:
        port = port or free_port()
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.path={workdir / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]
        super().__init__("alertmanager", argv, port, workdir, "/-/ready")


def shipped_config(webhook_url: str) -> str:
    """collector/alertmanager.yml with its receivers posting to ``webhook_url`` instead, nothing else changed."""
    text = SHIPPED_CONFIG.read_text()
    assert SHIPPED_WEBHOOK in text, f"{SHIPPED_CONFIG} no longer posts to {SHIPPED_WEBHOOK}"
    return text.replace(SHIPPED_WEBHOOK, webhook_url)

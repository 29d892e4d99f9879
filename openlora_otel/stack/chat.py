"""Forwarding what the stack's alert receiver prints to a chat: a Slack-style incoming webhook.

The body is ``{"text": ...}``, which Slack's incoming webhooks take, and Mattermost's and
Rocket.Chat's too (Discord's through its ``/slack`` endpoint). The messages go out from a thread of
their own, one at a time, each POST given :data:`POST_TIMEOUT_S` in all, at most :data:`QUEUED`
waiting: the receiver never waits for the chat, and a chat that is down or slow costs dropped
messages, each counted and said. The webhook's URL is its credential (Slack's path is its token):
it is only ever shown with its path redacted, and so is any error that could quote it.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TextIO

from openlora_otel._version import __version__
from openlora_otel.redaction import redact, redact_url, url_secrets

# The environment variable that names the chat webhook (a command line shows in `ps`; this does not).
CHAT_WEBHOOK_ENV = "OPENLORA_CHAT_WEBHOOK"
POST_TIMEOUT_S = 5.0  # one POST, connection and answer
QUEUED = 16  # messages waiting at most; more are dropped (and counted)
MAX_TEXT = 3000  # characters of one message (Slack cuts at 40,000; a chat is read by people)
RETRY_AFTER_MAX_S = 10.0  # a 429's Retry-After is honoured once, up to this long
CLOSE_WAIT_S = 10.0  # what close() gives the messages still queued
STUCK_MAX = 4  # POSTs given up on at their deadline that may still hold a connection


def slack_text(lines: Sequence[str]) -> str:
    """``lines`` as one message's text: Slack's three control characters escaped (``&``, ``<``, ``>``:
    ``<`` would start a link or a mention), at most :data:`MAX_TEXT` characters."""
    text = "\n".join(lines).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if len(text) > MAX_TEXT:
        cut = text.rfind("\n", 0, MAX_TEXT - 1)
        text = text[: cut if cut > 0 else MAX_TEXT - 1] + "\n…"
    return text


class ChatForwarder:
    """Posts messages to the Slack-style webhook at ``url``, from a thread of its own.

    :meth:`send` queues and returns at once; a failed POST is said on ``err`` (the URL redacted) and not
    tried again, but a 429 once, after its ``Retry-After`` (at most :data:`RETRY_AFTER_MAX_S`).
    """

    def __init__(self, url: str, err: TextIO, *, timeout_s: float = POST_TIMEOUT_S) -> None:
        self._url = url  # never shown: its path is the token
        self.shown = redact_url(url, path=True)
        self._secrets = url_secrets(url, path=True)
        self._err = err
        self._timeout_s = timeout_s
        self._queue: queue.Queue[str | None] = queue.Queue(QUEUED)
        self._lock = threading.Lock()
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._stuck: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._run, name="openlora-chat", daemon=True)
        self._thread.start()

    def send(self, lines: Sequence[str]) -> bool:
        """Queue ``lines`` as one message; False (and counted) when :data:`QUEUED` already wait."""
        if not lines:
            return True
        try:
            self._queue.put_nowait(slack_text(lines))
            return True
        except queue.Full:
            with self._lock:
                self.dropped += 1
                first = self.dropped == 1
            if first:  # said once; close() gives the count
                self._say(f"chat webhook {self.shown} is behind: messages dropped ({QUEUED} waiting)")
            return False

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Send what is queued (for at most ``wait_s`` in all), then stop."""
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=max(0.0, wait_s))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self.dropped:
            self._say(f"chat webhook {self.shown}: {self.dropped} message(s) dropped")

    def _say(self, text: str) -> None:
        print(f"openlora-otel stack: {redact(text, self._secrets)}", file=self._err, flush=True)

    def _run(self) -> None:
        while True:
            text = self._queue.get()
            if text is None:
                return
            try:
                problem = self._post(text)
            except Exception as exc:  # never this thread's end: the next messages still go
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                with self._lock:
                    self.failed += 1
                self._say(f"chat webhook {self.shown}: not delivered ({problem})")
            else:
                with self._lock:
                    self.sent += 1

    def _post(self, text: str) -> str | None:
        """POST one message; None when the chat took it, else what went wrong, in a few words (redacted,
        then cut: a token cut in two would no longer be found)."""
        body = json.dumps({"text": text}).encode()
        for attempt in (1, 2):
            answer = self._bounded(body)
            if isinstance(answer, str):
                return redact(answer, self._secrets)[:200]
            code, retry_after = answer
            if code < 300:
                return None
            wait = _retry_after(retry_after) if code == 429 else None
            if wait is None or attempt == 2:
                return f"HTTP {code}"
            time.sleep(wait)
        return None  # not reached: the second attempt returns

    def _bounded(self, body: bytes) -> tuple[int, str | None] | str:
        """One POST within :data:`POST_TIMEOUT_S` in all (a socket timeout bounds each read, not a
        chat that answers a byte at a time): run in a thread of its own, given up on at the deadline.
        At most :data:`STUCK_MAX` given-up POSTs may still hold a connection; past that none is made."""
        with self._lock:
            self._stuck = [t for t in self._stuck if t.is_alive()]
            if len(self._stuck) >= STUCK_MAX:
                return f"{len(self._stuck)} earlier POSTs still unanswered"
        answer: list[tuple[int, str | None] | str] = []
        worker = threading.Thread(target=lambda: answer.append(self._once(body)), name="openlora-chat-post", daemon=True)
        worker.start()
        worker.join(self._timeout_s)
        if worker.is_alive():
            with self._lock:
                self._stuck.append(worker)
            return f"no answer within {self._timeout_s:g} s"
        return answer[0] if answer else "no answer"

    def _once(self, body: bytes) -> tuple[int, str | None] | str:
        """(status, Retry-After) of one POST, or what went wrong."""
        request = urllib.request.Request(
            self._url, data=body, method="POST",
            headers={"Content-Type": "application/json", "User-Agent": f"openlora-otel/{__version__}"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                response.read(4096)
                return response.status, None
        except urllib.error.HTTPError as exc:
            retry_after = exc.headers.get("Retry-After") if exc.headers is not None else None
            exc.close()
            return exc.code, retry_after
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timed out, a bad answer
            reason = getattr(exc, "reason", exc)
            return f"{type(reason).__name__}: {reason}"
        except Exception as exc:  # whatever else the HTTP stack raises: said, never this thread's end
            return f"{type(exc).__name__}: {exc}"


def _retry_after(value: str | None) -> float | None:
    """A 429's ``Retry-After`` (seconds or an HTTP date) as the seconds to wait, capped; 1 s if absent."""
    if not value:
        return 1.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return 1.0
        seconds = when.timestamp() - time.time()
    if seconds != seconds:  # NaN
        return 1.0
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)

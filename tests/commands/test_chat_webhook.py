"""The stack's alert receiver forwarding what it prints (alerts, and the diagnosis of each alerting run)
to a Slack-style chat webhook: the message's shape and escaping, a chat that refuses, rate-limits or
hangs (bounded: the receiver never waits for it), the webhook's token never printed, and the
command line's checks. A real Prometheus firing a real alert into it: tests/report/test_alert_diagnosis.py."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from openlora_otel.stack import AlertPrinter, chat
from openlora_otel.stack.chat import ChatForwarder, slack_text
from tests.support.alertmanager import Webhook
from tests.support.fuzz import fuzz
from tests.support.polling import wait_until
from tests.support.processes import child_env, free_port, reap
from tests.support.stack import wait_for_line

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "T0000/B0000/XXXXsecretXXXX"  # where Slack's incoming webhook keeps its credential: the path
SLACK_PATH = f"/services/{TOKEN}"


def notify(printer: AlertPrinter, *alerts: dict) -> None:
    body = json.dumps({"version": "4", "status": "firing", "alerts": list(alerts)}).encode()
    with urllib.request.urlopen(urllib.request.Request(printer.url, data=body), timeout=5) as response:
        assert response.status == 200


def test_each_notification_and_each_diagnosis_is_a_message_in_slacks_shape() -> None:
    hook = Webhook(SLACK_PATH)
    out, err = io.StringIO(), io.StringIO()
    closed = f"http://127.0.0.1:{free_port()}"  # the diagnosis fails, and says so: that is forwarded too
    printer = AlertPrinter(0, out, diagnose_from=closed, chat=ChatForwarder(hook.url, err)).start()
    try:
        labels = {"alertname": "OpenloraRankHung", "severity": "critical", "openlora_run_id": "r-1",
                  "openlora_run_name": "a<b>&c"}  # fmt: skip
        notify(printer, {"status": "firing", "labels": labels, "annotations": {"summary": "rank 3 <stopped>"}})
        wait_until(lambda: len(hook.notifications) >= 2, 60, "the alert's and the diagnosis's messages")
    finally:
        printer.close()
        hook.close()
    alert, diagnosis = (message["text"] for message in hook.notifications)
    assert all(set(message) == {"text"} for message in hook.notifications)
    # Slack reads <...> as a link or a mention, & as an escape: the three are escaped, as Slack asks.
    assert alert == "[FIRING] critical OpenloraRankHung: rank 3 &lt;stopped&gt; (run a&lt;b&gt;&amp;c) [run id r-1]"
    assert diagnosis.startswith("  diagnosis of run r-1 failed: ") and closed.rsplit(":", 1)[1] in diagnosis
    assert out.getvalue().splitlines()[0].endswith("rank 3 <stopped> (run a<b>&c) [run id r-1]")  # printed as is
    assert err.getvalue() == ""


def test_a_chat_that_refuses_rate_limits_or_hangs_never_holds_the_receiver_nor_shows_the_token() -> None:
    # Refused: said, with the URL's path redacted.
    refusing = Webhook(SLACK_PATH, answers=[(404, {})])
    err = io.StringIO()
    forwarder = ChatForwarder(refusing.url, err)
    forwarder.send(["one"])
    forwarder.close()
    refusing.close()
    assert forwarder.failed == 1 and "not delivered (HTTP 404)" in err.getvalue(), err.getvalue()
    assert f"http://127.0.0.1:{refusing.url.split(':')[2].split('/')[0]}/<redacted>" in err.getvalue()
    # A 429 is tried once more, after its Retry-After.
    limited = Webhook(SLACK_PATH, answers=[(429, {"Retry-After": "0"})])
    err = io.StringIO()
    forwarder = ChatForwarder(limited.url, err)
    forwarder.send(["two"])
    forwarder.close()
    limited.close()
    assert (forwarder.sent, limited.refused, [m["text"] for m in limited.notifications]) == (1, 1, ["two"])
    assert err.getvalue() == ""
    # A chat that answers after 2 s, with a 0.3 s bound: each POST gives up; the receiver's notifications
    # are answered at once, the messages past QUEUED are dropped and counted.
    hanging = Webhook(SLACK_PATH, hold_s=2.0)
    err, out = io.StringIO(), io.StringIO()
    printer = AlertPrinter(0, out, chat=ChatForwarder(hanging.url, err, timeout_s=0.3)).start()
    try:
        began = time.monotonic()
        for number in range(chat.QUEUED + 8):
            notify(printer, {"status": "firing", "labels": {"alertname": f"A{number}", "severity": "warning"}})
        answered = time.monotonic() - began
    finally:
        printer.close()
    hanging.close()
    assert out.getvalue().count("[FIRING]") == chat.QUEUED + 8
    # Each notification answered without waiting for a 0.3 s POST (24 of them: 7 s if it did).
    assert answered < chat.QUEUED * 0.3, answered
    said = err.getvalue()
    assert "not delivered (no answer within 0.3 s)" in said and "messages dropped" in said, said
    assert TOKEN not in said and "XXXXsecretXXXX" not in said and TOKEN not in out.getvalue()


def raw_server(answer: Callable[[socket.socket], None]) -> tuple[socket.socket, str]:
    """A loopback server that reads a request and answers each connection with ``answer(connection)``."""
    listener = socket.create_server(("127.0.0.1", 0))

    def one(connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.recv(65536)
            answer(connection)

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}{SLACK_PATH}"


def test_a_chat_that_answers_garbage_or_a_byte_at_a_time_costs_one_message_each() -> None:
    """Found by review: a reply that is no HTTP (http.client's BadStatusLine) ended the forwarding
    thread, and a reply dripped a byte every half second held one POST past its bound for as long
    as the chat liked (a socket timeout bounds each read, not the POST)."""

    def drip(connection: socket.socket) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: yes\r\n":
            connection.sendall(bytes([byte]))
            time.sleep(0.5)

    listener, url = raw_server(lambda c: c.sendall(b"GARBAGE\r\n\r\n"))
    err = io.StringIO()
    forwarder = ChatForwarder(url, err, timeout_s=1.0)
    forwarder.send(["one"])
    forwarder.send(["two"])
    forwarder.close()
    listener.close()
    assert forwarder.failed == 2 and err.getvalue().count("not delivered (BadStatusLine") == 2, err.getvalue()
    # Each dripping POST is given up after its second; past STUCK_MAX of them still open, no new one.
    listener, url = raw_server(drip)
    err = io.StringIO()
    forwarder = ChatForwarder(url, err, timeout_s=1.0)
    began = time.monotonic()
    for number in range(chat.STUCK_MAX + 2):
        forwarder.send([f"message {number}"])
    forwarder.close()
    took = time.monotonic() - began
    listener.close()
    said = err.getvalue()
    assert said.count("not delivered (no answer within 1 s)") == chat.STUCK_MAX, said
    assert said.count(f"not delivered ({chat.STUCK_MAX} earlier POSTs still unanswered)") == 2, said
    assert took < chat.STUCK_MAX + 3.0, took  # a second a POST, not the drip's 16 s
    assert TOKEN not in said


def test_slack_text_escapes_and_cuts_long_messages_at_a_line() -> None:
    assert slack_text(["a & b", "<!channel>"]) == "a &amp; b\n&lt;!channel&gt;"
    long = slack_text([f"line {i} " + "x" * 90 for i in range(100)])
    assert len(long) <= chat.MAX_TEXT and long.endswith("\n…") and long.splitlines()[-2].endswith("x")


@fuzz
@given(value=st.one_of(st.none(), st.text(max_size=40), st.integers().map(str), st.floats().map(str)))
@example(value="nan")  # float("nan") is a number, and waits forever against min()/max()
@example(value="Wed, 21 Oct 2015 07:28:00 GMT")
@example(value="-1e309")
def test_fuzz_any_retry_after_header_is_a_bounded_wait(value: str | None) -> None:
    wait = chat._retry_after(value)
    assert wait is not None and 0.0 <= wait <= chat.RETRY_AFTER_MAX_S


def run_stack(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    process = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "stack", *argv], cwd=ROOT, env=child_env(PYTHONPATH=str(ROOT), **(env or {})),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return process.returncode, process.stdout + process.stderr


@pytest.mark.process
def test_the_command_lines_checks_never_show_the_token(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:9/{SLACK_PATH.lstrip('/')}"
    code, text = run_stack("--dir", str(tmp_path), "--chat-webhook", url)  # nothing would receive
    assert code == 2 and "--chat-webhook forwards what the receiver of --start or --receiver-only prints" in text
    code, text = run_stack("--dir", str(tmp_path), "--start", "--webhook", "http://127.0.0.1:9/a", "--chat-webhook", url)
    assert code == 2 and "needs the built-in receiver" in text
    code, text = run_stack("--receiver-only", "--chat-webhook", f"ftp://h/{SLACK_PATH}")
    assert code == 2 and "--chat-webhook" in text and "ftp://h/<redacted>" in text and TOKEN not in text, text
    code, text = run_stack("--receiver-only", env={chat.CHAT_WEBHOOK_ENV: f"http://h:99999/{TOKEN}"})
    assert code == 2 and chat.CHAT_WEBHOOK_ENV in text and TOKEN not in text, text
    code, text = run_stack("--dir", str(tmp_path), "--prometheus", "http://127.0.0.1:9090")
    assert code == 2 and "--prometheus is for --receiver-only" in text
    # Found by review: a mistyped option puts the URL after it in argparse's "unrecognized arguments".
    code, text = run_stack("--receiver-only", "--chat-web-hook", url)
    assert code == 2 and "unrecognized arguments: --chat-web-hook http://127.0.0.1:9/<redacted>" in text, text
    assert TOKEN not in text


@pytest.mark.process
def test_receiver_only_diagnoses_from_a_prometheus_and_forwards_to_the_chat_from_the_environment() -> None:
    hook = Webhook(SLACK_PATH)
    port, closed = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "openlora_otel", "stack", "--receiver-only", "--receiver-port", str(port),
         "--prometheus", f"http://127.0.0.1:{closed}"],
        cwd=ROOT, env=child_env(PYTHONPATH=str(ROOT), **{chat.CHAT_WEBHOOK_ENV: hook.url}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        lines = wait_for_line(process, f"receiving alerts at http://127.0.0.1:{port}/alerts", 30)
        assert f"diagnosing their runs from http://127.0.0.1:{closed}" in lines[-1]
        assert f"forwarded to http://127.0.0.1:{hook.url.split(':')[2].split('/')[0]}/<redacted>" in lines[-1]
        body = {"alerts": [{"status": "firing", "labels": {"alertname": "X", "severity": "warning",
                                                          "openlora_run_id": "run-9"}}]}  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{port}/alerts", data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        wait_for_line(process, "diagnosis of run run-9 failed", 60)
        wait_until(lambda: len(hook.notifications) >= 2, 30, "both messages")
    finally:
        process.send_signal(signal.SIGTERM)
        reap(process, 30)
        hook.close()
    assert process.returncode == 0
    texts = [m["text"] for m in hook.notifications]
    assert texts[0] == "[FIRING] warning X: [run id run-9]" and texts[1].startswith("  diagnosis of run run-9 failed")

"""``openlora-otel stack``: Prometheus and Alertmanager on this machine, without Docker.

The configs, the two servers and the alert printer (the parser is :mod:`openlora_otel.commands.stack`):
a Prometheus that scrapes the local ranks and loads the shipped rules, an Alertmanager with the
routes of ``collector/alertmanager.yml``; with ``--start`` both run until Ctrl-C or SIGTERM, said to
be running once Prometheus scrapes the targets. See docs/how-to/local-stack.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

from openlora_otel._version import __version__
from openlora_otel.config import DEFAULT_PROMETHEUS_PORT as _DEFAULT_METRICS_PORT
from openlora_otel.redaction import redact, redact_url, url_secrets
from openlora_otel.stack.chat import ChatForwarder
from openlora_otel.stack.rules import DEFAULT_RUNBOOK_BASE, rules_text

__all__ = [
    "AlertPrinter",
    "StackPlan",
    "alertmanager_config",
    "prometheus_config",
    "receive_only",
    "start",
    "write",
]

DEFAULT_PROMETHEUS_PORT = 9090
DEFAULT_ALERTMANAGER_PORT = 9093
DEFAULT_RECEIVER_PORT = 9095
DEFAULT_METRICS_PORT = _DEFAULT_METRICS_PORT  # the first rank's pull endpoint
# The shipped timings of collector/prometheus.yml: the rules' thresholds assume them.
DEFAULT_SCRAPE_INTERVAL = "5s"
DEFAULT_EVALUATION_INTERVAL = "15s"
LOOPBACK = "127.0.0.1"
# Prometheus and Alertmanager answer /-/ready within a few seconds; a slow disk may take longer.
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
# Per-node torchrun launches; a bigger list is a typo, not a node.
MAX_RANKS = 1024
PROMETHEUS_BINARIES = ("prometheus",)
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")


@dataclass(frozen=True)
class StackPlan:
    """What the stack scrapes, where it listens and where alerts go."""

    directory: Path
    targets: tuple[str, ...] = (f"localhost:{DEFAULT_METRICS_PORT}",)
    file_sd_dir: str | None = None
    webhook_url: str = field(default=f"http://{LOOPBACK}:{DEFAULT_RECEIVER_PORT}/alerts", repr=False)  # may hold a token
    builtin_receiver: bool = True
    prometheus_port: int = DEFAULT_PROMETHEUS_PORT
    alertmanager_port: int = DEFAULT_ALERTMANAGER_PORT
    receiver_port: int = DEFAULT_RECEIVER_PORT
    scrape_interval: str = DEFAULT_SCRAPE_INTERVAL
    evaluation_interval: str = DEFAULT_EVALUATION_INTERVAL
    runbook_base: str = DEFAULT_RUNBOOK_BASE
    # A Slack-style webhook the built-in receiver forwards its alerts and diagnoses to (its URL is a secret).
    chat_webhook: str | None = field(default=None, repr=False)

    @property
    def scraped(self) -> str:
        """What the Prometheus scrapes, in words."""
        if self.file_sd_dir:
            return f"the ranks registered in {self.file_sd_dir}"
        return ", ".join(self.targets)

    @property
    def prometheus_config_path(self) -> Path:
        return self.directory / "prometheus.yml"

    @property
    def alertmanager_config_path(self) -> Path:
        return self.directory / "alertmanager.yml"

    @property
    def rules_path(self) -> Path:
        return self.directory / "rules" / "openlora.yml"

    def prometheus_argv(self, binary: str = "prometheus") -> list[str]:
        return [
            binary,
            f"--config.file={self.prometheus_config_path}",
            f"--storage.tsdb.path={self.directory / 'data' / 'prometheus'}",
            f"--web.listen-address={LOOPBACK}:{self.prometheus_port}",
            # The URL alerts name ($externalURL: the diagnose annotation's --prometheus, the links back).
            f"--web.external-url=http://{LOOPBACK}:{self.prometheus_port}/",
            # An alert that fires before Prometheus has found the Alertmanager (its first
            # seconds) is sent again after this delay: one evaluation, not the default minute.
            f"--rules.alert.resend-delay={self.evaluation_interval}",
        ]

    def alertmanager_argv(self, binary: str = "prometheus-alertmanager") -> list[str]:
        return [
            binary,
            f"--config.file={self.alertmanager_config_path}",
            f"--storage.path={self.directory / 'data' / 'alertmanager'}",
            f"--web.listen-address={LOOPBACK}:{self.alertmanager_port}",
            # One Alertmanager, no cluster: the gossip listener would otherwise bind 0.0.0.0:9094.
            "--cluster.listen-address=",
        ]


def _quoted(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is valid YAML)."""
    return json.dumps(text)


def prometheus_config(plan: StackPlan) -> str:
    """The native Prometheus config: the pull job, the rules, the local Alertmanager, and both servers
    scraping themselves."""
    if plan.file_sd_dir:
        glob = str(Path(plan.file_sd_dir).resolve() / "*.json")
        discovery = (
            "    # Each rank registers its endpoint here while it runs (OPENLORA_PROMETHEUS_FILE_SD_DIR).\n"
            "    file_sd_configs:\n"
            f"      - files: [{_quoted(glob)}]\n"
        )
    else:
        discovery = (
            "    # One target per rank: port + LOCAL_RANK (OPENLORA_PROMETHEUS_PORT_OFFSET). A target\n"
            "    # shows DOWN while no run is on; no alert fires on that.\n"
            "    static_configs:\n"
            f"      - targets: [{', '.join(_quoted(t) for t in plan.targets)}]\n"
        )
    return (
        f"# Written by `openlora-otel stack` (openlora-otel {__version__}); running it again rewrites it.\n"
        f"# A native Prometheus for the pull path: scrapes {plan.scraped},\n"
        "# evaluates openlora-otel's rules and sends alerts to the local Alertmanager.\n"
        "global:\n"
        f"  scrape_interval: {plan.scrape_interval}\n"
        f"  scrape_timeout: {plan.scrape_interval}\n"
        f"  evaluation_interval: {plan.evaluation_interval}\n"
        "\n"
        "rule_files:\n"
        "  - rules/openlora.yml\n"
        "\n"
        "alerting:\n"
        "  alertmanagers:\n"
        "    - static_configs:\n"
        f"        - targets: [{_quoted(f'{LOOPBACK}:{plan.alertmanager_port}')}]\n"
        "\n"
        "scrape_configs:\n"
        "  # The job name the rules read for the pull path.\n"
        "  - job_name: openlora\n" + discovery + "\n"
        "  # Prometheus and Alertmanager themselves: the openlora-prometheus and openlora-alertmanager\n"
        "  # groups of the rules watch rule evaluation, notifications, the TSDB and config reloads.\n"
        "  - job_name: prometheus\n"
        "    static_configs:\n"
        f"      - targets: [{_quoted(f'{LOOPBACK}:{plan.prometheus_port}')}]\n"
        "  - job_name: alertmanager\n"
        "    static_configs:\n"
        f"      - targets: [{_quoted(f'{LOOPBACK}:{plan.alertmanager_port}')}]\n"
    )


def alertmanager_config(webhook_url: str) -> str:
    """Routes, grouping and inhibition as in ``collector/alertmanager.yml``; both receivers POST to ``webhook_url``."""
    receiver = f"    webhook_configs:\n      - url: {_quoted(webhook_url)}\n        send_resolved: true\n"
    return (
        "# Written by `openlora-otel stack`; running it again rewrites it. The routes, grouping and\n"
        "# inhibition of collector/alertmanager.yml; Slack and email receivers are shown there\n"
        '# (secrets read from files) and in docs/how-to/alerts.md.\n'
        "global:\n"
        "  resolve_timeout: 5m\n"
        "\n"
        "route:\n"
        "  receiver: warning\n"
        "  group_by: [alertname, openlora_run_id]\n"
        "  group_wait: 30s\n"
        "  group_interval: 5m\n"
        "  repeat_interval: 4h\n"
        "  routes:\n"
        "    - matchers: ['severity=\"critical\"']\n"
        "      receiver: critical\n"
        "      group_wait: 10s\n"
        "      group_interval: 1m\n"
        "      repeat_interval: 1h\n"
        "    - matchers: ['severity=\"warning\"']\n"
        "      receiver: warning\n"
        "\n"
        "inhibit_rules:\n"
        "  - source_matchers: ['severity=\"critical\"', 'openlora_run_id=~\".+\"']\n"
        "    target_matchers: ['severity=\"warning\"']\n"
        "    equal: [openlora_run_id]\n"
        "\n"
        "receivers:\n"
        "  - name: critical\n" + receiver + "  - name: warning\n" + receiver
    )


def write(plan: StackPlan) -> list[Path]:
    """Write the three files (the rules copied from the package); returns their paths."""
    plan.rules_path.parent.mkdir(parents=True, exist_ok=True)
    plan.rules_path.write_text(rules_text(plan.runbook_base), encoding="utf-8")
    plan.prometheus_config_path.write_text(prometheus_config(plan), encoding="utf-8")
    # The webhook URL may carry a token: readable by this user only.
    path = plan.alertmanager_config_path
    path.write_text(alertmanager_config(plan.webhook_url), encoding="utf-8")
    path.chmod(0o600)
    return [plan.prometheus_config_path, plan.rules_path, path]


# -- the built-in receiver ---------------------------------------------------------------------------


def _text(value: object, limit: int = 300) -> str:
    """A value of a notification as printed: control characters (a terminal's escape sequences) and lone
    surrogates written as escapes, at most ``limit`` characters."""
    from openlora_otel.report.model import shown

    return shown(value, limit)


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _alerts(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The alerts of a notification that are objects (anything else in a hostile or broken body is skipped)."""
    alerts = payload.get("alerts")
    return [alert for alert in alerts if isinstance(alert, dict)] if isinstance(alerts, list) else []


def format_notification(payload: dict[str, Any]) -> list[str]:
    """One line per alert of an Alertmanager webhook notification (version 4), its texts escaped."""
    lines = []
    for alert in _alerts(payload):
        labels = _mapping(alert.get("labels"))
        annotations = _mapping(alert.get("annotations"))
        status = _text(alert.get("status") or payload.get("status") or "?", 20).upper()
        text = _text(annotations.get("summary") or "")
        name, run_id, instance = (
            _text(labels["openlora_run_name"]) if labels.get("openlora_run_name") else None,
            _text(labels["openlora_run_id"]) if labels.get("openlora_run_id") else None,
            _text(labels["instance"]) if labels.get("instance") else None,
        )
        if instance and instance not in text:
            text += f" on {instance}"
        if name and name not in text:
            text += f" (run {name})"
        if run_id and run_id != name:
            text += f" [run id {run_id}]"
        line = f"[{status}] {_text(labels.get('severity', '?'), 40)} {_text(labels.get('alertname', '?'), 120)}"
        lines.append(f"{line}: {text.strip()}" if text.strip() else line)
    return lines


# A run is diagnosed at most once in this many seconds, whatever its alerts (Alertmanager repeats
# a group's notification, and a run's alerts come in several groups).
DIAGNOSE_EVERY_S = 600.0
DIAGNOSIS_FINDINGS = 3  # the top findings printed under an alert
DIAGNOSES_PER_NOTIFICATION = 3  # distinct runs diagnosed from one notification, at most
DIAGNOSES_PENDING = 4  # diagnoses queued or running, at most: a flood of runs is not all diagnosed
_DIAGNOSED_KEPT = 1024  # runs remembered for the once-in-DIAGNOSE_EVERY_S rule, at most
_MAX_RUN_ID = 160


def diagnosis_lines(run_id: str, findings: Sequence[Any]) -> list[str]:
    """What the receiver prints of a run's diagnosis: its top findings, each with its cause and runbook."""
    if not findings:
        return [f"  diagnosis of run {run_id}: no findings"]
    lines = [f"  diagnosis of run {run_id} (openlora-otel diagnose; {len(findings)} finding(s)):"]
    for finding in findings[:DIAGNOSIS_FINDINGS]:
        lines += [f"    [{finding.severity}] {finding.title}", f"      likely cause: {finding.cause}",
                  f"      runbook: {finding.runbook}"]  # fmt: skip
    return lines


class AlertPrinter:
    """A webhook receiver on loopback that prints each alert of every notification to ``out``.

    With ``diagnose_from`` (a Prometheus URL: the stack's own), the first firing alert of a run
    (its ``openlora_run_id`` label) has the run diagnosed there, as ``openlora-otel diagnose
    --prometheus`` does, in a thread of its own (one at a time; each of its queries bounded by the
    report's timeout); the top findings are printed under the alerts. A run is diagnosed at most once
    every :data:`DIAGNOSE_EVERY_S` seconds.

    With ``chat`` (:class:`~openlora_otel.stack.chat.ChatForwarder`), what is printed also goes to a
    chat: a message per notification's alerts and one per diagnosis. :meth:`close` closes it.
    """

    def __init__(
        self,
        port: int,
        out: TextIO | None = None,
        host: str = LOOPBACK,
        *,
        diagnose_from: str | None = None,
        chat: ChatForwarder | None = None,
    ) -> None:
        self._out = out if out is not None else sys.stdout
        self._lock = threading.Lock()
        self._diagnose_from = diagnose_from
        self._chat = chat
        self._diagnosed: dict[str, float] = {}
        self._pending = 0
        self._closed = threading.Event()
        self._diagnosis = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="openlora-diagnose")
        printer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if not 0 <= length <= 10 * 2**20:
                        raise ValueError(f"Content-Length {length}")
                    payload = json.loads(self.rfile.read(length) or b"{}")
                    lines = format_notification(payload) if isinstance(payload, dict) else []
                except (ValueError, UnicodeDecodeError, RecursionError):
                    self.send_response(400)
                    self.end_headers()
                    return
                printer._print(lines)
                if isinstance(payload, dict):
                    printer._diagnose_alerts(payload)
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet: only the alerts are shown
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://{host}:{self.port}/alerts"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="openlora-alerts", daemon=True
        )

    def _print(self, lines: list[str]) -> None:
        with self._lock:
            for line in lines:
                print(line, file=self._out, flush=True)
        if self._chat is not None and not self._closed.is_set():
            self._chat.send(lines)

    def _diagnose_alerts(self, payload: dict[str, Any]) -> None:
        if self._diagnose_from is None:
            return
        submitted = 0
        for alert in _alerts(payload):
            if submitted >= DIAGNOSES_PER_NOTIFICATION:
                return
            if str(alert.get("status") or payload.get("status")) != "firing":
                continue
            run_id = _mapping(alert.get("labels")).get("openlora_run_id")
            if not isinstance(run_id, str) or not run_id or len(run_id) > _MAX_RUN_ID:
                continue
            now = time.monotonic()
            with self._lock:
                if now - self._diagnosed.get(run_id, -DIAGNOSE_EVERY_S) < DIAGNOSE_EVERY_S:
                    continue
                if self._pending >= DIAGNOSES_PENDING:
                    return  # busy: this run's next notification (Alertmanager repeats) may find room
                for old in [r for r, at in self._diagnosed.items() if now - at >= DIAGNOSE_EVERY_S]:
                    del self._diagnosed[old]
                if len(self._diagnosed) >= _DIAGNOSED_KEPT:
                    return
                self._diagnosed[run_id] = now
                self._pending += 1
            try:
                self._diagnosis.submit(self._diagnose, run_id)
                submitted += 1
            except RuntimeError:  # closed
                return

    def _diagnose(self, run_id: str) -> None:
        from openlora_otel.report.diagnosis import diagnose
        from openlora_otel.report.model import ReportError, shown
        from openlora_otel.report.prometheus import read_prometheus

        assert self._diagnose_from is not None
        try:
            if self._closed.is_set():
                return
            runs = read_prometheus(self._diagnose_from, [run_id], every_rank=True)
            lines = [line for run in runs for line in diagnosis_lines(shown(run_id), diagnose(run))]
        except ReportError as exc:
            lines = [f"  diagnosis of run {shown(run_id)} failed: {shown(exc, 300)}"]
        except Exception as exc:  # never the receiver's end: the alerts go on being printed
            lines = [f"  diagnosis of run {shown(run_id)} failed: {type(exc).__name__}: {shown(exc, 300)}"]
        finally:
            with self._lock:
                self._pending -= 1
        if not self._closed.is_set():  # not after the stack stopped
            self._print(lines)

    def start(self) -> AlertPrinter:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._diagnosis.shutdown(wait=False, cancel_futures=True)
        if self._chat is not None:
            self._chat.close()


# -- running the two servers ----------------------------------------------------------------------------


def find_binary(names: Sequence[str]) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _scraping(plan: StackPlan) -> bool:
    """Whether Prometheus scrapes every target of the plan (a file_sd directory: nothing to wait for).

    ``/-/ready`` comes first: Prometheus 2 hands its targets to the scrape loops on a 5 s tick after
    start, so for about 5 s a ready Prometheus scrapes nothing. A target listed as active in
    ``/api/v1/targets`` has its loop running and is scraped within one scrape interval.
    """
    if plan.file_sd_dir:
        return True
    url = f"http://{LOOPBACK}:{plan.prometheus_port}/api/v1/targets?state=active"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            active = json.load(response)["data"]["activeTargets"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        scraped = {t["labels"]["instance"] for t in active if t.get("scrapePool") == "openlora"}
    except (KeyError, TypeError):
        return False
    return scraped.issuperset(plan.targets)


def _tail(path: Path, secrets: set[str], size: int = 2000) -> str:
    """The end of a server's log, ``secrets`` redacted (before it is cut, so none is cut in two)."""
    try:
        return redact(path.read_text(errors="replace"), secrets)[-size:]
    except OSError:
        return ""


class _Server:
    def __init__(self, name: str, argv: list[str], ready_url: str, log: Path) -> None:
        self.name = name
        self.ready_url = ready_url
        self.log = log
        self._log_handle = log.open("ab")
        # A session of its own: Ctrl-C in the terminal reaches this command only, which then
        # stops the servers one after the other.
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def exited(self) -> bool:
        return self.process.poll() is not None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log_handle.close()


def start(plan: StackPlan, err: TextIO, out: TextIO) -> int:
    prometheus = find_binary(PROMETHEUS_BINARIES)
    alertmanager = find_binary(ALERTMANAGER_BINARIES)
    missing = []
    if prometheus is None:
        missing.append("`prometheus` (Debian/Ubuntu: apt-get install prometheus)")
    if alertmanager is None:
        missing.append(
            "`prometheus-alertmanager` or `alertmanager` (Debian/Ubuntu: apt-get install prometheus-alertmanager)"
        )
    if missing:
        print(
            "openlora-otel stack: not found on PATH: "
            + "; ".join(missing)
            + ". Or take the release tarballs from https://prometheus.io/download/ and put the binaries "
            "on PATH. The configs are written; the commands above start them by hand.",
            file=err,
        )
        return 2
    assert prometheus is not None and alertmanager is not None
    printer = None
    if plan.builtin_receiver:
        chat = ChatForwarder(plan.chat_webhook, err) if plan.chat_webhook else None
        try:
            printer = AlertPrinter(
                plan.receiver_port, out, diagnose_from=f"http://{LOOPBACK}:{plan.prometheus_port}", chat=chat
            ).start()
        except OSError as exc:
            if chat is not None:
                chat.close(0)
            print(
                f"openlora-otel stack: cannot listen on {LOOPBACK}:{plan.receiver_port} for alerts "
                f"({exc.strerror or exc}); pick another --receiver-port or pass --webhook",
                file=err,
            )
            return 1
    secrets = set() if plan.builtin_receiver else url_secrets(plan.webhook_url, path=True)
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    servers: list[_Server] = []
    try:
        (plan.directory / "data").mkdir(parents=True, exist_ok=True)
        servers.append(
            _Server(
                "Alertmanager",
                plan.alertmanager_argv(alertmanager),
                f"http://{LOOPBACK}:{plan.alertmanager_port}/-/ready",
                plan.directory / "alertmanager.log",
            )
        )
        servers.append(
            _Server(
                "Prometheus",
                plan.prometheus_argv(prometheus),
                f"http://{LOOPBACK}:{plan.prometheus_port}/-/ready",
                plan.directory / "prometheus.log",
            )
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = list(servers)
        while waiting and not stop.is_set():
            for server in list(waiting):
                if server.exited():
                    return _died(server, err, secrets)
                if _ready(server.ready_url):
                    waiting.remove(server)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(s.name for s in waiting)
                print(
                    f"openlora-otel stack: {names} not ready in {READY_TIMEOUT_S:.0f} s; see the log in "
                    f"{plan.directory}",
                    file=err,
                )
                return 1
            stop.wait(0.2)
        # Ready is not yet scraping (see _scraping): a run started at the line below and over
        # within Prometheus's first seconds would otherwise never be scraped.
        while not stop.is_set() and not _scraping(plan):
            for server in servers:
                if server.exited():
                    return _died(server, err, secrets)
            if time.monotonic() > deadline:
                print(
                    f"openlora-otel stack: Prometheus does not scrape {plan.scraped} after "
                    f"{READY_TIMEOUT_S:.0f} s; see the log in {plan.directory}",
                    file=err,
                )
                return 1
            stop.wait(0.2)
        if stop.is_set():
            return 0
        alerts = "printed here" if printer is not None else f"sent to {redact_url(plan.webhook_url, path=True)}"
        if printer is not None and plan.chat_webhook:
            alerts += f", with the diagnoses, and forwarded to {redact_url(plan.chat_webhook, path=True)}"
        print(
            f"Prometheus   http://{LOOPBACK}:{plan.prometheus_port}  (log {servers[1].log})\n"
            f"Alertmanager http://{LOOPBACK}:{plan.alertmanager_port}  (log {servers[0].log})\n"
            f"alerts: {alerts}\n"
            "runs shorter than a scrape interval: OPENLORA_PROMETHEUS_EXPECT_SCRAPE=true makes them wait for it\n"
            "Ctrl-C stops both.",
            file=out,
            flush=True,
        )
        while not stop.wait(0.5):
            for server in servers:
                if server.exited():
                    return _died(server, err, secrets)
        return 0
    finally:
        for server in reversed(servers):  # Prometheus first: it stops sending before Alertmanager goes
            server.stop()
        if printer is not None:
            printer.close()
        _restore_handlers(previous)


def _died(server: _Server, err: TextIO, secrets: set[str]) -> int:
    # Alertmanager's log may quote the webhook it failed on: its secrets are not printed.
    print(
        f"openlora-otel stack: {server.name} exited with status {server.process.returncode}; "
        f"the end of {server.log}:\n{_tail(server.log, secrets)}",
        file=err,
    )
    return 1


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    """SIGINT and SIGTERM set ``stop`` (main thread only; elsewhere the caller stops by other means)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        previous[number] = signal.signal(number, lambda *_: stop.set())
    return previous


def _restore_handlers(previous: dict[int, Any]) -> None:
    for number, handler in previous.items():
        signal.signal(number, handler)


def receive_only(
    port: int, out: TextIO, err: TextIO, *, diagnose_from: str | None = None, chat_webhook: str | None = None
) -> int:
    """Print the alerts an Alertmanager sends to ``http://127.0.0.1:PORT/alerts`` until SIGINT / SIGTERM
    (``diagnose_from``: with the diagnosis of each alerting run, from that Prometheus; ``chat_webhook``:
    forwarded there too)."""
    chat = ChatForwarder(chat_webhook, err) if chat_webhook else None
    try:
        printer = AlertPrinter(port, out, diagnose_from=diagnose_from, chat=chat).start()
    except OSError as exc:
        if chat is not None:
            chat.close(0)
        print(f"openlora-otel stack: cannot listen on {LOOPBACK}:{port} ({exc.strerror or exc})", file=err)
        return 1
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        extra = f"; diagnosing their runs from {redact_url(diagnose_from)}" if diagnose_from else ""
        if chat_webhook:
            extra += f"; forwarded to {redact_url(chat_webhook, path=True)}"
        print(f"receiving alerts at {printer.url}{extra}; Ctrl-C stops", file=out, flush=True)
        stop.wait()
    finally:
        printer.close()
        _restore_handlers(previous)
    return 0

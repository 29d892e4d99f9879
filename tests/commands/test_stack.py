"""``openlora-otel stack``: the configs it writes, the checks Prometheus's and Alertmanager's own tools
run on them, the built-in alert printer, errors, and a real start and stop of both servers."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from openlora_otel import stack
from openlora_otel.commands import stack as stack_command
from openlora_otel.stack import servers
from tests.support.processes import child_env, free_port, reap
from tests.support.stack import start_stack, tool, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
COLLECTOR_ALERTMANAGER = ROOT / "collector" / "alertmanager.yml"


def run_stack(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    parser = argparse.ArgumentParser(prog="openlora-otel")
    stack_command.add_parser(parser.add_subparsers(dest="command"))
    code = stack_command.run(parser.parse_args(["stack", *argv]), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.process
def test_the_package_ships_the_one_rules_file(tmp_path: Path) -> None:
    # One file: what compose mounts, the tests load and the stack writes. No copy to drift.
    assert stack.rules_text() == RULES.read_text()
    assert not (ROOT / "collector" / "rules").exists()
    # A pip-installed user gets it: the wheel built from this tree holds it (built from a copy,
    # so that the build leaves nothing in the checkout).
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "openlora_otel", source / "openlora_otel", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    import zipfile

    (wheel,) = tmp_path.glob("openlora_otel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("openlora_otel/rules/openlora.yml").decode() == RULES.read_text()
        # Every module, subpackages included (setuptools finds a package by its __init__.py).
        sources = {path.relative_to(source).as_posix() for path in (source / "openlora_otel").rglob("*.py")}
        assert sources <= set(archive.namelist()), sources - set(archive.namelist())


def test_stack_writes_the_rules_with_its_runbook_base(tmp_path: Path) -> None:
    base = "http://127.0.0.1:8000/runbooks/"
    code, _, err = run_stack("--dir", str(tmp_path / "s"), "--runbook-base", base)
    assert code == 0, err
    assert (tmp_path / "s" / "rules" / "openlora.yml").read_text() == stack.rules_text(base)
    code, _, err = run_stack("--dir", str(tmp_path / "d"))
    assert code == 0, err
    assert (tmp_path / "d" / "rules" / "openlora.yml").read_text() == RULES.read_text()


def test_writes_a_prometheus_config_for_the_local_ranks(tmp_path: Path) -> None:
    code, out, err = run_stack("--dir", str(tmp_path / "stack"), "--ranks", "4", "--port", "9500")
    assert code == 0, err
    directory = tmp_path / "stack"
    config = yaml.safe_load((directory / "prometheus.yml").read_text())
    job, itself, alertmanager = config["scrape_configs"]
    assert job["job_name"] == "openlora"  # the job the pull-path rules read
    # Both servers scraped, for the openlora-prometheus and openlora-alertmanager groups.
    assert itself == {"job_name": "prometheus", "static_configs": [{"targets": ["127.0.0.1:9090"]}]}
    assert alertmanager == {"job_name": "alertmanager", "static_configs": [{"targets": ["127.0.0.1:9093"]}]}
    assert job["static_configs"] == [{"targets": [f"localhost:{p}" for p in range(9500, 9504)]}]
    assert config["rule_files"] == ["rules/openlora.yml"]
    assert (directory / "rules" / "openlora.yml").read_text() == RULES.read_text()
    assert config["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": ["127.0.0.1:9093"]}]}]
    # The timings the rules assume: those of collector/prometheus.yml.
    shipped = yaml.safe_load((ROOT / "collector" / "prometheus.yml").read_text())["global"]
    assert config["global"] == shipped
    # The exact command lines, on loopback, with the files just written.
    assert (
        f"prometheus --config.file={directory}/prometheus.yml --storage.tsdb.path={directory}/data/prometheus "
        "--web.listen-address=127.0.0.1:9090 --web.external-url=http://127.0.0.1:9090/ --rules.alert.resend-delay=15s"
    ) in out
    assert (
        f"--config.file={directory}/alertmanager.yml --storage.path={directory}/data/alertmanager "
        "--web.listen-address=127.0.0.1:9093 --cluster.listen-address=" in out
    )


@pytest.mark.process
def test_promtool_and_amtool_accept_what_it_writes(tmp_path: Path) -> None:
    code, _, err = run_stack("--dir", str(tmp_path), "--ranks", "2")
    assert code == 0, err
    checked = subprocess.run(
        [tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout
    checked = subprocess.run(
        [tool("amtool"), "check-config", str(tmp_path / "alertmanager.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_alertmanager_config_has_the_routes_of_the_compose_one(tmp_path: Path) -> None:
    code, _, err = run_stack("--dir", str(tmp_path), "--webhook", "https://hooks.example/openlora")
    assert code == 0, err
    written = yaml.safe_load((tmp_path / "alertmanager.yml").read_text())
    shipped = yaml.safe_load(COLLECTOR_ALERTMANAGER.read_text())
    for key in ("global", "route", "inhibit_rules"):
        assert written[key] == shipped[key], key
    assert [r["name"] for r in written["receivers"]] == [r["name"] for r in shipped["receivers"]]
    for receiver in written["receivers"]:
        assert receiver["webhook_configs"] == [
            {"url": "https://hooks.example/openlora", "send_resolved": True}
        ]
    # The URL may carry a token: the file is this user's only.
    assert stat.S_IMODE((tmp_path / "alertmanager.yml").stat().st_mode) == 0o600


def test_file_sd_directory_replaces_the_port_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    targets = tmp_path / "targets"
    monkeypatch.setenv("OPENLORA_PROMETHEUS_FILE_SD_DIR", str(targets))
    code, out, err = run_stack("--dir", str(tmp_path / "stack"))
    assert code == 0, err
    job, *_ = yaml.safe_load((tmp_path / "stack" / "prometheus.yml").read_text())["scrape_configs"]
    assert job["job_name"] == "openlora" and "static_configs" not in job
    assert job["file_sd_configs"] == [{"files": [str(targets.resolve() / "*.json")]}]
    assert f"the ranks registered in {targets}" in out


def test_port_and_host_follow_the_training_processes_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the ranks of a run started from the same shell bind: the port variable, and a
    # wildcard bind is reached by this machine's name (as the file_sd registration writes it).
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "9700")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "0.0.0.0")
    code, _, err = run_stack("--dir", str(tmp_path), "--ranks", "2")
    assert code == 0, err
    job, *_ = yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]
    host = socket.gethostname()
    assert job["static_configs"] == [{"targets": [f"{host}:9700", f"{host}:9701"]}]


def test_bad_settings_fail_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "ninety")
    code, _, err = run_stack("--dir", str(tmp_path / "a"))
    assert code == 2 and "OTEL_EXPORTER_PROMETHEUS_PORT='ninety' is not valid" in err
    assert not (tmp_path / "a").exists()
    monkeypatch.delenv("OTEL_EXPORTER_PROMETHEUS_PORT")
    for argv, message in (
        (["--ranks", "0"], "expected a number of ranks from 1 to 1024"),
        (["--port", "65535", "--ranks", "2"], "runs past port 65535"),
        (["--scrape-interval", "5"], "expected a Prometheus duration"),
        (["--webhook", "ftp://x"], "expected an http:// or https:// URL"),
        (["--prometheus-port", "9093"], "must differ"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            run_stack("--dir", str(tmp_path / "b"), *argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    with pytest.raises(SystemExit):
        run_stack()  # no --dir


SLACK_WEBHOOK = "https://hooks.slack.com/services/T0AAAAAA/B0BBBBBB/x9Secret9TokenXYZ"


@pytest.mark.parametrize(
    ("webhook", "secret"),
    [("https://bot:s3cr3t-t0ken@hooks.example/x", "s3cr3t-t0ken"), (SLACK_WEBHOOK, "x9Secret9TokenXYZ")],
    ids=["user-info", "slack-path"],
)
def test_credentials_in_the_webhook_url_are_not_printed(
    tmp_path: Path, webhook: str, secret: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_stack("--dir", str(tmp_path), "--webhook", webhook)
    assert code == 0
    assert secret not in out + err and "T0AAAAAA" not in out + err
    assert "alerts sent to https://" in out  # where they go: the scheme and host
    assert secret in (tmp_path / "alertmanager.yml").read_text()  # where Alertmanager needs it
    # Refused: a scheme other than http(s), and a URL urlsplit cannot parse (argparse would quote it).
    for bad in (webhook.replace("https://", "ftp://"), webhook.replace("https://", "https://[")):
        with pytest.raises(SystemExit):
            run_stack("--dir", str(tmp_path / "bad"), "--webhook", bad)
        refused = capsys.readouterr().err
        assert "expected an http:// or https:// URL" in refused
        assert secret not in refused and "T0AAAAAA" not in refused, refused


def test_a_dead_alertmanagers_log_is_shown_without_the_webhooks_token(tmp_path: Path, fake_servers: list) -> None:
    """Alertmanager's log may quote the webhook it failed to post to; stack shows the log's end when
    a server dies, and never the token in the webhook's path, not even a piece of it cut at the end's
    start."""
    line = f'level=error msg="Notify for alerts failed" err="Post \\"{SLACK_WEBHOOK}\\": dial tcp: i/o timeout"\n'
    # The shown end starts inside the token: cut first, then redacted, its tail would show.
    padding = "x" * (2000 - len(line) + line.index("9TokenXYZ"))
    (tmp_path / "alertmanager.log").write_text("y" * 500 + line + padding)
    plan = stack.StackPlan(tmp_path, targets=("localhost:9464",), webhook_url=SLACK_WEBHOOK, builtin_receiver=False)
    servers._Server.exited_flag = True  # the stand-in (fake_servers): Alertmanager exits at once
    out, err = io.StringIO(), io.StringIO()
    assert stack.start(plan, err, out) == 1
    assert "Alertmanager exited with status 0; the end of" in err.getvalue()
    assert "xxxx" in err.getvalue()
    for piece in ("T0AAAAAA", "B0BBBBBB", "x9Secret9TokenXYZ", "TokenXYZ"):
        assert piece not in err.getvalue() + out.getvalue(), piece


def test_start_without_the_binaries_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, out, err = run_stack("--dir", str(tmp_path / "stack"), "--start")
    assert code == 2
    assert "not found on PATH: `prometheus`" in err
    assert "apt-get install prometheus-alertmanager" in err
    assert (tmp_path / "stack" / "prometheus.yml").exists()  # written: the commands above still apply
    assert "prometheus --config.file=" in out


class _FakePrometheusApi:
    """``/-/ready`` at once, and ``/api/v1/targets`` listing ``target`` only once ``listed`` is set:
    what Prometheus 2 does in its first 5 s (ready, but its targets not yet handed to a scrape loop)."""

    def __init__(self, target: str) -> None:
        self.listed = threading.Event()
        self.target_queries = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/api/v1/targets"):
                    api.target_queries += 1
                    listed = [{"scrapePool": "openlora", "labels": {"instance": target}, "health": "unknown"}]
                    active = listed if api.listed.is_set() else []
                    body = json.dumps({"status": "success", "data": {"activeTargets": active}})
                else:
                    body = "Prometheus Server is Ready.\n"
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
        self.ports = [server.server_address[1] for server in self.servers]
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def fake_servers(monkeypatch: pytest.MonkeyPatch) -> list:
    """``_start`` with stand-ins for the two binaries: nothing is spawned; setting ``exited`` ends it."""
    started: list = []

    class FakeServer:
        exited_flag = False

        def __init__(self, name: str, argv: list[str], ready_url: str, log: Path) -> None:
            self.name, self.ready_url, self.log = name, ready_url, log
            self.process = argparse.Namespace(returncode=0)
            started.append(self)

        def exited(self) -> bool:
            return FakeServer.exited_flag

        def stop(self) -> None:
            pass

    monkeypatch.setattr(servers, "_Server", FakeServer)
    monkeypatch.setattr(servers, "find_binary", lambda names: "/nonexistent/" + names[0])
    return started


def test_start_says_it_runs_only_once_prometheus_scrapes_the_targets(
    tmp_path: Path, fake_servers: list
) -> None:
    """Prometheus 2 answers /-/ready about 5 s before it scrapes its static targets: a run started at
    the ready line and over by then (the NaN demo, 2 s) was never scraped, and its alerts never fired."""
    api = _FakePrometheusApi("localhost:9464")
    plan = stack.StackPlan(
        tmp_path,
        targets=("localhost:9464",),
        webhook_url="http://127.0.0.1:9/alerts",
        builtin_receiver=False,
        prometheus_port=api.ports[0],
        alertmanager_port=api.ports[1],
    )
    out, err = io.StringIO(), io.StringIO()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(stack.start(plan, err, out)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while api.target_queries < 3 and "Ctrl-C" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "Ctrl-C stops both" not in out.getvalue()  # not while the target is not scraped
        assert api.target_queries >= 3, err.getvalue()  # both ready: it asks what Prometheus scrapes
        api.listed.set()
        while "Ctrl-C stops both" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "Ctrl-C stops both" in out.getvalue()
    finally:
        type(fake_servers[0]).exited_flag = True
        thread.join(10)
        api.close()
    assert result == [1]  # ended by the fake servers "exiting"


def test_start_fails_when_prometheus_never_scrapes_the_targets(
    tmp_path: Path, fake_servers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "READY_TIMEOUT_S", 1.0)
    api = _FakePrometheusApi("localhost:9464")
    plan = stack.StackPlan(
        tmp_path,
        targets=("localhost:9464", "localhost:9465"),  # the second one is never listed
        webhook_url="http://127.0.0.1:9/alerts",
        builtin_receiver=False,
        prometheus_port=api.ports[0],
        alertmanager_port=api.ports[1],
    )
    api.listed.set()
    out, err = io.StringIO(), io.StringIO()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(stack.start(plan, err, out)), daemon=True)
    thread.start()
    thread.join(10)
    type(fake_servers[0]).exited_flag = True  # ends it, had it gone on to run
    thread.join(10)
    api.close()
    assert result == [1]
    assert "Prometheus does not scrape localhost:9464, localhost:9465 after 1 s" in err.getvalue()
    assert "Ctrl-C stops both" not in out.getvalue()


def test_a_file_sd_stack_has_no_targets_to_wait_for(tmp_path: Path) -> None:
    # The ranks register themselves whenever they start; nothing is listening on this port.
    plan = stack.StackPlan(tmp_path, file_sd_dir=str(tmp_path / "sd"), prometheus_port=free_port())
    assert servers._scraping(plan)


def test_the_alert_printer_shows_each_alert_with_its_run() -> None:
    out = io.StringIO()
    printer = stack.AlertPrinter(0, out).start()
    try:
        payload = {
            "version": "4",
            "status": "firing",
            "receiver": "critical",
            "alerts": [
                {
                    "status": "firing",
                    "labels": {
                        "alertname": "OpenloraLossNonFinite",
                        "severity": "critical",
                        "instance": "localhost:9464",
                        "openlora_run_id": "3f2a",
                        "openlora_run_name": "lr-high",
                    },
                    "annotations": {"summary": "NaN or infinite loss on localhost:9464 (run lr-high)"},
                },
                {
                    "status": "resolved",
                    "labels": {"alertname": "OpenloraCollectorDown", "severity": "critical"},
                },
            ],
        }
        request = urllib.request.Request(
            printer.url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        bad = urllib.request.Request(printer.url, data=b"{not json")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=5)
        assert refused.value.code == 400
    finally:
        printer.close()
    assert out.getvalue().splitlines() == [
        "[FIRING] critical OpenloraLossNonFinite: NaN or infinite loss on localhost:9464 (run lr-high) [run id 3f2a]",
        "[RESOLVED] critical OpenloraCollectorDown",
    ]


# -- the servers themselves -----------------------------------------------------------------------------


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.e2e
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_start_runs_both_on_loopback_and_stops_them(tmp_path: Path, how: signal.Signals) -> None:
    ports = [free_port() for _ in range(3)]
    process, lines = start_stack(
        tmp_path,
        "--prometheus-port",
        str(ports[0]),
        "--alertmanager-port",
        str(ports[1]),
        "--receiver-port",
        str(ports[2]),
    )
    try:
        assert f"Prometheus   http://127.0.0.1:{ports[0]}" in "\n".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/api/v1/alertmanagers", timeout=5) as r:
            body = json.load(r)
        deadline = time.monotonic() + 20  # the notifier's discovery sends its first update within 5 s
        while not body["data"]["activeAlertmanagers"] and time.monotonic() < deadline:
            time.sleep(0.5)
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/api/v1/alertmanagers", timeout=5) as r:
                body = json.load(r)
        assert body["data"]["activeAlertmanagers"] == [{"url": f"http://127.0.0.1:{ports[1]}/api/v2/alerts"}]
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/api/v1/rules", timeout=5) as r:
            groups = json.load(r)["data"]["groups"]
        assert {g["name"] for g in groups} >= {"openlora-training", "openlora-ranks"}
        # The servers listen on loopback only, on the ports asked for: no Alertmanager gossip port.
        import psutil

        pids = {process.pid} | {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
        assert len(pids) == 3  # this command, Prometheus, Alertmanager
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
        }
        assert listening == {("127.0.0.1", port) for port in ports}
    finally:
        process.send_signal(how)
        reap(process, 40)
    assert process.returncode == 0, process.stdout.read().decode()
    assert all(_refused(port) for port in ports)  # both servers and the printer are gone


def test_the_alert_printer_diagnoses_a_firing_runs_once_and_survives_a_prometheus_it_cannot_reach() -> None:
    """With diagnose_from, a firing alert's run is diagnosed there (once in DIAGNOSE_EVERY_S); a resolved
    alert, an alert without a run, and a repeat notification are not. Here the Prometheus is a closed
    port: the diagnosis says it failed and why, and the printer goes on. (A real Prometheus and a real
    run: tests/report/test_alert_diagnosis.py.)"""
    out = io.StringIO()
    closed = f"http://127.0.0.1:{free_port()}"
    printer = stack.AlertPrinter(0, out, diagnose_from=closed).start()

    def post(status: str, labels: dict) -> None:
        payload = {"version": "4", "status": status, "alerts": [{"status": status, "labels": labels, "annotations": {}}]}
        request = urllib.request.Request(printer.url, data=json.dumps(payload).encode())
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200

    try:
        run = {"alertname": "OpenloraRankHung", "severity": "critical", "openlora_run_id": "r-7"}
        post("firing", run)
        post("firing", run)  # Alertmanager's repeat: not diagnosed again
        post("resolved", {**run, "openlora_run_id": "r-8"})
        post("firing", {"alertname": "OpenloraCollectorDown", "severity": "critical"})
        deadline = time.monotonic() + 60
        while "diagnosis of run" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        printer.close()
    diagnoses = [line for line in out.getvalue().splitlines() if "diagnosis of run" in line]
    assert len(diagnoses) == 1 and diagnoses[0].startswith("  diagnosis of run r-7 failed: "), out.getvalue()
    assert closed.rsplit(":", 1)[1] in diagnoses[0]  # it says which Prometheus


def test_the_alert_printer_takes_hostile_notifications_without_harm() -> None:
    """Found by review: bodies that are not what Alertmanager sends broke the handler, a body of 5,000
    runs queued 5,000 diagnoses, and a label's escape sequences reached the terminal."""
    out = io.StringIO()
    printer = stack.AlertPrinter(0, out, diagnose_from=f"http://127.0.0.1:{free_port()}").start()

    def post(body: bytes, headers: dict | None = None) -> int:
        request = urllib.request.Request(printer.url, data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as refused:
            return refused.code

    try:
        for body in ({"alerts": 7}, {"alerts": ["x", 3, None]}, {"alerts": [{"labels": ["a"], "annotations": 2}]},
                     {"alerts": [{"status": "firing", "labels": {"openlora_run_id": ["r"]}}]}):  # fmt: skip
            assert post(json.dumps(body).encode()) == 200
        assert post(b"{}", {"Content-Length": "-1"}) in (400, 200)  # never a read to EOF
        flood = [{"status": "firing", "labels": {"alertname": "X", "openlora_run_id": f"run-{i}"}} for i in range(5000)]
        assert post(json.dumps({"alerts": flood}).encode()) == 200
        evil = {"alertname": "A\x1b]0;pwn\x07", "openlora_run_id": "r\x1b[2J", "severity": "warning"}
        assert post(json.dumps({"alerts": [{"status": "resolved", "labels": evil}]}).encode()) == 200
        deadline = time.monotonic() + 60
        while out.getvalue().count("diagnosis of run") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert printer._pending <= stack.servers.DIAGNOSES_PENDING and len(printer._diagnosed) <= 3
    finally:
        printer.close()
    text = out.getvalue()
    assert out.getvalue().count("diagnosis of run") == 3, text  # of the first notification's first runs only
    assert "\x1b" not in text and "A\\x1b]0;pwn\\x07" in text and "r\\x1b[2J" in text, text


@pytest.mark.process
def test_receiver_only_prints_alerts_until_sigterm() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "openlora_otel", "stack", "--receiver-only", "--receiver-port", str(port)],
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_line(process, f"receiving alerts at http://127.0.0.1:{port}/alerts", 30)
        payload = {"alerts": [{"status": "firing", "labels": {"alertname": "X", "severity": "warning"}}]}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/alerts", data=json.dumps(payload).encode())
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        wait_for_line(process, "[FIRING] warning X", 10)
    finally:
        process.send_signal(signal.SIGTERM)
        reap(process, 20)
    assert process.returncode == 0
    assert _refused(port)

"""Credentials never printed: every path that once leaked one, with all output and logs grepped.

The paths: the export-failure warning (the SDK's gRPC message quotes the
endpoint with its user:password; an HTTP server's reason phrase can quote a
header), ConfigError messages, `doctor`, and the config reprs. Each test captures
everything (caplog at DEBUG, the process's stdout/stderr through capfd, or a
child's output) and looks for the secret, after checking that the path really ran.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, unquote_plus

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.config import ConfigError, OTLPConfig, secrets_in_env
from openlora_otel.redaction import REDACTED, redact, redact_url, secret_forms, url_secrets
from tests.support.otlp_receiver import HttpReceiver
from tests.support.processes import child_env, free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-pw"
TOKEN = "t0ken-value-42"
SECRETS = (PASSWORD, TOKEN)


def leaked(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


def everything(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> str:
    """All captured logs (formatted, tracebacks included) and everything written to fds 1 and 2."""
    captured = capfd.readouterr()
    messages = "\n".join(record.getMessage() for record in caplog.records)
    return "\n".join([caplog.text, messages, captured.out, captured.err])


# ---- the helper itself -------------------------------------------------------------------------


def test_redact_scrubs_known_secrets_in_their_echoed_forms() -> None:
    secrets = secret_forms(f"Bearer {TOKEN}\r\nX-Evil: 1") | url_secrets(f"http://user:{PASSWORD}@h:1")
    for text in (
        f"reason: Bearer {TOKEN}",  # the value as sent
        f"invalid token {TOKEN}",  # the token alone
        f"header value: 'Bearer {TOKEN}\\r\\nX-Evil: 1'",  # repr-escaped, as requests prints it
        f"Bearer%20{TOKEN}",  # percent-encoded
        f"Failed to export metrics to user:{PASSWORD}@127.0.0.1:1",  # gRPC: no scheme
        "Basic dXNlcjpzM2NyZXQtcHc=",  # the Basic-auth form requests sends
    ):
        assert leaked(redact(text, secrets)) == [] and "dXNlcjpz" not in redact(text, secrets), text


def test_redact_scrubs_any_url_credentials_and_keeps_the_rest() -> None:
    assert (
        redact("to http://u:p@host:1/x and https://a@b.c/")
        == f"to http://{REDACTED}@host:1/x and https://{REDACTED}@b.c/"
    )
    # A password holding an unescaped "@" goes whole.
    assert redact_url("http://user:p@ss@h:1/x?y=z") == f"http://{REDACTED}@h:1/x?y={REDACTED}"
    # So does one holding an unescaped "/", "?" or "#": the user info runs to the last "@" anywhere.
    for delimiter in "/?#":
        assert redact_url(f"http://user:p{delimiter}ss@h:1/x") == f"http://{REDACTED}@h:1/x"
    assert redact_url("http://user:p@ss@h:1/x?y=a@b") == f"http://{REDACTED}@b"  # over-hidden, never under
    # Every query value and the fragment; the names stay.
    assert (
        redact_url("https://h/v1/metrics?api_key=k1&Sig=k2&bare#frag")
        == f"https://h/v1/metrics?api_key={REDACTED}&Sig={REDACTED}&{REDACTED}#{REDACTED}"
    )
    assert redact("failed: 'http://h:1/x?token=abc#f' (403)") == f"failed: 'http://h:1/x?token={REDACTED}#{REDACTED}' (403)"
    assert redact_url("user:pw@h:4317") == f"{REDACTED}@h:4317"
    # Only a scheme starts a URL: a "://" after the credentials of a scheme-less one is no scheme's
    # (found by tests/config/test_env_fuzz.py, issue 29; the password was shown).
    assert redact_url("user:pw@h:4317/a://b") == f"{REDACTED}@h:4317/a://b"
    assert "pw12" in url_secrets("user:pw12@h://")
    assert redact_url("http://u:pw@[::1") == f"http://{REDACTED}@[::1"  # too malformed for urlsplit
    assert redact("mail me@example.org, see http://host/a@b") == "mail me@example.org, see http://host/a@b"
    # Short values are not scrubbed from free text (they would garble it); they guard nothing.
    assert redact("html xml", secret_forms("ml")) == "html xml"


def test_a_webhooks_path_is_its_token_and_is_hidden_with_path_true() -> None:
    slack = "https://hooks.slack.com/services/T0AAAAAA/B0BBBBBB/x9Secret9TokenXYZ"
    assert redact_url(slack, path=True) == f"https://hooks.slack.com/{REDACTED}"
    assert redact_url(slack) == slack  # an endpoint's path (/v1/metrics) is shown
    assert (
        redact_url("https://bot:pw@h:8443/hook/abc?key=v#f", path=True)
        == f"https://{REDACTED}@h:8443/{REDACTED}?key={REDACTED}#{REDACTED}"
    )
    # Nothing to hide: no path, or just "/".
    assert redact_url("http://h:9/", path=True) == "http://h:9/"
    assert redact_url("http://h:9", path=True) == "http://h:9"
    # The path, whole and percent-decoded, among the secrets that free text is scrubbed of (an
    # Alertmanager log line quoting the URL it failed to post to).
    discord = "https://discord.com/api/webhooks/123456/tok%2Ben"
    secrets = url_secrets(discord, path=True)
    for shown in (discord, "https://discord.com/api/webhooks/123456/tok+en"):
        scrubbed = redact(f'msg="Notify failed" err="Post \\"{shown}\\": dial tcp: i/o timeout"', secrets)
        assert "123456" not in scrubbed and "tok" not in scrubbed, scrubbed
    assert scrubbed.startswith('msg="Notify failed" err="Post \\"https://<redacted>'), scrubbed
    assert not url_secrets(discord) & url_secrets(discord, path=True) - url_secrets(discord)  # only with path=True
    # The path after its host, not alone: a plain word of the log stays.
    line = 'msg="Notify for alerts failed" path=/api/v2/alerts err="Post \\"http://myhost:5001/alerts\\""'
    assert redact(line, url_secrets("http://myhost:5001/alerts", path=True)) == line.replace(
        "myhost:5001/alerts", REDACTED
    )


@pytest.mark.parametrize("value", ["a." * 100_000, "http://" + "a." * 100_000, "a://" * 50_000, "a://@" * 40_000])
def test_redaction_is_linear_in_a_long_hostile_value(value: str) -> None:
    """Every ConfigError's value goes through redact(): a long value built to make the URL patterns
    restart at each word boundary or `://` took seconds (quadratic); bounded here with a wide margin."""
    started = time.monotonic()
    with pytest.raises(ConfigError):
        TelemetryConfig.from_env({"OTEL_EXPORTER_PROMETHEUS_HOST": value})
    redact_url(value)
    assert time.monotonic() - started < 3.0


def test_secrets_in_env_reads_even_an_invalid_environment() -> None:
    secrets = secrets_in_env(
        {
            "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}%0D%0A,{PASSWORD}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://u:{PASSWORD}@[::1",
        }
    )
    assert TOKEN in secrets and PASSWORD in secrets


# ---- reprs -------------------------------------------------------------------------------------


def test_config_reprs_redact_headers_and_url_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    config = TelemetryConfig.from_env(
        {
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@collector:4318",
            "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN},x-team=ml",
        }
    )
    assert config.otlp.headers[0] == ("authorization", f"Bearer {TOKEN}")  # the value itself is intact
    telemetry = setup_telemetry(config=config)
    print(telemetry.config)
    print(config.otlp)
    print(repr(config), str(config.otlp), f"{config!r}")
    telemetry.shutdown()
    out = capsys.readouterr().out
    assert leaked(out) == []
    assert f"http://{REDACTED}@collector:4318/v1/metrics" in out
    assert f"('authorization', '{REDACTED}')" in out and "('x-team', '<redacted>')" in out


# ---- ConfigError -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@127.0.0.1:99999"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"ftp://user:{PASSWORD}@127.0.0.1:4318"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@[::1"},
        {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"https://user:{PASSWORD}@h\n:4318"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": f"user:{PASSWORD}@h:99999"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": f"user:{PASSWORD}@[zz]:1"},
        # A "://" after the credentials of a scheme-less endpoint (found by tests/config/test_env_fuzz.py).
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"user:{PASSWORD}@collector.example://"},
        # urlsplit's own error quotes the user info (found by tests/config/test_env_fuzz.py).
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": f"[user:{PASSWORD}@[::1]:4318"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}\uff03@collector.example:4318"},
        {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}%0D%0AX-Evil:%201"},
        {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}%00"},
        {"OTEL_EXPORTER_OTLP_METRICS_HEADERS": f"a=1,Bearer {TOKEN}"},
        {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}%ff"},
        {"OTEL_RESOURCE_ATTRIBUTES": f"repo=https://ci:{PASSWORD}@git.example/x,broken"},
    ],
)
def test_config_errors_never_show_credentials(
    env: dict[str, str], caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError) as info:
        TelemetryConfig.from_env(env)
    error = info.value
    assert leaked(str(error)) == [] and leaked(repr(error.value)) == [] and leaked(repr(error)) == []
    # The same through setup_telemetry() from the environment, logs and output included.
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ConfigError) as again:
            setup_telemetry()
        print(again.value)
    assert again.value.variable == error.variable
    assert leaked(everything(caplog, capfd)) == []


def test_a_header_with_encoded_crlf_is_refused_at_setup(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{TOKEN}%0D%0AX-Evil:%201")
    with pytest.raises(ConfigError, match="control character") as info:
        setup_telemetry()
    assert info.value.variable == "OTEL_EXPORTER_OTLP_HEADERS"
    assert leaked(everything(caplog, capfd)) == []


# ---- the export-failure warning: real failing exports through the SDK ----------------------------


def _export_once_and_shut_down(env: dict[str, str]) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
    telemetry.meter.create_counter("openlora.test.steps").add(3)
    telemetry.force_flush(timeout_s=10)  # one export, which fails
    telemetry.shutdown(timeout_s=5)


def test_grpc_failure_warning_hides_the_url_password(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    caplog.set_level(logging.DEBUG)
    _export_once_and_shut_down(
        {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@127.0.0.1:{free_port()}",
            "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
        }
    )
    text = everything(caplog, capfd)
    warnings = [r.getMessage() for r in caplog.records if r.name == "openlora_otel.exporters"]
    # The SDK's own message came through (it quotes the gRPC target), scrubbed.
    assert any("StatusCode." in w and f"{REDACTED}@127.0.0.1" in w for w in warnings), warnings
    assert leaked(text) == []


class _EchoingServer:
    """An OTLP/HTTP endpoint that refuses every export, quoting the request's credentials in
    its reason phrase, which the SDK puts into its failure message."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                echoed = f"denied {self.headers.get('x-api-key')} {self.headers.get('authorization')}"
                self.send_response(403, echoed)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def echoing_server() -> Iterator[_EchoingServer]:
    server = _EchoingServer()
    yield server
    server.close()


def test_http_failure_warning_hides_echoed_header_and_url_credentials(
    echoing_server: _EchoingServer, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    caplog.set_level(logging.DEBUG)
    _export_once_and_shut_down(
        {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@127.0.0.1:{echoing_server.port}",
            "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={TOKEN}",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
        }
    )
    text = everything(caplog, capfd)
    warnings = [r.getMessage() for r in caplog.records if r.name == "openlora_otel.exporters"]
    # The server's reason phrase reached our warning: the Basic credentials requests built
    # from the URL and the header, both scrubbed.
    assert any("code: 403" in w and f"denied {REDACTED} Basic {REDACTED}" in w for w in warnings), warnings
    assert leaked(text) == [] and "dXNlcjpz" not in text  # nor the Basic-auth form


def test_exception_text_from_the_sdk_is_scrubbed_too(
    echoing_server: _EchoingServer, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """A header our config would refuse, given to the SDK directly: requests refuses it on every
    export and quotes it (repr-escaped). The guard's redaction still hides it."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from openlora_otel.exporters.outage import GuardedExporter

    caplog.set_level(logging.DEBUG)
    bad_value = f"Bearer {TOKEN}\r\nX-Evil: 1"
    inner = OTLPMetricExporter(
        endpoint=f"http://127.0.0.1:{echoing_server.port}/v1/metrics",
        headers={"authorization": bad_value},
        timeout=1,
    )
    exporter = GuardedExporter(inner, describe="test export", secrets=secret_forms(bad_value))
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=600_000)
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("t").create_counter("c").add(1)
    provider.force_flush(timeout_millis=5000)
    provider.shutdown(timeout_millis=5000)
    text = everything(caplog, capfd)
    warnings = [r.getMessage() for r in caplog.records if r.name == "openlora_otel.exporters"]
    assert any("header value" in w and REDACTED in w for w in warnings), warnings
    assert leaked(text) == []


def test_sdk_records_outside_an_export_are_scrubbed_while_the_guard_is_installed(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """The SDK logs on its export loggers outside our export call too (channel setup, shutdown):
    those records pass, with the exporter's secrets redacted, traceback included."""
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    from openlora_otel.exporters.outage import GuardedExporter

    caplog.set_level(logging.DEBUG)
    otlp = OTLPConfig(
        endpoint=f"http://user:{PASSWORD}@127.0.0.1:4317",
        protocol="grpc",
        headers=(("authorization", f"Bearer {TOKEN}"),),
    )
    exporter = GuardedExporter(ConsoleMetricExporter(), describe="test", secrets=otlp.secrets())
    sdk_logger = logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter")
    try:
        sdk_logger.warning("channel to %s refused token %s", f"user:{PASSWORD}@127.0.0.1:4317", TOKEN)
        try:
            raise RuntimeError(f"bad metadata Bearer {TOKEN}")
        except RuntimeError:
            sdk_logger.exception("export setup failed")
    finally:
        exporter.shutdown()
    text = everything(caplog, capfd)
    assert "channel to <redacted>@127.0.0.1:4317 refused token <redacted>" in text
    assert "RuntimeError: bad metadata <redacted>" in text  # the traceback, scrubbed
    assert leaked(text) == []


def test_programmatic_otlp_config_cannot_carry_a_crlf_header() -> None:
    with pytest.raises(ConfigError) as info:
        OTLPConfig(headers=(("authorization", f"Bearer {TOKEN}\r\nX-Evil: 1"),))
    assert leaked(str(info.value)) == []


# ---- doctor, as a user runs it ------------------------------------------------------------------


def run_doctor_cli(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "openlora_otel", "doctor", "--timeout", "2"],
        env=child_env(OPENLORA_GPU_METRICS="off", **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.process
def test_doctor_with_credentials_against_a_live_collector() -> None:
    server = HttpReceiver()
    try:
        result = run_doctor_cli(
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://user:{PASSWORD}@127.0.0.1:{server.port}",
            OTEL_EXPORTER_OTLP_HEADERS=f"x-api-key={TOKEN}",
        )
    finally:
        server.close()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # The probe reached the collector the way the exporter would (Basic auth from the URL).
    assert "answered HTTP 200" in output
    assert leaked(output) == []


@pytest.mark.process
@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}%0D%0AX-Evil:%201"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@127.0.0.1:99999"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": f"user:{PASSWORD}@h:99999"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{PASSWORD}@[::1"},
    ],
)
def test_doctor_on_an_invalid_configuration(env: dict[str, str]) -> None:
    result = run_doctor_cli(OTEL_METRICS_EXPORTER="otlp", **env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "[FAIL] configuration" in output
    assert leaked(output) == []


def test_doctor_when_the_http_probe_fails() -> None:
    """A header the probe cannot send makes urllib raise with the value in its message."""
    from openlora_otel.commands.doctor import _check_otlp

    server = HttpReceiver()
    try:
        # Built by hand: from_env would refuse this header before doctor got here.
        config = TelemetryConfig(
            exporters=("otlp",),
            otlp=OTLPConfig(endpoint=f"http://127.0.0.1:{server.port}/v1/metrics"),
        )
        object.__setattr__(config.otlp, "headers", (("authorization", f"Bearer {TOKEN}\nX: 1"),))
        check = _check_otlp(config, timeout_s=2)
    finally:
        server.close()
    assert check.ok is False and "request failed" in check.detail
    assert leaked(check.detail) == []


# ---- hostile endpoint URLs through every output ------------------------------------------------
# A password with an unescaped `#`, `/` or `?` (which RFC 3986 reads as the end of the host), tokens in
# the query (every value is redacted, not a list of secret-sounding names) and the fragment, a user
# name alone, percent-encoded secrets: no byte of the secret, in its raw, decoded or encoded form, may
# show in any output. PIECE_A and PIECE_B make up every secret, so finding neither also rules out a
# secret cut in half at a delimiter (`pa` of `pa#ss` shown as a port).

PIECE_A = "Qz7kLp2x"
PIECE_B = "Wm4rTn9v"
PORT = "{port}"  # a loopback port with nothing listening, filled in by the test


@dataclass(frozen=True)
class Hostile:
    """An endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` unless ``variable`` says otherwise) and the secrets
    written in it; ``refused``: setup must refuse it (a ConfigError) rather than export with it."""

    url: str
    secrets: tuple[str, ...]
    refused: bool
    variable: str = "OTEL_EXPORTER_OTLP_ENDPOINT"
    grpc: bool = False

    def env(self, port: int) -> dict[str, str]:
        env = {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OPENLORA_GPU_METRICS": "off",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
            self.variable: self.url.replace(PORT, str(port)),
        }
        if self.grpc:
            env.update(OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_INSECURE="true")
        return env


HOSTILE = [
    # Unescaped delimiters in the password: refused (the URL names another host), never shown.
    Hostile(f"http://user:{PIECE_A}#{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}#{PIECE_B}",), refused=True),
    Hostile(f"http://user:{PIECE_A}/{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}/{PIECE_B}",), refused=True),
    Hostile(f"http://user:{PIECE_A}?{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}?{PIECE_B}",), refused=True),
    # Read by RFC 3986 as host `user`, port 24680: it was accepted and exported to that host.
    Hostile(f"http://user:24680/{PIECE_A}@127.0.0.1:{PORT}/", (f"24680/{PIECE_A}", "24680"), refused=True),
    Hostile(f"user:{PIECE_A}#{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}#{PIECE_B}",), refused=True, grpc=True),
    Hostile(f"http://user:{PIECE_A} {PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A} {PIECE_B}",), refused=True),
    # Malformed otherwise (a bad port): the error must still hide the secret.
    Hostile(f"http://user:{PIECE_A}%23{PIECE_B}@127.0.0.1:99999", (f"{PIECE_A}%23{PIECE_B}",), refused=True),
    Hostile(
        f"http://127.0.0.1:99999/v1/metrics?api_key={PIECE_A}",
        (PIECE_A,),
        refused=True,
        variable="OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ),
    Hostile(f"http://127.0.0.1:0/#{PIECE_A}", (PIECE_A,), refused=True),
    # Valid: exported to, and shown redacted everywhere.
    Hostile(f"http://user:{PIECE_A}%23{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}%23{PIECE_B}",), refused=False),
    Hostile(f"http://{PIECE_A}@127.0.0.1:{PORT}", (PIECE_A,), refused=False),  # a token as the user name
    Hostile(f"http://{PIECE_A}%2F{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}%2F{PIECE_B}",), refused=False),
    Hostile(
        f"http://127.0.0.1:{PORT}/v1/metrics?api_key={PIECE_A}&Signature={PIECE_B}",
        (PIECE_A, PIECE_B),
        refused=False,
        variable="OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ),
    Hostile(f"http://127.0.0.1:{PORT}?ACCESS_TOKEN={PIECE_A}%2B{PIECE_B}", (f"{PIECE_A}%2B{PIECE_B}",), refused=False),
    Hostile(
        f"http://127.0.0.1:{PORT}/v1/metrics?{PIECE_A}",
        (PIECE_A,),
        refused=False,
        variable="OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ),
    Hostile(
        f"http://127.0.0.1:{PORT}/v1/metrics#{PIECE_A}",
        (PIECE_A,),
        refused=False,
        variable="OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ),
    Hostile(f"http://user:{PIECE_A}%3F{PIECE_B}@127.0.0.1:{PORT}", (f"{PIECE_A}%3F{PIECE_B}",), refused=False, grpc=True),
    Hostile(f"user:{PIECE_A}@127.0.0.1:{PORT}", (PIECE_A,), refused=False, grpc=True),
]


def secret_leaks(text: str, case: Hostile) -> list[str]:
    """Every form of ``case``'s secrets (raw, percent-decoded, percent-encoded) and their pieces found in ``text``."""
    forms = {PIECE_A, PIECE_B}
    for secret in case.secrets:
        for form in (secret, unquote(secret), unquote_plus(secret)):
            forms |= {form, quote(form, safe=""), quote(form)}
    return sorted(form for form in forms if form in text)


def run_doctor_in_process(capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``openlora-otel doctor`` as the command line runs it, in this process: its exit status, and all
    output since the last read (so what came before it, such as setup's announcement, is in it too)."""
    from openlora_otel.cli import main

    status = main(["doctor", "--timeout", "1"])
    captured = capfd.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("case", HOSTILE, ids=lambda case: case.url)
def test_hostile_endpoint_urls_never_show_their_secrets(
    case: Hostile,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    if case.grpc and not case.refused:
        pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    caplog.set_level(logging.DEBUG)
    port = free_port()
    env = case.env(port)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    outputs: list[str] = []

    if case.refused:
        with pytest.raises(ConfigError) as info:
            TelemetryConfig.from_env(env)
        error = info.value
        assert error.variable == case.variable, error
        outputs += [str(error), repr(error), repr(error.value), str(error.args)]
        with pytest.raises(ConfigError) as again:
            setup_telemetry()
        outputs.append(str(again.value))
        status, doctor = run_doctor_in_process(capfd)
        assert status == 2 and "[FAIL] configuration" in doctor, doctor
    else:
        config = TelemetryConfig.from_env(env)
        outputs += [repr(config), str(config), repr(config.otlp), config.otlp.redacted_endpoint()]
        telemetry = setup_telemetry(config=config)
        where = telemetry.where_metrics_go()
        assert f"127.0.0.1:{port}" in where, where
        outputs.append(where)
        telemetry.meter.create_counter("openlora.test.steps").add(1)
        telemetry.force_flush(timeout_s=10)  # one export, which fails: nothing listens
        telemetry.shutdown(timeout_s=5)
        warnings = [r.getMessage() for r in caplog.records if r.name == "openlora_otel.exporters"]
        assert any(" failed (" in w for w in warnings), warnings
        status, doctor = run_doctor_in_process(capfd)
        assert status == 1 and "nothing answers" in doctor, doctor
    outputs.append(doctor)
    outputs.append(everything(caplog, capfd))
    for text in outputs:
        assert secret_leaks(text, case) == [], text

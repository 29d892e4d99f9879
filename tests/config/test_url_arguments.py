"""The URL arguments of the command line (``load --url``, ``report --prometheus``, ``stack --webhook``), all
checked by ``openlora_otel.config.checks.check_url``: a URL that cannot be used is a one-line usage error (exit 2),
never a traceback, and no output ever shows its password (nor a webhook's path, its token). In process;
no connection leaves the machine (``socket.create_connection`` refuses every one)."""

from __future__ import annotations

import socket
import string
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.support.cli import run_cli
from tests.support.fuzz import fuzz

SECRET = "Zq7PW-s3cret"


@pytest.fixture(autouse=True)
def no_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection is refused at once: an accepted URL is tried, and no packet leaves (nor a DNS query)."""

    def refuse(address: object, *args: object, **kwargs: object) -> socket.socket:
        raise ConnectionRefusedError(111, "Connection refused (no connection leaves this test)")

    monkeypatch.setattr(socket, "create_connection", refuse)


def load(url: str) -> list[str]:
    return ["load", "--url", url, "--adapters", "a1", "--requests", "1", "--timeout", "0.5"]


def report(url: str) -> list[str]:
    return ["report", "--prometheus", url, "--run", "r1"]


def stack(url: str, directory: Path) -> list[str]:
    return ["stack", "--dir", str(directory), "--webhook", url]


def assert_refused(code: int, output: str, *secrets: str) -> None:
    assert code == 2, output
    # One line says why (argparse prints its usage lines before it).
    said = [line for line in output.splitlines() if not line.startswith(("usage:", " "))]
    assert len(said) == 1 and said[0].startswith("openlora-otel "), output
    assert "Traceback" not in output, output
    for secret in secrets:
        assert secret not in output, output


@pytest.mark.parametrize(
    "url",
    [
        f"http://u:{SECRET}@host:99999/v1",
        f"ftp://u:{SECRET}@host:8000/v1",
        f"u:{SECRET}@host:8000",
        f"http://u:{SECRET}@[::1",
        f"http://u:{SECRET}@a b:8000",
        f"http://u:{SECRET}@host:8000/\udcff",  # a byte that was not UTF-8, from the shell
        f"http://u:{SECRET}@host:8000/é",
    ],
)
def test_load_url_refusals_are_usage_errors_without_the_password(url: str) -> None:
    code, output = run_cli(load(url))
    assert_refused(code, output, SECRET)
    assert "--url=" in output and "<redacted>@" in output


@pytest.mark.parametrize(
    "url",
    [
        f"http://u:{SECRET}@host:99999",
        f"http://u:{SECRET}@[::1",
        "http://[::1",
        f"http://u:{SECRET}@a b:9090",
        "http://a b:9090",
        f"https://u:{SECRET}@host:9090/\udcff",
        f"https://u:{SECRET}@host:9090/é",
    ],
)
def test_report_prometheus_refusals_are_usage_errors_without_the_password(url: str) -> None:
    code, output = run_cli(report(url))
    assert_refused(code, output, SECRET)
    assert output.startswith("openlora-otel report: --prometheus=")


@pytest.mark.parametrize(
    "url",
    [
        f"https://u:{SECRET}@hooks.example:99999/services/T0/B0/{SECRET}",
        f"https://hooks.example/services/{SECRET}\udcff",
        f"https://[hooks.example/services/{SECRET}",
    ],
)
def test_stack_webhook_refusals_are_usage_errors_without_the_token(url: str, tmp_path: Path) -> None:
    code, output = run_cli(stack(url, tmp_path / "stack"))
    assert_refused(code, output, SECRET)
    assert "argument --webhook: --webhook=" in output and not (tmp_path / "stack").exists()


def test_an_accepted_url_is_tried_and_its_password_still_never_shown(tmp_path: Path) -> None:
    code, output = run_cli(load(f"http://u:{SECRET}@localhost:8000/v1?key={SECRET}"))
    assert code == 1 and "cannot connect to localhost:8000" in output and SECRET not in output
    code, output = run_cli(report(f"http://u:{SECRET}@localhost:9090/prom?key={SECRET}"))
    assert code == 2 and "cannot reach Prometheus at http://<redacted>@localhost:9090/prom" in output
    assert SECRET not in output
    code, output = run_cli(stack(f"https://u:{SECRET}@hooks.example/services/{SECRET}", tmp_path))
    assert code == 0 and "sent to https://<redacted>@hooks.example/<redacted>" in output
    assert SECRET not in output


# -- property: any URL-like text ------------------------------------------------------------------------

# The characters a URL's parts are made of, and the ones that break it (space, controls, brackets,
# non-ASCII, a byte that was not UTF-8).
_URL_CHARS = string.ascii_letters + string.digits + "-._~:/?#[]@!$&'()*+,;=%"
_ODD = st.sampled_from([" ", "\t", "\n", "\x00", "\x7f", "[", "]", "é", "\udcff", "\u2028", "\u2115"])
_piece = st.text(st.sampled_from(_URL_CHARS) | _ODD, max_size=10)
_password = st.builds(
    lambda tail, encoded: (
        SECRET + (quote(tail.encode("utf-8", "surrogateescape"), safe="") if encoded else tail)
    ),
    _piece,
    st.booleans(),
)
_host = (
    st.sampled_from(["localhost", "127.0.0.1", "[::1]", "[::1", "h.example", "", "a b", "é.example"]) | _piece
)
_port = st.sampled_from(
    ["", ":", ":8000", ":0", ":65535", ":65536", ":99999", ":-1", ":\uff18\uff10"]
) | _piece.map(lambda text: ":" + text)
_url = st.builds(
    lambda scheme, password, host, port, path, query: (
        f"{scheme}{'' if password is None else f'user:{password}@'}{host}{port}{path}{query}"
    ),
    st.sampled_from(["http://", "https://", "ftp://", "", "http:/", "HTTP://"]),
    st.none() | _password,
    _host,
    _port,
    st.sampled_from(["", "/", "/v1", "/prom/"]) | _piece.map(lambda text: "/" + text),
    st.sampled_from(["", "?"]) | _password.map(lambda secret: f"?api_key={secret}"),
)


def _secrets(url: str) -> list[str]:
    """Each password or query value in ``url`` (it starts with SECRET), raw and decoded."""
    found = []
    for start in range(len(url)):
        if url.startswith(SECRET, start):
            end = min([i for i in (url.find(c, start) for c in "@&#") if i >= 0] or [len(url)])
            found += [url[start:end], unquote(url[start:end])]
    return [secret for secret in found if secret]


@fuzz
@given(url=_url)
@example(url=f"http://user:{SECRET}@host:99999/v1")
@example(url=f"ftp://user:{SECRET}@host/v1")
@example(url=f"user:{SECRET}@host:8000")
@example(url=f"http://user:{SECRET}@[::1")
@example(url="http://a b:9090")
@example(url=f"http://user:{SECRET}@host:8000/\udcff")
@example(url=f"http://user:{SECRET}@host:8000/é")
def test_fuzz_url_arguments_never_trace_back_nor_show_the_password(url: str, tmp_path: Path) -> None:
    """Bounded by tests/support/fuzz.py; about 2 s at the default 150 examples."""
    secrets = _secrets(url)
    code, output = run_cli(load(url))
    assert code in (1, 2), output  # refused, or accepted and not reachable
    assert "Traceback" not in output and not any(secret in output for secret in secrets), output
    code, output = run_cli(report(url))
    assert code == 2, output  # refused, or not reachable
    assert "Traceback" not in output and not any(secret in output for secret in secrets), output
    code, output = run_cli(stack(url, tmp_path / "stack"))
    assert code in (0, 2), output
    # The webhook's path is hidden too: no piece of the URL after its host is printed.
    assert "Traceback" not in output and not any(secret in output for secret in secrets), output

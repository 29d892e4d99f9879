"""``--runbook-base`` (``openlora-otel rules`` and ``stack``): what cannot be a URL in a runbook link is a
usage error and leaves no file behind; what is accepted gives a rules file that PyYAML loads (and promtool
checks) whose every runbook_url is that base, '#' and the alert's anchor."""

from __future__ import annotations

import string
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from openlora_otel.stack import DEFAULT_RUNBOOK_BASE, check_runbook_base, rules_text
from tests.support.cli import run_cli
from tests.support.fuzz import fuzz
from tests.support.prometheus_server import promtool

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def runbook_urls(text: str) -> dict[str, str]:
    """Alert name -> runbook_url of the rules in ``text``, as PyYAML reads them."""
    groups = yaml.load(text, Loader=_LOADER)["groups"]
    return {
        rule["alert"]: rule["annotations"]["runbook_url"]
        for group in groups
        for rule in group["rules"]
        if "alert" in rule
    }


DEFAULT_URLS = runbook_urls(rules_text())
ANCHORS = {alert: url.removeprefix(DEFAULT_RUNBOOK_BASE) for alert, url in DEFAULT_URLS.items()}


def assert_refused(base: str, tmp_path: Path) -> None:
    """Both commands refuse ``base``: exit 2, one line, and no file written."""
    target = tmp_path / "openlora.yml"
    code, output = run_cli(["rules", "--runbook-base", base, "--output", str(target)])
    assert code == 2 and "argument --runbook-base:" in output and "Traceback" not in output, output
    assert not target.exists()
    directory = tmp_path / "stack"
    code, output = run_cli(["stack", "--dir", str(directory), "--runbook-base", base])
    assert code == 2 and "argument --runbook-base:" in output and "Traceback" not in output, output
    assert not directory.exists()


@pytest.mark.parametrize(
    "base",
    [
        "http://x/\x01",
        "http://x/\x1b[31m",
        "http://x/{{ .Labels.job }}",
        "http://x/{{",
        "http://x/\udcff",  # the byte 0xff from the shell: a UnicodeEncodeError and a 0-byte file before
        "http://x/é",
        "http://x/%zz",
        "http://x/a\\b",
        "/runbooks/",
        "runbooks",
        "ftp://x/runbooks/",
        "http://:8000/runbooks/",
        "http://x:99999/runbooks/",
        "http://x/#",
        "",
    ],
)
def test_what_cannot_be_a_url_in_a_runbook_link_is_refused_and_leaves_no_file(
    base: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError):
        check_runbook_base(base)
    assert_refused(base, tmp_path)


def test_a_refusal_never_shows_the_password(tmp_path: Path) -> None:
    base = "https://ops:Zq7PW-s3cret@wiki.example:99999/runbooks/"
    code, output = run_cli(["rules", "--runbook-base", base])
    assert code == 2 and "Zq7PW-s3cret" not in output and "<redacted>@wiki.example" in output, output


# Unusual, valid: a port, a path parameter, a query with '$' and brackets, an escape, sub-delimiters.
ODD_BASE = "https://wiki.example:8443/ops/run-books;v=2/?page=1&x=$y[0]%41!*(),+~/"


@pytest.mark.process
def test_rules_with_an_unusual_valid_base_pass_promtool(tmp_path: Path) -> None:
    target = tmp_path / "openlora.yml"
    assert run_cli(["rules", "--runbook-base", ODD_BASE, "--output", str(target)])[0] == 0
    result = promtool("check", "rules", str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    assert runbook_urls(target.read_text()) == {alert: ODD_BASE + anchor for alert, anchor in ANCHORS.items()}


# -- property: any text as a base -----------------------------------------------------------------------

_URL_CHARS = string.ascii_letters + string.digits + "-._~:/?#[]@!$&'()*+,;=%"
_ODD = st.sampled_from(['"', "\\", "{", "}", " ", "\t", "\n", "\x01", "\x1b", "é", "\udcff", "\u2028"])
_base = st.builds(
    lambda start, rest: start + rest,
    st.sampled_from(["https://wiki.example/", "http://127.0.0.1:8000/", "https://", "http:", ""]),
    st.text(st.sampled_from(_URL_CHARS) | _ODD, max_size=24),
)


@fuzz
@given(base=_base)
@example(base="http://x/\x01")
@example(base="http://x/\x1b[0m")
@example(base="http://x/{{ $labels }}")
@example(base="http://x/\udcff")
@example(base=ODD_BASE)
def test_fuzz_an_accepted_runbook_base_makes_rules_pyyaml_loads_with_that_base_and_the_anchor(
    base: str, tmp_path: Path
) -> None:
    """Bounded by tests/support/fuzz.py; about 2 s at the default 150 examples."""
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one directory per example: tmp_path is the test's
    try:
        check_runbook_base(base)
    except ValueError:
        assert_refused(base, tmp_path)
        return
    text = rules_text(base)
    assert runbook_urls(text) == {alert: base + anchor for alert, anchor in ANCHORS.items()}
    # Nothing else changed.
    assert text.replace(base + "#", DEFAULT_RUNBOOK_BASE + "#") == rules_text()
    target = tmp_path / "openlora.yml"
    code, output = run_cli(["rules", "--runbook-base", base, "--output", str(target)])
    assert code == 0 and target.read_text(encoding="utf-8") == text, output

"""The real parts the tests start that a machine may lack, and the one command that sets them all up.

A test that needs a missing one calls ``missing(part, message)``: it skips, except under CI (``CI`` set),
where ``.ci/run`` has run the set-up and a missing part is a failure. The skip carries its part
(``part_of``); tests/conftest.py counts such skips by part after the run and names ``SETUP``.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

SETUP = "tools/setup-real-parts.sh"

# part -> what a test that skips for it needs, as the summary says it
PARTS = {
    "debian:prometheus": "Debian's `prometheus` (prometheus, promtool)",
    "debian:prometheus-alertmanager": "Debian's `prometheus-alertmanager` (alertmanager, amtool)",
    "debian:victoria-metrics": "Debian's `victoria-metrics` (victoria-metrics, vmalert)",
    "debian:chromium": "Debian's `chromium`",
    "build/bin": "build/bin (tools/build.sh)",
    ".venv-aiperf": ".venv-aiperf (AIPerf from PyPI)",
}


def debian(package: str) -> str:
    """The part that Debian package ``package`` is."""
    part = f"debian:{package}"
    assert part in PARTS, part
    return part


def missing(part: str, message: str) -> NoReturn:
    """Skip the test for lack of ``part`` (one of PARTS), saying ``message``; fail under CI."""
    assert part in PARTS, part
    if os.environ.get("CI"):
        pytest.fail(f"{message}; under CI it must be there ({SETUP}, which .ci/run runs, sets it up)")
    try:
        pytest.skip(message)
    except pytest.skip.Exception as skip:
        skip.openlora_real_part = part  # type: ignore[attr-defined]
        raise


def part_of(excinfo: pytest.ExceptionInfo[BaseException] | None) -> str | None:
    """The part a test phase skipped for, if it skipped through ``missing``."""
    if excinfo is None:
        return None
    return getattr(excinfo.value, "openlora_real_part", None)

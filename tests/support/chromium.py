"""Debian's Chromium, headless, for the tests that open a page (the report, the docs site): where it is,
how it is started so that it makes no connection of its own, and which requests a page made."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from tests.support.real_parts import debian, missing

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium's own connections (component updates, sync) are
# refused by this machine's closed network, many at a time.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str:
    """The browser's path; skips without it, fails under CI (where .ci/run installs it)."""
    if not os.access(CHROMIUM, os.X_OK):
        missing(debian("chromium"), f"{CHROMIUM} is not installed (Debian package `chromium`)")
    return CHROMIUM


def headless(workdir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium with ``args`` and a fresh profile under ``workdir``; text output."""
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir)
    return subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def page_requests(netlog: Path) -> list[str]:
    """The URLs pages asked for, from a ``--log-net-log`` file (Chromium's own background requests have
    no initiator origin)."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [
        event["params"]["url"]
        for event in log["events"]
        if event["type"] == start and event.get("params", {}).get("initiator", "not an origin") != "not an origin"
    ]

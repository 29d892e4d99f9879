"""A real Prometheus (Debian's package) started on loopback for end-to-end tests.

It gets a generated scrape config, a temporary data directory and a free
127.0.0.1 port; every wait is bounded. Tests skip when the binary is missing,
except under CI (``CI`` set), where a missing Prometheus is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        message = "the prometheus binary is not installed (Debian package `prometheus`)"
        if os.environ.get("CI"):
            pytest.fail(message + "; .ci/run must install it")
        pytest.skip(message)
    return binary


class Prometheus:
    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        scrape_interval: str = "1s",
        job: str = "openlora",
        rule_files: list[str] | None = None,
        file_sd: list[str] | None = None,
    ) -> None:
        """Scrape ``targets`` (static) and, with ``file_sd``, the targets in files matching those globs."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        target_list = ", ".join(f'"{t}"' for t in targets)
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  scrape_timeout: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + ("rule_files:\n" + "".join(f"  - {path}\n" for path in rule_files) if rule_files else "")
            + "scrape_configs:\n"
            f"  - job_name: {job}\n"
            f"    static_configs:\n      - targets: [{target_list}]\n"
            + (
                "    file_sd_configs:\n      - refresh_interval: 1s\n        files:\n"
                + "".join(f'          - "{glob}"\n' for glob in file_sd)
                if file_sd
                else ""
            )
        )
        self.log = workdir / "prometheus.log"
        self._log_handle = self.log.open("wb")
        self._process = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready(timeout=30)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready in time")

    def query(self, expr: str) -> list[dict]:
        """Instant query; the ``result`` list of the HTTP API."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def active_targets(self) -> list[dict]:
        """The scrape targets Prometheus knows now (``/api/v1/targets``, active ones)."""
        with urllib.request.urlopen(self.url + "/api/v1/targets?state=active", timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["activeTargets"]

    def wait_for(self, expr: str, timeout: float = 20.0) -> list[dict]:
        """Poll (bounded) until ``expr`` returns at least one series."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)
        self._log_handle.close()

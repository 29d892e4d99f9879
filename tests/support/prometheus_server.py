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
import yaml

from tests.support import real_parts
from tests.support.built import built
from tests.support.polling import wait_until
from tests.support.processes import free_port, reap

# The Prometheus releases the tests run: Debian's 2.42 (the oldest supported) and 3.16, built from the
# module proxy by tools/build.sh. Tests that hold on both take ``major`` from PROMETHEUS_MAJORS.
PROMETHEUS_MAJORS = pytest.mark.parametrize("major", [2, 3], ids=["prometheus2", "prometheus3"])


def _release_binary(name: str, major: int, missing: str) -> str:
    """``name`` of Prometheus ``major``: 2 is Debian's package (skip without it, fail under CI), 3 is
    build/bin/``name`` (tools/build.sh)."""
    if major == 3:
        return built(name)
    binary = shutil.which(name)
    if binary is None:
        real_parts.missing(real_parts.debian("prometheus"), f"{missing} (Debian package `prometheus`)")
    return binary


def prometheus_binary(major: int = 2) -> str:
    """The ``prometheus`` of release ``major``: 2 is Debian's package, 3 is build/bin/prometheus."""
    return _release_binary("prometheus", major, "the prometheus binary is not installed")


def promtool(*args: str, major: int = 2, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run promtool of Prometheus ``major``: 2 is Debian's package, 3 is build/bin/promtool (tools/build.sh).
    Bounded at 5 minutes: all the rule tests take 71 s with 2.42 alone on the 2-core machine, and timed out
    at the former 2 minutes beside a cold .ci/run's test suite."""
    binary = _release_binary("promtool", major, "promtool is not installed")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


class PrometheusApi:
    """Prometheus' HTTP API at ``url`` (the path before ``/api/v1``): Prometheus itself, VictoriaMetrics,
    Thanos Query, Cortex (``/prometheus``)."""

    url: str

    def get(self, path: str, **params: str | list[str]) -> dict:
        url = f"{self.url}{path}?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)

    def query(self, expr: str) -> list[dict]:
        """Instant query; the ``result`` list of the HTTP API."""
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 20.0) -> list[dict]:
        """Poll (bounded) until ``expr`` returns at least one series."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def wait_for_scrapes(self, count: int, timeout: float = 20.0) -> bool:
        """Poll (bounded) until every target was scraped ``count`` more times from now (its ``up``
        samples since the call, up or down); whether it was. Instead of sleeping some scrape intervals:
        a rate over a series that just appeared has its samples then, however loaded the machine."""
        since = time.time()

        def scraped() -> bool:
            window = f"{max(1, int((time.time() - since) * 1000))}ms"
            result = self.query(f"min(count_over_time(up[{window}]))")
            return bool(result) and float(result[0]["value"][1]) >= count

        return bool(wait_until(scraped, timeout, interval=0.25))


class ServerProcess(PrometheusApi):
    """A server process on loopback, its log in ``workdir``, ready when ``ready_path`` answers 200."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        workdir: Path,
        ready_path: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / f"{name}.log"
        self._argv, self._workdir, self._ready_path = argv, workdir, ready_path
        self._env = None if env is None else {**os.environ, **env}
        self._log_handle = self.log.open("wb")
        self._start()

    def _start(self) -> None:
        self._process = subprocess.Popen(
            self._argv, stdout=self._log_handle, stderr=subprocess.STDOUT, cwd=self._workdir, env=self._env
        )
        try:
            self._wait_ready()
        except BaseException:
            # Not left running (not ready in time, or the caller interrupted: SIGTERM, Ctrl-C): the
            # caller never gets a handle to stop it.
            if self._process.poll() is None:
                self._process.kill()
                reap(self._process, 15)
            self._log_handle.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + self._ready_path, timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in 30 s: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self._process.pid

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would: nothing is flushed. :meth:`restart` starts it again."""
        if self._process.poll() is None:
            self._process.kill()
            reap(self._process, 15)
        self._log_handle.close()

    def restart(self) -> None:
        """Stop the process (SIGTERM) and start it again with the same command line, on the same port;
        its log goes on in the same file."""
        self.stop()
        self._log_handle = self.log.open("ab")
        self._start()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            reap(self._process, 15)
        self._log_handle.close()


class Prometheus(ServerProcess):
    """A Prometheus (``major`` 2: Debian's, 3: build/bin's) with a generated scrape config and a temporary
    data directory; ``extra_args`` go on its command line."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        scrape_interval: str = "1s",
        job: str = "openlora",
        rule_files: list[str] | None = None,
        file_sd: list[str] | None = None,
        major: int = 2,
        extra_args: tuple[str, ...] = (),
        honor_labels: bool = False,
        blocks: dict | None = None,
        external_labels: dict[str, str] | None = None,
        evaluation_interval: str | None = None,
        external_url: bool = False,
    ) -> None:
        """Scrape ``targets`` (static) and, with ``file_sd``, the targets in files matching those globs;
        with ``external_url``, its ``--web.external-url`` is its own loopback URL (what ``$externalURL``
        gives the alerts' annotations);
        ``honor_labels`` as the scrape job of a Collector's exporter has it. ``blocks``: more top-level
        sections of the config (``otlp``, ``storage``), as YAML would give them; ``external_labels``
        those of the ``global`` section (a Thanos sidecar needs some); ``evaluation_interval`` that of the
        rules (the scrape interval unless given)."""
        port = free_port()
        config = workdir / "prometheus.yml"
        target_list = ", ".join(f'"{t}"' for t in targets)
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  scrape_timeout: {scrape_interval}\n"
            f"  evaluation_interval: {evaluation_interval or scrape_interval}\n"
            + (
                "  external_labels:\n" + "".join(f'    {k}: "{v}"\n' for k, v in external_labels.items())
                if external_labels
                else ""
            )
            + ("rule_files:\n" + "".join(f"  - {path}\n" for path in rule_files) if rule_files else "")
            + "scrape_configs:\n"
            f"  - job_name: {job}\n"
            + ("    honor_labels: true\n" if honor_labels else "")
            + f"    static_configs:\n      - targets: [{target_list}]\n"
            + (
                "    file_sd_configs:\n      - refresh_interval: 1s\n        files:\n"
                + "".join(f'          - "{glob}"\n' for glob in file_sd)
                if file_sd
                else ""
            )
            + (yaml.safe_dump(blocks) if blocks else "")
        )
        argv = [
            prometheus_binary(major),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            *((f"--web.external-url=http://127.0.0.1:{port}/",) if external_url else ()),
            *extra_args,
        ]
        super().__init__("prometheus", argv, port, workdir, "/-/ready")

    @property
    def rules_url(self) -> str:
        """Where the rules are evaluated: ``/api/v1/rules`` there lists them (vmalert's, for VictoriaMetrics)."""
        return self.url

    def active_targets(self) -> list[dict]:
        """The scrape targets Prometheus knows now (``/api/v1/targets``, active ones)."""
        body = self.get("/api/v1/targets", state="active")
        assert body["status"] == "success", body
        return body["data"]["activeTargets"]


class VictoriaMetrics(ServerProcess):
    """VictoriaMetrics (build/bin's, tools/build.sh victoriametrics) and a vmalert evaluating
    ``rule_files`` against it, as deploy/prometheus/victoria-metrics/ runs them; queried through its
    Prometheus API like :class:`Prometheus`. Takes remote write at ``/api/v1/write`` and OTLP at
    ``/opentelemetry/v1/metrics``."""

    def __init__(
        self, workdir: Path, rule_files: list[str] | None = None, extra_args: tuple[str, ...] = ()
    ) -> None:
        port = free_port()
        argv = [
            built("victoria-metrics"),
            f"-storageDataPath={workdir / 'vm-data'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-search.latencyOffset=0s",  # fresh samples visible at once
            "-loggerLevel=WARN",
            *extra_args,
        ]
        super().__init__("victoria-metrics", argv, port, workdir, "/health")
        self.vmalert: ServerProcess | None = None
        if rule_files:
            vmalert_port = free_port()
            try:
                self.vmalert = ServerProcess(
                    "vmalert",
                    [
                        built("vmalert"),
                        *(f"-rule={path}" for path in rule_files),
                        f"-datasource.url={self.url}",
                        f"-remoteWrite.url={self.url}",
                        f"-remoteRead.url={self.url}",
                        f"-notifier.url=http://127.0.0.1:{free_port()}",  # alerts are not under test
                        "-evaluationInterval=1s",
                        # Evaluate at now, as VictoriaMetrics answers fresh samples at once (the
                        # default, 30 s back, would not see a run that started seconds ago).
                        "-rule.evalDelay=0s",
                        "-remoteWrite.flushInterval=1s",
                        f"-httpListenAddr=127.0.0.1:{vmalert_port}",
                        "-loggerLevel=WARN",
                    ],
                    vmalert_port,
                    workdir,
                    "/health",
                )
            except BaseException:
                super().stop()
                raise

    @property
    def rules_url(self) -> str:
        assert self.vmalert is not None, "no rules given"
        return self.vmalert.url

    def stop(self) -> None:
        if self.vmalert is not None:
            self.vmalert.stop()
        super().stop()

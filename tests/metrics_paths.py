"""The ways a test's processes can bring their metrics to a real Prometheus, and that Prometheus.

- ``pull``: Prometheus (Debian's 2.42 or 3.16) scrapes each process's own endpoint;
- ``collector``: the processes push OTLP (HTTP) to our Collector running collector/otelcol.yaml, and
  Prometheus scrapes the Collector's prometheus exporter with ``honor_labels``, as collector/prometheus.yml;
- ``otlp``: the processes push OTLP straight into Prometheus 3's receiver, configured with the
  ``otlp`` and ``storage`` blocks of deploy/prometheus/otlp.yml.

On the push paths ``instance`` is the process's ``service.instance.id``: :meth:`MetricsPath.push_env`
sets one a test can name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.collector_server import Collector
from tests.prometheus_server import Prometheus, prometheus_binary

ROOT = Path(__file__).resolve().parent.parent
METRIC_PATHS = pytest.mark.parametrize(
    ("path", "major"),
    [("pull", 2), ("pull", 3), ("collector", 2), ("collector", 3), ("otlp", 3)],
    ids=["pull-prometheus2", "pull-prometheus3", "collector-prometheus2", "collector-prometheus3", "otlp-prometheus3"],
)
PUSH_INTERVAL_MS = "1000"  # the processes' OTLP export interval (the default is 60 s)


class MetricsPath:
    """Use as a context manager; on a push path the Collector and Prometheus start at once, on the pull
    path Prometheus starts at :meth:`scrape`, when the targets are known."""

    def __init__(self, path: str, major: int, workdir: Path, rule_files: list[str] | None = None) -> None:
        assert path in ("pull", "collector", "otlp"), path
        prometheus_binary(major)  # skip (or fail under CI) before anything starts
        self.path, self.major, self.workdir, self.rule_files = path, major, workdir, rule_files
        self.collector: Collector | None = None
        self.prometheus: Prometheus | None = None

    def __enter__(self) -> MetricsPath:
        try:
            if self.path == "collector":
                self.collector = Collector(self.workdir, ROOT / "collector" / "otelcol.yaml")
                self.prometheus = Prometheus(
                    self.workdir,
                    [f"127.0.0.1:{self.collector.ports['prometheus']}"],
                    job="openlora-collector",
                    honor_labels=True,
                    rule_files=self.rule_files,
                    major=self.major,
                )
            elif self.path == "otlp":
                shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "otlp.yml").read_text())
                self.prometheus = Prometheus(
                    self.workdir,
                    [],
                    rule_files=self.rule_files,
                    major=self.major,
                    extra_args=("--web.enable-otlp-receiver",),
                    blocks={"otlp": shipped["otlp"], "storage": shipped["storage"]},
                )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def push(self) -> bool:
        return self.path != "pull"

    @property
    def otlp_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for the processes (setup_telemetry appends /v1/metrics)."""
        if self.collector is not None:
            return self.collector.otlp_http
        assert self.prometheus is not None and self.path == "otlp"
        return f"{self.prometheus.url}/api/v1/otlp"

    def push_env(self, instance: str | None = None) -> dict[str, str]:
        """The environment that sends a process's metrics this way (push paths); ``instance``: its
        service.instance.id, so its ``instance`` label, instead of a random one."""
        env = {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint,
            "OTEL_METRIC_EXPORT_INTERVAL": PUSH_INTERVAL_MS,
        }
        if instance is not None:
            env["OTEL_RESOURCE_ATTRIBUTES"] = f"service.instance.id={instance}"
        return env

    def scrape(self, targets: list[str]) -> Prometheus:
        """The Prometheus holding the metrics: on the pull path started now, scraping ``targets``."""
        if self.prometheus is None:
            self.prometheus = Prometheus(self.workdir, targets, rule_files=self.rule_files, major=self.major)
        return self.prometheus

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.collector is not None:
            self.collector.stop()

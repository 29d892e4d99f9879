"""The ways a test's processes can bring their metrics to a real Prometheus, and that Prometheus.

- ``pull``: Prometheus (Debian's 2.42 or 3.16) scrapes each process's own endpoint;
- ``collector``: the processes push OTLP (HTTP) to our Collector running collector/otelcol.yaml, and
  Prometheus scrapes the Collector's prometheus exporter with ``honor_labels``, as collector/prometheus.yml;
- ``otlp``: the processes push OTLP straight into Prometheus 3's receiver, configured with the
  ``otlp`` and ``storage`` blocks of deploy/prometheus/otlp.yml (``major`` 0: into VictoriaMetrics
  1.151's OTLP ingestion, which makes no target_info and no job or instance: not a path the
  dashboards work on, see tests/exporters/test_push_paths.py);
- ``gateway``: the processes push OTLP to a Collector running deploy/collector/agent.yaml, which
  forwards it over OTLP gRPC to one running deploy/collector/gateway.yaml, which remote-writes to
  Prometheus (its remote-write receiver on, evaluating the rules) or, ``major`` 0, to
  VictoriaMetrics 1.151 with vmalert evaluating them; ``"thanos"``: to Thanos Receive (two receivers,
  replication 2), Thanos Ruler evaluating the rules, queried through Thanos Query; ``"cortex"``: to
  Cortex, its ruler evaluating them. With ``gateways`` 2 or more, that many gateways, and the agent
  load-balances over them (:func:`~tests.support.collector_server.load_balancing_agent`); each
  stamps its own ``deployment.environment.name``, ``gateway-<index>``.
- ``otlp`` and ``gateway`` with ``"native"``: as with Prometheus 3, the processes' histograms exponential
  (``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram``), which
  Prometheus stores as native histograms, and deploy/prometheus/native-histograms.yml loaded with the rules.
- ``pull`` with ``"thanos"``: the sidecar shape, a Prometheus 3 scraping the processes and evaluating
  the rules, queried through Thanos Query over its sidecar and a store gateway
  (tests/support/long_term_stores.py).

On the push paths ``instance`` is the process's ``service.instance.id``: :meth:`MetricsPath.push_env`
sets one a test can name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.built import built
from tests.support.collector_server import Collector, load_balancing_agent
from tests.support.long_term_stores import Cortex, ThanosReceive, ThanosSidecar
from tests.support.prometheus_server import Prometheus, VictoriaMetrics, prometheus_binary

ROOT = Path(__file__).resolve().parent.parent.parent
METRIC_PATHS = pytest.mark.parametrize(
    ("path", "major"),
    [
        ("pull", 2),
        ("pull", 3),
        ("collector", 2),
        ("collector", 3),
        ("otlp", 3),
        ("otlp", "native"),
        ("gateway", 2),
        ("gateway", 3),
        ("gateway", "native"),
        ("gateway", 0),
        ("pull", "thanos"),
        ("gateway", "thanos"),
        ("gateway", "cortex"),
    ],
    ids=[
        "pull-prometheus2",
        "pull-prometheus3",
        "collector-prometheus2",
        "collector-prometheus3",
        "otlp-prometheus3",
        "otlp-prometheus3-native",
        "gateway-prometheus2",
        "gateway-prometheus3",
        "gateway-prometheus3-native",
        "gateway-victoriametrics",
        "sidecar-thanos",
        "receive-thanos",
        "gateway-cortex",
    ],
)
PUSH_INTERVAL_MS = "1000"
NATIVE_RULES = ROOT / "deploy" / "prometheus" / "native-histograms.yml"
HISTOGRAM_AGGREGATION = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"  # the processes' OTLP export interval (the default is 60 s)


class MetricsPath:
    """Use as a context manager; on a push path the Collector and Prometheus start at once, on the pull
    path Prometheus starts at :meth:`scrape`, when the targets are known."""

    def __init__(
        self,
        path: str,
        major: int | str,
        workdir: Path,
        rule_files: list[str] | None = None,
        collector_overrides: dict | None = None,
        evaluation_interval: str = "1s",
        gateways: int = 1,
        store_options: dict | None = None,
    ) -> None:
        """``collector_overrides``: a config fragment merged over the Collector's shipped one (the
        ``collector`` path), such as a shorter ``metric_expiration``; ``evaluation_interval``: the
        rules' on Thanos Ruler and Cortex's ruler (benchmarks/bench_scale_out.py sets the shipped 15 s);
        ``gateways``: how many on the gateway path (2 or more: load-balanced by the agent);
        ``store_options``: more keyword arguments for :class:`ThanosReceive` or :class:`Cortex` (where
        their alerts go)."""
        assert path in ("pull", "collector", "otlp", "gateway"), path
        assert gateways >= 1 and (gateways == 1 or path == "gateway"), (path, gateways)
        assert major in (2, 3, 0) or (path, major) in (
            ("pull", "thanos"),
            ("gateway", "thanos"),
            ("gateway", "cortex"),
            ("otlp", "native"),
            ("gateway", "native"),
        )
        # "native": Prometheus 3 again, the processes' histograms exponential (stored as native histograms),
        # and deploy/prometheus/native-histograms.yml loaded beside the rules.
        self.native = major == "native"
        if self.native:
            major = 3
            rule_files = [*(rule_files or []), str(NATIVE_RULES)]
        # Skip (or fail under CI) before anything starts.
        if major in ("thanos", "cortex"):
            built(major)
            if path == "pull":
                prometheus_binary(3)
        elif major:
            prometheus_binary(major)
        else:
            built("victoria-metrics")
            built("vmalert")
        if path in ("collector", "gateway"):
            built("otelcol-openlora")
        if gateways > 1:
            built("otelcol-openlora-lb")
        self.gateway_count = gateways
        self.store_options = store_options or {}
        self.path, self.major, self.workdir, self.rule_files = path, major, workdir, rule_files
        self.collector_overrides = collector_overrides
        self.evaluation_interval = evaluation_interval
        self.collector: Collector | None = None  # where the processes push (the agent on the gateway path)
        self.gateways: list[Collector] = []
        self.prometheus: Prometheus | VictoriaMetrics | ThanosSidecar | ThanosReceive | Cortex | None = None

    def __enter__(self) -> MetricsPath:
        try:
            if self.path == "collector":
                self.collector = Collector(
                    self.workdir, ROOT / "collector" / "otelcol.yaml", overrides=self.collector_overrides
                )
                self.prometheus = Prometheus(
                    self.workdir,
                    [f"127.0.0.1:{self.collector.ports['prometheus']}"],
                    job="openlora-collector",
                    honor_labels=True,
                    rule_files=self.rule_files,
                    major=self.major,
                )
            elif self.path == "otlp" and not self.major:
                self.prometheus = VictoriaMetrics(
                    self.workdir, self.rule_files, extra_args=("-opentelemetry.usePrometheusNaming",)
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
            elif self.path == "gateway":
                if self.major == "thanos":
                    self.prometheus = ThanosReceive(
                        self.workdir, self.rule_files, self.evaluation_interval, **self.store_options
                    )
                elif self.major == "cortex":
                    self.prometheus = Cortex(
                        self.workdir, self.rule_files, self.evaluation_interval, **self.store_options
                    )
                elif self.major:
                    self.prometheus = Prometheus(
                        self.workdir,
                        [],
                        rule_files=self.rule_files,
                        major=self.major,
                        extra_args=("--web.enable-remote-write-receiver",),
                    )
                else:
                    self.prometheus = VictoriaMetrics(self.workdir, self.rule_files)
                write_url = getattr(self.prometheus, "write_url", f"{self.prometheus.url}/api/v1/write")
                several = self.gateway_count > 1
                for index in range(self.gateway_count):
                    self.gateways.append(
                        Collector(
                            self.workdir,
                            ROOT / "deploy" / "collector" / "gateway.yaml",
                            name=f"gateway-{index}" if several else "gateway",
                            env={
                                "OPENLORA_REMOTE_WRITE_URL": write_url,
                                "OPENLORA_REMOTE_WRITE_AUTHORIZATION": "",
                                # Each of several stamps its own (the shipped resource processor), so a
                                # rank's target_info says which gateway it came through.
                                **({"OPENLORA_ENVIRONMENT": f"gateway-{index}"} if several else {}),
                            },
                        )
                    )
                if several:
                    self.collector = load_balancing_agent(self.workdir, self.gateways)
                else:
                    self.collector = Collector(
                        self.workdir,
                        ROOT / "deploy" / "collector" / "agent.yaml",
                        name="agent",
                        overrides={"exporters": {"otlp_grpc": {"endpoint": f"127.0.0.1:{self.gateways[0].ports['grpc']}"}}},
                    )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def gateway(self) -> Collector | None:
        """The (first) gateway on the gateway path."""
        return self.gateways[0] if self.gateways else None

    @property
    def push(self) -> bool:
        return self.path != "pull"

    @property
    def otlp_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for the processes (setup_telemetry appends /v1/metrics)."""
        if self.collector is not None:
            return self.collector.otlp_http
        assert self.prometheus is not None and self.path == "otlp"
        if isinstance(self.prometheus, VictoriaMetrics):
            return f"{self.prometheus.url}/opentelemetry"
        return f"{self.prometheus.url}/api/v1/otlp"

    def push_env(self, instance: str | None = None) -> dict[str, str]:
        """The environment that sends a process's metrics this way (push paths): :func:`push_env`; on the
        native paths with exponential histograms."""
        env = push_env(self.otlp_endpoint, instance)
        if self.native:
            env[HISTOGRAM_AGGREGATION] = "base2_exponential_bucket_histogram"
        return env

    def scrape(self, targets: list[str]) -> Prometheus | VictoriaMetrics | ThanosSidecar | ThanosReceive | Cortex:
        """The store holding the metrics: on the pull path started now, scraping ``targets``."""
        if self.prometheus is None and self.major == "thanos":
            self.prometheus = ThanosSidecar(self.workdir, targets, self.rule_files)
        elif self.prometheus is None:
            self.prometheus = Prometheus(self.workdir, targets, rule_files=self.rule_files, major=self.major)
        return self.prometheus

    def stop(self) -> None:
        for server in (self.collector, *self.gateways, self.prometheus):
            if server is not None:
                server.stop()


def push_env(endpoint: str, instance: str | None = None) -> dict[str, str]:
    """The environment that pushes a process's metrics over OTLP to ``endpoint`` every second;
    ``instance``: its service.instance.id, so its ``instance`` label, instead of a random one."""
    env = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_METRIC_EXPORT_INTERVAL": PUSH_INTERVAL_MS,
    }
    if instance is not None:
        env["OTEL_RESOURCE_ATTRIBUTES"] = f"service.instance.id={instance}"
    return env

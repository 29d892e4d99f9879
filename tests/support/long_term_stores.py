"""Thanos and Cortex on loopback, started from the shipped deploy/thanos/*.default and
deploy/cortex/cortex.yaml with ports and directories of their own; each answers PromQL like
:class:`~tests.support.prometheus_server.Prometheus` (``url``, ``query``, ``rules_url``).

- :class:`ThanosReceive`: two receivers in one hashring (replication factor 2), a ruler evaluating
  the rules through Thanos Query, and that Query over both receivers and the ruler.
- :class:`ThanosSidecar`: a Prometheus 3 scraping the targets and evaluating the rules itself, its
  sidecar, a store gateway over the bucket both use (a directory), and Query over sidecar and store.
- :class:`Cortex`: the single binary (``-target=all``), its ruler loading the rules from its local
  rule store and sending to its own Alertmanager.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from tests.support.built import built
from tests.support.polling import wait_until
from tests.support.processes import free_port
from tests.support.prometheus_server import Prometheus, PrometheusApi, ServerProcess
from tests.support.shipped import rewrite_args, shipped_args

ROOT = Path(__file__).resolve().parent.parent.parent
THANOS = ROOT / "deploy" / "thanos"
CORTEX = ROOT / "deploy" / "cortex" / "cortex.yaml"
EVALUATION = "1s"  # the tests' evaluation and scrape interval; the shipped 15 s would only slow them


def bucket_config(workdir: Path) -> Path:
    """deploy/thanos/bucket.yml with its directory in ``workdir``."""
    config = yaml.safe_load((THANOS / "bucket.yml").read_text())
    config["config"]["directory"] = str(workdir / "bucket")
    path = workdir / "bucket.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def thanos_component(
    name: str, component: str, workdir: Path, values: dict, extra: tuple[str, ...] = ()
) -> ServerProcess:
    """``thanos <component>`` with the shipped ARGS of deploy/thanos/<component>.default, ``values``
    replacing the flags named and ``extra`` added; its HTTP port is that of ``--http-address``."""
    port = int(str(values["--http-address"]).rsplit(":", 1)[1])
    argv = [built("thanos"), component, *rewrite_args(shipped_args(THANOS / f"{component}.default"), values)]
    return ServerProcess(name, [*argv, *extra, "--log.level=warn"], port, workdir, "/-/ready")


def thanos_query(workdir: Path, endpoints: list[str], http_port: int | None = None) -> ServerProcess:
    """Thanos Query (deploy/thanos/query.default) over the StoreAPI ``endpoints``, on ``http_port``."""
    return thanos_component(
        "thanos-query",
        "query",
        workdir,
        {
            "--http-address": f"127.0.0.1:{http_port or free_port()}",
            "--grpc-address": f"127.0.0.1:{free_port()}",
            "--endpoint": endpoints,
        },
    )


def thanos_store(workdir: Path, bucket: Path, grpc_port: int) -> ServerProcess:
    """A store gateway (deploy/thanos/store.default) over ``bucket``, its StoreAPI on ``grpc_port``."""
    return thanos_component(
        "thanos-store",
        "store",
        workdir,
        {
            "--data-dir": str(workdir / "store"),
            "--objstore.config-file": str(bucket),
            "--grpc-address": f"127.0.0.1:{grpc_port}",
            "--http-address": f"127.0.0.1:{free_port()}",
        },
    )


def wait_for_stores(query: ServerProcess, count: int, timeout: float = 30.0) -> None:
    """Until Thanos Query has ``count`` healthy stores (it finds its endpoints some seconds after it
    is ready)."""

    def healthy() -> bool:
        stores = query.get("/api/v1/stores")["data"]
        return sum(1 for group in stores.values() for store in group if not store.get("lastError")) >= count

    if not wait_until(healthy, timeout):
        raise RuntimeError(f"Thanos Query has not {count} healthy stores: {query.get('/api/v1/stores')}")


class ThanosReceive(PrometheusApi):
    """The Receive shape of docs/how-to/beyond-one-prometheus.md. Remote write goes to
    :attr:`write_url` (receiver 0, which forwards to receiver 1); queries to Thanos Query. With
    ``rule_files``, Thanos Ruler evaluates them and sends its alerts to ``alertmanager_url`` (unless
    given, a port nothing listens on)."""

    def __init__(
        self,
        workdir: Path,
        rule_files: list[str] | None = None,
        evaluation_interval: str = EVALUATION,
        alertmanager_url: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.servers: list[ServerProcess] = []
        self.receivers: list[ServerProcess] = []
        self.ruler: ServerProcess | None = None
        try:
            bucket = bucket_config(workdir)
            grpc = [free_port() for _ in range(2)]
            hashring = workdir / "hashring.json"
            hashring.write_text(f'[{{"endpoints": ["127.0.0.1:{grpc[0]}", "127.0.0.1:{grpc[1]}"]}}]')
            self.write_ports = []
            for replica in range(2):
                write = free_port()
                self.write_ports.append(write)
                self.receivers.append(
                    thanos_component(
                        f"thanos-receive-{replica}",
                        "receive",
                        workdir,
                        {
                            "--tsdb.path": str(workdir / f"receive-{replica}"),
                            "--grpc-address": f"127.0.0.1:{grpc[replica]}",
                            "--http-address": f"127.0.0.1:{free_port()}",
                            "--remote-write.address": f"127.0.0.1:{write}",
                            "--receive.capnproto-address": f"127.0.0.1:{free_port()}",
                            "--receive.hashrings-file": str(hashring),
                            "--receive.local-endpoint": f"127.0.0.1:{grpc[replica]}",
                            "--label": f'receive_replica="{replica}"',
                            "--objstore.config-file": str(bucket),
                        },
                    )
                )
                self.servers.append(self.receivers[-1])
            query_http, endpoints = free_port(), [f"127.0.0.1:{port}" for port in grpc]
            if rule_files:
                ruler_grpc = free_port()
                endpoints.append(f"127.0.0.1:{ruler_grpc}")
                self.ruler = thanos_component(
                    "thanos-rule",
                    "rule",
                    workdir,
                    {
                        "--data-dir": str(workdir / "rule"),
                        "--rule-file": rule_files,
                        "--eval-interval": evaluation_interval,
                        "--query": f"http://127.0.0.1:{query_http}",
                        "--alertmanagers.url": alertmanager_url or f"http://127.0.0.1:{free_port()}",
                        "--label": 'rule_replica="0"',
                        "--grpc-address": f"127.0.0.1:{ruler_grpc}",
                        "--http-address": f"127.0.0.1:{free_port()}",
                        "--objstore.config-file": str(bucket),
                    },
                )
                self.servers.append(self.ruler)
            self.querier = thanos_query(workdir, endpoints, query_http)
            self.servers.append(self.querier)
            self.url = self.querier.url
            wait_for_stores(self.querier, len(endpoints))
        except BaseException:
            self.stop()
            raise

    @property
    def write_url(self) -> str:
        """Where the senders remote-write (receiver 0's remote-write endpoint)."""
        return f"http://127.0.0.1:{self.write_ports[0]}/api/v1/receive"

    @property
    def rules_url(self) -> str:
        assert self.ruler is not None, "no rules given"
        return self.ruler.url

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


class ThanosSidecar(PrometheusApi):
    """The sidecar shape: a Prometheus 3 (``external_labels`` cluster and replica, local compaction
    off) scraping ``targets`` and evaluating ``rule_files``, its Thanos sidecar uploading to a
    directory bucket, a store gateway over that bucket, and Thanos Query over sidecar and store.
    ``scrape_interval`` (and the rules' ``evaluation_interval``, the scrape interval unless given):
    1 s for the tests; benchmarks/bench_scale_out.py sets the shipped 15 s."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        rule_files: list[str] | None = None,
        *,
        scrape_interval: str = "1s",
        evaluation_interval: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.servers: list[ServerProcess] = []
        try:
            bucket = bucket_config(workdir)
            self.prometheus = Prometheus(
                workdir,
                targets,
                rule_files=rule_files,
                major=3,
                scrape_interval=scrape_interval,
                evaluation_interval=evaluation_interval,
                external_labels={"cluster": "openlora-test", "replica": "0"},
                extra_args=("--storage.tsdb.min-block-duration=2h", "--storage.tsdb.max-block-duration=2h"),
            )
            self.servers.append(self.prometheus)
            sidecar_grpc, store_grpc = free_port(), free_port()
            self.sidecar = thanos_component(
                "thanos-sidecar",
                "sidecar",
                workdir,
                {
                    "--tsdb.path": str(workdir / "data"),
                    "--prometheus.url": self.prometheus.url,
                    "--grpc-address": f"127.0.0.1:{sidecar_grpc}",
                    "--http-address": f"127.0.0.1:{free_port()}",
                    "--objstore.config-file": str(bucket),
                },
            )
            self.servers.append(self.sidecar)
            self.store = thanos_store(workdir, bucket, store_grpc)
            self.servers.append(self.store)
            self.querier = thanos_query(workdir, [f"127.0.0.1:{sidecar_grpc}", f"127.0.0.1:{store_grpc}"])
            self.servers.append(self.querier)
            self.url = self.querier.url
            wait_for_stores(self.querier, 2)
        except BaseException:
            self.stop()
            raise

    @property
    def rules_url(self) -> str:
        return self.prometheus.url

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


class Cortex(PrometheusApi):
    """deploy/cortex/cortex.yaml on loopback with its directories in ``workdir``: remote write at
    :attr:`write_url`, PromQL at ``/prometheus``; ``rule_files`` go to its local rule store for
    tenant ``fake`` and are evaluated every ``evaluation_interval``; its ruler sends the alerts to its
    own Alertmanager, on ``alertmanager_config`` for that tenant (unless given, one receiver that
    sends nowhere)."""

    def __init__(
        self,
        workdir: Path,
        rule_files: list[str] | None = None,
        evaluation_interval: str = EVALUATION,
        alertmanager_config: str | None = None,
    ) -> None:
        config = yaml.safe_load(CORTEX.read_text())
        data = workdir / "cortex"
        http, grpc = free_port(), free_port()
        config["server"].update(http_listen_address="127.0.0.1", http_listen_port=http)
        config["server"].update(grpc_listen_address="127.0.0.1", grpc_listen_port=grpc)
        local = f"http://127.0.0.1:{http}"
        config["blocks_storage"]["filesystem"]["dir"] = str(data / "blocks")
        config["blocks_storage"]["tsdb"]["dir"] = str(data / "tsdb")
        config["blocks_storage"]["bucket_store"]["sync_dir"] = str(data / "tsdb-sync")
        config["compactor"]["data_dir"] = str(data / "compactor")
        config["ruler"].update(
            evaluation_interval=evaluation_interval,
            alertmanager_url=f"{local}/alertmanager",
            rule_path=str(data / "ruler"),
        )
        config["ruler_storage"]["local"]["directory"] = str(data / "rules")
        config["alertmanager"].update(external_url=f"{local}/alertmanager", data_dir=str(data / "am-data"))
        config["alertmanager_storage"]["local"]["path"] = str(data / "alertmanager")
        tenant_rules = data / "rules" / "fake"
        tenant_rules.mkdir(parents=True)
        for path in rule_files or []:
            shutil.copy(path, tenant_rules / Path(path).name)
        (data / "alertmanager").mkdir()
        (data / "alertmanager" / "fake.yaml").write_text(
            alertmanager_config or "route:\n  receiver: none\nreceivers:\n  - name: none\n"
        )
        config_path = workdir / "cortex.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.rule_files = rule_files
        self.server = ServerProcess(
            "cortex", [built("cortex"), f"-config.file={config_path}"], http, workdir, "/ready"
        )
        self.base = self.server.url
        self.url = f"{self.base}/prometheus"
        try:
            if rule_files:
                self._wait_for_rules()
        except BaseException:
            self.stop()
            raise

    def _wait_for_rules(self, timeout: float = 30.0) -> None:
        def loaded() -> bool:
            return bool(self.get("/api/v1/rules")["data"]["groups"])

        if not wait_until(loaded, timeout):
            raise RuntimeError(f"Cortex's ruler loaded no rules in {timeout} s: {self.server.log.read_text()[-3000:]}")

    @property
    def write_url(self) -> str:
        return f"{self.base}/api/v1/push"

    @property
    def rules_url(self) -> str:
        return self.url

    def stop(self) -> None:
        self.server.stop()


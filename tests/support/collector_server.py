"""Our Collector distributions (build/bin/otelcol-openlora and -lb) running a shipped config on loopback.

The shipped configs listen on fixed ports of every interface (4317, 4318, 8888, 8889, 13133), as a
container needs; here a second config file, merged over the shipped one by the collector itself,
moves each of them to a free 127.0.0.1 port, so the file under test is the shipped one, unchanged
but for where it listens. Ready when the health_check extension answers.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.built import built
from tests.support.processes import free_port
from tests.support.prometheus_server import ServerProcess

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "collector"


class Collector(ServerProcess):
    def __init__(
        self,
        workdir: Path,
        config: Path,
        *,
        env: dict[str, str] | None = None,
        name: str = "otelcol",
        overrides: dict | None = None,
        overlays: tuple[Path, ...] = (),
        binary: str = "otelcol-openlora",
    ) -> None:
        """Run ``config`` as shipped (with the shipped ``overlays`` merged over it), its ports moved to
        loopback; ``overrides`` (a config fragment, merged last: maps key by key, lists replaced) changes what
        else a test needs, an exporter's endpoint say. ``binary``: the distribution (tools/build.sh)."""
        shipped = yaml.safe_load(config.read_text())
        self.ports = {
            "grpc": free_port(),
            "http": free_port(),
            "health": free_port(),
            "self_metrics": free_port(),
        }
        overlay: dict = {
            "receivers": {
                "otlp": {
                    "protocols": {
                        "grpc": {"endpoint": f"127.0.0.1:{self.ports['grpc']}"},
                        "http": {"endpoint": f"127.0.0.1:{self.ports['http']}"},
                    }
                }
            },
            "extensions": {"health_check": {"endpoint": f"127.0.0.1:{self.ports['health']}"}},
            "service": {
                "telemetry": {
                    "metrics": {
                        "readers": [
                            {
                                "pull": {
                                    "exporter": {
                                        "prometheus": {
                                            "host": "127.0.0.1",
                                            "port": self.ports["self_metrics"],
                                        }
                                    }
                                }
                            }
                        ]
                    }
                }
            },
        }
        if "prometheus" in (shipped.get("exporters") or {}):
            self.ports["prometheus"] = free_port()
            overlay["exporters"] = {"prometheus": {"endpoint": f"127.0.0.1:{self.ports['prometheus']}"}}
        self.overlay = workdir / f"{name}-loopback.yaml"
        self.overlay.write_text(yaml.safe_dump(overlay))
        # Always there (empty: nothing changed), so that restart(overrides=...) can change it.
        self.overrides = workdir / f"{name}-overrides.yaml"
        self.overrides.write_text(yaml.safe_dump(overrides or {}))
        extra = ["--config", str(self.overrides)]
        shipped_files = [arg for path in (config, *overlays) for arg in ("--config", str(path))]
        argv = [built(binary), *shipped_files, "--config", str(self.overlay), *extra]
        super().__init__(name, argv, self.ports["health"], workdir, "/", env=env)

    @property
    def otlp_http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    def log_lines(self, level: str) -> list[str]:
        """The log lines of ``level`` (``warn``, ``error``): the collector's console log is tab-separated."""
        return [line for line in self.log.read_text().splitlines() if f"\t{level}\t" in line]

    def restart(self, overrides: dict | None = None) -> None:
        """Stop and start again on the same ports; ``overrides`` replaces those given at the start."""
        if overrides is not None:
            self.overrides.write_text(yaml.safe_dump(overrides))
        super().restart()


def load_balancing_agent(workdir: Path, gateways: list[Collector], *, name: str = "agent") -> Collector:
    """An agent on deploy/collector/agent.yaml with the overlay agent-loadbalancing.yaml, on
    collector/otelcol-openlora-lb, load-balancing over ``gateways``: the shipped DNS resolver replaced
    by a static list of their addresses (no DNS server runs here)."""
    hostnames = [f"127.0.0.1:{gateway.ports['grpc']}" for gateway in gateways]
    return Collector(
        workdir,
        DEPLOY / "agent.yaml",
        overlays=(DEPLOY / "agent-loadbalancing.yaml",),
        binary="otelcol-openlora-lb",
        name=name,
        overrides={"exporters": {"load_balancing": {"resolver": {"dns": None, "static": {"hostnames": hostnames}}}}},
    )

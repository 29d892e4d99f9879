"""Prometheus pull endpoint: a ``/metrics`` HTTP server on a background thread.

The reader gets its own ``CollectorRegistry`` rather than prometheus_client's
global one, so that the endpoint shows exactly this run's metrics (plus
``target_info`` with the Resource) and can be torn down and rebuilt in one process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

from openlora_otel.config import ConfigError, TelemetryConfig

__all__ = ["PrometheusEndpoint", "build_prometheus"]

_logger = logging.getLogger(__name__)


@dataclass
class PrometheusEndpoint:
    """A bound, serving ``/metrics`` endpoint and the reader behind it."""

    reader: PrometheusMetricReader
    registry: CollectorRegistry
    host: str
    port: int
    _server: object
    _thread: threading.Thread
    _pid: int = field(default_factory=os.getpid)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (idempotent; in a forked child, only drops the socket)."""
        server = self._server
        if server is None:
            return
        self._server = None
        try:
            if os.getpid() == self._pid:
                server.shutdown()  # type: ignore[attr-defined]
            # else: a forked child has no serving thread; shutdown() would wait for it forever.
            server.server_close()  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover - defensive: closing must never raise
            _logger.debug("closing the Prometheus endpoint failed", exc_info=True)
        self._thread.join(timeout=1.0)


def build_prometheus(config: TelemetryConfig) -> PrometheusEndpoint:
    """Bind the endpoint on ``config.prometheus_host:config.prometheus_port`` and start serving.

    Raises :class:`ConfigError` naming the variable when the address cannot be
    bound (port in use, unknown host); nothing is left running in that case.
    """
    registry = CollectorRegistry(auto_describe=False)
    host, port = config.prometheus_host, config.prometheus_port
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except socket.gaierror as exc:
        raise ConfigError(
            "OTEL_EXPORTER_PROMETHEUS_HOST", host, "a resolvable host name or IP address", str(exc)
        ) from None
    except OSError as exc:
        raise ConfigError(
            config.prometheus_port_variable,
            port,
            "a port that is free on " + host,
            f"binding {host}:{port} failed: {exc.strerror or exc}; pick another port, or 0 for any free port",
        ) from None
    bound_port = server.server_address[1]
    reader = PrometheusMetricReader(registry=registry)
    return PrometheusEndpoint(
        reader=reader, registry=registry, host=host, port=bound_port, _server=server, _thread=thread
    )

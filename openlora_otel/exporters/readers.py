"""Which readers a configuration builds: the one place that maps ``OTEL_METRICS_EXPORTER`` (and
``OPENLORA_HISTORY_DIR``) to the exporter modules, each imported only when selected.

:func:`build_readers` checks everything that can fail cheaply (a missing exporter package, the history
directory) before it binds a port or starts a thread, and stops whatever it started when a later
step fails.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from openlora_otel._deps import require
from openlora_otel.config import TelemetryConfig

if TYPE_CHECKING:
    from openlora_otel.exporters.prometheus import PrometheusEndpoint

_logger = logging.getLogger("openlora_otel")

# The push exporters: name -> (module, builder of a periodic reader from the config).
PUSH_READERS: dict[str, tuple[str, str]] = {
    "otlp": ("openlora_otel.exporters.otlp", "build_otlp_reader"),
    "console": ("openlora_otel.exporters.console", "build_console_reader"),
}


@dataclass
class Readers:
    """The readers built for a configuration, in shutdown order (the history file's first, so its final
    line never waits behind a slow push), and the pull endpoint when there is one."""

    readers: list[MetricReader] = field(default_factory=list)
    prometheus: PrometheusEndpoint | None = None

    def close(self) -> None:
        """Stop every reader and the endpoint, best effort (for a setup that failed after building them)."""
        for reader in self.readers:
            try:
                reader.shutdown(timeout_millis=500)
            except Exception:  # pragma: no cover - best effort cleanup
                _logger.debug("reader cleanup failed", exc_info=True)
        if self.prometheus is not None:
            self.prometheus.close()


def check_packages(config: TelemetryConfig) -> None:
    """Fail on a missing exporter package (MissingDependencyError naming it) before anything starts."""
    if "otlp" in config.enabled_exporters:
        module = "grpc" if config.otlp.protocol == "grpc" else "http"
        require(
            f"opentelemetry.exporter.otlp.proto.{module}",
            f"OTEL_METRICS_EXPORTER=otlp ({config.otlp.protocol})",
        )


def build_readers(config: TelemetryConfig, resource: Resource) -> Readers:
    """Every reader ``config`` selects, started: the Prometheus endpoint bound (and registered for
    file-based discovery), the push readers' threads running, the history file open. A missing exporter
    package fails first (:func:`check_packages`), before a port is bound or a thread started."""
    check_packages(config)
    exporters = config.enabled_exporters
    history = None
    if config.history_dir:
        from openlora_otel.exporters.history_writer import build_history_exporter

        # Checked before a port is bound or a thread started (ConfigError / MissingDependencyError).
        history = build_history_exporter(config, resource)

    built = Readers()
    try:
        if "prometheus" in exporters:
            from openlora_otel.exporters.prometheus import build_prometheus

            built.prometheus = build_prometheus(config)
            built.readers.append(built.prometheus.reader)
            if config.file_sd_dir:
                built.prometheus.register_file_sd(config.file_sd_dir)
        elif config.file_sd_dir:
            _logger.info(
                "OPENLORA_PROMETHEUS_FILE_SD_DIR is set but the prometheus exporter is not: nothing to register"
            )
        for name, (module, builder) in PUSH_READERS.items():
            if name in exporters:
                build: Callable[[TelemetryConfig], MetricReader] = getattr(importlib.import_module(module), builder)
                built.readers.append(build(config))
        if history is not None:
            from openlora_otel.exporters.history_writer import history_reader

            built.readers.insert(0, history_reader(history, config))
    except BaseException:
        built.close()
        raise
    return built

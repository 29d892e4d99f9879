"""openlora-otel: OpenTelemetry metrics for LoRA / LLM fine-tuning jobs.

``setup_telemetry()`` reads the standard ``OTEL_*`` variables (and a few
``OPENLORA_*`` ones) and returns a :class:`Telemetry` handle whose meter feeds a
Prometheus pull endpoint (the default), OTLP push, the console, or nothing.

Importing this package imports no framework (torch, transformers, lightning)
and no GPU library; those are loaded only by the parts that need them.
"""

from openlora_otel._deps import MissingDependencyError
from openlora_otel._version import __version__
from openlora_otel.config import ConfigError, TelemetryConfig
from openlora_otel.telemetry import Telemetry, setup_telemetry

__all__ = [
    "ConfigError",
    "MissingDependencyError",
    "Telemetry",
    "TelemetryConfig",
    "__version__",
    "setup_telemetry",
]

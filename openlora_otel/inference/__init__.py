"""Per-request metrics of a server of LoRA adapters: :class:`InferenceMetrics` (``telemetry.inference``).

The library any server imports: the standard library and OpenTelemetry only. The server and the
load generator that ship with openlora-otel are programs above it, in :mod:`openlora_otel.serving`.
"""

from openlora_otel.inference.metrics import (
    ADAPTER_BASE,
    ADAPTER_OTHER,
    DEFAULT_MAX_ADAPTERS,
    AdapterOrigin,
    InferenceMetrics,
    InferenceRequest,
    inference_views,
)

__all__ = [
    "ADAPTER_BASE",
    "ADAPTER_OTHER",
    "DEFAULT_MAX_ADAPTERS",
    "AdapterOrigin",
    "InferenceMetrics",
    "InferenceRequest",
    "inference_views",
]

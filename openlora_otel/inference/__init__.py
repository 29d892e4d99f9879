"""Serving LoRA adapters: per-request metrics (:class:`InferenceMetrics`), an HTTP server (``serve`` extra) and a load generator.

``import openlora_otel.inference`` imports only the metrics: the server stack
(FastAPI, uvicorn, torch) is imported by the ``serve`` command itself. The load
generator (``openlora-otel load``, :mod:`openlora_otel.inference.load`) uses the
standard library only.
"""

from openlora_otel.inference.metrics import (
    ADAPTER_BASE,
    ADAPTER_OTHER,
    DEFAULT_MAX_ADAPTERS,
    InferenceMetrics,
    InferenceRequest,
    inference_views,
)

__all__ = [
    "ADAPTER_BASE",
    "ADAPTER_OTHER",
    "DEFAULT_MAX_ADAPTERS",
    "InferenceMetrics",
    "InferenceRequest",
    "inference_views",
]

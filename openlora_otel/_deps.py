"""Optional packages: which extra provides which module, and a loud error when one is missing."""

from __future__ import annotations

import importlib.util

__all__ = ["OPTIONAL_PACKAGES", "MissingDependencyError", "is_installed", "require"]


class MissingDependencyError(ImportError):
    """An optional package needed by the chosen configuration is not installed."""


# import name -> (distribution on PyPI, openlora-otel extra that installs it)
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "opentelemetry.exporter.otlp.proto.http": ("opentelemetry-exporter-otlp-proto-http", "otlp"),
    "opentelemetry.exporter.otlp.proto.grpc": ("opentelemetry-exporter-otlp-proto-grpc", "otlp"),
    # The OTLP encoder behind OPENLORA_HISTORY_DIR (both OTLP exporters depend on it).
    "opentelemetry.exporter.otlp.proto.common": ("opentelemetry-exporter-otlp-proto-common", "otlp"),
    # The gRPC server interceptor (openlora_otel/inference/grpc_interceptor.py); the OTLP gRPC exporter brings it.
    "grpc": ("grpcio", "otlp"),
    "pynvml": ("nvidia-ml-py", "gpu"),
    "torch": ("torch", "torch"),
    "transformers": ("transformers", "hf"),
    "peft": ("peft", "hf"),
    "lightning": ("lightning", "lightning"),
    "matplotlib": ("matplotlib", "report"),
    # `openlora-otel serve` (with torch, transformers and peft).
    "fastapi": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "opentelemetry.instrumentation.fastapi": ("opentelemetry-instrumentation-fastapi", "serve"),
}


def is_installed(module: str) -> bool:
    """True when ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str, *, extra: str | None = None) -> None:
    """Raise :class:`MissingDependencyError` naming the package and the extra when ``module`` is missing."""
    if is_installed(module):
        return
    distribution, default_extra = OPTIONAL_PACKAGES[module]
    extra = extra or default_extra
    raise MissingDependencyError(
        f"{purpose} needs the package {distribution!r}, which is not installed: "
        f"pip install 'openlora-otel[{extra}]'"
    )

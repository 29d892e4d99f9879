"""Runs written through the real history exporter, for the tests that read history files back."""

from __future__ import annotations

from pathlib import Path

from openlora_otel import TelemetryConfig

A_DAY_MS = 86_400_000.0  # no periodic line: every line comes from a flush or the shutdown


def history_config(directory: Path, **changes: object) -> TelemetryConfig:
    """History lines into ``directory`` only when flushed or shut down; no other exporter, no host or GPU
    metrics; ``changes`` on top (``quiet=True``, ``run_id=...``)."""
    base = TelemetryConfig(
        exporters=("none",),
        host_metrics=False,
        gpu_metrics="off",
        history_dir=str(directory),
        history_interval_ms=A_DAY_MS,
    )
    return base.replace(**changes)

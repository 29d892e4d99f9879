"""``openlora-otel metrics``: the table of metrics, and the map from the seeds' names, as Markdown."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from openlora_otel.commands._args import command_parser
from openlora_otel.names import (
    ADAPTER_METRICS,
    GPU_METRICS,
    INFERENCE_METRICS,
    RUN_METRICS,
    TRAINING_METRICS,
    MetricSpec,
)

# What the command prints, in this order (the host metrics have their own page's table).
LISTED = (*RUN_METRICS, *TRAINING_METRICS, *ADAPTER_METRICS, *GPU_METRICS, *INFERENCE_METRICS)


def register(commands: Any) -> None:
    metrics = command_parser(
        commands,
        "metrics",
        help="list every metric with its Prometheus series name, type, unit and meaning",
        description="Print the table of metrics openlora-otel exports, as Markdown.",
    )
    metrics.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(metrics_markdown())
    print()
    print(seeds_markdown())
    return 0


def metrics_markdown(specs: Iterable[MetricSpec] = LISTED) -> str:
    """The table of ``specs`` as Markdown: OpenTelemetry name, Prometheus series, type, unit, meaning."""
    rows = [
        "| OpenTelemetry name | Prometheus series (pulled; through the Collector where it differs) | Type | Unit | Meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in specs:
        series = spec.prometheus
        if spec.kind == "histogram":
            series = f"{series}_bucket`, `_sum`, `_count"
        if spec.prometheus_collector != spec.prometheus:  # the semantic conventions' unit `1` gauges
            series += f"`, Collector: `{spec.prometheus_collector}"
        unit = f"`{spec.unit}`" if spec.unit else "(none)"
        rows.append(f"| `{spec.name}` | `{series}` | {spec.kind} | {unit} | {spec.description} |")
    return "\n".join(rows)


def seeds_markdown() -> str:
    """The map from the seeds' metric names to ours."""
    rows = ["| Seeds' name | Ours (Prometheus series) |", "| --- | --- |"]
    for spec in LISTED:
        if spec.seed_name:
            rows.append(f"| `{spec.seed_name}` | `{spec.prometheus}` |")
    return "\n".join(rows)

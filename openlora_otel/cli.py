"""The ``openlora-otel`` command line: ``doctor`` and ``env``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from openlora_otel._version import __version__
from openlora_otel.config import VARIABLES
from openlora_otel.names import ADAPTER_METRICS, GPU_METRICS, TRAINING_METRICS

__all__ = ["main", "metrics_markdown", "variables_markdown"]


def variables_markdown() -> str:
    """The environment table as Markdown; the README carries the same table."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for variable in VARIABLES:
        names = ", ".join(f"`{name.strip()}`" for name in variable.name.split(","))
        rows.append(f"| {names} | {variable.default} | {variable.meaning} |")
    return "\n".join(rows)


def metrics_markdown() -> str:
    """The metric table as Markdown: OpenTelemetry name, Prometheus series, type, unit, meaning."""
    rows = [
        "| OpenTelemetry name | Prometheus series (pulled; through the Collector where it differs) | Type | Unit | Meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in (*TRAINING_METRICS, *ADAPTER_METRICS, *GPU_METRICS):
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
    for spec in (*TRAINING_METRICS, *ADAPTER_METRICS, *GPU_METRICS):
        if spec.seed_name:
            rows.append(f"| `{spec.seed_name}` | `{spec.prometheus}` |")
    return "\n".join(rows)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openlora-otel",
        description="OpenTelemetry metrics for LoRA / LLM fine-tuning jobs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor",
        help="check the configuration, the ports and endpoints it names, and the optional packages",
        description="Print the configuration resolved from the environment (secrets redacted), check that "
        "the Prometheus port can be bound and the OTLP endpoint answers, list optional packages, and say "
        "what to fix. Exit status: 0 all good, 1 a check failed, 2 invalid configuration.",
    )
    doctor.add_argument(
        "--timeout", type=float, default=2.0, metavar="SECONDS", help="per network check (default 2)"
    )
    commands.add_parser(
        "env",
        help="list every environment variable with its default and meaning",
        description="Print the table of environment variables openlora-otel reads, as Markdown.",
    )
    commands.add_parser(
        "metrics",
        help="list every metric with its Prometheus series name, type, unit and meaning",
        description="Print the table of metrics openlora-otel exports, as Markdown.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        if args.timeout <= 0:
            parser.error("--timeout must be > 0")
        from openlora_otel.doctor import run_doctor

        return run_doctor(timeout_s=args.timeout)
    if args.command == "env":
        print(variables_markdown())
        return 0
    if args.command == "metrics":
        print(metrics_markdown())
        print()
        print(seeds_markdown())
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

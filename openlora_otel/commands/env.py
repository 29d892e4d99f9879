"""``openlora-otel env``: the table of environment variables, as Markdown (the README carries the same)."""

from __future__ import annotations

import argparse
from typing import Any

from openlora_otel.config import VARIABLES


def register(commands: Any) -> None:
    env = commands.add_parser(
        "env",
        help="list every environment variable with its default and meaning",
        description="Print the table of environment variables openlora-otel reads, as Markdown.",
    )
    env.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(variables_markdown())
    return 0


def variables_markdown() -> str:
    """The environment table as Markdown; the README carries the same table."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for variable in VARIABLES:
        names = ", ".join(f"`{name.strip()}`" for name in variable.name.split(","))
        rows.append(f"| {names} | {variable.default} | {variable.meaning} |")
    return "\n".join(rows)

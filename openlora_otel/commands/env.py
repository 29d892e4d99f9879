"""``openlora-otel env``: the tables of environment variables by group, as Markdown (docs/reference/configuration.md carries the same)."""

from __future__ import annotations

import argparse
from typing import Any

from openlora_otel.commands._args import command_parser
from openlora_otel.config import GROUPS, VARIABLES


def register(commands: Any) -> None:
    env = command_parser(
        commands,
        "env",
        help="list every environment variable with its default and meaning",
        description="Print the tables of environment variables openlora-otel reads, by group, as Markdown.",
    )
    env.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(variables_markdown())
    return 0


def variables_markdown() -> str:
    """The environment tables as Markdown, one per group of :data:`~openlora_otel.config.GROUPS`;
    docs/reference/configuration.md carries the same."""
    blocks = []
    for group in GROUPS:
        rows = [f"**{group}**", "", "| Variable | Default | Meaning |", "| --- | --- | --- |"]
        for variable in VARIABLES:
            if variable.group == group:
                names = ", ".join(f"`{name.strip()}`" for name in variable.name.split(","))
                rows.append(f"| {names} | {variable.default_text} | {variable.meaning} |")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)

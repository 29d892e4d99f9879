"""The ``openlora-otel`` command line: a dispatcher over :mod:`openlora_otel.commands` (``demo``, ``serve``,
``doctor``, ``env``, ``metrics``, ``rules``, ``stack``, ``report``, ``load``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from openlora_otel._version import __version__
from openlora_otel.commands import COMMANDS
from openlora_otel.commands._args import RedactingParser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = RedactingParser(
        prog="openlora-otel",
        description="OpenTelemetry metrics for LoRA / LLM fine-tuning jobs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:  # no command given
        parser.print_help(sys.stderr)
        return 2
    return func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

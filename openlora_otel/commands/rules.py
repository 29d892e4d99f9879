"""``openlora-otel rules``: the shipped alerting and recording rules, with the runbook URLs' base of your
choice (:func:`openlora_otel.stack.rules.rules_text`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from openlora_otel.commands._args import add_runbook_base_argument, command_parser
from openlora_otel.stack.rules import rules_text


def register(commands: Any) -> None:
    parser = command_parser(
        commands,
        "rules",
        help="print (or write) the Prometheus alerting and recording rules, with your runbook URL base",
        description="Print the alerting and recording rules openlora-otel ships "
        "(openlora_otel/rules/openlora.yml), or write them to --output, with every runbook_url "
        "starting with --runbook-base. Exit status: 0 done, 2 usage error or the file cannot be written.",
    )
    add_runbook_base_argument(parser)
    parser.add_argument("--output", type=Path, metavar="FILE", help="write the rules here instead of printing them")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    text = rules_text(args.runbook_base)
    if args.output is None:
        out.write(text)
        return 0
    try:
        args.output.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"openlora-otel rules: cannot write {args.output} ({exc.strerror or exc})", file=err)
        return 2
    print(f"wrote {args.output}", file=err)
    return 0

"""Argument types and checks the command line's parsers share (``openlora-otel demo``, ``serve``, ``load``,
``report``, ``rules``, ``stack``): the numbers, the one way to a usage error (:func:`usage_error`,
through the parser :func:`command_parser` made) and :func:`fail`, ``--runbook-base``. The check of a URL
argument is :func:`openlora_otel.config.checks.check_url`."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from openlora_otel.redaction import redact_url
from openlora_otel.stack.rules import DEFAULT_RUNBOOK_BASE, check_runbook_base


def number(kind: type, *, allow_zero: bool = False) -> Callable[[str], Any]:
    """An argparse type: a finite ``kind`` (int or float) > 0, or >= 0 with ``allow_zero``."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} {bound}, got {text!r}"
            ) from None
        if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = number(int)
non_negative_int = number(int, allow_zero=True)
positive_float = number(float)
non_negative_float = number(float, allow_zero=True)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


class RedactingParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors show every URL with its credentials and path redacted: an
    option mistyped before a webhook's URL lands in "unrecognized arguments: ...", and a Slack webhook's
    path is its token. The subcommands' parsers are of this class too (argparse makes them so)."""

    def error(self, message: str) -> NoReturn:
        super().error(_URL.sub(lambda match: redact_url(match.group(), path=True), message))


def command_parser(subparsers: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of ``openlora-otel NAME`` (``kwargs`` as ``add_parser`` takes them), kept in the parsed
    arguments as ``parser`` so that :func:`usage_error` can reach it."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, **kwargs)
    parser.set_defaults(parser=parser)
    return parser


def usage_error(args: argparse.Namespace, problem: object) -> NoReturn:
    """The arguments of the command ``args`` were parsed for cannot be used together: its usage line, then
    ``openlora-otel COMMAND: error: problem`` on stderr (argparse's own form); exit status 2."""
    parser: argparse.ArgumentParser = args.parser
    parser.error(str(problem))


def fail(command: str, problem: object) -> int:
    """Say on stderr why ``openlora-otel COMMAND`` cannot go on (``openlora-otel COMMAND: problem``), when
    what is wrong is found past the arguments (a file, a directory, the environment); exit status 2."""
    print(f"openlora-otel {command}: {problem}", file=sys.stderr)
    return 2


def runbook_base(text: str) -> str:
    """The argument type of ``--runbook-base`` (``rules`` and ``stack``)."""
    try:
        return check_runbook_base(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_runbook_base_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runbook-base",
        type=runbook_base,
        default=DEFAULT_RUNBOOK_BASE,
        metavar="URL",
        help="what every alert's runbook_url starts with (an http:// or https:// URL), before '#' and the "
        "alert's name in lower case: "
        "the docs site's runbooks page (default %(default)s, where the site is meant to be published; "
        "`mkdocs serve` serves it at http://127.0.0.1:8000/runbooks/)",
    )

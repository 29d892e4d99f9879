"""Argument types and checks the command line's parsers share (``openlora-otel demo``, ``serve``, ``load``,
``report``, ``stack``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult


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


def fail(command: str, problem: object) -> int:
    """Say on stderr why ``openlora-otel COMMAND`` cannot go on (``openlora-otel COMMAND: problem``); exit status 2."""
    print(f"openlora-otel {command}: {problem}", file=sys.stderr)
    return 2


def check_url(option: str, text: str, *, host_port: bool = False, hide_path: bool = False) -> SplitResult:
    """``text`` split, when ``option`` (``--url``, say) can use it: an http:// or https:// URL
    (``host_port``: or a bare ``HOST:PORT``) with a host, a port from 1 to 65535 if any, no space
    or control character, no unescaped ``@`` after the host, no byte that was not UTF-8 (it
    arrives as a lone surrogate, which no file or request can carry) and only ASCII after the host
    (percent-encoded). The checks of an OTLP endpoint (``openlora_otel.config.checks``) and those two.

    Else :class:`~openlora_otel.config.ConfigError`, one line naming ``option``, which shows
    ``text`` without its user info, query values and fragment (``hide_path``: nor its path, a
    webhook's token), so a usage error never prints a password.
    """
    from openlora_otel.config.checks import ConfigError, _check_endpoint
    from openlora_otel.redaction import redact_url

    shown = redact_url(text, path=hide_path)
    accepted = "an http:// or https:// URL" + (", or HOST:PORT" if host_port else "")
    if any("\ud800" <= c <= "\udfff" for c in text):
        raise ConfigError(option, shown, accepted, "it holds bytes that are not UTF-8 text")
    schemes = ("", "http", "https") if host_port else ("http", "https")
    parts = _check_endpoint(option, text, schemes=schemes, accepted=accepted, shown=shown)
    if not (parts.path + parts.query + parts.fragment).isascii():
        # http.client sends the request line as ASCII: it raised UnicodeEncodeError on the first request.
        raise ConfigError(option, shown, accepted, "percent-encode the non-ASCII characters after its host")
    return parts

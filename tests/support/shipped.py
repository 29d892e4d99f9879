"""The command lines of the shipped /etc/default files (deploy/), made runnable on loopback."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def shipped_args(path: Path) -> list[str]:
    """The ARGS="..." command line of a shipped /etc/default file."""
    match = re.search(r'^ARGS="(.*)"$', path.read_text(), re.M)
    assert match, f"{path} has no ARGS line"
    return shlex.split(match.group(1))


def rewrite_args(args: list[str], values: dict[str, str | list[str]]) -> list[str]:
    """Replace the values of the flags named as spelled (``--config.file``, ``-storageDataPath``); a
    list replaces every occurrence of a repeated flag (``--endpoint``) with one flag per item, where
    the first stood. Each must be in the shipped line, so a renamed flag fails here, not silently."""
    out: list[str] = []
    seen: set[str] = set()
    for arg in args:
        flag = arg.partition("=")[0]
        if flag not in values:
            out.append(arg)
            continue
        value = values[flag]
        if flag not in seen:
            out += [f"{flag}={item}" for item in value] if isinstance(value, list) else [f"{flag}={value}"]
        seen.add(flag)
    assert seen == set(values), f"flags not in the shipped line: {set(values) - seen}"
    return out

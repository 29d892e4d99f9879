"""The text of the README and the docs pages, for the tests that check what they say.

A test names the file that holds the text (``README.md`` or a page under ``docs/``) and reads a
part of it by its markers, ``<!-- name:start -->`` and ``<!-- name:end -->`` (HTML comments: the
rendered page shows nothing), rather than by headings, which move and get renamed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def text(path: str) -> str:
    """The whole file, ``path`` relative to the repository root (``README.md``, ``docs/...``)."""
    return (ROOT / path).read_text()


def marked(path: str, name: str) -> str:
    """What lies between the file's one pair of ``name`` markers (without the marker lines)."""
    found = re.findall(rf"<!-- {re.escape(name)}:start -->\n(.*?)\n?<!-- {re.escape(name)}:end -->", text(path), re.S)
    assert len(found) == 1, f"{path}: {len(found)} blocks marked {name!r}, expected 1"
    return found[0]


def fenced(path: str, name: str, language: str) -> str:
    """The fenced code block (```language) that is all of the ``name`` block, without its fences."""
    block = marked(path, name)
    match = re.fullmatch(rf"```{language}\n(.*?)\n```\n?", block, re.S)
    assert match, f"{path}: the {name!r} block is not one ```{language} block"
    return match.group(1)

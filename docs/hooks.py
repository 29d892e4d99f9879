"""MkDocs hooks for this site (mkdocs.yml `hooks:`).

The docstrings use Sphinx's cross-reference roles (``:class:`TrainingMetrics```), which mkdocstrings
shows as literal text (":class:" before the name). The rendered pages show the name alone, as code;
``~`` keeps the last component, as Sphinx does.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")


def _name(match: re.Match[str]) -> str:
    name = match.group(2)
    if match.group(1):
        name = name.rsplit(".", 1)[-1]
    return f"<code>{name}</code>"


def on_page_content(html: str, **_: object) -> str:
    return _ROLE.sub(_name, html)

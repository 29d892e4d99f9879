"""The alerting and recording rules this package ships (``openlora_otel/rules/openlora.yml``), with the
runbook URLs' base of your choice: what ``openlora-otel rules`` prints and ``openlora-otel stack`` writes."""

from __future__ import annotations

import re
import string
from importlib import resources

from openlora_otel.redaction import redact_url

__all__ = ["DEFAULT_RUNBOOK_BASE", "RUNBOOK_BASE_ACCEPTED", "check_runbook_base", "rules_text"]

# Where the docs site is meant to be published: its runbooks page, which every runbook_url of the shipped
# rules starts with (the alert's name in lower case is the anchor). docs/runbooks.md says the same.
DEFAULT_RUNBOOK_BASE = "https://openlora.github.io/openlora-otel/runbooks/"
_RUNBOOK_URL = re.compile(r'^(\s*runbook_url: )"' + re.escape(DEFAULT_RUNBOOK_BASE) + r'#([a-z0-9]+)"$', re.M)


# A URL's characters (RFC 3986) but '#' (the anchor follows the base) and "'"; a '%' starts an escape.
_RUNBOOK_BASE_CHARS = frozenset(string.ascii_letters + string.digits + "-._~:/?[]@!$&()*+,;=%")
RUNBOOK_BASE_ACCEPTED = (
    "an http:// or https:// URL with a host, of ASCII letters, digits and -._~:/?[]@!$&()*+,;=% "
    "(percent-encode anything else; no quotes, braces or '#')"
)


def check_runbook_base(base: str) -> str:
    """``base`` when every runbook_url can start with it (:data:`RUNBOOK_BASE_ACCEPTED`), else ValueError
    (one line, the URL shown without its credentials).

    What is refused is what cannot be a URL in a link and would break the rules file: a control
    character or ESC (PyYAML and promtool refused the file), ``{{`` (Prometheus reads an annotation
    as a template), a byte that was not UTF-8 (the file could not be written), a quote, a backslash
    or ``#``; and a '%' that is not an escape, a bad port, no host.
    """
    from openlora_otel.config.checks import check_url

    shown = redact_url(base)
    if not base or not set(base) <= _RUNBOOK_BASE_CHARS or re.search(r"%(?![0-9A-Fa-f]{2})", base):
        raise ValueError(f"a runbook base is {RUNBOOK_BASE_ACCEPTED}, got {shown!r}")
    check_url("--runbook-base", base)  # a ConfigError, a ValueError: the scheme, the host, the port
    return base


def rules_text(runbook_base: str | None = None) -> str:
    """The alerting and recording rules shipped in the package (``openlora_otel/rules/openlora.yml``),
    with every ``runbook_url`` starting with ``runbook_base`` instead of :data:`DEFAULT_RUNBOOK_BASE`
    when it is given (the anchor, the alert's name in lower case, stays)."""
    text = (resources.files("openlora_otel") / "rules" / "openlora.yml").read_text(encoding="utf-8")
    if runbook_base is None or runbook_base == DEFAULT_RUNBOOK_BASE:
        return text
    base = check_runbook_base(runbook_base)
    return _RUNBOOK_URL.sub(lambda m: f'{m.group(1)}"{base}#{m.group(2)}"', text)

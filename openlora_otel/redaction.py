"""Redaction: the one place that hides credentials in text we print or log.

Two kinds of secret reach our messages: the ``user:password@`` part of an
endpoint URL and OTLP header values (``authorization=Bearer ...``). They can come
back to us inside text we did not write (an SDK log line, an exception from
requests or gRPC, an HTTP reason phrase a server chose), so redaction works on
arbitrary text: every *known* secret (the configured values, in the forms they
are likely to be echoed in) is replaced, and so is any ``scheme://user:pass@``
pattern, known or not.

Used by :class:`~openlora_otel.config.ConfigError`, the config reprs, the export
guard and ``doctor``.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from urllib.parse import quote, unquote

__all__ = ["REDACTED", "redact", "redact_url", "secret_forms", "url_secrets"]

REDACTED = "<redacted>"

# Shorter known values are not scrubbed from free text: replacing every "ml" or
# "on" in a message would make it unreadable, and such a value guards nothing.
MIN_SECRET_LENGTH = 4

# Words that start an Authorization value: they are not the secret, and scrubbing
# them alone would garble messages that merely mention them.
_AUTH_SCHEMES = frozenset({"bearer", "basic", "token", "digest", "apikey", "api-key", "negotiate"})

# scheme://userinfo@ : userinfo runs to the last "@" before the path, query,
# fragment or whitespace, so a password with an unescaped "@" is hidden whole.
_USERINFO_RE = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s@]*(?:@[^/?#\s@]*)*@")


def secret_forms(value: str) -> set[str]:
    """``value`` and the forms it is likely to be echoed in (percent-encoded, repr-escaped, its tokens)."""
    forms = {value, quote(value, safe=""), repr(value)[1:-1]}
    for token in value.split():
        if token.lower() not in _AUTH_SCHEMES:
            forms.update({token, quote(token, safe="")})
    return {form for form in forms if len(form) >= MIN_SECRET_LENGTH}


def url_secrets(url: str) -> set[str]:
    """The secrets in ``url``'s ``user:password@`` part (raw and decoded), and its Basic-auth form.

    Parsed by hand, not with urlsplit: it must work on a URL too malformed to parse.
    """
    userinfo, at, _ = _authority(url).rpartition("@")
    if not at:
        return set()
    user, _, password = userinfo.partition(":")
    decoded = f"{unquote(user)}:{unquote(password)}"
    # requests turns URL credentials into "Authorization: Basic base64(user:password)".
    basic = base64.b64encode(decoded.encode("latin-1", "replace")).decode("ascii")
    secrets = {userinfo, decoded, basic}
    if password:
        secrets |= {password, unquote(password)}
    return {form for secret in secrets for form in secret_forms(secret)}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret and any ``scheme://user:pass@`` credentials replaced by ``<redacted>``."""
    # Longest first, so "Bearer abc123" goes whole before its token "abc123".
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET_LENGTH}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _USERINFO_RE.sub(rf"\g<scheme>{REDACTED}@", text)


def redact_url(url: str) -> str:
    """``url`` with its ``user:password@`` part (scheme or not) replaced by ``<redacted>@``."""
    authority = _authority(url)
    userinfo, at, _ = authority.rpartition("@")
    if at:
        start = url.index(authority)
        url = url[:start] + REDACTED + url[start + len(userinfo) :]
    return redact(url)


def _authority(url: str) -> str:
    """The ``[userinfo@]host[:port]`` part of ``url`` (which may lack the scheme)."""
    rest = url.partition("://")[2] if "://" in url else url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    return rest[:end]

"""Redaction: the one place that hides credentials in text we print or log.

Secrets can come back inside text we did not write (an SDK log line, an exception, a reason phrase),
so :func:`redact` works on any text: every known secret is replaced, and so are any
``scheme://user:pass@`` and any URL's query values and fragment. :func:`redact_url` shows a URL's
scheme, host, port, path and query names only. Used by :class:`~openlora_otel.config.ConfigError`,
the config reprs, the export guard and ``doctor``. See docs/reference/setup.md.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from urllib.parse import quote, unquote, unquote_plus

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
# The scheme's length is bounded: unbounded, every word boundary of a long "a.a.a..." value started a
# scan to its end, and redacting a 100k-character ConfigError took seconds.
_USERINFO_RE = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]{0,31}://)[^/?#\s@]*(?:@[^/?#\s@]*)*@")
# A URL's query and fragment in free text run to whitespace or a quote (an exception's repr quotes
# the URL it failed on): redacted token by token, in linear time (a regex restarting at every "://"
# of "a://a://..." scanned to the end from each).
_TOKEN_RE = re.compile(r"[^\s'\"]+")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")


def secret_forms(value: str) -> set[str]:
    """``value`` and the forms it is likely to be echoed in (percent-encoded, repr-escaped, its tokens)."""
    forms = {value, _quote(value, safe=""), _quote(value), repr(value)[1:-1]}
    for token in value.split():
        if token.lower() not in _AUTH_SCHEMES:
            forms.update({token, _quote(token, safe="")})
    return {form for form in forms if len(form) >= MIN_SECRET_LENGTH}


def _quote(value: str, safe: str = "/") -> str:
    """quote(), also of text with a lone surrogate (plain quote() raised UnicodeEncodeError): a byte of the
    environment that is not UTF-8 is encoded as the byte it was, any other surrogate as UTF-8 would."""
    try:
        return quote(value, safe=safe, errors="surrogateescape")
    except UnicodeEncodeError:
        return quote(value, safe=safe, errors="surrogatepass")


def url_secrets(url: str, *, path: bool = False) -> set[str]:
    """The secrets in ``url``: its user info (raw and decoded, and the Basic-auth form requests sends),
    its query values and its fragment, each in the forms :func:`secret_forms` lists; ``path``: its
    path too, whole and after its host and port (a webhook's, see :func:`redact_url`): the path
    alone (``alerts`` of ``http://h:5001/alerts``) could be any word of the text.

    Parsed by hand, not with urlsplit: it must work on a URL too malformed to parse.
    """
    _, userinfo, rest, query, fragment = _split(url)
    secrets: set[str] = set()
    if path:
        host, slash, tail = rest.partition("/")
        if tail:
            secrets |= {host + slash + tail, unquote(host + slash + tail)}
    if userinfo is not None:
        user, _, password = userinfo.partition(":")
        decoded = f"{unquote(user)}:{unquote(password)}"
        # requests turns URL credentials into "Authorization: Basic base64(user:password)".
        basic = base64.b64encode(decoded.encode("latin-1", "replace")).decode("ascii")
        secrets |= {userinfo, decoded, basic}
        if ":" not in userinfo:  # a token given as the user name: it is the secret
            secrets.add(unquote(user))
        if password:
            secrets |= {password, unquote(password)}
    values = [item.partition("=")[2] if "=" in item else item for item in (query or "").split("&")]
    for value in [*values, fragment or ""]:
        secrets |= {value, unquote(value), unquote_plus(value)}
    return {form for secret in secrets if secret for form in secret_forms(secret)}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret, any ``scheme://user:pass@`` credentials and any ``scheme://``
    URL's query values and fragment replaced by ``<redacted>``."""
    # Longest first, so "Bearer abc123" goes whole before its token "abc123".
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET_LENGTH}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    # The query first: once the user info reads "<redacted>@", the "<" would end the URL's match.
    text = _TOKEN_RE.sub(_redact_token_tail, text)
    return _USERINFO_RE.sub(rf"\g<scheme>{REDACTED}@", text)


def redact_url(url: str, *, path: bool = False) -> str:
    """``url`` (scheme or not) with its user info, query values and fragment replaced by ``<redacted>``
    (see the module's policy); ``path``: its path too, for a webhook, whose path is often its token
    (Slack's ``/services/T.../B.../...``, Discord's, Teams'): ``https://hooks.slack.com/<redacted>``."""
    prefix, userinfo, rest, query, fragment = _split(url)
    if path:
        host, slash, tail = rest.partition("/")
        rest = host + (slash + REDACTED if tail else slash)
    shown = prefix + (f"{REDACTED}@" if userinfo is not None else "") + rest
    if query is not None:
        shown += "?" + _redact_query(query)
    if fragment is not None:
        shown += f"#{REDACTED}" if fragment else "#"
    return redact(shown)


def _split(url: str) -> tuple[str, str | None, str, str | None, str | None]:
    """``url`` as (``scheme://`` or "", user info or None, host/port/path, query or None, fragment or None).

    The user info runs to the last ``@`` anywhere (see the module's policy), so what follows it holds
    no ``@``; the query starts at the first ``?`` after that, the fragment at the first ``#``.
    """
    # Only a scheme before "://" starts the URL: in "user:pw@host:4317/a://b" (gRPC's form has none)
    # the "://" is later, and taking all before it as the scheme showed the password.
    scheme = _SCHEME_RE.match(url)
    prefix = scheme[0] if scheme else ""
    rest = url[len(prefix) :]
    userinfo: str | None = None
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
    rest, hash_sign, fragment = rest.partition("#")
    rest, question_mark, query = rest.partition("?")
    return prefix, userinfo, rest, query if question_mark else None, fragment if hash_sign else None


def _redact_query(query: str) -> str:
    """``a=1&b`` -> ``a=<redacted>&<redacted>``: names kept, every value (and a bare item) hidden."""
    return "&".join(
        f"{item.partition('=')[0]}={REDACTED}" if "=" in item else (REDACTED if item else "")
        for item in query.split("&")
    )


def _redact_token_tail(match: re.Match[str]) -> str:
    """A whitespace-free token, with the query values and fragment of a ``scheme://`` URL in it redacted."""
    token = match[0]
    start = token.find("://")
    if start < 0:
        return token
    cut = min((i for i in (token.find("?", start), token.find("#", start)) if i >= 0), default=-1)
    return token if cut < 0 else token[:cut] + _redact_tail(token[cut:])


def _redact_tail(tail: str) -> str:
    """A free-text URL's ``?query#fragment`` (either may be absent), redacted as :func:`redact_url` does."""
    query, hash_sign, _ = tail.partition("#")
    shown = "?" + _redact_query(query[1:]) if query else ""
    return shown + (f"#{REDACTED}" if hash_sign else "")

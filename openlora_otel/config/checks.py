"""What a valid value is: :class:`ConfigError`, the accepted choices and ranges, and the shared checks.

Values from the environment (:mod:`.env`) and set in code (:class:`~openlora_otel.config.TelemetryConfig`)
pass the same checks: ASCII digits within documented ranges, so a value that would stall or kill a
thread later is refused at setup; credentials never appear in an error. The helpers are public for
the package's modules only: outside ``openlora_otel.config`` use :class:`ConfigError`,
:func:`check_url` and what the package re-exports. See docs/reference/setup.md.
"""

from __future__ import annotations

import binascii
import ipaddress
import math
import os
import re
import ssl
from urllib.parse import SplitResult, unquote, urlsplit

from openlora_otel.redaction import redact, redact_url

EXPORTERS = ("prometheus", "otlp", "console", "none")
PROTOCOLS = ("http/protobuf", "grpc")
COMPRESSIONS = ("none", "gzip")
TEMPORALITIES = ("cumulative", "delta", "lowmemory")
HISTOGRAM_AGGREGATIONS = ("explicit_bucket_histogram", "base2_exponential_bucket_histogram")
PORT_OFFSETS = ("local_rank", "rank", "none")
GPU_MODES = ("auto", "on", "off")
GPU_DEVICE_MODES = ("process", "all")

# Accepted ranges, in milliseconds. Below the minimum an interval spins a core or
# an export cannot finish; above the maximum the SDK's waits overflow or the
# value cannot be meant (a day between pushes, ten minutes to shut down).
EXPORT_INTERVAL_RANGE_MS = (100.0, 86_400_000.0)
EXPORT_TIMEOUT_RANGE_MS = (100.0, 86_400_000.0)
OTLP_TIMEOUT_RANGE_MS = (100.0, 86_400_000.0)
SHUTDOWN_TIMEOUT_RANGE_MS = (1.0, 600_000.0)
GPU_TIMEOUT_RANGE_MS = (1.0, 60_000.0)
FINAL_SCRAPE_TIMEOUT_RANGE_MS = (0.0, 600_000.0)
HISTORY_INTERVAL_RANGE_MS = (100.0, 86_400_000.0)
DEFAULT_HISTORY_MAX_BYTES = 64 * 1024 * 1024
MIN_HISTORY_MAX_BYTES = 1024 * 1024
INFERENCE_MAX_ADAPTERS_RANGE = (1, 1000)
MAX_RUN_NAME_LENGTH = 100
# A run id names the history file (with a rank suffix, under the 255-byte limit of a file name) and
# labels every series of the run.
MAX_RUN_ID_LENGTH = 128
MAX_RUN_ATTEMPT = 1_000_000  # attempts of one run (openlora.run.attempt)
RUN_ID_ACCEPTED = f"a run id of 1 to {MAX_RUN_ID_LENGTH} printable characters"
# Ranks are exported as integers: keep them far inside int64.
MAX_RANK = 2**31 - 1


def ms_range(bounds: tuple[float, float], scale: float = 1.0) -> str:
    """``100 to 86400000 (1 day)``: an accepted range as the docs' table and errors say it."""
    low, high = bounds
    human = {86_400_000: "1 day", 600_000: "10 min", 60_000: "1 min"}.get(int(high), f"{high / 1000:g} s")
    return f"{low * scale:.15g} to {high * scale:.15g} ({human})"


def ms_accepted(bounds: tuple[float, float]) -> str:
    return f"a number of milliseconds from {ms_range(bounds)}, in ASCII digits"


_MAX_SHOWN = 200


class ConfigError(ValueError):
    """A configuration value that openlora-otel cannot use.

    ``variable`` is the environment variable (or argument) at fault, ``value``
    what it held and ``accepted`` a short description of valid values.
    ``scheme://user:password@`` credentials and URL query values are redacted, in the message and in
    ``value`` alike; callers pass header values and scheme-less endpoints
    already redacted (only they know which part is secret).
    """

    def __init__(self, variable: str, value: object, accepted: str, detail: str = "") -> None:
        if isinstance(value, str):
            value = redact(value)
        self.variable = variable
        self.value = value
        self.accepted = accepted
        shown = repr(value)
        if len(shown) > _MAX_SHOWN:  # a 100k-character host should not make a 100k-character error
            shown = f"{shown[: _MAX_SHOWN // 2]}...{shown[-16:]} ({len(str(value))} characters)"
        message = f"{variable}={shown} is not valid: expected {accepted}"
        if detail:
            detail = redact(detail)  # before cutting, so a cut never splits a credential out of view
            message += f" ({detail if len(detail) <= _MAX_SHOWN else detail[:_MAX_SHOWN] + '...'})"
        super().__init__(redact(message))



_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
DIGITS_RE = re.compile(r"[0-9]+")
DECIMAL_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
HEADERS_ACCEPTED = (
    "headers as `key=value` pairs separated by commas, values percent-encoded; "
    "names are HTTP tokens, decoded values printable ASCII"
)
HOST_ACCEPTED = "a host name (at most 253 characters, labels of letters, digits, `-`, `_`) or an IP address"
HTTP_SCHEMES = ("http", "https")
ANY_SCHEME = ("", "http", "https")

PEAK_FLOPS_RANGE = (1.0, 1e21)
PEAK_FLOPS_ACCEPTED = "a number of FLOP/s from 1 to 1e21 in ASCII digits, with an optional exponent, such as 989e12"
# A decimal with an optional exponent, ASCII only: float() would also take "1_000", a sign,
# "nan", "infinity" and non-ASCII (fullwidth) digits.
EXPONENT_DECIMAL_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


GLOB_RE = re.compile(r"[A-Za-z0-9_.*?\[\]!-]+")
GLOBS_ACCEPTED = "glob patterns over metric names (letters, digits, `.`, `_`, `-`, `*`, `?`, `[...]`), e.g. `system.network.*`"


def brackets_closed(pattern: str) -> bool:
    """Every `[` of a glob opens a set that a later `]` closes (fnmatch's reading)."""
    index = 0
    while (index := pattern.find("[", index)) >= 0:
        start = index + 1
        start += pattern[start : start + 1] == "!"  # a negated set
        start += pattern[start : start + 1] == "]"  # a `]` first in the set is one of its characters
        close = pattern.find("]", start)
        if close < 0:
            return False
        index = close + 1
    return True


DIRECTORY_ACCEPTED = "a directory, or a path where one can be created"
FILE_SD_ACCEPTED = DIRECTORY_ACCEPTED


RUN_NAME_ACCEPTED = f"a name of 1 to {MAX_RUN_NAME_LENGTH} printable characters"


def run_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name.strip():
        return "it is empty"
    return _label_text_problem(name, MAX_RUN_NAME_LENGTH)


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` cannot be a run id, if it cannot."""
    if not isinstance(run_id, str):
        return f"it is a {type(run_id).__name__}, not a string"
    if not run_id:
        return "it is empty"
    return _label_text_problem(run_id, MAX_RUN_ID_LENGTH)


def _label_text_problem(text: str, max_length: int) -> str | None:
    """What rules a non-empty run name or id out as a label value: its length, a control character."""
    if len(text) > max_length:
        return f"it has {len(text)} characters"
    if not text.isprintable():
        return "it contains a control character"
    return None


HISTORY_MAX_BYTES_ACCEPTED = f"an integer number of bytes of at least {MIN_HISTORY_MAX_BYTES} (1 MiB)"


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot be sent with the metrics, or None: a lone surrogate, which is how Python reads a
    byte of the environment that is not UTF-8, fails every export and every scrape (UnicodeEncodeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid UTF-8 (a byte the environment could not decode)"
    return None


def choices_accepted(values: tuple[str, ...]) -> str:
    return "one of " + ", ".join(f"`{v}`" for v in values)


def in_range(value: object, bounds: tuple[float, float]) -> bool:
    """A real number (not a bool), finite, within ``bounds`` inclusive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return bounds[0] <= value <= bounds[1]


def in_seconds(bounds_ms: tuple[float, float]) -> tuple[float, float]:
    return bounds_ms[0] / 1000.0, bounds_ms[1] / 1000.0


def s_accepted(bounds_ms: tuple[float, float]) -> str:
    return f"a number of seconds from {ms_range(bounds_ms, scale=0.001)}"



def check_endpoint(
    variable: str, endpoint: str, *, schemes: tuple[str, ...], accepted: str = "", shown: str = ""
) -> SplitResult:
    """Parse ``endpoint`` or raise a ConfigError that shows it with credentials redacted (or as ``shown``).

    ``schemes`` containing ``""`` allows gRPC's scheme-less ``host:port``.
    """
    shown = shown or redact_url(endpoint)
    accepted = accepted or ("an http:// or https:// URL" + (", or host:port" if "" in schemes else ""))
    # urlsplit silently drops tabs and newlines, so what it parses is not what would be sent.
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in endpoint):
        raise ConfigError(variable, shown, accepted, "it contains a space or a control character")
    problem = utf8_problem(endpoint)
    if problem:
        raise ConfigError(variable, shown, accepted, problem)
    text = endpoint if "://" in endpoint or "" not in schemes else "//" + endpoint
    try:
        parts = urlsplit(text)
    except ValueError as exc:
        # Its message can quote the netloc, user info and all ("'alice:pw@[::1' does not appear to be an
        # IPv4 or IPv6 address"): say what is wrong without it.
        detail = (
            "its host or user info changes under NFKC normalization"
            if "NFKC" in str(exc)
            else "brackets that hold no IP address"
        )
        raise ConfigError(variable, shown, accepted, detail) from None
    if parts.scheme not in schemes:
        raise ConfigError(variable, shown, accepted)
    if "@" in parts.path + parts.query + parts.fragment:
        # Almost always a password with an unescaped "/", "?" or "#": the URL would then name another
        # host (or port) and carry the password's end as a path, query or fragment, in plain view.
        raise ConfigError(variable, shown, accepted, _UNESCAPED_USERINFO)
    hostport = parts.netloc.rpartition("@")[2]
    match = _HOSTPORT_RE.fullmatch(hostport)
    if not match or not match["host"]:
        raise ConfigError(variable, shown, accepted, "no host")
    host = match["host"]
    problem = _ip_problem(host[1:-1]) if host.startswith("[") else host_problem(host)
    if problem:
        raise ConfigError(variable, shown, accepted, problem)
    port = match["port"]
    if (
        port is not None
        and port != ""
        and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)
    ):
        raise ConfigError(variable, shown, "a URL whose port is an integer from 1 to 65535")
    return parts


def check_url(option: str, text: str, *, host_port: bool = False, hide_path: bool = False) -> SplitResult:
    """``text`` split, when ``option`` (``--url``, say) can use it: an http:// or https:// URL
    (``host_port``: or a bare ``HOST:PORT``) with a host, a port from 1 to 65535 if any, no space
    or control character, no unescaped ``@`` after the host, no byte that was not UTF-8 (it
    arrives as a lone surrogate, which no file or request can carry) and only ASCII after the host
    (percent-encoded). The checks of an OTLP endpoint (:func:`check_endpoint`) and those two; the
    check of every URL argument of the command line (``--url``, ``--prometheus``, ``--webhook-url``...).

    Else :class:`ConfigError`, one line naming ``option``, which shows
    ``text`` without its user info, query values and fragment (``hide_path``: nor its path, a
    webhook's token), so a usage error never prints a password.
    """
    shown = redact_url(text, path=hide_path)
    accepted = "an http:// or https:// URL" + (", or HOST:PORT" if host_port else "")
    schemes = ("", "http", "https") if host_port else ("http", "https")
    parts = check_endpoint(option, text, schemes=schemes, accepted=accepted, shown=shown)
    if not (parts.path + parts.query + parts.fragment).isascii():
        # http.client sends the request line as ASCII: it raised UnicodeEncodeError on the first request.
        raise ConfigError(option, shown, accepted, "percent-encode the non-ASCII characters after its host")
    return parts


_UNESCAPED_USERINFO = (
    "an `@` after the host: percent-encode `/`, `?`, `#` and `@` in a user name or password "
    "(`%2F`, `%3F`, `%23`, `%40`)"
)
# host, then an optional ":port" (empty allowed, as in "http://h:/"); IPv6 in brackets.
_HOSTPORT_RE = re.compile(r"(?P<host>\[[^\[\]]*\]|[^:\[\]]*)(?::(?P<port>[^:]*))?")
_LABEL_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?")


def _ip_problem(text: str) -> str | None:
    try:
        ipaddress.ip_address(unquote(text))  # a zone id may be percent-encoded: fe80::1%25eth0
    except ValueError:
        return "not a valid IP address in brackets"
    return None


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a usable host name or IP address, or None.

    Checked here because the resolver fails late and with the wrong error type:
    a label over 63 characters raises UnicodeError from the idna codec.
    """
    if not isinstance(host, str) or not host:
        return "empty"
    if len(host) > 253:
        return f"{len(host)} characters, at most 253"
    if any(ord(c) < 0x20 or ord(c) == 0x7F or c.isspace() for c in host):
        return "it contains a space or a control character"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return "not a valid host name"
    labels = ascii_host.removesuffix(".").split(".")
    if len(ascii_host) > 253 or not all(len(label) <= 63 and _LABEL_RE.fullmatch(label) for label in labels):
        return "not a valid host name"
    return None


def header_problem(name: str, value: str) -> str | None:
    """Why a header cannot be sent as is, or None; never quotes the value."""
    if not _TOKEN_RE.fullmatch(name):
        if name.isascii() and name.isprintable():
            return f"{name!r} is not a valid header name"
        return "a header name contains a control or non-ASCII character"
    # An encoded CR/LF would let a value inject headers; other control bytes
    # make requests or gRPC refuse every export and print the value while doing so.
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return f"the value of {name!r} contains a control character (such as CR, LF or NUL)"
    if not value.isascii():
        return f"the value of {name!r} is not ASCII (gRPC metadata and HTTP headers need ASCII)"
    return None


# -- TLS files ---------------------------------------------------------------------------------------
# The standard library is enough to check them, and no new dependency is needed: the `ssl` module
# wraps OpenSSL, the library requests hands these files to for http/protobuf, and gRPC's BoringSSL
# reads the same PEM blocks. A CA file OpenSSL cannot load into a trust store, or a key it cannot load
# with its certificate, fails every export later; here it fails setup, once, naming the variable.
CERTIFICATE_ACCEPTED = "a readable PEM file with at least one certificate"
CLIENT_KEY_ACCEPTED = "a readable PEM file with an unencrypted private key"
# A CA bundle is a few hundred KiB; a larger "PEM file" is a wrong path (a disk image, a log).
MAX_PEM_BYTES = 16 * 1024 * 1024
_CERTIFICATE_RE = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)
# PKCS#8 (`PRIVATE KEY`), PKCS#1 (`RSA PRIVATE KEY`), SEC1 (`EC PRIVATE KEY`), `ENCRYPTED PRIVATE KEY`.
_PRIVATE_KEY_RE = re.compile(
    r"-----BEGIN (?P<label>(?:[A-Z0-9]+ )*)PRIVATE KEY-----(?P<body>.*?)-----END (?P=label)PRIVATE KEY-----", re.S
)


def _read_pem(variable: str, path: str, accepted: str) -> str:
    """The text of the file at ``path``, or a ConfigError saying why it cannot be read."""
    if "\0" in path:
        raise ConfigError(variable, path, accepted, "it contains a NUL character")
    if not os.path.exists(path):
        raise ConfigError(variable, path, accepted, "no such file")
    # Before open(): opening a FIFO would block setup, and a directory or device is no PEM file.
    if not os.path.isfile(path):
        raise ConfigError(variable, path, accepted, "not a regular file")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PEM_BYTES + 1)
    except OSError as exc:  # mode 000 (for anyone but root), an I/O error
        raise ConfigError(variable, path, accepted, f"cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(variable, path, accepted, f"larger than {MAX_PEM_BYTES // (1024 * 1024)} MiB")
    # PEM is ASCII; a CA bundle's comments may not be (latin-1 reads any byte).
    return data.decode("latin-1")


def check_certificate_file(variable: str, path: str) -> None:
    """Refuse ``path`` unless it is a readable PEM file whose every certificate OpenSSL can load."""
    text = _read_pem(variable, path, CERTIFICATE_ACCEPTED)
    blocks = _CERTIFICATE_RE.findall(text)
    if not blocks:
        raise ConfigError(
            variable, path, CERTIFICATE_ACCEPTED, "it holds no `-----BEGIN CERTIFICATE-----` block"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for number, block in enumerate(blocks, 1):
        try:
            # Base64 to DER, then a real X.509 parse: a block of the right shape with junk inside fails.
            context.load_verify_locations(cadata=ssl.PEM_cert_to_DER_cert(block))
        except (ValueError, ssl.SSLError) as exc:
            reason = getattr(exc, "reason", None) or str(exc)
            raise ConfigError(
                variable, path, CERTIFICATE_ACCEPTED, f"certificate {number} is not a valid X.509 certificate ({reason})"
            ) from None


def check_private_key_file(variable: str, path: str) -> None:
    """Refuse ``path`` unless it is a readable PEM file with an unencrypted private key block."""
    text = _read_pem(variable, path, CLIENT_KEY_ACCEPTED)
    match = _PRIVATE_KEY_RE.search(text)
    if not match:
        raise ConfigError(variable, path, CLIENT_KEY_ACCEPTED, "it holds no `-----BEGIN ... PRIVATE KEY-----` block")
    body = match["body"]
    if match["label"] == "ENCRYPTED " or "Proc-Type: 4,ENCRYPTED" in body:
        # Neither requests nor gRPC takes a passphrase: OpenSSL would prompt on the terminal or fail.
        raise ConfigError(
            variable, path, CLIENT_KEY_ACCEPTED, "the key is encrypted; decrypt it with `openssl pkey -in KEY -out KEY.pem`"
        )
    try:
        binascii.a2b_base64("".join(line for line in body.splitlines() if ":" not in line).encode("latin-1"))
    except (binascii.Error, UnicodeEncodeError):
        raise ConfigError(variable, path, CLIENT_KEY_ACCEPTED, "the key block is not valid base64") from None


def check_client_key_pair(key_variable: str, key: str, certificate_variable: str, certificate: str) -> None:
    """Refuse a client key that OpenSSL cannot load with the client certificate (the usual case: they
    do not belong together)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # The password callback keeps OpenSSL from prompting on the terminal for an encrypted key.
        context.load_cert_chain(certificate, key, password=lambda: b"")
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(
            key_variable,
            key,
            f"the private key of the certificate in {certificate_variable} ({certificate})",
            f"OpenSSL cannot use them together: {reason}",
        ) from None

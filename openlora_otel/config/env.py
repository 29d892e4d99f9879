"""Typed readers over an environment mapping: each reads one variable's text, returns the value (or
None when the variable is unset or empty) and raises a :class:`~.checks.ConfigError` naming the
variable otherwise. :data:`~.variables.VARIABLES` says which reader reads which variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar
from urllib.parse import unquote

from openlora_otel.config.checks import (
    DECIMAL_RE,
    DIGITS_RE,
    DIRECTORY_ACCEPTED,
    EXPONENT_DECIMAL_RE,
    EXPORTERS,
    GLOB_RE,
    GLOBS_ACCEPTED,
    HEADERS_ACCEPTED,
    HOST_ACCEPTED,
    MAX_RUN_ATTEMPT,
    PEAK_FLOPS_ACCEPTED,
    PEAK_FLOPS_RANGE,
    RUN_NAME_ACCEPTED,
    ConfigError,
    brackets_closed,
    choices_accepted,
    header_problem,
    host_problem,
    in_range,
    ms_accepted,
    run_name_problem,
    utf8_problem,
)
from openlora_otel.redaction import secret_forms, url_secrets

_T = TypeVar("_T")


class Env:
    """Typed readers over an environment mapping; each error names its variable."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def get(self, name: str) -> str:
        return self._environ.get(name, "").strip()

    def text(self, name: str) -> str:
        """Text sent with the metrics (the service name): refused unless it is valid UTF-8."""
        raw = self.get(name)
        problem = utf8_problem(raw)
        if problem:
            raise ConfigError(name, raw, "text in UTF-8", problem)
        return raw

    def __contains__(self, name: str) -> bool:
        return name in self._environ

    def first(self, *names: str) -> tuple[str, str]:
        """The first of ``names`` that is set and non-empty, as (name, value); else (last name, "")."""
        for name in names:
            value = self.get(name)
            if value:
                return name, value
        return names[-1], ""

    def winner(self, read: Callable[[str], _T], *names: str) -> tuple[str, _T | None]:
        """``read`` every one of ``names`` (so each set one is validated); the first set one wins.

        The per-signal variable overrides the base one, but the base one is still
        checked: the docs promise that every variable is validated.
        """
        results = [(name, read(name)) for name in names if self.get(name)]
        if results:
            return results[0]
        return names[-1], None

    def boolean(self, name: str, *names: str, default: bool = False) -> bool:
        _, value = self.winner(self._boolean, name, *names)
        return default if value is None else value

    def _boolean(self, name: str) -> bool:
        raw = self.get(name)
        lowered = raw.lower()
        if lowered in ("", "false"):
            return False
        if lowered == "true":
            return True
        # The spec reads anything but "true" as false; we refuse instead, because
        # OTEL_SDK_DISABLED=1 silently meaning "enabled" is the worse surprise.
        raise ConfigError(name, raw, "`true` or `false` (case-insensitive)")

    def integer(self, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        raw = self.get(name)
        if not raw:
            return None
        accepted = "an integer"
        if minimum is not None and maximum is not None:
            accepted = f"an integer from {minimum} to {maximum}"
        elif minimum is not None:
            accepted = f"an integer >= {minimum}"
        # int() also takes "1_000", "+5" and non-ASCII digits (fullwidth ones): refuse
        # them, so the value means what it looks like to every other tool.
        if not DIGITS_RE.fullmatch(raw) or len(raw) > 20:
            raise ConfigError(name, raw, accepted + ", in ASCII digits")
        value = int(raw, 10)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ConfigError(name, raw, accepted)
        return value

    def milliseconds(self, *names: str, bounds: tuple[float, float] = (1.0, 86_400_000.0)) -> float | None:
        """A duration in milliseconds within ``bounds`` (integers per the spec; decimals tolerated).

        Only plain ASCII decimals: float() would also take "1e308", "nan",
        "infinity", "1_000" and non-ASCII digits, which either overflow a wait
        later or do not mean what they look like.
        """

        def read(name: str) -> float:
            raw = self.get(name)
            accepted = ms_accepted(bounds)
            if not DECIMAL_RE.fullmatch(raw) or len(raw) > 32:
                raise ConfigError(name, raw, accepted)
            value = float(raw)
            if not bounds[0] <= value <= bounds[1]:
                raise ConfigError(name, raw, accepted)
            return value

        return self.winner(read, *names)[1]

    def choice(self, name: str, choices: tuple[str, ...], *names: str) -> str | None:
        def read(variable: str) -> str:
            raw = self.get(variable)
            lowered = raw.lower()
            if lowered not in choices:
                raise ConfigError(variable, raw, choices_accepted(choices))
            return lowered

        return self.winner(read, name, *names)[1]

    def exporters(self, name: str) -> tuple[str, ...]:
        """A comma list of exporter names, repeats dropped (the variable is set)."""
        raw = self.get(name)
        names: list[str] = []
        for part in raw.split(","):
            item = part.strip().lower()
            if item not in EXPORTERS:
                detail = f"unknown exporter {part.strip()!r}"
                raise ConfigError(
                    name, raw, "a comma list of " + ", ".join(f"`{e}`" for e in EXPORTERS), detail
                )
            if item not in names:
                names.append(item)
        if "none" in names and len(names) > 1:
            raise ConfigError(name, raw, "`none` alone, or a list without `none`")
        return tuple(names)

    def key_values(self, *names: str, what: str) -> list[tuple[str, str]]:
        """Parse the W3C-baggage-like ``k=v,k2=v2`` list used for headers and resource attributes."""
        return self.winner(lambda name: self._key_values(name, what), *names)[1] or []

    def _key_values(self, variable: str, what: str) -> list[tuple[str, str]]:
        raw = self.get(variable)
        pairs: list[tuple[str, str]] = []
        headers = what == "headers"
        accepted = (
            HEADERS_ACCEPTED
            if headers
            else f"{what} as `key=value` pairs separated by commas, values percent-encoded"
        )
        # Header values are usually credentials: never echo them in an error.
        shown = _redact_key_values(raw) if headers else raw
        for item in raw.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                entry = "an entry" if headers else f"entry {item.strip()!r}"
                raise ConfigError(variable, shown, accepted, f"{entry} has no `key=`")
            try:
                decoded = unquote(value.strip(), errors="strict")
            except UnicodeDecodeError:
                raise ConfigError(
                    variable, shown, accepted, f"value of {key!r} is not valid percent-encoding"
                ) from None
            name = unquote(key)
            problem = utf8_problem(name + decoded)
            if problem:
                # Sent with every export: a lone surrogate would fail each one.
                entry = "an entry" if headers else f"entry {item.strip()!r}"
                raise ConfigError(variable, shown, accepted, f"{entry}: {problem}")
            if headers:
                # HTTP drops leading/trailing spaces of a field value; requests refuses them.
                decoded = decoded.strip(" ")
                problem = header_problem(name, decoded)
                if problem:
                    raise ConfigError(variable, shown, accepted, problem)
            pairs.append((name, decoded))
        return pairs


def secrets_in_env(environ: Mapping[str, str]) -> frozenset[str]:
    """Every credential in ``environ`` (OTLP header values, endpoint user info, query values and
    fragment), for redaction.

    Read leniently, without validation: it must also work on the environment
    that just failed to parse, so that the error about it can be scrubbed.
    """
    found: set[str] = set()
    for name in ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        for item in environ.get(name, "").split(","):
            key, sep, value = item.partition("=")
            raw = (value if sep else key).strip()  # an entry without "=" may be a pasted token
            found |= secret_forms(raw) | secret_forms(unquote(raw).strip())
    for name in ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        found |= url_secrets(environ.get(name, "").strip())
    return frozenset(found)


def _redact_key_values(raw: str) -> str:
    return ",".join(
        f"{item.partition('=')[0].strip()}=<redacted>" if "=" in item else "<redacted>"
        for item in raw.split(",")
    )


# -- readers of one variable: (env, name) -> value, or None when unset or empty ----------------------

Reader = Callable[[Env, str], object]


def boolean(env: Env, name: str) -> bool | None:
    """``true`` or ``false``, any case."""
    return env.winner(env._boolean, name)[1]


def milliseconds_within(bounds: tuple[float, float]) -> Reader:
    """A duration in milliseconds within ``bounds``."""
    return lambda env, name: env.milliseconds(name, bounds=bounds)


def integer_within(minimum: int, maximum: int | None = None) -> Reader:
    """An integer of ASCII digits from ``minimum`` (to ``maximum``)."""
    return lambda env, name: env.integer(name, minimum=minimum, maximum=maximum)


def one_of(choices: tuple[str, ...]) -> Reader:
    """One of ``choices``, any case, returned in lower case."""
    return lambda env, name: env.choice(name, choices)


def exporters(env: Env, name: str) -> tuple[str, ...] | None:
    """A comma list of exporter names (repeats dropped), or ``none`` alone."""
    return env.exporters(name) if env.get(name) else None


def host(env: Env, name: str) -> str | None:
    """A host name or an IP address to bind to."""
    value = env.get(name)
    if not value:
        return None
    problem = host_problem(value)
    if problem:
        raise ConfigError(name, value, HOST_ACCEPTED, problem)
    return value


def present_text(env: Env, name: str) -> str | None:
    """The text of a variable whose empty value means something (``CUDA_VISIBLE_DEVICES=`` hides every GPU);
    None only when it is not set at all."""
    return env.get(name) if name in env else None


def peak_flops(env: Env, name: str) -> float | None:
    """A plain positive decimal, the one number here with an exponent (``989e12``)."""
    raw = env.get(name)
    if not raw:
        return None
    if not EXPONENT_DECIMAL_RE.fullmatch(raw) or len(raw) > 32:
        raise ConfigError(name, raw, PEAK_FLOPS_ACCEPTED)
    number = float(raw)
    if not in_range(number, PEAK_FLOPS_RANGE):
        raise ConfigError(name, raw, PEAK_FLOPS_ACCEPTED)
    return number


def metric_globs(env: Env, name: str) -> tuple[str, ...] | None:
    """Glob patterns over metric names, split as opentelemetry-instrumentation-system-metrics split them
    (commas, blanks dropped)."""
    raw = env.get(name)
    if not raw:
        return None
    patterns = tuple(part.strip() for part in raw.split(",") if part.strip())
    for pattern in patterns:
        # fnmatch reads a `[` without its `]` as a literal character, which no metric name has.
        if not GLOB_RE.fullmatch(pattern) or not brackets_closed(pattern):
            raise ConfigError(name, raw, "a comma list of " + GLOBS_ACCEPTED, f"{pattern!r} can match no metric name")
    return patterns


def directory(env: Env, name: str) -> str | None:
    """A path that is (or can become) a directory, made absolute."""
    value = env.get(name)
    if not value:
        return None
    if "\0" in value:
        raise ConfigError(name, value, DIRECTORY_ACCEPTED, "it contains a NUL character")
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(name, value, DIRECTORY_ACCEPTED, "it is not a directory")
    return path


def run_name(env: Env, name: str) -> str | None:
    """A run name: 1 to 100 printable characters, blanks around it dropped."""
    value = env.get(name)
    if not value:
        return None
    problem = run_name_problem(value)
    if problem:
        raise ConfigError(name, value, RUN_NAME_ACCEPTED, problem)
    return value.strip()


def run_attempt(env: Env, name: str) -> int | None:
    """The run's attempt: ``OPENLORA_RUN_ATTEMPT``, else a launcher's restart count plus one
    (torchrun's ``TORCHELASTIC_RESTART_COUNT``, Slurm's ``SLURM_RESTART_COUNT``; both under ``srun
    torchrun``, counted with ``TORCHELASTIC_MAX_RESTARTS``); None when none is set."""
    attempt = env.integer(name, minimum=1, maximum=MAX_RUN_ATTEMPT)
    if attempt is not None:
        return attempt
    torchrun = env.integer("TORCHELASTIC_RESTART_COUNT", minimum=0, maximum=MAX_RUN_ATTEMPT - 1)
    slurm = env.integer("SLURM_RESTART_COUNT", minimum=0, maximum=MAX_RUN_ATTEMPT - 1)
    if torchrun is not None and slurm is not None:
        # torchrun inside a Slurm job: a requeue starts torchrun's count at 0 again, so the attempts of
        # each requeue come after all those torchrun may have made before it.
        most = env.integer("TORCHELASTIC_MAX_RESTARTS", minimum=0, maximum=MAX_RUN_ATTEMPT - 1) or 0
        return min(slurm * (most + 1) + torchrun + 1, MAX_RUN_ATTEMPT)
    if torchrun is not None:
        return torchrun + 1
    if slurm is not None:
        return slurm + 1
    return None

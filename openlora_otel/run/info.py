"""The run's name and hyperparameters, as one info-style series.

The Resource is fixed when the MeterProvider is built, before a Trainer knows its learning rate,
so they travel in one gauge per process, ``openlora.run.info`` (value 1), joined on
``(job, instance)`` like ``target_info``. Bounded: at most :data:`MAX_HYPERPARAMETERS` keys of
:data:`MAX_KEY_LENGTH` characters, values of :data:`MAX_VALUE_LENGTH`. See docs/concepts/run-identity.md.
"""

from __future__ import annotations

import enum
import logging
import math
import re
import threading
from collections.abc import Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel.config import (
    MAX_RUN_NAME_LENGTH,
    RUN_NAME_ACCEPTED,
    ConfigError,
    TelemetryConfig,
    run_name_problem,
)
from openlora_otel.names import RUN_METRICS, RUN_NAME_ATTRIBUTE
from openlora_otel.run.identity import decided_run_id

__all__ = [
    "HPARAM_PREFIX",
    "MAX_HYPERPARAMETERS",
    "MAX_KEY_LENGTH",
    "MAX_VALUE_LENGTH",
    "RunInfo",
    "hyperparameter_key",
    "hyperparameter_value",
    "hyperparameters_from",
    "normalize_hyperparameters",
]

_logger = logging.getLogger(__name__)

HPARAM_PREFIX = "openlora.hparam."
MAX_HYPERPARAMETERS = 32
MAX_KEY_LENGTH = 40
MAX_VALUE_LENGTH = 100

_NOT_KEY = re.compile(r"[^a-z0-9_]+")


def hyperparameter_key(key: object) -> str:
    """``key`` as a hyperparameter key: lowercase ``[a-z0-9_]``, at most :data:`MAX_KEY_LENGTH` characters.

    Anything else becomes ``_`` (``LoRA r`` -> ``lora_r``), so the Prometheus label
    ``openlora_hparam_<key>`` is the key itself. Empty when nothing is left.
    """
    text = _NOT_KEY.sub("_", str(key).strip().lower()).strip("_")
    return text[:MAX_KEY_LENGTH].rstrip("_")


_SURROGATE = re.compile("[\ud800-\udfff]")


def hyperparameter_value(value: object) -> str | None:
    """``value`` as short text: numbers compact (``0.0002``, ``8``), booleans ``true``/``false``,
    sequences and sets joined with ``,`` (sets sorted); None for None. At most
    :data:`MAX_VALUE_LENGTH` characters (longer text ends in ``…``)."""
    if value is None:
        return None
    if isinstance(value, enum.Enum):  # transformers' SchedulerType, OptimizerNames, ...
        value = value.value
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        text = _number(value)
    elif isinstance(value, str):
        text = value
    elif isinstance(value, (set, frozenset)):
        text = ",".join(sorted(str(hyperparameter_value(v)) for v in value))
    elif isinstance(value, (list, tuple)):
        text = ",".join(str(hyperparameter_value(v)) for v in value)
    else:
        text = str(value)
    # One line of printable text: a label value a person reads in a legend.
    text = " ".join(text.split())
    # A lone surrogate (a byte of the environment that is not UTF-8, as in PL_GLOBAL_SEED) would fail
    # every export and scrape of the run info: it is sent as U+FFFD.
    text = _SURROGATE.sub("\ufffd", text)
    if not text:
        return None  # an empty label value is no label at all in Prometheus
    if len(text) > MAX_VALUE_LENGTH:
        text = text[: MAX_VALUE_LENGTH - 1] + "…"
    return text


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"


def normalize_hyperparameters(
    values: Mapping[str, object] | None, *, what: str = "hyperparameters"
) -> dict[str, str]:
    """Keys and values as :func:`hyperparameter_key` / :func:`hyperparameter_value` make them.

    None values and keys that normalize to nothing are dropped; of two keys that
    normalize alike the first wins. Past :data:`MAX_HYPERPARAMETERS` keys the rest
    are dropped with one warning that says how many.
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise TypeError(f"{what} must be a mapping of names to values, got {type(values).__name__}")
    out: dict[str, str] = {}
    dropped = 0
    for raw_key, raw_value in values.items():
        key = hyperparameter_key(raw_key)
        value = hyperparameter_value(raw_value)
        if not key or value is None or key in out:
            continue
        if len(out) >= MAX_HYPERPARAMETERS:
            dropped += 1
            continue
        out[key] = value
    if dropped:
        _logger.warning(
            "openlora-otel: %d %s beyond the first %d were left out of openlora.run.info",
            dropped,
            what,
            MAX_HYPERPARAMETERS,
        )
    return out


def hyperparameters_from(attributes: Mapping[str, object], prefix: str = HPARAM_PREFIX) -> dict[str, str]:
    """The hyperparameters in a run info's attributes (``prefix`` ``openlora_hparam_`` for Prometheus labels)."""
    return {k[len(prefix) :]: str(v) for k, v in attributes.items() if k.startswith(prefix)}


def _check_name(name: object, what: str) -> str:
    problem = run_name_problem(name)
    if problem:
        raise ConfigError(what, name, RUN_NAME_ACCEPTED, problem)
    return str(name).strip()


def _one_line(name: object) -> str | None:
    """What an integration found as a name, made one line of at most the allowed length; None if unusable."""
    if not isinstance(name, str):
        return None
    text = " ".join(name.split())[:MAX_RUN_NAME_LENGTH].strip()
    return text if text and run_name_problem(text) is None else None


class RunInfo:
    """The ``openlora.run.info`` series of one :class:`~openlora_otel.telemetry.Telemetry`.

    The run id and the name are the configuration's (``setup_telemetry(run_name=...)``); that name
    and values given to :meth:`update` are the user's and win; :meth:`update` with
    ``explicit=False`` (what the callbacks call) only fills what the user left out.
    """

    def __init__(self, meter: Meter, config: TelemetryConfig) -> None:
        name = config.run_name
        self._run_id = decided_run_id(config)
        self._lock = threading.Lock()
        self._name = _check_name(name, "run_name") if name is not None else None
        self._name_explicit = name is not None
        self._explicit: dict[str, str] = {}
        self._filled: dict[str, str] = {}
        self._attributes = self._build()
        spec = RUN_METRICS[0]
        meter.create_observable_gauge(
            spec.name, callbacks=[self._observe], unit=spec.unit, description=spec.description
        )

    @property
    def name(self) -> str:
        """The run's name: the one given, else the run id."""
        return self._name or self._run_id

    @property
    def hyperparameters(self) -> dict[str, str]:
        """The hyperparameters as they are exported (normalized keys, text values)."""
        return hyperparameters_from(self._attributes)

    def update(
        self,
        *,
        name: str | None = None,
        hyperparameters: Mapping[str, object] | None = None,
        explicit: bool = True,
    ) -> None:
        """Set the name and add hyperparameters; the next collection exports them.

        ``explicit=True`` (the default, for application code) overrides earlier
        values, and a name that is not one line of at most 100 printable characters
        raises ``ConfigError``; ``explicit=False`` (for integrations) never overrides a
        value the application gave, and makes what a framework hands it (a tab, a
        pasted newline) one line rather than refuse it.
        """
        if name is None:
            checked = None
        elif explicit:
            checked = _check_name(name, "name")
        else:
            checked = _one_line(name)
        values = normalize_hyperparameters(hyperparameters)
        with self._lock:
            if checked is not None and (explicit or not self._name_explicit):
                self._name = checked
                self._name_explicit = self._name_explicit or explicit
            if explicit:
                self._explicit.update(values)
            else:
                self._filled.update(values)
            self._attributes = self._build()

    def _build(self) -> dict[str, str]:
        merged = {**self._filled, **self._explicit}
        # The user's keys first, so the cap never drops one of theirs for an integration's.
        ordered = list(self._explicit) + [k for k in self._filled if k not in self._explicit]
        attributes = {RUN_NAME_ATTRIBUTE: self._name or self._run_id}
        for key in ordered[:MAX_HYPERPARAMETERS]:
            attributes[HPARAM_PREFIX + key] = merged[key]
        return attributes

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1, self._attributes)]

    def __repr__(self) -> str:
        return f"RunInfo(name={self.name!r}, hyperparameters={self.hyperparameters!r})"

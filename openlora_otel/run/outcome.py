"""How a run ended, as one info-style series: ``openlora.run.outcome``.

``running`` from the start; when ``Telemetry.shutdown()`` begins the outcome is decided once
(``terminated``, ``stopped_by_guard``, ``failed``, else ``finished``) and the final collection
carries it. ``vanished`` is never reported: the rules derive it from a ``running`` series that
is gone. Read once per collection, never on the step path. See docs/concepts/lifecycle.md.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel.config import TelemetryConfig
from openlora_otel.names import (
    ATTR_ERROR_TYPE,
    ATTR_RUN_OUTCOME,
    ATTR_RUN_SIGNAL,
    RUN_ATTEMPT_ATTRIBUTE,
    RUN_ID_ATTRIBUTE,
    RUN_METRICS,
)
from openlora_otel.run.identity import decided_run_id

__all__ = ["MAX_ERROR_TYPE_LENGTH", "RunOutcome", "error_type"]

MAX_ERROR_TYPE_LENGTH = 100

_SPEC = next(spec for spec in RUN_METRICS if spec.name == "openlora.run.outcome")


def error_type(exc: BaseException | type[BaseException]) -> str:
    """The exception's type as ``error.type`` has it: ``ValueError`` for a builtin, else
    ``module.QualifiedName`` (``torch.OutOfMemoryError``); at most 100 characters, never the message."""
    kind = exc if isinstance(exc, type) else type(exc)
    module = getattr(kind, "__module__", "") or ""
    name = getattr(kind, "__qualname__", None) or kind.__name__
    text = name if module in ("builtins", "__main__", "") else f"{module}.{name}"
    return text[:MAX_ERROR_TYPE_LENGTH]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunOutcome:
    """The ``openlora.run.outcome`` series of one :class:`~openlora_otel.telemetry.Telemetry`.

    The run id and attempt are the configuration's. What is noted along the way (a signal, an
    exception) only counts once :meth:`decide` runs at the start of the shutdown; the first decision stays.
    """

    def __init__(self, meter: Meter, config: TelemetryConfig) -> None:
        run_id, attempt = decided_run_id(config), config.run_attempt
        self._run_id = run_id
        self._attempt = attempt
        self._lock = threading.Lock()
        self._signal: str | None = None
        self._error: str | None = None
        # The attempt too: each attempt of a restarted run ends on its own (one vanished, the next finished).
        self._attributes: dict[str, str | int] = {
            RUN_ID_ATTRIBUTE: run_id,
            RUN_ATTEMPT_ATTRIBUTE: attempt,
            ATTR_RUN_OUTCOME: "running",
        }
        self._decided = False
        meter.create_observable_gauge(
            _SPEC.name, callbacks=[self._observe], unit=_SPEC.unit, description=_SPEC.description
        )

    @property
    def outcome(self) -> str:
        """``running`` until :meth:`decide`, then the run's outcome."""
        return self._attributes[ATTR_RUN_OUTCOME]

    @property
    def attributes(self) -> dict[str, str | int]:
        return dict(self._attributes)

    def note_signal(self, signum: int) -> None:
        """A signal is ending the run (the first one noted is kept)."""
        with self._lock:
            if self._signal is None:
                self._signal = _signal_name(signum)

    def note_exception(self, exc: BaseException | type[BaseException] | None) -> None:
        """An exception is ending the run. ``KeyboardInterrupt`` is SIGINT; ``SystemExit`` (the
        program chose to exit) and ``GeneratorExit`` are no failure. The first one noted is kept."""
        if exc is None:
            return
        kind = exc if isinstance(exc, type) else type(exc)
        if issubclass(kind, KeyboardInterrupt):
            self.note_signal(signal.SIGINT)
            return
        if issubclass(kind, (SystemExit, GeneratorExit)):
            return
        with self._lock:
            if self._error is None:
                self._error = error_type(kind)

    def forget_exception(self) -> None:
        """A noted exception was dealt with (a Lightning fit that raised, then a new fit began)."""
        with self._lock:
            self._error = None

    def decide(self, *, guard_tripped: bool = False) -> str:
        """Settle the outcome (once): a signal, else a latched guard trip, else an exception, else finished."""
        with self._lock:
            if self._decided:
                return self.outcome
            self._decided = True
            attributes: dict[str, str | int] = {RUN_ID_ATTRIBUTE: self._run_id, RUN_ATTEMPT_ATTRIBUTE: self._attempt}
            if self._signal is not None:
                attributes[ATTR_RUN_OUTCOME] = "terminated"
                attributes[ATTR_RUN_SIGNAL] = self._signal
            elif guard_tripped:
                attributes[ATTR_RUN_OUTCOME] = "stopped_by_guard"
            elif self._error is not None:
                attributes[ATTR_RUN_OUTCOME] = "failed"
                attributes[ATTR_ERROR_TYPE] = self._error
            else:
                attributes[ATTR_RUN_OUTCOME] = "finished"
            self._attributes = attributes
            return attributes[ATTR_RUN_OUTCOME]

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1, self._attributes)]

    def __repr__(self) -> str:
        return f"RunOutcome({self.outcome!r})"

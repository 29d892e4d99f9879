"""Per-request serving metrics under the OpenTelemetry GenAI conventions, with the adapter as its own attribute.

One :class:`InferenceMetrics` per process (``telemetry.inference``): a server wraps each request in
``inference.request(...)`` and each adapter load in ``inference.loading_adapter(...)``. A request's
end costs one lock and a bisect (the SDK takes a window per collection, :mod:`openlora_otel.window_histograms`),
and the attributes are bounded per process (adapter names, model names, ``error.type`` values).
See docs/how-to/serving.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.inference.histograms import PROVIDER as PROVIDER  # where it was defined before
from openlora_otel.inference.histograms import RequestHistograms, SeriesKey, inference_views
from openlora_otel.names import (
    ATTR_ADAPTER,
    ATTR_BASE_FINGERPRINT,
    ATTR_BASE_MODEL,
    ATTR_ERROR_TYPE,
    ATTR_TRAINING_EVAL_LOSS,
    ATTR_TRAINING_RUN_ID,
    ATTR_TRAINING_RUN_NAME,
)

__all__ = [
    "ADAPTER_BASE",
    "ADAPTER_OTHER",
    "DEFAULT_MAX_ADAPTERS",
    "OTHER",
    "AdapterOrigin",
    "InferenceMetrics",
    "InferenceRequest",
    "inference_views",
]

_logger = logging.getLogger(__name__)

ADAPTER_BASE = "base"  # requests served by the base model, without an adapter
ADAPTER_OTHER = "other"  # adapter names past the cap
OTHER = "_OTHER"  # model names and error types past their caps (the conventions' fallback value)
DEFAULT_MAX_ADAPTERS = 32
MAX_MODELS = 8
MAX_ERROR_TYPES = 16  # of the server's error types: a client's (CLIENT_ERROR_PATTERN) are not capped
_MAX_LABEL_CHARS = 100
DEFAULT_OPERATION = "text_completion"

_SPECS = {spec.name: spec for spec in names.INFERENCE_METRICS}

F = TypeVar("F", bound=Callable[..., Any])
# A request's series but for error.type (see histograms.SeriesKey).
_Key = tuple[str, str, str, str]


@dataclass(frozen=True)
class AdapterOrigin:
    """Where a served adapter came from, for its ``openlora.inference.adapter.info`` series.

    Every field is optional: give what is known (an adapter from elsewhere may have no training run).
    ``run_id`` and ``run_name`` are its training run's ``openlora.run.id`` and ``openlora.run.name``
    (exported as ``openlora.training.run.id`` / ``.name``); ``base_model`` the base it runs on,
    ``base_fingerprint`` an identifier of that base's weights (the demo's: 16 hex digits of the
    SHA-256 of its safetensors); ``final_eval_loss`` the training's last evaluation loss, exported as
    text with 6 significant digits (``NaN`` for a diverged evaluation). Strings are cut to 100 characters.
    """

    run_id: str | None = None
    run_name: str | None = None
    base_model: str | None = None
    base_fingerprint: str | None = None
    final_eval_loss: float | None = None

    def attributes(self) -> dict[str, str]:
        """The info series' attributes besides the adapter's name: only those known."""
        attributes = {}
        for key, value in (
            (ATTR_TRAINING_RUN_ID, self.run_id),
            (ATTR_TRAINING_RUN_NAME, self.run_name),
            (ATTR_BASE_MODEL, self.base_model),
            (ATTR_BASE_FINGERPRINT, self.base_fingerprint),
        ):
            if value is not None and str(value):
                attributes[key] = str(value)[:_MAX_LABEL_CHARS]
        loss = _loss_text(self.final_eval_loss)
        if loss is not None:
            attributes[ATTR_TRAINING_EVAL_LOSS] = loss
        return attributes


def _loss_text(value: Any) -> str | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.6g}"


class InferenceRequest:
    """One request being served: made by :meth:`InferenceMetrics.request`; timing starts there.

    Use it as a context manager, or call :meth:`end` yourself (idempotent), for
    example in a streaming generator's ``finally``. Every method is cheap and
    never raises for a value it cannot use (it logs once and ignores it).
    """

    __slots__ = ("_error", "_first", "_input", "_key", "_metrics", "_output", "_started", "_t0", "ended")

    def __init__(self, metrics: InferenceMetrics, key: _Key, queued: bool) -> None:
        self._metrics = metrics
        self._key = key
        self._t0 = time.perf_counter()
        self._started = not queued
        self._first: float | None = None
        self._input: int | None = None
        self._output: int | None = None
        self._error: str | None = None
        self.ended = False

    def start(self) -> None:
        """The request left the queue and is being generated (``queued=True`` requests only; else a no-op)."""
        if not self._started and not self.ended:
            self._started = True
            self._metrics._move_to_running(self._key)

    def first_token(self, at: float | None = None) -> None:
        """The first output token is ready (the first call counts). Implies :meth:`start`. ``at``: when it
        was, a ``time.perf_counter()`` value, if not now (a middleware that reads the answer after
        sending it). An ``at`` that is not a number is ignored with one warning, as bad token counts are:
        the request goes on without a time to first token (a non-finite one is left out the same way)."""
        if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float))):
            # Checked here: taken as it is, it raised TypeError in end(), out of the app's `with` exit.
            self._metrics._warn_once("first-token-at", f"first_token(at=...) must be a time.perf_counter() reading, got {at!r}: ignored")
            self.start()
            return
        if self._first is None and not self.ended:
            self._first = time.perf_counter() if at is None else at
            self.start()

    def tokens(self, input: int | None = None, output: int | None = None) -> None:
        """Token counts of the request: prompt (``input``) and generated (``output``); the last call wins."""
        if input is not None:
            self._input = self._metrics._count(input, "input")
        if output is not None:
            self._output = self._metrics._count(output, "output")

    @property
    def input_tokens(self) -> int | None:
        """The prompt's tokens as last given to :meth:`tokens` (``None``: not given)."""
        return self._input

    @property
    def output_tokens(self) -> int | None:
        """The generated tokens as last given to :meth:`tokens` (``None``: not given)."""
        return self._output

    def fail(self, error_type: str | None) -> None:
        """Mark the request failed with ``error_type`` (``None`` clears it: the request succeeded after all)."""
        self._error = None if error_type is None else self._metrics._error_value(error_type)

    def end(self, error: str | None = None) -> None:
        """Finish the request now (later calls do nothing); ``error`` as for :meth:`fail`."""
        if self.ended:
            return
        self.ended = True
        if error is not None:
            self.fail(error)
        self._metrics._finish(self, time.perf_counter())

    def __enter__(self) -> InferenceRequest:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None and self._error is None:
            self.fail(exception_error_type(kind))
        self.end()


class InferenceMetrics:
    """Serving metrics on ``meter`` (``names.INFERENCE_METRICS``); one per process, thread-safe.

    ``window_histogram``: set it only when the meter's provider has
    :func:`inference_views` (``setup_telemetry`` does both); then a request's end
    costs a lock and a few bisects, and each series reaches the SDK once per
    collection. ``model`` is the served (base) model's name: ``gen_ai.response.model``, and
    ``gen_ai.request.model`` of requests to the base; ``max_adapters`` caps distinct adapter names;
    ``exporting_pid``: the process whose readers export (default this one), where recording from
    any other (a forked child) warns once that it is lost.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        model: str = "",
        operation: str = DEFAULT_OPERATION,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        window_histogram: bool = False,
        exponential_histograms: bool = False,
        exporting_pid: int | None = None,
    ) -> None:
        if isinstance(max_adapters, bool) or not isinstance(max_adapters, int) or max_adapters < 1:
            raise ValueError(f"max_adapters must be an integer >= 1, got {max_adapters!r}")
        self._lock = threading.Lock()
        self._max_adapters = max_adapters
        self._adapters: dict[str, str] = {}  # name -> recorded value (itself, or "other" past the cap)
        self._models: dict[str, str] = {}
        self._errors: dict[str, str] = {}
        self._operations: dict[str, str] = {}
        self._default_model = ""
        self._default_operation = DEFAULT_OPERATION
        self._active: dict[_Key, list[int]] = {}  # key -> [running, waiting]
        self._loaded: dict[str, int] = {}  # adapter value -> 1 loaded / 0 unloaded
        self._loaded_past_cap: set[str] = set()  # loaded names recorded as "other": it reads 1 while any is
        self._info: dict[str, dict[str, str]] = {}  # loaded adapter value (not "other") -> its info attributes
        self._warned: set[str] = set()
        # The process whose readers export what this records (the Telemetry's, which may have built this
        # later, in a forked child): a request recorded in another process is lost (see request()).
        self._pid = os.getpid() if exporting_pid is None else exporting_pid
        self.set_model(model, operation=operation)
        # The histograms and each series' pending window (used under self._lock).
        self._histograms = RequestHistograms(
            meter, window_histogram=window_histogram, warn=self._warn_once, exponential=exponential_histograms
        )
        # The first callback of a collection hands the pending windows to the histograms above:
        # the SDK runs observable callbacks before it reads the synchronous instruments.
        for name, callback in (
            ("openlora.inference.requests.running", self._observe_running),
            ("openlora.inference.requests.waiting", self._observe_waiting),
        ):
            spec = _SPECS[name]
            meter.create_observable_up_down_counter(
                spec.name, callbacks=[callback], unit=spec.unit, description=spec.description
            )
        for name, callback in (
            ("openlora.inference.adapter.loaded", self._observe_loaded),
            ("openlora.inference.adapter.info", self._observe_info),
        ):
            spec = _SPECS[name]
            meter.create_observable_gauge(
                spec.name, callbacks=[callback], unit=spec.unit, description=spec.description
            )

    # -- configuration --------------------------------------------------------------
    @property
    def window_histogram(self) -> bool:
        """Whether a series' values reach the SDK as one window per collection (the views are in place)."""
        with self._lock:
            return self._histograms.merging

    def set_model(self, model: str, *, operation: str | None = None) -> None:
        """Set the served model: ``gen_ai.response.model`` of later requests, and their ``gen_ai.request.model``
        when they ask for the base (an adapter's requests carry its name); and the default ``gen_ai.operation.name``."""
        with self._lock:
            self._default_model = self._capped(self._models, str(model or ""), MAX_MODELS, "model")
            if operation is not None:
                self._default_operation = self._capped(self._operations, str(operation), 4, "operation")

    # -- adapters ---------------------------------------------------------------------
    @contextmanager
    def loading_adapter(self, name: str, *, trained_by: AdapterOrigin | None = None) -> Iterator[None]:
        """Time an adapter load: on success the adapter is loaded; an exception records ``error.type`` and propagates.

        ``trained_by``: where the adapter came from, for its ``openlora.inference.adapter.info`` series
        (see :class:`AdapterOrigin`); without it that series carries the adapter's name only. On success
        it replaces what an earlier load of that name said; a failed load changes nothing there.
        """
        info = self._origin_attributes(trained_by)
        value = self._adapter_slot(name, reserve=True)
        started = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self._record_load(value, time.perf_counter() - started, exception_error_type(type(exc)))
            raise
        self._record_load(value, time.perf_counter() - started, None)
        self._mark_loaded(name, value, True, info)

    def adapter_loaded(
        self, name: str, load_time_s: float | None = None, *, trained_by: AdapterOrigin | None = None
    ) -> None:
        """Mark adapter ``name`` loaded (and record its load time when given); ``trained_by`` as for
        :meth:`loading_adapter`. Calling it again for a loaded adapter (a reload) replaces its info series."""
        info = self._origin_attributes(trained_by)
        value = self._adapter_slot(name, reserve=True)
        if load_time_s is not None:
            seconds = _seconds_or_none(load_time_s)
            if seconds is None:
                self._warn_once("load_time", f"load_time_s must be a finite number >= 0, got {load_time_s!r}")
            else:
                self._record_load(value, seconds, None)
        self._mark_loaded(name, value, True, info)

    def adapter_unloaded(self, name: str) -> None:
        """Mark adapter ``name`` unloaded: its gauge reads 0 from the next collection, its info series is gone."""
        value = self._adapter_slot(name, reserve=True)
        self._mark_loaded(name, value, False)

    def _origin_attributes(self, trained_by: AdapterOrigin | None) -> dict[str, str]:
        if trained_by is None:
            return {}
        if not isinstance(trained_by, AdapterOrigin):
            raise TypeError(f"trained_by must be an AdapterOrigin or None, got {type(trained_by).__name__}")
        if trained_by.final_eval_loss is not None and _loss_text(trained_by.final_eval_loss) is None:
            self._warn_once("eval-loss", f"final_eval_loss must be a number, got {trained_by.final_eval_loss!r}")
        return trained_by.attributes()

    def _mark_loaded(self, name: str, value: str, loaded: bool, info: dict[str, str] | None = None) -> None:
        with self._lock:
            if value != ADAPTER_OTHER:
                # One info series per adapter with its own slot: past the cap, names share "other" and
                # their origins would be many series under one name.
                if loaded:
                    self._info[value] = {ATTR_ADAPTER: value, **(info or {})}
                else:
                    self._info.pop(value, None)
            if value == ADAPTER_OTHER:
                # Several adapters past the cap share "other": it stays loaded until the last one goes.
                if loaded:
                    self._loaded_past_cap.add(str(name))
                else:
                    self._loaded_past_cap.discard(str(name))
                loaded = bool(self._loaded_past_cap)
            if loaded:
                self._loaded[value] = 1
            elif value in self._loaded:
                self._loaded[value] = 0

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(name for name, loaded in self._loaded.items() if loaded)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The adapter names holding one of the ``max_adapters`` slots, in the order they took them (later
        names are recorded as ``"other"`` and not remembered)."""
        with self._lock:
            return tuple(self._adapters)

    # -- requests ---------------------------------------------------------------------
    def request(
        self,
        adapter: str | None = None,
        *,
        model: str | None = None,
        operation: str | None = None,
        queued: bool = False,
    ) -> InferenceRequest:
        """Start timing one request. ``queued=True``: it waits until :meth:`InferenceRequest.start`.

        ``adapter``: the adapter serving it; ``None`` (or ``"base"``) for the base model.
        A server should pass :data:`ADAPTER_OTHER` for a name it does not serve (a
        request it rejects), so made-up names never take one of the capped slots.
        """
        if os.getpid() != self._pid:
            self._warn_once(
                "forked",
                f"a request recorded in process {os.getpid()}, forked from process {self._pid} where the"
                " telemetry was set up, is lost: a forked child exports nothing. Set up telemetry in each"
                " worker (gunicorn: an app factory, `module:create_app()`, or a post_fork hook, not"
                " --preload; uvicorn --workers: --factory); see docs/how-to/serving.md",
            )
        if not adapter or adapter == ADAPTER_BASE:  # None or "": the base model
            value = ADAPTER_BASE
        elif adapter == ADAPTER_OTHER:
            value = ADAPTER_OTHER
        else:
            value = self._adapter_slot(adapter)
        with self._lock:
            # gen_ai.request.model is the name the client asked for: an adapter's own name (the
            # conventions: a fine-tuned model's is more specific than its base's), bounded as the
            # adapter is; the base model's name for the base. gen_ai.response.model: the served base.
            if model is not None:
                model_value = self._capped(self._models, str(model), MAX_MODELS, "model")
            elif value != ADAPTER_BASE:
                model_value = value
            else:
                model_value = self._default_model
            operation_value = (
                self._default_operation
                if operation is None
                else self._capped(self._operations, str(operation), 4, "operation")
            )
            key = (operation_value, model_value, self._default_model, value)
            active = self._active.get(key)
            if active is None:
                active = self._active[key] = [0, 0]
            active[1 if queued else 0] += 1
        return InferenceRequest(self, key, queued)

    def instrument(
        self, fn: F | None = None, *, adapter: str | None = None, operation: str | None = None
    ) -> Any:
        """Decorator: each call of ``fn`` (a function or coroutine function) is one request.

        It records the duration and, for an exception, its ``error.type``; for
        the first token and token counts use :meth:`request` inside instead.
        """

        def decorate(function: F) -> F:
            if inspect.iscoroutinefunction(function):

                @functools.wraps(function)
                async def run_async(*args: Any, **kwargs: Any) -> Any:
                    with self.request(adapter, operation=operation):
                        return await function(*args, **kwargs)

                return run_async  # type: ignore[return-value]

            @functools.wraps(function)
            def run(*args: Any, **kwargs: Any) -> Any:
                with self.request(adapter, operation=operation):
                    return function(*args, **kwargs)

            return run  # type: ignore[return-value]

        return decorate(fn) if fn is not None else decorate

    # -- the request path (called by InferenceRequest) ----------------------------------
    def _move_to_running(self, key: _Key) -> None:
        with self._lock:
            active = self._active[key]
            active[1] -= 1
            active[0] += 1

    def _finish(self, request: InferenceRequest, now: float) -> None:
        key = request._key
        series_key = (*key, request._error)
        with self._lock:
            self._active[key][0 if request._started else 1] -= 1
            self._histograms.add(series_key, request._t0, now, request._first, request._input, request._output)
            if not self._histograms.merging:
                # No window views on this meter: hand the values to the SDK now (slower, same result).
                self._commit_locked()

    # -- collection -------------------------------------------------------------------
    def _observe_running(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            self._commit_locked(empty_for_loaded=self._histograms.merging)
            return self._active_observations(0)

    def _observe_waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return self._active_observations(1)

    def _observe_loaded(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [Observation(loaded, {ATTR_ADAPTER: name}) for name, loaded in self._loaded.items()]

    def _observe_info(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [Observation(1, attributes) for attributes in self._info.values()]

    def _active_observations(self, index: int) -> list[Observation]:
        seen = set(self._active)
        observations = [
            Observation(counts[index], self._histograms.attributes((*key, None)))
            for key, counts in self._active.items()
        ]
        # A loaded adapter's default series reads 0 before its first request (not after it was unloaded).
        for adapter in self._loaded_now():
            key = (self._default_operation, adapter, self._default_model, adapter)
            if key not in seen:
                observations.append(Observation(0, self._histograms.attributes((*key, None))))
        return observations

    def _loaded_now(self) -> list[str]:
        return [adapter for adapter, loaded in self._loaded.items() if loaded]

    def _commit_locked(self, empty_for_loaded: bool = False) -> None:
        """Hand every pending window to the histograms (the caller holds the lock)."""
        empty: list[SeriesKey] = []
        if empty_for_loaded:
            # Loaded adapters get their request-count series at 0, so the first request is a rise.
            for adapter in self._loaded_now():
                empty.append((self._default_operation, adapter, self._default_model, adapter, None))
        self._histograms.commit(empty)

    def _record_load(self, adapter: str, seconds: float, error: str | None) -> None:
        attributes = {ATTR_ADAPTER: adapter}
        if error is not None:
            with self._lock:
                attributes[ATTR_ERROR_TYPE] = self._capped(self._errors, error, MAX_ERROR_TYPES, "error.type")
        try:
            self._histograms.record_load(seconds, attributes)
        except Exception:  # telemetry never breaks serving
            self._warn_once("load", "recording an adapter load time failed", exc_info=True)

    # -- bounded values ---------------------------------------------------------------
    def _adapter_slot(self, name: str, *, reserve: bool = False) -> str:
        name = str(name)
        value = self._adapters.get(name)  # the common case, without the lock
        if value is not None:
            return value
        if reserve and name in (ADAPTER_BASE, ADAPTER_OTHER):
            raise ValueError(
                f"adapter name {name!r} is reserved: {ADAPTER_BASE!r} and {ADAPTER_OTHER!r} are not names"
            )
        with self._lock:
            return self._capped(self._adapters, name, self._max_adapters, "adapter", overflow=ADAPTER_OTHER)

    def _error_value(self, error_type: str) -> str:
        value = self._errors.get(error_type)
        if value is not None:
            return value
        if names.is_client_error(str(error_type)):
            # A client's fault: a bounded set of its own (CLIENT_ERROR_PATTERN), never capped, so that a
            # public endpoint's many kinds of bad requests cannot push a server error past the cap into
            # _OTHER, nor a client error into _OTHER, which the server-error ratio counts.
            return str(error_type)
        with self._lock:
            return self._capped(self._errors, str(error_type), MAX_ERROR_TYPES, "error.type")

    def _capped(self, seen: dict[str, str], name: str, cap: int, what: str, overflow: str = OTHER) -> str:
        """``name`` itself while fewer than ``cap`` distinct names were seen, then ``overflow`` (caller holds the lock).

        Names past the cap are not remembered: a stream of distinct names costs no memory.
        """
        value = seen.get(name)
        if value is not None:
            return value
        if len(seen) >= cap:
            self._warn_once(
                f"cap-{what}",
                f"more than {cap} distinct {what} values in this process: {name[:_MAX_LABEL_CHARS]!r} and "
                f"later new ones are recorded as {overflow!r}",
            )
            return overflow
        value = seen[name] = name[:_MAX_LABEL_CHARS]
        return value

    def _count(self, value: Any, what: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self._warn_once(
                f"tokens-{what}", f"{what} token count must be an integer >= 0, got {value!r}: ignored"
            )
            return None
        return value

    def _warn_once(self, key: str, message: str, exc_info: bool = False) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        _logger.warning("inference metrics: %s", message, exc_info=exc_info)


def exception_error_type(kind: type[BaseException]) -> str:
    """``error.type`` for an exception: its class name; a cancelled request or closed stream is ``cancelled``."""
    if kind is GeneratorExit or kind.__name__ == "CancelledError":
        return "cancelled"
    return kind.__qualname__


def _seconds_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None

"""`TrainingMetrics`: one cheap call per optimizer step, read when metrics are collected.

Why not one OpenTelemetry instrument call per value: each SDK call costs a few
microseconds, and the usual recipe calls ``loss.item()`` every step, which
stalls the GPU pipeline. Here ``record_step`` only updates plain Python
accumulators under a lock (about a microsecond for all six values) and keeps
tensors as references. Everything else happens at collection time, on the
exporter's or the scrape's thread:

- gauges report the window since the previous collection: loss and gradient
  norm are the mean of the window's finite values (NaN/inf are counted in the
  ``*.nonfinite`` counters instead, so a single bad step never turns the gauge
  into NaN); learning rate is the latest value; throughput is tokens (samples)
  over the window's wall time. A window with no step repeats the previous
  loss, gradient norm and learning rate; throughput drops to 0 once such an
  empty window is at least a second long (a stalled run must show as stalled).
- ``openlora.training.last_step.timestamp`` is the wall-clock time of the
  latest ``record_step``: the step path stores the ``perf_counter()`` reading it
  takes anyway, and the collection converts it. It lets PromQL compare ranks'
  progress (``time() - ...``) without any communication between them.
- tensors are reduced on their own device and read back there; for CUDA
  tensors the copy to the host is asynchronous and is only polled, never
  waited on with a synchronizing call, so ``torch.cuda.set_sync_debug_mode("error")``
  holds. Values a GPU has not produced yet are carried into the next collection.
- the window's counts go into synchronous SDK counters and its step durations
  into the ``openlora.training.step.duration`` histogram when the window is
  taken. Measurements of synchronous instruments stay in the SDK until a
  collection completes, so a collection that fails after the window was taken
  neither loses nor repeats it (observable counters would: the SDK adds an
  aborted collection's observation to the next one's).
- on the provider ``setup_telemetry`` builds, :func:`step_duration_view` makes
  the histogram take a whole window as one measurement, so a collection costs
  the same after ten steps or ten million; on any other meter the window is
  replayed, one ``record`` per step (exact, about 5 us per step).

Each reader of the provider ``setup_telemetry`` builds has its own window: with
two readers (say Prometheus and the history file), each reports the steps since
its own previous collection, spikes included, whatever the other collected in
between. A window is still taken, read back and judged by the guard once; what
it held is then added to every reader's pending span. Readers the provider was
not built with (someone else's provider) share one window.
"""

from __future__ import annotations

import logging
import math
import operator
import sys
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.names import ATTR_EVAL_METRIC, ATTR_GUARD_REASON, GUARD_REASONS, STEP_DURATION_BUCKETS
from openlora_otel.training.guard import DivergenceGuard, LossWindow, Trip
from openlora_otel.windows import BucketCounts, replay, window_merging_works, window_view

__all__ = ["TrainingMetrics", "collecting_for", "step_duration_view"]

_logger = logging.getLogger(__name__)

# Tensors kept per window before they are folded on their device into one partial
# result (one small reduction per this many steps keeps memory flat without a reader).
_FOLD_EVERY = 512
# After a fold fails, a window stops folding (retrying would re-stack the whole growing
# list on every step, under the lock) and keeps at most this many tensors until its
# collection; beyond it they are dropped and counted.
_MAX_UNFOLDED = 16384
# Devices without float64 support: the fold reduces in float32 there (decided by
# device type, not by trying float64 on every fold; counts stay exact to 2**24 a window).
_NO_FLOAT64 = frozenset({"mps"})
# Tensor-like objects that are not torch tensors (duck-typed test doubles, other
# frameworks) cannot be folded without reading them; beyond this they are dropped.
_MAX_FOREIGN = 65536
# How long a collection polls for a GPU read-back before carrying it to the next one.
_READBACK_WAIT_S = 0.2
# How long the guard's own check polls (its thread has nothing else to do).
_GUARD_READBACK_WAIT_S = 5.0
# An empty window shorter than this keeps the previous throughput (two readers back to back).
_MIN_EMPTY_WINDOW_S = 1.0
_MAX_EVAL_METRICS = 64
# OTLP carries integer points as int64: a larger count fails the whole export, every time.
_INT64_MAX = 2**63 - 1
_DURATION = "openlora.training.step.duration"


class _Series:
    """One scalar over a window: sum, count, extremes and last value, host values plus deferred tensors.

    ``trailing`` is how many values at the end of the window were non-finite in a
    row (what the divergence guard counts). Values merged from a device read-back
    count as coming after the host values of the same window.
    """

    __slots__ = (
        "count", "deferred", "fold_failed", "foreign", "highest", "last", "lowest", "nonfinite",
        "partials", "total", "trailing",
    )  # fmt: skip

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.nonfinite = 0
        self.last: float | None = None
        self.highest = -math.inf  # of the finite values; -inf while there is none
        self.lowest = math.inf
        self.trailing = 0
        self.deferred: list[Any] = []  # torch tensors, detached, not yet folded
        # folded vectors on device: [sum_finite, n_finite, n_nonfinite, last, max, min, trailing]
        self.partials: list[Any] = []
        self.foreign: list[Any] = []  # tensor-likes that are not torch tensors
        # A fold failed in this window: no more folds until the window is collected
        # (a new window, with a new series, folds again).
        self.fold_failed = False

    def add_host(self, value: float) -> None:
        if value - value == 0.0:  # finite (NaN and inf give NaN)
            self.total += value
            self.count += 1
            self.trailing = 0
            if value > self.highest:
                self.highest = value
            if value < self.lowest:
                self.lowest = value
        else:
            self.nonfinite += 1
            self.trailing += 1
        self.last = value

    def merge(self, values: _Folded) -> None:
        self.total += values.total
        self.count += values.count
        self.nonfinite += values.nonfinite
        if values.last is not None:
            self.last = values.last
        self.highest = max(self.highest, values.highest)
        self.lowest = min(self.lowest, values.lowest)
        # Values merged here came after this series' own: their run continues ours only
        # when none of them was finite.
        self.trailing = values.trailing + (self.trailing if values.count == 0 else 0)

    def folded(self) -> _Folded:
        """The host-side values as one fold (what a reader's span adds up)."""
        return _Folded(self.total, self.count, self.nonfinite, self.last, self.highest, self.lowest, self.trailing)

    def copy(self) -> _Series:
        """A copy whose lists can be read while the step path appends to the original's."""
        twin = _Series()
        for name in self.__slots__:
            value = getattr(self, name)
            setattr(twin, name, list(value) if type(value) is list else value)
        return twin


@dataclass(frozen=True)
class _Folded:
    """What a device read-back gives for one series (see `_fold`)."""

    total: float
    count: int
    nonfinite: int
    last: float | None
    highest: float
    lowest: float
    trailing: int

    @classmethod
    def from_values(cls, values: list[float]) -> _Folded:
        total, count, nonfinite, last, highest, lowest, trailing = values
        return cls(total, int(count), int(nonfinite), last, highest, lowest, int(trailing))


@dataclass
class _Window:
    started: float
    steps: int = 0
    tokens: int = 0
    samples: int = 0
    loss: _Series = field(default_factory=_Series)
    grad: _Series = field(default_factory=_Series)
    lr: _Series = field(default_factory=_Series)
    durations: BucketCounts = field(default_factory=lambda: BucketCounts(STEP_DURATION_BUCKETS))
    # perf_counter() of the window's latest step: the step path stores the clock reading it
    # already took; the wall-clock conversion waits for the collection.
    last_step: float | None = None
    # Steps that gave data_time_s: how many, their data waits, and (for those that also
    # had a previous call) their waits and the wall time since the previous record_step.
    data_steps: int = 0
    data_total: float = 0.0
    data_timed: float = 0.0
    data_wall: float = 0.0

    def absorb(self, window: _Window) -> None:
        """Add a taken, read-back window to this span (a reader's steps since its last collection)."""
        self.steps += window.steps
        self.tokens += window.tokens
        self.samples += window.samples
        self.loss.merge(window.loss.folded())
        self.grad.merge(window.grad.folded())
        self.lr.merge(window.lr.folded())
        if window.last_step is not None:
            self.last_step = window.last_step
        self.data_steps += window.data_steps
        self.data_total += window.data_total
        self.data_timed += window.data_timed
        self.data_wall += window.data_wall


class _Reader:
    """One reader's view: the span it has not reported yet and what its gauges show."""

    __slots__ = ("snapshot", "span")

    def __init__(self, started: float) -> None:
        self.span = _Window(started=started)
        self.snapshot = _Snapshot()


# Which reader the current thread collects for (set around a reader's collection by
# setup_telemetry; None: the shared window of readers it did not build).
_collecting = threading.local()


@contextmanager
def collecting_for(key: Hashable) -> Iterator[None]:
    """Mark the collection this thread runs as ``key``'s: its gauges report ``key``'s own window."""
    previous = getattr(_collecting, "key", None)
    _collecting.key = key
    try:
        yield
    finally:
        _collecting.key = previous


@dataclass
class _Snapshot:
    """What the gauges report until the next collection."""

    loss: float | None = None
    grad: float | None = None
    lr: float | None = None
    loss_max: float | None = None
    loss_min: float | None = None
    grad_max: float | None = None
    grad_min: float | None = None
    data_wait: float | None = None
    data_fraction: float | None = None
    window_steps: int = 0
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    last_step_time: float | None = None  # seconds since the epoch


class _Total:
    """A synchronous counter and what was added to it, kept within int64 (saturates rather than poisons exports)."""

    __slots__ = ("counter", "total")

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.total = 0

    def add(self, amount: int) -> bool:
        """Add ``amount``; False when the total reached int64's maximum and part of it was not counted."""
        room = _INT64_MAX - self.total
        taken = amount if amount <= room else room
        self.total += taken
        self.counter.add(taken)  # also when 0: the series exists from the first collection
        return taken == amount


class TrainingMetrics:
    """Training instruments under ``openlora.training.*`` and ``openlora.adapter.*``.

    Get it as ``telemetry.training``, or build one from any OpenTelemetry
    ``Meter``. Safe to call from several threads; calls after :meth:`close`
    (which ``Telemetry.shutdown()`` calls) are accepted and ignored.

    ``readers``: keys of the readers that collect under :func:`collecting_for`
    (``setup_telemetry`` passes its own); each gets a window of its own from the
    start. A key first seen at a collection starts from that collection.

    ``window_histogram``: set it only when the meter's provider was built with
    :func:`step_duration_view` (``setup_telemetry`` does both): each collection
    then hands the step-duration histogram one pre-bucketed window instead of
    replaying every step's duration (one SDK call per step).

    Argument rules (checked on every call; a wrong type is a programming error
    and raises at once, a non-finite value is data and is counted):

    - ``loss``, ``grad_norm``: a Python or NumPy number, or a one-element tensor
      on the CPU, a CUDA device or the current ``torch.accelerator`` (never read
      on the calling thread). NaN/inf are counted, not averaged. A multi-element
      tensor, a ``meta`` tensor (it has no data) or a tensor on another kind of
      device raises ``ValueError``; a string, ``bool`` or ``None``-like raises
      ``TypeError``. ``grad_norm`` must not be negative.
    - ``learning_rate``: the same, and not negative.
    - ``tokens``, ``samples``: integers from 0 to 2**63 - 1 (Python or NumPy); a
      tensor raises ``TypeError`` because counting it would need a device read.
    - ``step_time_s``: non-negative seconds; when omitted, the time since the
      previous ``record_step`` call is used (nothing for the first call).
    - ``data_time_s``: non-negative seconds this step waited for its batch. The
      wait fraction is measured against the wall time between consecutive
      ``record_step`` calls, whatever ``step_time_s`` covers.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        step_duration_buckets: Sequence[float] = STEP_DURATION_BUCKETS,
        window_histogram: bool = False,
        peak_flops: float | None = None,
        readers: Iterable[Hashable] = (),
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        if list(step_duration_buckets) != list(STEP_DURATION_BUCKETS):
            raise ValueError(
                "custom step_duration_buckets are not supported yet; use names.STEP_DURATION_BUCKETS"
            )
        self._merge_windows = bool(window_histogram) and window_merging_works()
        self._window = _Window(started=time.monotonic())
        self._last_call: float | None = None
        started = time.monotonic()
        self._readers: dict[Hashable, _Reader] = {key: _Reader(started) for key in (None, *readers)}
        self._carry: list[tuple[str, Any]] = []  # GPU read-backs not finished at the previous collection
        self._epoch: float | None = None
        self._eval_loss: float | None = None
        self._eval: dict[str, float] = {}
        self._adapter: dict[str, float] = {}
        # Model FLOPs: per token from set_model_flops(); the peak given there, unless
        # the configuration (OPENLORA_PEAK_FLOPS) set one, which wins.
        self._flops_per_token: float | None = None
        self._configured_peak = None if peak_flops is None else _positive(peak_flops, "peak_flops")
        self._peak_flops = self._configured_peak
        self._guard: DivergenceGuard | None = None
        self._guard_lock = threading.Lock()  # orders a guard's look at the current window against _roll
        self._guard_stop = threading.Event()
        self._guard_thread: threading.Thread | None = None
        self._steps_recorded = 0  # for Trip.steps: committed windows' steps
        self._dropped_foreign = 0
        self._dropped_unfolded = 0
        self._warned: set[str] = set()

        spec = {m.name: m for m in (*names.TRAINING_METRICS, *names.ADAPTER_METRICS)}

        def gauge(name: str, callback: Any) -> None:
            meter.create_observable_gauge(
                name, callbacks=[callback], unit=spec[name].unit, description=spec[name].description
            )

        def raw_counter(name: str) -> Any:
            return meter.create_counter(name, unit=spec[name].unit, description=spec[name].description)

        def counter(name: str) -> _Total:
            return _Total(raw_counter(name))

        # Counters are synchronous: a window's counts are added once, when it is taken
        # (see the module docstring for why not observable counters).
        self._steps = counter("openlora.training.steps")
        self._tokens = counter("openlora.training.tokens")
        self._samples = counter("openlora.training.samples")
        self._loss_nonfinite = counter("openlora.training.loss.nonfinite")
        self._grad_nonfinite = counter("openlora.training.gradient_norm.nonfinite")
        # Counted with attributes, one at a time: plain SDK counters.
        self._guard_trips = raw_counter("openlora.training.guard.trips")
        self._eval_nonfinite = raw_counter("openlora.training.eval.nonfinite")
        duration = spec[_DURATION]
        self._duration = meter.create_histogram(
            duration.name,
            unit=duration.unit,
            description=duration.description,
            explicit_bucket_boundaries_advisory=list(STEP_DURATION_BUCKETS),
        )
        # The first callback of every collection takes the window; the rest read the snapshot.
        gauge("openlora.training.loss", self._observe_loss)
        gauge("openlora.training.gradient_norm", lambda o: self._one(self._snapshot.grad))
        gauge("openlora.training.loss.max", lambda o: self._one(self._snapshot.loss_max))
        gauge("openlora.training.loss.min", lambda o: self._one(self._snapshot.loss_min))
        gauge("openlora.training.gradient_norm.max", lambda o: self._one(self._snapshot.grad_max))
        gauge("openlora.training.gradient_norm.min", lambda o: self._one(self._snapshot.grad_min))
        gauge("openlora.training.data_wait.duration", lambda o: self._one(self._snapshot.data_wait))
        gauge("openlora.training.data_wait.fraction", lambda o: self._one(self._snapshot.data_fraction))
        gauge("openlora.training.learning_rate", lambda o: self._one(self._snapshot.lr))
        gauge("openlora.training.window.steps", lambda o: self._one(self._snapshot.window_steps))
        gauge("openlora.training.last_step.timestamp", lambda o: self._one(self._snapshot.last_step_time))
        gauge("openlora.training.throughput.tokens", lambda o: self._one(self._snapshot.tokens_per_s))
        gauge("openlora.training.throughput.samples", lambda o: self._one(self._snapshot.samples_per_s))
        gauge("openlora.model.flops_per_token", lambda o: self._one(self._flops_per_token))
        gauge("openlora.training.throughput.flops", lambda o: self._one(self._achieved_flops()))
        gauge("openlora.training.peak_flops", lambda o: self._one(self._peak_flops))
        gauge("openlora.training.model_flops.utilization", lambda o: self._one(self._utilization()))
        gauge("openlora.training.epoch", lambda o: self._one(self._epoch))
        gauge("openlora.training.eval.loss", lambda o: self._one(self._eval_loss))
        gauge("openlora.training.eval.value", self._observe_eval)
        for adapter_spec in names.ADAPTER_METRICS:
            key = adapter_spec.name
            gauge(key, lambda o, key=key: self._one(self._adapter.get(key)))

    # -- the step path --------------------------------------------------------
    def record_step(
        self,
        *,
        loss: Any = None,
        grad_norm: Any = None,
        learning_rate: Any = None,
        tokens: Any = None,
        samples: Any = None,
        step_time_s: Any = None,
        data_time_s: Any = None,
    ) -> None:
        """Record one optimizer step. See the class docstring for what each argument accepts."""
        now = time.perf_counter()
        last, self._last_call = self._last_call, now
        if step_time_s is None:
            step_time = None if last is None else now - last
        else:
            # The check inline for the usual float; the call only for anything else.
            if type(step_time_s) is not float or not 0.0 <= step_time_s < math.inf:
                step_time_s = _seconds(step_time_s, "step_time_s")
            step_time = step_time_s
        if data_time_s is not None and (type(data_time_s) is not float or not 0.0 <= data_time_s < math.inf):
            data_time_s = _seconds(data_time_s, "data_time_s")
        # `x >> 63` is 0 exactly for 0 <= x < 2**63: one operation for both bounds.
        if tokens is not None and (type(tokens) is not int or tokens >> 63):
            tokens = _count(tokens, "tokens")
        if samples is not None and (type(samples) is not int or samples >> 63):
            samples = _count(samples, "samples")
        # Validate everything before touching state: a call that raises records nothing.
        if loss is not None and type(loss) is not float:
            loss = _prepare(loss, "loss")
        if grad_norm is not None and (type(grad_norm) is not float or grad_norm < 0.0):
            grad_norm = _prepare(grad_norm, "grad_norm")
        if learning_rate is not None and (type(learning_rate) is not float or learning_rate < 0.0):
            learning_rate = _prepare(learning_rate, "learning_rate")
        with self._lock:
            if self._closed:
                return
            window = self._window
            window.steps += 1
            window.last_step = now
            if loss is not None:
                if type(loss) is float:
                    window.loss.add_host(loss)
                else:
                    self._defer(window.loss, loss)
            if grad_norm is not None:
                if type(grad_norm) is float:
                    window.grad.add_host(grad_norm)
                else:
                    self._defer(window.grad, grad_norm)
            if learning_rate is not None:
                if type(learning_rate) is float:
                    window.lr.add_host(learning_rate)
                else:
                    self._defer(window.lr, learning_rate)
            if tokens:
                window.tokens += tokens
            if samples:
                window.samples += samples
            if data_time_s is not None:
                window.data_steps += 1
                window.data_total += data_time_s
                if last is not None:
                    window.data_timed += data_time_s
                    window.data_wall += now - last
            if step_time is not None:
                window.durations.add(step_time)

    def record_values(self, *, loss: Any = None, grad_norm: Any = None, learning_rate: Any = None) -> None:
        """Add loss / gradient norm / learning rate values without counting a step.

        For frameworks that report these less often than every step (the
        Hugging Face Trainer logs them every ``logging_steps``) or more often
        (one loss per micro-batch under gradient accumulation). Same rules as
        :meth:`record_step`; the values join the current window's means.
        """
        values = [
            None if v is None else _prepare(v, what)
            for v, what in ((loss, "loss"), (grad_norm, "grad_norm"), (learning_rate, "learning_rate"))
        ]
        with self._lock:
            if self._closed:
                return
            window = self._window
            for series, value in zip((window.loss, window.grad, window.lr), values, strict=True):
                if value is None:
                    continue
                if type(value) is float:
                    series.add_host(value)
                else:
                    self._defer(series, value)

    def _defer(self, series: _Series, value: Any) -> None:
        """Keep a tensor (lock held); fold torch tensors on their device every ``_FOLD_EVERY``."""
        if type(value) is _Foreign:
            if len(series.foreign) < _MAX_FOREIGN:
                series.foreign.append(value.value)
            else:
                self._dropped_foreign += 1
            return
        deferred = series.deferred
        if series.fold_failed:
            # One failed attempt per window: retrying on each step would re-stack the whole
            # growing list under the lock (milliseconds per step after a few thousand).
            if len(deferred) < _MAX_UNFOLDED:
                deferred.append(value)
            else:
                self._dropped_unfolded += 1
            return
        deferred.append(value)
        if len(deferred) >= _FOLD_EVERY:
            torch = sys.modules["torch"]
            try:
                series.partials.extend(_fold_by_device(deferred, torch))
                series.deferred = []
                if len(series.partials) >= _FOLD_EVERY:
                    series.partials = _fold_partials(series.partials, torch)
            except Exception:  # never let bookkeeping break the step; read them all at collection instead
                series.fold_failed = True
                self._warn_once(
                    "fold",
                    f"folding kept tensors failed; this window keeps up to {_MAX_UNFOLDED} of them "
                    "for its collection (the next window folds again)",
                    exc=True,
                )

    # -- other records ----------------------------------------------------------
    def record_epoch(self, epoch: float) -> None:
        """Set the current epoch (may be fractional, as the Hugging Face Trainer reports it)."""
        value = _host_number(epoch, "epoch")
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"epoch must be finite and >= 0, got {epoch!r}")
        self._epoch = value

    def record_eval(self, loss: Any = None, **metrics: Any) -> None:
        """Record an evaluation: its loss and any other named metrics (accuracy=..., perplexity=...).

        Values are read at once (evaluation is not the step path); tensors are
        converted with ``float()``. A NaN or infinite value is data, not an
        error: OpenTelemetry cannot export it, so that series shows no value
        until a finite one is recorded; ``openlora.training.eval.nonfinite``
        counts it (per metric name) and one warning per name says so. At most
        64 names besides the loss are kept; more are ignored with one warning.
        """
        values: dict[str, float] = {}
        if loss is not None:
            values["loss"] = _host_number(loss, "loss")
        for key, value in metrics.items():
            if value is not None:
                values[key] = _host_number(value, key)
        for key, number in values.items():
            if key != "loss" and key not in self._eval and len(self._eval) >= _MAX_EVAL_METRICS:
                self._warn_once(
                    "eval", f"more than {_MAX_EVAL_METRICS} evaluation metric names; {key!r} ignored"
                )
                continue
            if not math.isfinite(number):
                # Counted, so an alert can see it: the value's own series goes quiet.
                self._eval_nonfinite.add(1, {ATTR_EVAL_METRIC: key})
                self._warn_once(
                    f"eval-{key}",
                    f"evaluation {key} is {number}: OpenTelemetry cannot export a non-finite value, so "
                    "that series shows no value until a finite one is recorded; "
                    "openlora.training.eval.nonfinite counts it (warned once per name)",
                )
            if key == "loss":  # the `loss` argument: a keyword cannot repeat it
                self._eval_loss = number
            else:
                self._eval[key] = number

    def set_adapter(
        self,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        target_modules: int | str | Iterable[str] = 0,
        trainable_params: int | None = None,
        total_params: int | None = None,
    ) -> None:
        """Describe the LoRA adapter: rank, alpha, dropout, targeted modules, parameter counts.

        ``r`` and the counts are integers up to 2**63 - 1; ``alpha`` is finite and
        > 0 (the adapter's scale is alpha / r); ``target_modules`` is a count, one
        module name (a string, as PEFT also takes a regex), or an iterable of names.
        """
        rank = _count(r, "r")
        if rank == 0:
            raise ValueError("r must be > 0")
        alpha_value = _host_number(alpha, "alpha")
        if not (alpha_value > 0 and math.isfinite(alpha_value)):
            raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
        dropout_value = _host_number(dropout, "dropout")
        if not 0.0 <= dropout_value < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if isinstance(target_modules, str):
            modules: Any = 1  # one name or pattern, not its characters
        elif isinstance(target_modules, bytes):
            raise TypeError("target_modules must be a count, a module name or module names, got bytes")
        elif isinstance(target_modules, (list, tuple, set, frozenset, dict)):
            modules = len(target_modules)
        elif isinstance(target_modules, Iterable):
            modules = len(list(target_modules))
        else:
            modules = target_modules
        adapter: dict[str, float] = {
            "openlora.adapter.rank": rank,
            "openlora.adapter.alpha": alpha_value,
            "openlora.adapter.dropout": dropout_value,
            "openlora.adapter.target_modules": _count(modules, "target_modules"),
        }
        trainable = None if trainable_params is None else _count(trainable_params, "trainable_params")
        if trainable is not None:
            adapter["openlora.adapter.parameters.trainable"] = trainable
        if total_params is not None:
            total = _count(total_params, "total_params")
            adapter["openlora.model.parameters"] = total
            if trainable is not None:
                if trainable > total:
                    raise ValueError("trainable_params cannot exceed total_params")
                adapter["openlora.adapter.trainable.ratio"] = trainable / total if total else 0.0
        self._adapter = adapter

    def set_model_flops(self, per_token: float, *, peak_flops: float | None = None) -> None:
        """Set the model's training FLOPs per token, and the peak FLOP/s of this process's device.

        Achieved FLOP/s is then tokens/s x ``per_token``, and model FLOPs
        utilization is achieved / peak. ``peak_flops`` is ignored when the
        configuration gave one (``OPENLORA_PEAK_FLOPS``); with neither, only the
        achieved FLOP/s is reported (on a CPU, say). See
        :func:`openlora_otel.training.flops.training_flops_per_token` for the estimate.
        """
        flops = _positive(per_token, "per_token")
        peak = None if peak_flops is None else _positive(peak_flops, "peak_flops")
        self._flops_per_token = flops
        self._peak_flops = self._configured_peak if self._configured_peak is not None else peak

    def _achieved_flops(self) -> float | None:
        tokens_per_s, per_token = self._snapshot.tokens_per_s, self._flops_per_token
        return None if tokens_per_s is None or per_token is None else tokens_per_s * per_token

    def _utilization(self) -> float | None:
        achieved, peak = self._achieved_flops(), self._peak_flops
        return None if achieved is None or peak is None else achieved / peak

    def attach_guard(self, guard: DivergenceGuard) -> DivergenceGuard:
        """Watch the losses with ``guard`` (see :mod:`openlora_otel.training.guard`); returns it.

        Starts the guard's check thread. One guard per ``TrainingMetrics``:
        attaching the same one again does nothing, another raises ``ValueError``.
        """
        if not isinstance(guard, DivergenceGuard):
            raise TypeError(f"attach_guard takes a DivergenceGuard, got {type(guard).__name__}")
        with self._guard_lock:
            if self._guard is guard:
                return guard
            if self._guard is not None:
                raise ValueError("a divergence guard is already attached to this TrainingMetrics")
            self._guard = guard
        for reason in GUARD_REASONS:  # the series exist from the start, so increase() sees the first trip
            self._guard_trips.add(0, {ATTR_GUARD_REASON: reason})
        guard._bind(
            lambda reason: self._guard_trips.add(1, {ATTR_GUARD_REASON: reason}),
            lambda: self._steps_recorded + self._window.steps,
        )
        if not self._closed:
            self._guard_thread = threading.Thread(
                target=self._guard_loop, args=(guard,), name="openlora-otel-guard", daemon=True
            )
            self._guard_thread.start()
        return guard

    def _guard_loop(self, guard: DivergenceGuard) -> None:
        while not self._guard_stop.wait(guard.check_interval_s):
            if self._closed:
                return
            try:
                self._check_current_window(guard)
            except Exception:
                self._warn_once("guard", "the divergence guard's check failed; it retries", exc=True)

    def _check_current_window(self, guard: DivergenceGuard) -> None:
        """Show the guard the window so far, read back the collection's way, without taking it."""
        with self._lock:
            window = self._window
            loss = window.loss.copy()
            steps = self._steps_recorded + window.steps
        if not (loss.count or loss.nonfinite or loss.deferred or loss.partials or loss.foreign):
            return
        for item in loss.foreign:
            loss.add_host(float(item))
        if loss.deferred or loss.partials:
            failed: list[str] = []
            handles = _start_readback(loss, sys.modules.get("torch"), lambda: failed.append("loss"))
            waiting: list[tuple[str, list[Any]]] = []
            # This thread has nothing else to do: it waits for a device that runs far behind
            # the host as long as the window lasts, rather than giving up and starting over.
            for _, folded in _poll_readbacks(
                [("loss", handles)], waiting, wait_s=_GUARD_READBACK_WAIT_S, stop=self._guard_stop
            ):
                loss.merge(folded)
            if failed or waiting:
                return  # not readable yet: the next check or the collection sees it
        with self._guard_lock:
            if self._window is not window:  # the collection took it and judges it whole
                return
            trip = guard._observe(_loss_window(loss, steps), complete=False)
        if trip is not None:
            guard._fire(trip)

    def close(self) -> None:
        """Stop accepting records (idempotent); later calls are ignored.

        What was recorded before stays in the window, so a collection after
        ``close()`` (the final export of ``Telemetry.shutdown()``) still reports it.
        """
        # No lock: Telemetry.shutdown() calls this first (also from the SIGTERM exit
        # thread), and the main thread may hold the lock while stuck in C (a fold's kernel
        # launch behind a hung collective). Storing a bool is atomic under the GIL; the
        # record paths check it under the lock, so a record racing with close() either
        # lands in the window the final collection takes (the collection takes the lock)
        # or is ignored. Both are fine.
        self._closed = True
        self._guard_stop.set()

    def join_guard(self, timeout_s: float) -> bool:
        """After :meth:`close`, wait (at most ``timeout_s``) for the guard's check thread to end;
        True when none is left running. A check in the middle of reading the device back gives up
        at once on close, so the thread never touches the device after the shutdown (at
        interpreter exit CUDA may already be going away)."""
        thread = self._guard_thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    # -- collection ---------------------------------------------------------------
    @property
    def _snapshot(self) -> _Snapshot:
        """What the gauges of the collection on this thread report."""
        reader = self._readers.get(getattr(_collecting, "key", None))
        return reader.snapshot if reader is not None else self._readers[None].snapshot

    @staticmethod
    def _one(value: float | int | None) -> list[Observation]:
        # Non-finite values are left out here: the SDK would drop them anyway, with a
        # warning on every collection.
        return [] if value is None or value - value != 0 else [Observation(value)]

    def _observe_loss(self, options: CallbackOptions) -> list[Observation]:
        try:
            self._roll()
        except Exception:  # the scrape must survive anything a tensor read throws
            self._warn_once(
                "roll", "reading training values failed; this collection reports stale values", exc=True
            )
        return self._one(self._snapshot.loss)

    def _observe_eval(self, options: CallbackOptions) -> list[Observation]:
        return [
            Observation(v, {ATTR_EVAL_METRIC: k}) for k, v in list(self._eval.items()) if math.isfinite(v)
        ]

    def _roll(self) -> None:
        now = time.monotonic()
        # The guard lock is held from the swap until the guard has seen this window whole
        # (below): a check of the new window in between would count the old one's
        # non-finite run twice. Only the guard's thread ever waits for it.
        with self._guard_lock:
            trip = self._roll_locked(now)
        if trip is not None and self._guard is not None:
            self._guard._fire(trip)  # after the lock: on_trip may collect

    def _roll_locked(self, now: float) -> Trip | None:
        """Take the window, read it back and judge it; returns a new trip of the guard, if any."""
        with self._lock:
            window, self._window = self._window, _Window(started=now)
        # Counts first, before anything that reads a tensor can fail: the window is
        # handed to the SDK exactly once, and stays there until a collection completes.
        self._commit(window)

        pending = self._carry
        self._carry = []
        failed: set[str] = set()
        torch = sys.modules.get("torch")
        for label, series in (("loss", window.loss), ("grad", window.grad), ("lr", window.lr)):
            # One value or device failing to read (a tensor on a device that went away, a
            # foreign object that raises) costs only those values, never the rest.
            for item in series.foreign:
                try:
                    number = float(item)
                except Exception:
                    self._fail_read(label, failed)
                else:
                    series.add_host(number)
            if series.deferred or series.partials:
                handles = _start_readback(series, torch, lambda label=label: self._fail_read(label, failed))
                if handles:
                    pending.append((label, handles))
        ready = _poll_readbacks(pending, self._carry, lambda label: self._fail_read(label, failed))
        merged = {"loss": window.loss, "grad": window.grad, "lr": window.lr}
        for label, folded in ready:
            merged[label].merge(folded)

        self._steps_recorded += window.steps
        guard = self._guard
        trip = None
        if guard is not None and "loss" not in failed:
            trip = guard._observe(_loss_window(window.loss, self._steps_recorded), complete=True)
        if not self._loss_nonfinite.add(window.loss.nonfinite) or not self._grad_nonfinite.add(
            window.grad.nonfinite
        ):
            self._warn_saturated()
        # The window goes to every reader's span; the collecting reader reports its span.
        key = getattr(_collecting, "key", None)
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = _Reader(window.started)
        for each in self._readers.values():
            each.span.absorb(window)
        window, reader.span = reader.span, _Window(started=now)
        elapsed = now - window.started
        previous = reader.snapshot
        snapshot = _Snapshot(
            loss=_window_value(window.loss, previous.loss, "loss" in failed, mean=True),
            grad=_window_value(window.grad, previous.grad, "grad" in failed, mean=True),
            lr=_window_value(window.lr, previous.lr, "lr" in failed, mean=False),
            loss_max=_window_extreme(window.loss, previous.loss_max, "loss" in failed, highest=True),
            loss_min=_window_extreme(window.loss, previous.loss_min, "loss" in failed, highest=False),
            grad_max=_window_extreme(window.grad, previous.grad_max, "grad" in failed, highest=True),
            grad_min=_window_extreme(window.grad, previous.grad_min, "grad" in failed, highest=False),
            data_wait=window.data_total / window.data_steps if window.data_steps else previous.data_wait,
            data_fraction=(
                min(window.data_timed / window.data_wall, 1.0) if window.data_wall > 0 else previous.data_fraction
            ),
            window_steps=window.loss.count or window.grad.count,
            last_step_time=previous.last_step_time,
        )
        if window.last_step is not None:
            # The step's perf_counter() reading, placed on the wall clock as it reads now: an age
            # computed against the current wall clock (Prometheus's time()) stays right even if
            # the wall clock was stepped since, and the step path pays no time.time() call.
            snapshot.last_step_time = time.time() - (time.perf_counter() - window.last_step)
        if window.steps or elapsed >= _MIN_EMPTY_WINDOW_S:
            snapshot.tokens_per_s = window.tokens / elapsed if elapsed > 0 else previous.tokens_per_s
            snapshot.samples_per_s = window.samples / elapsed if elapsed > 0 else previous.samples_per_s
        else:
            snapshot.tokens_per_s, snapshot.samples_per_s = previous.tokens_per_s, previous.samples_per_s
        reader.snapshot = snapshot
        if self._dropped_foreign:
            self._warn_once(
                "foreign", f"{self._dropped_foreign} tensor-like values dropped (no collection for too long)"
            )
        if self._dropped_unfolded:
            self._warn_once(
                "unfolded",
                f"{self._dropped_unfolded} loss / gradient norm / learning rate tensors dropped: folding "
                f"them failed and more than {_MAX_UNFOLDED} waited for one collection",
            )
        return trip

    def _commit(self, window: _Window) -> None:
        """Hand the window's counts and step durations to the SDK's synchronous instruments."""
        saturated = not self._steps.add(window.steps)
        saturated |= not self._tokens.add(window.tokens)
        saturated |= not self._samples.add(window.samples)
        if saturated:
            self._warn_saturated()
        durations = window.durations
        if not durations.count:
            return
        if self._merge_windows:
            batch = durations.window()
            self._duration.record(batch)
            if batch.merged:
                return
            # Only when told the view is there and it is not: that one window was
            # counted as a single 0 s step. Every later window is replayed.
            self._merge_windows = False
            self._warn_once(
                "merge",
                f"{_DURATION} is not using step_duration_view() on this meter's provider; "
                "step durations are replayed one by one from now on",
            )
            return
        # Per bucket, its count at the bucket's mean: counts and sum are exact, one
        # SDK call per step (min and max become the extreme buckets' means).
        replay(self._duration.record, durations.counts, durations.sums)

    def _fail_read(self, label: str, failed: set[str]) -> None:
        failed.add(label)
        self._warn_once(
            f"read-{label}",
            f"reading {label} values failed; those values are dropped, the others still count "
            "(a window with none readable reports no value rather than a stale one)",
            exc=True,
        )

    def _warn_saturated(self) -> None:
        self._warn_once(
            "int64", "a training counter reached 2**63 - 1, the largest value OTLP carries; it stays there"
        )

    def _warn_once(self, key: str, message: str, *, exc: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning("openlora-otel: %s", message, exc_info=exc)


def _window_value(series: _Series, previous: float | None, failed: bool, *, mean: bool) -> float | None:
    """The window's mean (or latest) finite value; else the previous one, unless its values could not be read."""
    if series.count:
        if mean:
            return series.total / series.count
        if series.last is not None and series.last - series.last == 0:
            return series.last
    if failed and not series.nonfinite:
        return None  # repeating the previous value would hide that nothing could be read
    return previous


def _loss_window(series: _Series, steps: int) -> LossWindow:
    return LossWindow(series.count, series.nonfinite, series.trailing, series.highest, series.total, steps)


def _window_extreme(series: _Series, previous: float | None, failed: bool, *, highest: bool) -> float | None:
    """The window's largest (smallest) finite value, with the same fallbacks as `_window_value`."""
    if series.count:
        return series.highest if highest else series.lowest
    if failed and not series.nonfinite:
        return None
    return previous


def _seconds(value: Any, what: str) -> float:
    """A duration argument: a finite host number >= 0 (a tensor is refused, as for counts)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a Python number (reading a tensor here would sync the device)")
    number = _host_number(value, what)
    if not 0.0 <= number < math.inf:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")
    return number


def _positive(value: Any, what: str) -> float:
    number = _host_number(value, what)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{what} must be finite and > 0, got {value!r}")
    return number


def step_duration_view() -> Any:
    """The ``View`` that lets ``openlora.training.step.duration`` take a whole window per collection.

    Pass it to ``MeterProvider(views=[...])`` and build ``TrainingMetrics(meter,
    window_histogram=True)`` on that provider; ``setup_telemetry`` does both. It
    keeps the same buckets (``names.STEP_DURATION_BUCKETS``); on an SDK whose
    internals no longer fit, it is a plain explicit-bucket view and windows are replayed.
    """
    return window_view(_DURATION, STEP_DURATION_BUCKETS)


# -- helpers -------------------------------------------------------------------------
class _Foreign:
    """A tensor-like that is not a torch tensor: kept as is and read with ``float()`` at collection."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _prepare(value: Any, what: str) -> Any:
    """Validate a loss / grad norm / learning rate off the lock: a host float, a 0-d torch tensor, or a `_Foreign`."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")
    if isinstance(value, (int, float)):
        number = _host_number(value, what)
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {value!r}")
        return number
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if not (value.is_cpu or value.is_cuda):  # two cheap flags first: the usual cases
            _check_device(value, what, torch)
        if value.numel() != 1:
            raise ValueError(f"{what} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            value = value.reshape(())  # shape metadata only; folding then stacks without per-item work
        return value
    numel = getattr(value, "numel", None)
    if callable(numel):  # a tensor-like from elsewhere: keep the reference, read it at collection
        if numel() != 1:
            raise ValueError(f"{what} must have exactly one element")
        return _Foreign(value)
    if hasattr(value, "__float__") and not hasattr(value, "__len__"):
        number = _host_number(value, what)  # NumPy scalars, Decimal: host values, no device involved
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {number!r}")
        return number
    raise TypeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")


def _check_device(tensor: Any, what: str, torch: Any) -> None:
    """Refuse, at the call, a tensor whose value could never be read back without a sync."""
    device = tensor.device
    if device.type == "meta":
        raise ValueError(f"{what} is a meta tensor, which has no data to report; pass a real tensor or a number")
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is None or current.type != device.type or not hasattr(torch, "Event"):
        raise ValueError(
            f"{what} is on device {str(device)!r}, which openlora-otel cannot read back asynchronously "
            "(CPU, CUDA and the current torch.accelerator are supported); pass a number instead"
        )


def _host_number(value: Any, what: str) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large for a float: {value!r}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}") from None


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a non-negative integer, got bool")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a Python int (reading a tensor here would sync the device)")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be a non-negative integer, got {type(value).__name__}") from None
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number}")
    if number > _INT64_MAX:
        raise ValueError(f"{what} must be <= 2**63 - 1 (the largest integer OTLP carries), got {number}")
    return number


def _fold_by_device(tensors: list[Any], torch: Any) -> list[Any]:
    """One partial per device the tensors live on (almost always one)."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        return [_fold(tensors, torch)]
    groups: dict[Any, list[Any]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return [_fold(group, torch) for group in groups.values()]


def _fold_partials(partials: list[Any], torch: Any) -> list[Any]:
    """Combine partial results into one per device."""
    groups: dict[Any, list[Any]] = {}
    for partial in partials:
        groups.setdefault(partial.device, []).append(partial)
    return [group[0] if len(group) == 1 else _combine(group, torch) for group in groups.values()]


def _reduce_dtype(device_type: str, torch: Any) -> Any:
    """float64 for the sums, except on a device that has none (MPS): float32 there."""
    return torch.float32 if device_type in _NO_FLOAT64 else torch.float64


def _fold(tensors: list[Any], torch: Any) -> Any:
    """Reduce 0-d tensors of one device to [sum of finite, n finite, n non-finite, last, max, min, trailing]; no sync.

    max and min are of the finite values (-inf and inf when there is none);
    trailing is how many values at the end are non-finite in a row.
    """
    dtype = _reduce_dtype(tensors[0].device.type, torch)
    stacked = (
        torch.stack([t.to(dtype) for t in tensors])
        if len({t.dtype for t in tensors}) > 1
        else torch.stack(tensors)
    )
    stacked = stacked.to(dtype)
    size = stacked.shape[0]
    finite = torch.isfinite(stacked)
    count = finite.sum().to(dtype)
    # Python scalars, not filled tensors: fewer kernels per fold.
    index = torch.arange(size, device=stacked.device, dtype=dtype)
    last_finite = torch.where(finite, index, -1.0).max()
    return torch.stack(
        (
            torch.where(finite, stacked, 0.0).sum(),
            count,
            size - count,
            stacked[-1],
            torch.where(finite, stacked, -math.inf).max(),
            torch.where(finite, stacked, math.inf).min(),
            (size - 1) - last_finite,
        )
    )


def _combine(partials: list[Any], torch: Any) -> Any:
    """Partials in the order they were folded, combined into one; no sync."""
    stacked = torch.stack(partials)
    index = torch.arange(stacked.shape[0], device=stacked.device, dtype=stacked.dtype)
    # The trailing run of the whole: the trailing runs from the last partial that had a
    # finite value onwards (the partials after it were non-finite throughout).
    has_finite = stacked[:, 1] > 0
    start = torch.where(has_finite, index, torch.full_like(index, -1.0)).max()
    trailing = torch.where(index >= start, stacked[:, 6], torch.zeros_like(index)).sum()
    return torch.cat(
        (
            stacked[:, :3].sum(dim=0),
            stacked[-1, 3:4],
            stacked[:, 4].max().reshape(1),
            stacked[:, 5].min().reshape(1),
            trailing.reshape(1),
        )
    )


def _start_readback(series: _Series, torch: Any, on_failure: Any) -> list[Any]:
    """Reduce a series' tensors to one partial per device and start copying each to the host.

    Each device is handled apart: one that fails (calls ``on_failure``) costs only its own values.
    """
    groups: dict[Any, tuple[list[Any], list[Any]]] = {}
    for partial in series.partials:
        groups.setdefault(partial.device, ([], []))[0].append(partial)
    for tensor in series.deferred:
        groups.setdefault(tensor.device, ([], []))[1].append(tensor)
    handles = []
    for device, (partials, deferred) in groups.items():
        try:
            parts = partials + ([_fold(deferred, torch)] if deferred else [])
            partial = parts[0] if len(parts) == 1 else _combine(parts, torch)
            handles.append(_HostRead(partial) if device.type == "cpu" else _DeviceRead.start(partial, torch))
        except Exception:
            on_failure()
    return handles


class _HostRead:
    """A CPU tensor: readable right away."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def ready(self) -> bool:
        return True

    def values(self) -> list[float]:
        return self._tensor.tolist()


class _DeviceRead:
    """An asynchronous device-to-host copy into pinned memory, completed by polling an event."""

    def __init__(self, host: Any, event: Any) -> None:
        self._host = host
        self._event = event

    @classmethod
    def start(cls, tensor: Any, torch: Any) -> _DeviceRead:
        device = tensor.device
        if device.type == "cuda":
            with torch.cuda.device(device):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return cls(host, event)
        # Another accelerator (XPU, MPS, HPU, ...): the same steps through torch's
        # device-generic API, on that device's current stream.
        with torch.accelerator.device_index(device.index):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
        return cls(host, event)

    def ready(self) -> bool:
        return bool(self._event.query())

    def values(self) -> list[float]:
        return self._host.tolist()


def _poll_readbacks(
    pending: list[tuple[str, list[Any]]],
    carry: list[tuple[str, list[Any]]],
    on_failure: Any = None,
    wait_s: float | None = None,
    stop: threading.Event | None = None,
) -> list[tuple[str, _Folded]]:
    """Values of the finished read-backs; unfinished ones go to ``carry`` for the next collection.

    A read-back that raises is dropped alone (``on_failure(label)`` is called). The wait ends
    early when ``stop`` is set.
    """
    deadline = time.monotonic() + (_READBACK_WAIT_S if wait_s is None else wait_s)
    ready: list[tuple[str, _Folded]] = []
    for label, handles in pending:
        waiting = []
        for handle in handles:
            try:
                while not handle.ready() and time.monotonic() < deadline and not (stop and stop.is_set()):
                    time.sleep(0.001)
                if handle.ready():
                    ready.append((label, _Folded.from_values(handle.values())))
                else:
                    waiting.append(handle)
            except Exception:
                if on_failure is None:
                    raise
                on_failure(label)
        if waiting:
            carry.append((label, waiting))
    return ready

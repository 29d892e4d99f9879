"""`TrainingMetrics`: one cheap call per optimizer step, read when metrics are collected.

Why not one OpenTelemetry instrument call per value: each SDK call costs a few
microseconds, and the usual recipe calls ``loss.item()`` every step, which
stalls the GPU pipeline. Here ``record_step`` only updates plain Python
accumulators under a lock (about a microsecond for all six values) and keeps
device tensors as references. Everything else happens at collection time, on the
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
- device tensors are reduced on their own device and read back there without
  a sync (:mod:`openlora_otel.training.readback`). Values a GPU has not produced
  yet are carried into the next collection. A CPU tensor's value is ready, and is
  read at the call like a number (:func:`~.arguments._cpu_number`).
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

Each reader of the provider ``setup_telemetry`` builds reports the steps since
its own previous collection (:mod:`openlora_otel.training.window`). Here: the
instruments, the step path (the record calls, on the caller's thread; their
argument checks are :mod:`openlora_otel.training.arguments`), the guard's
thread, and the collection that takes the window and judges it once.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.names import (
    ATTR_EVAL_METRIC,
    ATTR_GUARD_REASON,
    ATTR_TRAINING_PHASE,
    GUARD_REASONS,
    STEP_DURATION_BUCKETS,
    TRAINING_PHASES,
)
from openlora_otel.training.arguments import (
    INT64_MAX,
    MAX_STEP_TIME_S,
    Foreign,
    adapter_values,
    checked_count,
    checked_positive,
    checked_seconds,
    host_number,
    prepare_value,
)
from openlora_otel.training.goodput import PhaseClock, ProgressFile
from openlora_otel.training.guard import DivergenceGuard, Trip
from openlora_otel.training.readback import fold_by_device, fold_partials, poll_readbacks, start_readback
from openlora_otel.training.window import (
    FOLD_EVERY,
    MAX_FOREIGN,
    MAX_UNFOLDED,
    Readers,
    Recording,
    Series,
    Snapshot,
    Window,
    collecting_for,
    loss_window,
    span_snapshot,
)
from openlora_otel.windows import replay, window_merging_works, window_view

__all__ = ["TrainingMetrics", "collecting_for", "step_duration_view"]

_logger = logging.getLogger(__name__)

# How long the guard's own check polls (its thread has nothing else to do).
_GUARD_READBACK_WAIT_S = 5.0
_MAX_EVAL_METRICS = 64
_DURATION = "openlora.training.step.duration"


class _Total:
    """A synchronous counter and what was added to it, kept within int64 (saturates rather than poisons exports)."""

    __slots__ = ("counter", "total")

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.total = 0

    def add(self, amount: int) -> bool:
        """Add ``amount``; False when the total reached int64's maximum and part of it was not counted."""
        room = INT64_MAX - self.total
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

    - ``loss``, ``grad_norm``: a Python or NumPy real number, a 0-d NumPy array
      of an integer or float dtype (read as its scalar), or a one-element tensor
      on the CPU (read at once: its value is ready), a CUDA device or the current
      ``torch.accelerator`` (never read on the calling thread). NaN/inf are counted, not averaged. A multi-element
      tensor, a NumPy array of one or more dimensions, a sparse tensor of one or
      more dimensions, a ``meta`` tensor (it has no data) or a tensor on another
      kind of device raises ``ValueError``; a string, ``bool`` or ``np.bool_``,
      a complex number, ``None``-like, or a tensor-like whose ``numel()`` raises
      raises ``TypeError``. ``grad_norm`` must not be negative.
    - ``learning_rate``: the same, and not negative.
    - ``tokens``, ``samples``: integers from 0 to 2**63 - 1 (Python or NumPy); a
      tensor raises ``TypeError`` because counting it would need a device read.
    - ``step_time_s``: seconds from 0 to ``MAX_STEP_TIME_S`` (86400, one day);
      when omitted, the time since the previous ``record_step`` call is used
      (nothing for the first call). Longer, NaN or infinite raises
      ``ValueError``: past a day it is a unit mistake or garbage (``1e308`` would
      leave the step-duration histogram's ``_sum`` at +Inf for the rest of the
      run), and clamping would record a day-long step that never happened.
    - ``data_time_s``: seconds this step waited for its batch, within the same
      bounds. The wait fraction is measured against the wall time between
      consecutive ``record_step`` calls, whatever ``step_time_s`` covers.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        step_duration_buckets: Sequence[float] = STEP_DURATION_BUCKETS,
        window_histogram: bool = False,
        peak_flops: float | None = None,
        readers: Iterable[Hashable] = (),
        run_id: str = "",
        attempt: int = 1,
    ) -> None:
        if list(step_duration_buckets) != list(STEP_DURATION_BUCKETS):
            raise ValueError(
                "custom step_duration_buckets are not supported yet; use names.STEP_DURATION_BUCKETS"
            )
        self._merge_windows = bool(window_histogram) and window_merging_works()
        self._recording = Recording(started=time.monotonic())  # the window the record calls fill
        self._last_call: float | None = None
        started = time.monotonic()
        self._readers = Readers(readers, started)
        self._carry: list[tuple[str, Any]] = []  # GPU read-backs not finished at the previous collection
        self._epoch: float | None = None
        self._eval_loss: float | None = None
        self._eval: dict[str, float] = {}
        self._adapter: dict[str, float] = {}
        # Model FLOPs: per token from set_model_flops(); the peak given there, unless
        # the configuration (OPENLORA_PEAK_FLOPS) set one, which wins.
        self._flops_per_token: float | None = None
        self._configured_peak = None if peak_flops is None else checked_positive(peak_flops, "peak_flops")
        self._peak_flops = self._configured_peak
        self._guard: DivergenceGuard | None = None
        self._guard_lock = threading.Lock()  # orders a guard's look at the current window against _roll
        self._guard_stop = threading.Event()  # ends the guard's check thread (close())
        self._steps_recorded = 0  # for Trip.steps: committed windows' steps
        self._warned: set[str] = set()
        # Where the process's time goes (goodput), and the file that carries the highest step to
        # the next attempt (track_progress()).
        self._clock = PhaseClock()
        self._run_id = run_id
        self._attempt = attempt
        self._progress: ProgressFile | None = None
        self._phases_started = False

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
        self._time = raw_counter("openlora.training.time")
        self._lost_steps = raw_counter("openlora.training.steps.lost")
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
        if last is None:
            self._clock.first_step(now)
        elif self._clock.stalled:
            self._clock.unstall(now)
        if step_time_s is None:
            step_time = None if last is None else now - last
        else:
            # The check inline for the usual float; the call only for anything else.
            if type(step_time_s) is not float or not 0.0 <= step_time_s <= MAX_STEP_TIME_S:
                step_time_s = checked_seconds(step_time_s, "step_time_s")
            step_time = step_time_s
        if data_time_s is not None and (
            type(data_time_s) is not float or not 0.0 <= data_time_s <= MAX_STEP_TIME_S
        ):
            data_time_s = checked_seconds(data_time_s, "data_time_s")
        # `x >> 63` is 0 exactly for 0 <= x < 2**63: one operation for both bounds.
        if tokens is not None and (type(tokens) is not int or tokens >> 63):
            tokens = checked_count(tokens, "tokens")
        if samples is not None and (type(samples) is not int or samples >> 63):
            samples = checked_count(samples, "samples")
        # Validate everything before touching state: a call that raises records nothing.
        if loss is not None and type(loss) is not float:
            loss = prepare_value(loss, "loss")
        if grad_norm is not None and (type(grad_norm) is not float or grad_norm < 0.0):
            grad_norm = prepare_value(grad_norm, "grad_norm")
        if learning_rate is not None and (type(learning_rate) is not float or learning_rate < 0.0):
            learning_rate = prepare_value(learning_rate, "learning_rate")
        recording = self._recording
        with recording.lock:
            if recording.closed:
                return
            window = recording.window
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
            None if v is None else prepare_value(v, what)
            for v, what in ((loss, "loss"), (grad_norm, "grad_norm"), (learning_rate, "learning_rate"))
        ]
        recording = self._recording
        with recording.lock:
            if recording.closed:
                return
            window = recording.window
            for series, value in zip((window.loss, window.grad, window.lr), values, strict=True):
                if value is None:
                    continue
                if type(value) is float:
                    series.add_host(value)
                else:
                    self._defer(series, value)

    def _defer(self, series: Series, value: Any) -> None:
        """Keep a tensor (lock held); fold torch tensors on their device every ``FOLD_EVERY``."""
        if type(value) is Foreign:
            if len(series.foreign) < MAX_FOREIGN:
                series.foreign.append(value.value)
            else:
                self._recording.dropped_foreign += 1
            return
        deferred = series.deferred
        if series.fold_failed:
            # One failed attempt per window: retrying on each step would re-stack the whole
            # growing list under the lock (milliseconds per step after a few thousand).
            if len(deferred) < MAX_UNFOLDED:
                deferred.append(value)
            else:
                self._recording.dropped_unfolded += 1
            return
        deferred.append(value)
        if len(deferred) >= FOLD_EVERY:
            torch = sys.modules["torch"]
            try:
                series.partials.extend(fold_by_device(deferred, torch))
                series.deferred = []
                if len(series.partials) >= FOLD_EVERY:
                    series.partials = fold_partials(series.partials, torch)
            except Exception:  # never let bookkeeping break the step; read them all at collection instead
                series.fold_failed = True
                self._warn_once(
                    "fold",
                    f"folding kept tensors failed; this window keeps up to {MAX_UNFOLDED} of them "
                    "for its collection (the next window folds again)",
                    exc=True,
                )

    # -- other records ----------------------------------------------------------
    def record_epoch(self, epoch: float) -> None:
        """Set the current epoch (may be fractional, as the Hugging Face Trainer reports it)."""
        value = host_number(epoch, "epoch")
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
            values["loss"] = host_number(loss, "loss")
        for key, value in metrics.items():
            if value is not None:
                values[key] = host_number(value, key)
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
        self._adapter = adapter_values(
            r, alpha, dropout, target_modules, trainable_params=trainable_params, total_params=total_params
        )

    def set_model_flops(self, per_token: float, *, peak_flops: float | None = None) -> None:
        """Set the model's training FLOPs per token, and the peak FLOP/s of this process's device.

        Achieved FLOP/s is then tokens/s x ``per_token``, and model FLOPs
        utilization is achieved / peak. ``peak_flops`` is ignored when the
        configuration gave one (``OPENLORA_PEAK_FLOPS``); with neither, only the
        achieved FLOP/s is reported (on a CPU, say). See
        :func:`openlora_otel.training.flops.training_flops_per_token` for the estimate.
        """
        flops = checked_positive(per_token, "per_token")
        peak = None if peak_flops is None else checked_positive(peak_flops, "peak_flops")
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
        guard.bind(
            lambda reason: self._guard_trips.add(1, {ATTR_GUARD_REASON: reason}),
            lambda: self._steps_recorded + self._recording.window.steps,
        )
        if not self._recording.closed:
            guard.start(lambda: self._guard_check(guard), self._guard_stop)
        return guard

    def _guard_check(self, guard: DivergenceGuard) -> None:
        """What the guard's thread runs every ``check_interval_s`` (never raises: the thread goes on)."""
        if self._recording.closed:
            return  # close() is about to set _guard_stop, which ends the thread
        try:
            self._check_current_window(guard)
        except Exception:
            self._warn_once("guard", "the divergence guard's check failed; it retries", exc=True)

    def _check_current_window(self, guard: DivergenceGuard) -> None:
        """Show the guard the window so far, read back the collection's way, without taking it."""
        recording = self._recording
        with recording.lock:
            window = recording.window
            loss = window.loss.copy()
            steps = self._steps_recorded + window.steps
        if not (loss.count or loss.nonfinite or loss.deferred or loss.partials or loss.foreign):
            return
        for item in loss.foreign:
            loss.add_host(float(item))
        if loss.deferred or loss.partials:
            failed: list[str] = []
            handles = start_readback(
                loss.partials, loss.deferred, sys.modules.get("torch"), lambda: failed.append("loss")
            )
            waiting: list[tuple[str, list[Any]]] = []
            # This thread has nothing else to do: it waits for a device that runs far behind
            # the host as long as the window lasts, rather than giving up and starting over.
            for _, folded in poll_readbacks(
                [("loss", handles)], waiting, wait_s=_GUARD_READBACK_WAIT_S, stop=self._guard_stop
            ):
                loss.merge(folded)
            if failed or waiting:
                return  # not readable yet: the next check or the collection sees it
        with self._guard_lock:
            if recording.window is not window:  # the collection took it and judges it whole
                return
            trip = guard.observe(loss_window(loss, steps), complete=False)
        if trip is not None:
            guard.fire(trip)

    # -- where the time goes (goodput) ------------------------------------------
    def phase(self, name: str) -> Any:
        """A context manager whose time counts as phase ``name`` of ``openlora.training.time``.

        ``name``: ``evaluation``, ``checkpoint_save`` or ``checkpoint_load`` (others raise
        ``ValueError``). ``with telemetry.training.phase("checkpoint_save"): save(...)``. Cheap (under
        a microsecond), reusable, safe to nest (the innermost counts) and to leave by an exception.
        The HF and Lightning callbacks mark these phases themselves.
        """
        return self._clock.phase(name)

    def resumed(self, step: int, *, reached: int | None = None) -> int:
        """Say that this attempt continues from global step ``step`` (a checkpoint's).

        ``reached``: the highest step an earlier attempt of the run got to, if known (default: what
        the progress file of :meth:`track_progress` holds). The next ``reached - step`` steps are
        done again: their time counts as ``lost_progress`` and ``openlora.training.steps.lost``
        counts them. Returns that number.
        """
        step = checked_count(step, "step")
        if reached is None and self._progress is not None:
            reached = self._progress.earlier_attempt(step, run_id=self._run_id)
        elif reached is not None:
            reached = checked_count(reached, "reached")
        lost = self._clock.resumed(step, reached)
        if lost:
            _logger.info(
                "openlora-otel: resuming at step %d after an earlier attempt reached step %d: %d steps lost",
                step, reached, lost,
            )  # fmt: skip
        return lost

    def track_progress(self, path: Any) -> ProgressFile:
        """Keep the highest global step in ``path``: a directory (made when first written, if missing) gets
        ``openlora-progress.json``; a path ending in ``.json`` is the file.

        Written at each collection and at shutdown (``Telemetry.shutdown()``, which also runs on SIGTERM
        and at interpreter exit), whatever the exporter: steps a pull endpoint was never scraped for
        count too. So an attempt started after a crash knows how far this one got (:meth:`resumed`
        reads it). Call it before :meth:`resumed`.
        """
        self._progress = ProgressFile(path)
        return self._progress

    def save_progress(self, timeout_s: float = 1.0) -> None:
        """Write the progress file of :meth:`track_progress` now, with every step recorded so far,
        collected or not (none tracked: nothing to do). ``Telemetry.shutdown()`` calls it after the
        final collection; with a pull endpoint nobody may collect at the end.

        A collection counts the steps of the window it took between taking it and booking it; this
        waits for that (at most ``timeout_s``, then writes what it knows) so no step is left out.
        """
        progress = self._progress
        if progress is None:
            return
        # _roll holds the guard lock from taking the window until its steps are in the clock.
        locked = self._guard_lock.acquire(timeout=max(0.0, timeout_s))
        try:
            step = min(self._clock.global_step + self._recording.window.steps, INT64_MAX)
        finally:
            if locked:
                self._guard_lock.release()
        progress.write(step, run_id=self._run_id, attempt=self._attempt)

    @property
    def global_step(self) -> int:
        """The run's step as this attempt knows it: the step it resumed at plus the steps recorded since
        (counted at collections)."""
        return self._clock.global_step

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
        self._recording.closed = True
        self._clock.close(time.perf_counter(), last_step=self._last_call)
        self._guard_stop.set()

    def join_guard(self, timeout_s: float) -> bool:
        """After :meth:`close`, wait (at most ``timeout_s``) for the guard's check thread to end;
        True when none is left running. A check in the middle of reading the device back gives up
        at once on close, so the thread never touches the device after the shutdown (at
        interpreter exit CUDA may already be going away)."""
        guard = self._guard
        return guard is None or guard.join(timeout_s)

    # -- collection ---------------------------------------------------------------
    @property
    def _snapshot(self) -> Snapshot:
        """What the gauges of the collection on this thread report."""
        return self._readers.snapshot()

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
            self._guard.fire(trip)  # after the lock: on_trip may collect

    def _roll_locked(self, now: float) -> Trip | None:
        """Take the window, read it back and judge it; returns a new trip of the guard, if any."""
        recording = self._recording
        with recording.lock:
            window, recording.window = recording.window, Window(started=now)
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
                handles = start_readback(
                    series.partials, series.deferred, torch, lambda label=label: self._fail_read(label, failed)
                )
                if handles:
                    pending.append((label, handles))
        ready = poll_readbacks(pending, self._carry, lambda label: self._fail_read(label, failed))
        merged = {"loss": window.loss, "grad": window.grad, "lr": window.lr}
        for label, folded in ready:
            merged[label].merge(folded)

        self._steps_recorded += window.steps
        guard = self._guard
        trip = None
        if guard is not None and "loss" not in failed:
            trip = guard.observe(loss_window(window.loss, self._steps_recorded), complete=True)
        if not self._loss_nonfinite.add(window.loss.nonfinite) or not self._grad_nonfinite.add(
            window.grad.nonfinite
        ):
            self._warn_saturated()
        # The window goes to every reader's span; the collecting reader reports its span.
        reader, span = self._readers.take(window, now)
        snapshot = span_snapshot(span, reader.snapshot, now, failed)
        if span.last_step is not None:
            # The step's perf_counter() reading, placed on the wall clock as it reads now: an age
            # computed against the current wall clock (Prometheus's time()) stays right even if
            # the wall clock was stepped since, and the step path pays no time.time() call.
            snapshot.last_step_time = time.time() - (time.perf_counter() - span.last_step)
        reader.snapshot = snapshot
        if recording.dropped_foreign:
            self._warn_once(
                "foreign", f"{recording.dropped_foreign} tensor-like values dropped (no collection for too long)"
            )
        if recording.dropped_unfolded:
            self._warn_once(
                "unfolded",
                f"{recording.dropped_unfolded} loss / gradient norm / learning rate tensors dropped: folding "
                f"them failed and more than {MAX_UNFOLDED} waited for one collection",
            )
        return trip

    def _commit(self, window: Window) -> None:
        """Hand the window's counts and step durations to the SDK's synchronous instruments."""
        try:
            self._book_time(window)
        except Exception:  # the step counts below must be handed over whatever happens here
            self._warn_once("goodput", "booking the time per phase failed; openlora.training.time misses it", exc=True)
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

    def _book_time(self, window: Window) -> None:
        """Add the seconds per phase since the previous collection, and the steps lost to a restart."""
        # data_timed: the waits of steps that had a step before them (the first step's wait is start-up's).
        spent = self._clock.take(
            time.perf_counter(), steps=window.steps, data_wait=window.data_timed, last_step=window.last_step
        )
        if not self._phases_started:
            # Every phase from the first collection on: a series born later would lose its
            # first increase in PromQL's increase() and rate().
            self._phases_started = True
            for phase in TRAINING_PHASES:
                spent.setdefault(phase, 0.0)
            self._lost_steps.add(0)
        for phase, seconds in spent.items():
            self._time.add(seconds, {ATTR_TRAINING_PHASE: phase})
        lost = self._clock.take_lost_steps()
        if lost:
            self._lost_steps.add(lost)
        if self._progress is not None:
            self._progress.write(self._clock.global_step, run_id=self._run_id, attempt=self._attempt)

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


def step_duration_view() -> Any:
    """The ``View`` that lets ``openlora.training.step.duration`` take a whole window per collection.

    Pass it to ``MeterProvider(views=[...])`` and build ``TrainingMetrics(meter,
    window_histogram=True)`` on that provider; ``setup_telemetry`` does both. It
    keeps the same buckets (``names.STEP_DURATION_BUCKETS``); on an SDK whose
    internals no longer fit, it is a plain explicit-bucket view and windows are replayed.
    """
    return window_view(_DURATION, STEP_DURATION_BUCKETS)

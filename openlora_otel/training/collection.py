"""What a metric reader's collection does with the training window: take it, commit it, read it back, judge it.

:class:`~openlora_otel.training.metrics.TrainingMetrics` keeps the step path; :class:`Collection`
does everything that may be slow, wait on a device or fail, on the collecting thread. The window's
counts go to synchronous SDK counters first, so a collection that fails after taking the window
neither loses nor repeats it. See docs/concepts/collection.md.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.names import (
    ATTR_GUARD_REASON,
    ATTR_TRAINING_PHASE,
    GUARD_REASONS,
    STEP_DURATION_BUCKETS,
    TRAINING_PHASES,
)
from openlora_otel.training.arguments import INT64_MAX
from openlora_otel.training.goodput import PhaseClock
from openlora_otel.training.guard import DivergenceGuard, Trip
from openlora_otel.training.readback import poll_readbacks, start_readback
from openlora_otel.training.window import (
    MAX_UNFOLDED,
    Readers,
    Recording,
    Snapshot,
    Window,
    loss_window,
    observed,
    span_snapshot,
)
from openlora_otel.window_histograms import (
    exponential_merging_works,
    replay,
    window_merging_works,
    window_view,
)

__all__ = ["Collection", "step_duration_view"]

# How long the guard's own check polls (its thread has nothing else to do).
_GUARD_READBACK_WAIT_S = 5.0
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


class Collection:
    """Takes the step path's window at each collection and judges it once: the window's instruments and guard.

    ``recording``: what the step path fills. ``readers`` and ``window_histogram``: as
    :class:`~openlora_otel.training.metrics.TrainingMetrics` takes them; ``started``: when the
    first window started. ``clock`` books the time per phase at each collection;
    ``warn(key, message, exc=False)`` logs once per key; ``write_progress(step)`` keeps the
    progress file, if one is tracked.
    """

    def __init__(
        self,
        meter: Meter,
        recording: Recording,
        *,
        readers: Iterable[Hashable],
        started: float,
        window_histogram: bool,
        exponential: bool = False,
        clock: PhaseClock,
        warn: Callable[..., None],
        write_progress: Callable[[int], None],
    ) -> None:
        self._recording = recording
        self._merge_windows = bool(window_histogram) and (
            exponential_merging_works() if exponential else window_merging_works()
        )
        self._readers = Readers(readers, started)
        self._carry: list[tuple[str, Any]] = []  # GPU read-backs not finished at the previous collection
        self._clock = clock
        self._phases_started = False
        self._warn_once = warn
        self._write_progress = write_progress
        self.guard: DivergenceGuard | None = None
        self._guard_lock = threading.Lock()  # orders a guard's look at the current window against _roll
        self._guard_stop = threading.Event()  # ends the guard's check thread (stop_guard())
        self.steps_recorded = 0  # for Trip.steps: committed windows' steps

        spec = {m.name: m for m in names.TRAINING_METRICS}

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
        gauge("openlora.training.gradient_norm", lambda o: observed(self.snapshot().grad))
        gauge("openlora.training.loss.max", lambda o: observed(self.snapshot().loss_max))
        gauge("openlora.training.loss.min", lambda o: observed(self.snapshot().loss_min))
        gauge("openlora.training.gradient_norm.max", lambda o: observed(self.snapshot().grad_max))
        gauge("openlora.training.gradient_norm.min", lambda o: observed(self.snapshot().grad_min))
        gauge("openlora.training.data_wait.duration", lambda o: observed(self.snapshot().data_wait))
        gauge("openlora.training.data_wait.fraction", lambda o: observed(self.snapshot().data_fraction))
        gauge("openlora.training.learning_rate", lambda o: observed(self.snapshot().lr))
        gauge("openlora.training.window.steps", lambda o: observed(self.snapshot().window_steps))
        gauge("openlora.training.last_step.timestamp", lambda o: observed(self.snapshot().last_step_time))
        gauge("openlora.training.throughput.tokens", lambda o: observed(self.snapshot().tokens_per_s))
        gauge("openlora.training.throughput.samples", lambda o: observed(self.snapshot().samples_per_s))

    def snapshot(self) -> Snapshot:
        """What the gauges of the collection on this thread report."""
        return self._readers.snapshot()

    # -- the guard ----------------------------------------------------------------
    def attach(self, guard: DivergenceGuard) -> None:
        """Judge every window with ``guard`` and start its check thread (``TrainingMetrics.attach_guard``).

        The same guard again does nothing; another raises ``ValueError``.
        """
        with self._guard_lock:
            if self.guard is guard:
                return
            if self.guard is not None:
                raise ValueError("a divergence guard is already attached to this TrainingMetrics")
            self.guard = guard
        for reason in GUARD_REASONS:  # the series exist from the start, so increase() sees the first trip
            self._guard_trips.add(0, {ATTR_GUARD_REASON: reason})
        guard.bind(
            lambda reason: self._guard_trips.add(1, {ATTR_GUARD_REASON: reason}),
            lambda: self.steps_recorded + self._recording.window.steps,
        )
        if not self._recording.closed:
            guard.start(lambda: self._guard_check(guard), self._guard_stop)

    def stop_guard(self) -> None:
        """End the guard's check thread; a check waiting on the device gives up at once (``close()``)."""
        self._guard_stop.set()

    def join_guard(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the guard's check thread to end; True when none is left running."""
        guard = self.guard
        return guard is None or guard.join(timeout_s)

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
            steps = self.steps_recorded + window.steps
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

    def global_step_now(self, timeout_s: float) -> int:
        """The global step with every step recorded so far, collected or not (``save_progress()``).

        A collection counts the steps of the window it took between taking it and booking them; this
        waits for that (at most ``timeout_s``, then counts what it knows) so no step is left out.
        """
        # _roll holds the guard lock from taking the window until its steps are in the clock.
        locked = self._guard_lock.acquire(timeout=max(0.0, timeout_s))
        try:
            return min(self._clock.global_step + self._recording.window.steps, INT64_MAX)
        finally:
            if locked:
                self._guard_lock.release()

    # -- collection ---------------------------------------------------------------
    def _observe_loss(self, options: CallbackOptions) -> list[Observation]:
        try:
            self._roll()
        except Exception:  # the scrape must survive anything a tensor read throws
            self._warn_once(
                "roll", "reading training values failed; this collection reports stale values", exc=True
            )
        return observed(self.snapshot().loss)

    def _roll(self) -> None:
        now = time.monotonic()
        # The guard lock is held from the swap until the guard has seen this window whole
        # (below): a check of the new window in between would count the old one's
        # non-finite run twice. Only the guard's thread ever waits for it.
        with self._guard_lock:
            trip = self._roll_locked(now)
        if trip is not None and self.guard is not None:
            self.guard.fire(trip)  # after the lock: on_trip may collect

    def _roll_locked(self, now: float) -> Trip | None:
        """Take the window, read it back and judge it; returns a new trip of the guard, if any."""
        recording = self._recording
        with recording.lock:
            window, recording.window = recording.window, Window(started=now, durations=recording.new_durations())
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

        self.steps_recorded += window.steps
        guard = self.guard
        trip = None
        if guard is not None and "loss" not in failed:
            trip = guard.observe(loss_window(window.loss, self.steps_recorded), complete=True)
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
        self._write_progress(self._clock.global_step)

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


def step_duration_view(*, exponential: bool = False) -> Any:
    """The ``View`` that lets ``openlora.training.step.duration`` take a whole window per collection.

    Pass it to ``MeterProvider(views=[...])`` and build ``TrainingMetrics(meter,
    window_histogram=True)`` on that provider; ``setup_telemetry`` does both. It
    keeps the same buckets (``names.STEP_DURATION_BUCKETS``), or base-2 exponential ones with
    ``exponential`` (and ``TrainingMetrics(..., exponential_histograms=True)``); on an SDK whose
    internals no longer fit, it is a plain view of that kind and windows are replayed.
    """
    return window_view(_DURATION, STEP_DURATION_BUCKETS, exponential=exponential)

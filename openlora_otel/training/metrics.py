"""`TrainingMetrics`: one cheap call per optimizer step, read when metrics are collected.

``record_step`` updates plain accumulators under a lock and keeps device tensors as references
(never ``loss.item()``, which stalls the GPU pipeline); everything else happens at collection
(:mod:`openlora_otel.training.collection`). Here: the step path and the public API, sharing one
:class:`~.window.Recording` with the collection. See docs/concepts/no-sync.md.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import Meter

from openlora_otel.names import STEP_DURATION_BUCKETS
from openlora_otel.training.arguments import (
    MAX_STEP_TIME_S,
    Foreign,
    adapter_values,
    checked_count,
    checked_positive,
    checked_seconds,
    prepare_value,
)
from openlora_otel.training.collection import Collection, step_duration_view
from openlora_otel.training.goodput import PhaseClock, ProgressFile
from openlora_otel.training.guard import DivergenceGuard
from openlora_otel.training.readback import fold_by_device, fold_partials
from openlora_otel.training.values import RunValues
from openlora_otel.training.window import (
    FOLD_EVERY,
    MAX_FOREIGN,
    MAX_UNFOLDED,
    Recording,
    Series,
    collecting_for,
)

__all__ = ["TrainingMetrics", "collecting_for", "step_duration_view"]

_logger = logging.getLogger(__name__)


class TrainingMetrics:
    """Training instruments under ``openlora.training.*`` and ``openlora.adapter.*``.

    Get it as ``telemetry.training``, or build one from any OpenTelemetry ``Meter``. Safe to call
    from several threads; calls after :meth:`close` (which ``Telemetry.shutdown()`` calls) are
    accepted and ignored.

    ``readers``: keys of the readers that collect under :func:`collecting_for` (``setup_telemetry``
    passes its own), each with a window of its own from the start (a key first seen at a collection
    starts from that collection). ``window_histogram``: set it only when the meter's provider was
    built with :func:`step_duration_view` (``setup_telemetry`` does both): each collection then hands
    the step-duration histogram one pre-bucketed window instead of one SDK call per step.
    ``exponential_histograms``: the provider was built with ``step_duration_view(exponential=True)``
    (``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram``):
    the window counts step durations into fine exponential buckets instead of the explicit ones.

    Every call checks its arguments: a wrong type raises at once, a non-finite value is data and is
    counted. Loss, gradient norm and learning rate may stay one-element device tensors (never read on
    the calling thread); see "Argument rules" in docs/getting-started/training-loop.md.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        step_duration_buckets: Sequence[float] = STEP_DURATION_BUCKETS,
        window_histogram: bool = False,
        exponential_histograms: bool = False,
        peak_flops: float | None = None,
        readers: Iterable[Hashable] = (),
        run_id: str = "",
        attempt: int = 1,
    ) -> None:
        if list(step_duration_buckets) != list(STEP_DURATION_BUCKETS):
            raise ValueError(
                "custom step_duration_buckets are not supported yet; use names.STEP_DURATION_BUCKETS"
            )
        # The window the record calls fill.
        self._recording = Recording(started=time.monotonic(), exponential=exponential_histograms)
        self._last_call: float | None = None
        started = time.monotonic()
        configured_peak = None if peak_flops is None else checked_positive(peak_flops, "peak_flops")
        self._warned: set[str] = set()
        # Where the process's time goes (goodput), and the file that carries the highest step to
        # the next attempt (track_progress()).
        self._clock = PhaseClock()
        self._run_id = run_id
        self._attempt = attempt
        self._progress: ProgressFile | None = None

        # The window's instruments, its guard and what each collection does with it.
        self._collection = Collection(
            meter,
            self._recording,
            readers=readers,
            started=started,
            window_histogram=window_histogram,
            exponential=exponential_histograms,
            clock=self._clock,
            warn=self._warn_once,
            write_progress=self._write_progress,
        )
        # Epoch, evaluation, adapter and model FLOPs, and their gauges (after the window's).
        self._values = RunValues(
            meter,
            configured_peak=configured_peak,
            tokens_per_s=lambda: self._collection.snapshot().tokens_per_s,
            warn=self._warn_once,
        )

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
        self._values.record_epoch(epoch)

    def record_eval(self, loss: Any = None, **metrics: Any) -> None:
        """Record an evaluation: its loss and any other named metrics (accuracy=..., perplexity=...).

        Values are read at once (evaluation is not the step path); tensors are
        converted with ``float()``. A NaN or infinite value is data, not an
        error: OpenTelemetry cannot export it, so that series shows no value
        until a finite one is recorded; ``openlora.training.eval.nonfinite``
        counts it (per metric name) and one warning per name says so. At most
        64 names besides the loss are kept; more are ignored with one warning.
        """
        self._values.record_eval(loss, metrics)

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
        self._values.set_adapter(
            adapter_values(
                r, alpha, dropout, target_modules, trainable_params=trainable_params, total_params=total_params
            )
        )

    def set_model_flops(self, per_token: float, *, peak_flops: float | None = None) -> None:
        """Set the model's training FLOPs per token, and the peak FLOP/s of this process's device.

        Achieved FLOP/s is then tokens/s x ``per_token``, and model FLOPs
        utilization is achieved / peak. ``peak_flops`` is ignored when the
        configuration gave one (``OPENLORA_PEAK_FLOPS``); with neither, only the
        achieved FLOP/s is reported (on a CPU, say). See
        :func:`openlora_otel.training.flops.training_flops_per_token` for the estimate.
        """
        self._values.set_model_flops(per_token, peak_flops)

    def attach_guard(self, guard: DivergenceGuard) -> DivergenceGuard:
        """Watch the losses with ``guard`` (see :mod:`openlora_otel.training.guard`); returns it.

        Starts the guard's check thread. One guard per ``TrainingMetrics``:
        attaching the same one again does nothing, another raises ``ValueError``.
        """
        if not isinstance(guard, DivergenceGuard):
            raise TypeError(f"attach_guard takes a DivergenceGuard, got {type(guard).__name__}")
        self._collection.attach(guard)
        return guard

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
        step = self._collection.global_step_now(timeout_s)
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
        self._collection.stop_guard()

    def join_guard(self, timeout_s: float) -> bool:
        """After :meth:`close`, wait (at most ``timeout_s``) for the guard's check thread to end;
        True when none is left running. A check in the middle of reading the device back gives up
        at once on close, so the thread never touches the device after the shutdown (at
        interpreter exit CUDA may already be going away)."""
        return self._collection.join_guard(timeout_s)

    @property
    def _guard(self) -> DivergenceGuard | None:
        """The attached guard, if any (``Telemetry`` reads it to decide the run's outcome)."""
        return self._collection.guard

    def _write_progress(self, step: int) -> None:
        """Keep ``step`` in the progress file of :meth:`track_progress`, if any (each collection calls it)."""
        if self._progress is not None:
            self._progress.write(step, run_id=self._run_id, attempt=self._attempt)

    def _warn_once(self, key: str, message: str, *, exc: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning("openlora-otel: %s", message, exc_info=exc)


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
- tensors are reduced on their own device and read back there; for CUDA
  tensors the copy to the host is asynchronous and is only polled, never
  waited on with a synchronizing call, so ``torch.cuda.set_sync_debug_mode("error")``
  holds. Values a GPU has not produced yet are carried into the next collection.
- step durations are bucketed per step and replayed into the
  ``openlora.training.step.duration`` histogram at collection.

The window is shared by all readers: with two readers (say Prometheus and
OTLP), each reports the window since whichever collected last.
"""

from __future__ import annotations

import bisect
import logging
import math
import operator
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.names import ATTR_EVAL_METRIC, STEP_DURATION_BUCKETS

__all__ = ["TrainingMetrics"]

_logger = logging.getLogger(__name__)

# Tensors kept per window before they are folded on their device into one partial
# result (one small reduction per this many steps keeps memory flat without a reader).
_FOLD_EVERY = 512
# Tensor-like objects that are not torch tensors (duck-typed test doubles, other
# frameworks) cannot be folded without reading them; beyond this they are dropped.
_MAX_FOREIGN = 65536
# How long a collection polls for a GPU read-back before carrying it to the next one.
_READBACK_WAIT_S = 0.2
# An empty window shorter than this keeps the previous throughput (two readers back to back).
_MIN_EMPTY_WINDOW_S = 1.0
_MAX_EVAL_METRICS = 64


class _Series:
    """Sum, count, non-finite count and last value of one scalar over a window, host values plus deferred tensors."""

    __slots__ = ("count", "deferred", "foreign", "last", "nonfinite", "partials", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.nonfinite = 0
        self.last: float | None = None
        self.deferred: list[Any] = []  # torch tensors, detached, not yet folded
        self.partials: list[Any] = []  # folded 4-vectors [sum_finite, n_finite, n_nonfinite, last] on device
        self.foreign: list[Any] = []  # tensor-likes that are not torch tensors

    def add_host(self, value: float) -> None:
        if value - value == 0.0:  # finite (NaN and inf give NaN)
            self.total += value
            self.count += 1
        else:
            self.nonfinite += 1
        self.last = value

    def merge(self, total: float, count: int, nonfinite: int, last: float | None) -> None:
        self.total += total
        self.count += count
        self.nonfinite += nonfinite
        if last is not None:
            self.last = last


@dataclass
class _Window:
    started: float
    steps: int = 0
    tokens: int = 0
    samples: int = 0
    loss: _Series = field(default_factory=_Series)
    grad: _Series = field(default_factory=_Series)
    lr: _Series = field(default_factory=_Series)
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_DURATION_BUCKETS) + 1))
    bucket_sums: list[float] = field(default_factory=lambda: [0.0] * (len(STEP_DURATION_BUCKETS) + 1))


@dataclass
class _Snapshot:
    """What the gauges report until the next collection."""

    loss: float | None = None
    grad: float | None = None
    lr: float | None = None
    window_steps: int = 0
    tokens_per_s: float | None = None
    samples_per_s: float | None = None


class TrainingMetrics:
    """Training instruments under ``openlora.training.*`` and ``openlora.adapter.*``.

    Get it as ``telemetry.training``, or build one from any OpenTelemetry
    ``Meter``. Safe to call from several threads; calls after :meth:`close`
    (which ``Telemetry.shutdown()`` calls) are accepted and ignored.

    Argument rules (checked on every call; a wrong type is a programming error
    and raises at once, a non-finite value is data and is counted):

    - ``loss``, ``grad_norm``: a Python or NumPy number, or a one-element tensor
      on any device (never read on the calling thread). NaN/inf are counted,
      not averaged. A multi-element tensor raises ``ValueError``; a string,
      ``bool`` or ``None``-like raises ``TypeError``. ``grad_norm`` must not be negative.
    - ``learning_rate``: the same, and not negative.
    - ``tokens``, ``samples``: non-negative integers (Python or NumPy); a tensor
      raises ``TypeError`` because counting it would need a device read.
    - ``step_time_s``: non-negative seconds; when omitted, the time since the
      previous ``record_step`` call is used (nothing for the first call).
    """

    def __init__(
        self, meter: Meter, *, step_duration_buckets: Sequence[float] = STEP_DURATION_BUCKETS
    ) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._bounds = list(step_duration_buckets)
        if self._bounds != list(STEP_DURATION_BUCKETS):
            raise ValueError(
                "custom step_duration_buckets are not supported yet; use names.STEP_DURATION_BUCKETS"
            )
        self._window = _Window(started=time.monotonic())
        self._last_call: float | None = None
        self._snapshot = _Snapshot()
        self._carry: list[tuple[str, Any]] = []  # GPU read-backs not finished at the previous collection
        # Cumulative totals (monotonic counters), updated at collection.
        self._steps = 0
        self._tokens = 0
        self._samples = 0
        self._loss_nonfinite = 0
        self._grad_nonfinite = 0
        self._epoch: float | None = None
        self._eval_loss: float | None = None
        self._eval: dict[str, float] = {}
        self._adapter: dict[str, float] = {}
        self._dropped_foreign = 0
        self._warned: set[str] = set()

        spec = {m.name: m for m in (*names.TRAINING_METRICS, *names.ADAPTER_METRICS)}

        def gauge(name: str, callback: Any) -> None:
            meter.create_observable_gauge(
                name, callbacks=[callback], unit=spec[name].unit, description=spec[name].description
            )

        def counter(name: str, callback: Any) -> None:
            meter.create_observable_counter(
                name, callbacks=[callback], unit=spec[name].unit, description=spec[name].description
            )

        # The first callback of every collection rolls the window; the rest read the snapshot.
        counter("openlora.training.steps", self._observe_steps)
        counter("openlora.training.tokens", lambda o: self._one(self._tokens))
        counter("openlora.training.samples", lambda o: self._one(self._samples))
        counter("openlora.training.loss.nonfinite", lambda o: self._one(self._loss_nonfinite))
        counter("openlora.training.gradient_norm.nonfinite", lambda o: self._one(self._grad_nonfinite))
        gauge("openlora.training.loss", lambda o: self._one(self._snapshot.loss))
        gauge("openlora.training.gradient_norm", lambda o: self._one(self._snapshot.grad))
        gauge("openlora.training.learning_rate", lambda o: self._one(self._snapshot.lr))
        gauge("openlora.training.window.steps", lambda o: self._one(self._snapshot.window_steps))
        gauge("openlora.training.throughput.tokens", lambda o: self._one(self._snapshot.tokens_per_s))
        gauge("openlora.training.throughput.samples", lambda o: self._one(self._snapshot.samples_per_s))
        gauge("openlora.training.epoch", lambda o: self._one(self._epoch))
        gauge("openlora.training.eval.loss", lambda o: self._one(self._eval_loss))
        gauge("openlora.training.eval.value", self._observe_eval)
        for adapter_spec in names.ADAPTER_METRICS:
            key = adapter_spec.name
            gauge(key, lambda o, key=key: self._one(self._adapter.get(key)))
        duration = spec["openlora.training.step.duration"]
        self._duration = meter.create_histogram(
            duration.name,
            unit=duration.unit,
            description=duration.description,
            explicit_bucket_boundaries_advisory=list(STEP_DURATION_BUCKETS),
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
    ) -> None:
        """Record one optimizer step. See the class docstring for what each argument accepts."""
        now = time.perf_counter()
        if step_time_s is None:
            last, self._last_call = self._last_call, now
            step_time = None if last is None else now - last
        else:
            self._last_call = now
            if type(step_time_s) is not float:
                step_time_s = _host_number(step_time_s, "step_time_s")
            if not step_time_s >= 0.0 or step_time_s == math.inf:
                raise ValueError(f"step_time_s must be finite and >= 0, got {step_time_s!r}")
            step_time = step_time_s
        if tokens is not None and (type(tokens) is not int or tokens < 0):
            tokens = _count(tokens, "tokens")
        if samples is not None and (type(samples) is not int or samples < 0):
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
            if step_time is not None:
                index = bisect.bisect_left(self._bounds, step_time)
                window.bucket_counts[index] += 1
                window.bucket_sums[index] += step_time

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
        deferred.append(value)
        if len(deferred) >= _FOLD_EVERY:
            torch = sys.modules["torch"]
            try:
                series.partials.extend(_fold_by_device(deferred, torch))
                series.deferred = []
                if len(series.partials) >= _FOLD_EVERY:
                    series.partials = _fold_partials(series.partials, torch)
            except Exception:  # never let bookkeeping break the step; read them all at collection instead
                self._warn_once(
                    "fold", "folding kept tensors failed; they are kept until collection", exc=True
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
        converted with ``float()``. Non-finite values are reported as they are.
        """
        if loss is not None:
            self._eval_loss = _host_number(loss, "loss")
        for key, value in metrics.items():
            if value is None:
                continue
            number = _host_number(value, key)
            if key not in self._eval and len(self._eval) >= _MAX_EVAL_METRICS:
                self._warn_once(
                    "eval", f"more than {_MAX_EVAL_METRICS} evaluation metric names; {key!r} ignored"
                )
                continue
            self._eval[key] = number

    def set_adapter(
        self,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        target_modules: int | Iterable[str] = 0,
        trainable_params: int | None = None,
        total_params: int | None = None,
    ) -> None:
        """Describe the LoRA adapter: rank, alpha, dropout, targeted modules, parameter counts."""
        rank = _count(r, "r")
        if rank == 0:
            raise ValueError("r must be > 0")
        alpha_value = _host_number(alpha, "alpha")
        dropout_value = _host_number(dropout, "dropout")
        if not 0.0 <= dropout_value < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        modules = (
            target_modules
            if isinstance(target_modules, int)
            else len(
                target_modules
                if isinstance(target_modules, (list, tuple, set, frozenset))
                else list(target_modules)
            )
        )
        adapter: dict[str, float] = {
            "openlora.adapter.rank": rank,
            "openlora.adapter.alpha": alpha_value,
            "openlora.adapter.dropout": dropout_value,
            "openlora.adapter.target_modules": _count(modules, "target_modules"),
        }
        if trainable_params is not None:
            adapter["openlora.adapter.parameters.trainable"] = _count(trainable_params, "trainable_params")
        if total_params is not None:
            total = _count(total_params, "total_params")
            adapter["openlora.model.parameters"] = total
            if trainable_params is not None:
                if trainable_params > total:
                    raise ValueError("trainable_params cannot exceed total_params")
                adapter["openlora.adapter.trainable.ratio"] = trainable_params / total if total else 0.0
        self._adapter = adapter

    def close(self) -> None:
        """Stop accepting records (idempotent); later calls are ignored.

        What was recorded before stays in the window, so a collection after
        ``close()`` (the final export of ``Telemetry.shutdown()``) still reports it.
        """
        with self._lock:
            self._closed = True

    # -- collection ---------------------------------------------------------------
    @staticmethod
    def _one(value: float | int | None) -> list[Observation]:
        return [] if value is None else [Observation(value)]

    def _observe_steps(self, options: CallbackOptions) -> list[Observation]:
        try:
            self._roll()
        except Exception:  # the scrape must survive anything a tensor read throws
            self._warn_once(
                "roll", "reading training values failed; this collection reports stale values", exc=True
            )
        return [Observation(self._steps)]

    def _observe_eval(self, options: CallbackOptions) -> list[Observation]:
        return [Observation(v, {ATTR_EVAL_METRIC: k}) for k, v in list(self._eval.items())]

    def _roll(self) -> None:
        now = time.monotonic()
        with self._lock:
            window, self._window = self._window, _Window(started=now)
        elapsed = now - window.started
        self._steps += window.steps
        self._tokens += window.tokens
        self._samples += window.samples

        pending = self._carry
        self._carry = []
        for label, series in (("loss", window.loss), ("grad", window.grad), ("lr", window.lr)):
            # One series failing to read (a tensor on a device that went away, a
            # foreign object that raises) must not cost the others, or the counts.
            try:
                for item in series.foreign:
                    series.add_host(float(item))
                if series.deferred or series.partials:
                    pending.append((label, _start_readback(series, sys.modules["torch"])))
            except Exception:
                self._warn_once(f"read-{label}", f"reading {label} values failed; they are dropped", exc=True)
        ready = _poll_readbacks(pending, self._carry)
        merged = {"loss": window.loss, "grad": window.grad, "lr": window.lr}
        for label, (total, count, nonfinite, last) in ready:
            merged[label].merge(total, count, nonfinite, last)

        self._loss_nonfinite += window.loss.nonfinite
        self._grad_nonfinite += window.grad.nonfinite
        previous = self._snapshot
        snapshot = _Snapshot(
            loss=window.loss.total / window.loss.count if window.loss.count else previous.loss,
            grad=window.grad.total / window.grad.count if window.grad.count else previous.grad,
            lr=window.lr.last
            if window.lr.last is not None and math.isfinite(window.lr.last)
            else previous.lr,
            window_steps=window.loss.count or window.grad.count,
        )
        if window.steps or elapsed >= _MIN_EMPTY_WINDOW_S:
            snapshot.tokens_per_s = window.tokens / elapsed if elapsed > 0 else previous.tokens_per_s
            snapshot.samples_per_s = window.samples / elapsed if elapsed > 0 else previous.samples_per_s
        else:
            snapshot.tokens_per_s, snapshot.samples_per_s = previous.tokens_per_s, previous.samples_per_s
        self._snapshot = snapshot

        # Replay the window's step durations into the histogram: per bucket, its
        # count at the bucket's mean, so counts and sum are exact.
        record = self._duration.record
        for count, total in zip(window.bucket_counts, window.bucket_sums, strict=True):
            if count:
                mean = total / count
                for _ in range(count):
                    record(mean)
        if self._dropped_foreign:
            self._warn_once(
                "foreign", f"{self._dropped_foreign} tensor-like values dropped (no collection for too long)"
            )

    def _warn_once(self, key: str, message: str, *, exc: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning("openlora-otel: %s", message, exc_info=exc)


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
        number = float(value)
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {value!r}")
        return number
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
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
        number = float(value)  # NumPy scalars, Decimal: host values, no device involved
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {number!r}")
        return number
    raise TypeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")


def _host_number(value: Any, what: str) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    try:
        return float(value)
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


def _fold(tensors: list[Any], torch: Any) -> Any:
    """Reduce 0-d tensors of one device to [sum of finite, n finite, n non-finite, last]; no sync."""
    stacked = (
        torch.stack([t.to(torch.float64) for t in tensors])
        if len({t.dtype for t in tensors}) > 1
        else torch.stack(tensors)
    )
    stacked = stacked.to(torch.float64)
    finite = torch.isfinite(stacked)
    zeros = torch.zeros_like(stacked)
    return torch.stack(
        (
            torch.where(finite, stacked, zeros).sum(),
            finite.sum().to(torch.float64),
            (~finite).sum().to(torch.float64),
            stacked[-1],
        )
    )


def _combine(partials: list[Any], torch: Any) -> Any:
    stacked = torch.stack(partials)
    return torch.cat((stacked[:, :3].sum(dim=0), stacked[-1, 3:]))


def _start_readback(series: _Series, torch: Any) -> Any:
    """Reduce a series' tensors to one partial per device and start copying each to the host."""
    partials = list(series.partials)
    if series.deferred:
        partials += _fold_by_device(series.deferred, torch)
    return [
        _DeviceRead.start(partial, torch) if partial.device.type != "cpu" else _HostRead(partial)
        for partial in _fold_partials(partials, torch)
    ]


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
        with torch.cuda.device(tensor.device):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return cls(host, event)

    def ready(self) -> bool:
        return bool(self._event.query())

    def values(self) -> list[float]:
        return self._host.tolist()


def _poll_readbacks(
    pending: list[tuple[str, list[Any]]], carry: list[tuple[str, list[Any]]]
) -> list[tuple[str, tuple[float, int, int, float | None]]]:
    """Values of the finished read-backs; unfinished ones go to ``carry`` for the next collection."""
    deadline = time.monotonic() + _READBACK_WAIT_S
    ready: list[tuple[str, tuple[float, int, int, float | None]]] = []
    for label, handles in pending:
        waiting = []
        for handle in handles:
            while not handle.ready() and time.monotonic() < deadline:
                time.sleep(0.001)
            if handle.ready():
                total, count, nonfinite, last = handle.values()
                ready.append((label, (total, int(count), int(nonfinite), last)))
            else:
                waiting.append(handle)
        if waiting:
            carry.append((label, waiting))
    return ready

"""Windows of steps, and what each metric reader's gauges report from them.

The step path fills one :class:`Window`; a collection takes it, reads it back and hands it to
:class:`Readers`, which adds it to every reader's span (one per reader of ``setup_telemetry``'s
provider, one shared otherwise); a span becomes its reader's :class:`Snapshot`. Nothing here reads a
clock. Of the public names only :func:`collecting_for` is re-exported by
:mod:`openlora_otel.training`. See docs/concepts/collection.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import Observation

from openlora_otel.names import STEP_DURATION_BUCKETS
from openlora_otel.training.guard import LossWindow
from openlora_otel.training.readback import Folded
from openlora_otel.window_histograms import BucketCounts, ExponentialCounts

__all__ = ["collecting_for"]

# Tensors kept per window before they are folded on their device into one partial
# result (one small reduction per this many steps keeps memory flat without a reader).
FOLD_EVERY = 512
# After a fold fails, a window stops folding (retrying would re-stack the whole growing
# list on every step, under the lock) and keeps at most this many tensors until its
# collection; beyond it they are dropped and counted.
MAX_UNFOLDED = 16384
# Tensor-like objects that are not torch tensors (duck-typed test doubles, other
# frameworks) cannot be folded without reading them; beyond this they are dropped.
MAX_FOREIGN = 65536
# An empty window shorter than this keeps the previous throughput (two readers back to back).
_MIN_EMPTY_WINDOW_S = 1.0


class Series:
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

    def merge(self, values: Folded) -> None:
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

    def folded(self) -> Folded:
        """The host-side values as one fold (what a reader's span adds up)."""
        return Folded(self.total, self.count, self.nonfinite, self.last, self.highest, self.lowest, self.trailing)

    def copy(self) -> Series:
        """A copy whose lists can be read while the step path appends to the original's."""
        twin = Series()
        for name in self.__slots__:
            value = getattr(self, name)
            setattr(twin, name, list(value) if type(value) is list else value)
        return twin


@dataclass
class Window:
    started: float
    steps: int = 0
    tokens: int = 0
    samples: int = 0
    loss: Series = field(default_factory=Series)
    grad: Series = field(default_factory=Series)
    lr: Series = field(default_factory=Series)
    durations: BucketCounts | ExponentialCounts = field(default_factory=lambda: BucketCounts(STEP_DURATION_BUCKETS))
    # perf_counter() of the window's latest step: the step path stores the clock reading it
    # already took; the wall-clock conversion waits for the collection.
    last_step: float | None = None
    # Steps that gave data_time_s: how many, their data waits, and (for those that also
    # had a previous call) their waits and the wall time since the previous record_step.
    data_steps: int = 0
    data_total: float = 0.0
    data_timed: float = 0.0
    data_wall: float = 0.0

    def absorb(self, window: Window) -> None:
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


class Recording:
    """What the step path shares with the collection: the window it fills now and the lock it fills it
    under, whether it still takes records, and how many tensors it had to drop (told at collection).

    The record calls add to ``window`` holding ``lock``; a collection swaps in a fresh one under it.
    """

    __slots__ = ("closed", "dropped_foreign", "dropped_unfolded", "lock", "new_durations", "window")

    def __init__(self, started: float, *, exponential: bool = False) -> None:
        self.lock = threading.Lock()
        # What a window counts step durations into: the explicit buckets, or fine exponential ones when
        # the histogram is exported exponential.
        self.new_durations: Callable[[], BucketCounts | ExponentialCounts] = (
            ExponentialCounts if exponential else lambda: BucketCounts(STEP_DURATION_BUCKETS)
        )
        self.window = Window(started=started, durations=self.new_durations())
        self.closed = False
        self.dropped_foreign = 0  # tensor-likes past MAX_FOREIGN in one window
        self.dropped_unfolded = 0  # tensors past MAX_UNFOLDED after a failed fold


class _Reader:
    """One reader's view: the span it has not reported yet and what its gauges show."""

    __slots__ = ("snapshot", "span")

    def __init__(self, started: float) -> None:
        self.span = Window(started=started)
        self.snapshot = Snapshot()


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
class Snapshot:
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


def observed(value: float | int | None) -> list[Observation]:
    """What a gauge callback reports for ``value``: one observation, or none for None or a non-finite value."""
    # Non-finite values are left out here: the SDK would drop them anyway, with a
    # warning on every collection.
    return [] if value is None or value - value != 0 else [Observation(value)]


class Readers:
    """Every reader's span and snapshot, by the key its collection runs under (:func:`collecting_for`).

    ``None`` is the shared span of readers that were not named; a key first seen at a
    collection starts from the window that collection took.
    """

    __slots__ = ("_readers",)

    def __init__(self, keys: Iterable[Hashable], started: float) -> None:
        self._readers: dict[Hashable, _Reader] = {key: _Reader(started) for key in (None, *keys)}

    def snapshot(self) -> Snapshot:
        """What the gauges of the collection on this thread report."""
        reader = self._readers.get(getattr(_collecting, "key", None))
        return reader.snapshot if reader is not None else self._readers[None].snapshot

    def take(self, window: Window, now: float) -> tuple[_Reader, Window]:
        """Add a taken, read-back window to every reader's span; the collecting reader and its span, now ended."""
        key = getattr(_collecting, "key", None)
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = _Reader(window.started)
        for each in self._readers.values():
            each.span.absorb(window)
        span, reader.span = reader.span, Window(started=now)
        return reader, span


def span_snapshot(span: Window, previous: Snapshot, now: float, failed: set[str]) -> Snapshot:
    """What a reader's gauges report after its span ending ``now`` (``failed``: series that could not be read).

    ``last_step_time`` stays the previous one: placing the span's last step on the wall
    clock is the caller's (it reads the clocks).
    """
    elapsed = now - span.started
    snapshot = Snapshot(
        loss=_window_value(span.loss, previous.loss, "loss" in failed, mean=True),
        grad=_window_value(span.grad, previous.grad, "grad" in failed, mean=True),
        lr=_window_value(span.lr, previous.lr, "lr" in failed, mean=False),
        loss_max=_window_extreme(span.loss, previous.loss_max, "loss" in failed, highest=True),
        loss_min=_window_extreme(span.loss, previous.loss_min, "loss" in failed, highest=False),
        grad_max=_window_extreme(span.grad, previous.grad_max, "grad" in failed, highest=True),
        grad_min=_window_extreme(span.grad, previous.grad_min, "grad" in failed, highest=False),
        data_wait=span.data_total / span.data_steps if span.data_steps else previous.data_wait,
        data_fraction=(
            min(span.data_timed / span.data_wall, 1.0) if span.data_wall > 0 else previous.data_fraction
        ),
        window_steps=span.loss.count or span.grad.count,
        last_step_time=previous.last_step_time,
    )
    if span.steps or elapsed >= _MIN_EMPTY_WINDOW_S:
        snapshot.tokens_per_s = span.tokens / elapsed if elapsed > 0 else previous.tokens_per_s
        snapshot.samples_per_s = span.samples / elapsed if elapsed > 0 else previous.samples_per_s
    else:
        snapshot.tokens_per_s, snapshot.samples_per_s = previous.tokens_per_s, previous.samples_per_s
    return snapshot


def _window_value(series: Series, previous: float | None, failed: bool, *, mean: bool) -> float | None:
    """The window's mean (or latest) finite value; else the previous one, unless its values could not be read."""
    if series.count:
        if mean:
            return series.total / series.count
        if series.last is not None and series.last - series.last == 0:
            return series.last
    if failed and not series.nonfinite:
        return None  # repeating the previous value would hide that nothing could be read
    return previous


def loss_window(series: Series, steps: int) -> LossWindow:
    return LossWindow(series.count, series.nonfinite, series.trailing, series.highest, series.total, steps)


def _window_extreme(series: Series, previous: float | None, failed: bool, *, highest: bool) -> float | None:
    """The window's largest (smallest) finite value, with the same fallbacks as `_window_value`."""
    if series.count:
        return series.highest if highest else series.lowest
    if failed and not series.nonfinite:
        return None
    return previous

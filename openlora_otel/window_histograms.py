"""Histograms fed a whole window of bucketed values at once: the hot path bisects, the collection merges.

Hot paths count values into per-bucket lists under their own lock; at collection each window reaches
the SDK as one :class:`BucketWindow`, which :func:`window_view`'s aggregation merges in O(buckets),
exactly as per-value ``record`` calls would have (no exemplars). On an SDK whose internals moved
(:func:`window_merging_works`), :func:`replay` records each bucket's count at its mean.
See docs/concepts/collection.md.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

__all__ = ["BucketCounts", "BucketWindow", "replay", "window_merging_works", "window_view"]

_logger = logging.getLogger(__name__)


class BucketWindow(float):
    """A window of values, bucketed, passed to ``Histogram.record`` as one value.

    As a float it is 0.0, which passes the SDK's finite and non-negative checks;
    the window aggregation reads the buckets instead, and sets ``merged``.
    """

    bounds: tuple[float, ...]
    counts: list[int]
    total: float
    shortest: float
    longest: float
    merged: bool

    def __new__(
        cls, bounds: tuple[float, ...], counts: list[int], total: float, shortest: float, longest: float
    ) -> BucketWindow:
        self = super().__new__(cls, 0.0)
        self.bounds, self.counts, self.total = bounds, counts, total
        self.shortest, self.longest, self.merged = shortest, longest, False
        return self


class BucketCounts:
    """Values counted into explicit buckets (the SDK's rule: a value equal to a bound goes below it).

    Not locked: the owner holds its own lock around :meth:`add`, and takes the whole object
    (a new one per window) before :meth:`window` hands it to the SDK.
    """

    __slots__ = ("bounds", "count", "counts", "longest", "shortest", "sums")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sums = [0.0] * (len(bounds) + 1)
        self.count = 0
        self.shortest = math.inf
        self.longest = -math.inf

    def add(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        self.counts[index] += 1
        self.sums[index] += value
        self.count += 1
        if value < self.shortest:
            self.shortest = value
        if value > self.longest:
            self.longest = value

    def window(self) -> BucketWindow:
        return BucketWindow(self.bounds, self.counts, math.fsum(self.sums), self.shortest, self.longest)


def replay(record: Callable[..., None], counts: Sequence[int], sums: Sequence[float], *args: Any) -> None:
    """Record each bucket's count at the bucket's mean: exact counts and sum, one SDK call per value."""
    for count, total in zip(counts, sums, strict=True):
        if count:
            mean = total / count
            for _ in range(count):
                record(mean, *args)


@cache
def _histogram_classes() -> tuple[type, type] | None:
    """The SDK classes the merging aggregation builds on, or None when this SDK version lacks them."""
    try:
        from opentelemetry.sdk.metrics._internal.aggregation import (
            AggregationTemporality,
            _ExplicitBucketHistogramAggregation,
        )
        from opentelemetry.sdk.metrics.view import Aggregation
    except ImportError:  # pragma: no cover - a future SDK layout
        return None

    class _WindowHistogram(_ExplicitBucketHistogramAggregation):  # type: ignore[misc, valid-type]
        """The SDK's explicit-bucket histogram, which also takes a whole `BucketWindow` at once."""

        def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
            batch = measurement.value
            if type(batch) is not BucketWindow or batch.bounds != self._boundaries:
                super().aggregate(measurement, should_sample_exemplar)
                return
            with self._lock:
                if self._value is None:
                    self._value = self._get_empty_bucket_counts()
                counts = self._value
                for index, count in enumerate(batch.counts):
                    counts[index] += count
                self._sum += batch.total
                if self._record_min_max and any(batch.counts):
                    self._min = min(self._min, batch.shortest)
                    self._max = max(self._max, batch.longest)
            batch.merged = True

    class _WindowAggregation(Aggregation):  # type: ignore[misc, valid-type]
        """Explicit buckets that merge `BucketWindow` values with the same bounds."""

        def __init__(self, bounds: tuple[float, ...]) -> None:
            self._bounds = bounds

        def _create_aggregation(
            self, instrument: Any, attributes: Any, reservoir_factory: Any, start_time_unix_nano: int
        ) -> Any:
            from opentelemetry.metrics import Synchronous

            return _WindowHistogram(
                attributes,
                AggregationTemporality.DELTA
                if isinstance(instrument, Synchronous)
                else AggregationTemporality.CUMULATIVE,
                start_time_unix_nano,
                reservoir_factory(_WindowHistogram),
                self._bounds,
            )

    return _WindowHistogram, _WindowAggregation


@cache
def window_merging_works() -> bool:
    """Check once that this SDK's histogram aggregation still has the shape the window merge relies on."""
    classes = _histogram_classes()
    if classes is None:
        return False
    window_histogram, _ = classes
    bounds = (0.001, 0.01, 1.0)
    try:
        from opentelemetry.context import Context
        from opentelemetry.sdk.metrics import AlignedHistogramBucketExemplarReservoir
        from opentelemetry.sdk.metrics._internal.aggregation import AggregationTemporality
        from opentelemetry.sdk.metrics._internal.measurement import Measurement

        def measure(value: float) -> Any:
            return Measurement(value, 0, None, Context())  # type: ignore[arg-type]

        probe = window_histogram(
            {}, AggregationTemporality.DELTA, 0, AlignedHistogramBucketExemplarReservoir, bounds
        )
        counts = [2, 0, 0, 1]
        batch = BucketWindow(bounds, counts, 100.0, 0.0005, 99.0)
        probe.aggregate(measure(batch))
        probe.aggregate(measure(0.003))
        point = probe.collect(AggregationTemporality.CUMULATIVE, 1)
        return (
            batch.merged
            and list(point.bucket_counts) == [2, 1, 0, 1]
            and point.count == 4
            and point.sum == 100.0 + 0.003
            and (point.min, point.max) == (0.0005, 99.0)
        )
    except Exception:  # an SDK whose internals moved: replaying stays exact, only slower
        _logger.debug("merging histogram windows is not possible with this SDK", exc_info=True)
        return False


def window_view(instrument_name: str, bounds: Sequence[float]) -> Any:
    """The ``View`` that lets histogram ``instrument_name`` take whole windows with these ``bounds``.

    On an SDK where merging does not work it is a plain explicit-bucket view with
    the same bounds; callers then check ``BucketWindow.merged`` after recording
    and replay instead.
    """
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    classes = _histogram_classes()
    bounds = tuple(float(b) for b in bounds)
    aggregation = (
        classes[1](bounds)
        if classes is not None and window_merging_works()
        else ExplicitBucketHistogramAggregation(list(bounds))
    )
    return View(instrument_type=Histogram, instrument_name=instrument_name, aggregation=aggregation)

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

__all__ = [
    "EXPONENTIAL_SCALE",
    "BucketCounts",
    "BucketWindow",
    "ExponentialCounts",
    "ExponentialWindow",
    "exponential_merging_works",
    "replay",
    "window_merging_works",
    "window_view",
]

# The hot path's base-2 exponential buckets when histograms are exponential: 2**(1/256) apart (0.27 %
# wide), finer than the scale the SDK settles on for any spread of step or request times wider than
# about 1.5x (160 buckets); each reaches the SDK at its values' mean.
EXPONENTIAL_SCALE = 8
_PER_OCTAVE = 2**EXPONENTIAL_SCALE

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


class ExponentialWindow(float):
    """A window of values in fine exponential buckets, passed to ``Histogram.record`` as one value (0.0)."""

    buckets: dict[int, list[float]]
    zeros: int
    shortest: float
    longest: float
    merged: bool

    def __new__(cls, counts: ExponentialCounts) -> ExponentialWindow:
        self = super().__new__(cls, 0.0)
        self.buckets, self.zeros = counts.buckets, counts.zeros
        self.shortest, self.longest, self.merged = counts.shortest, counts.longest, False
        return self


class ExponentialCounts:
    """Values counted into base-2 exponential buckets of :data:`EXPONENTIAL_SCALE` (with each bucket's sum),
    for histograms exported as exponential ones. The same use as :class:`BucketCounts`. Zeros are counted
    apart (``zeros``); negative and non-finite values are dropped, as ``Histogram.record`` drops them."""

    __slots__ = ("buckets", "count", "longest", "shortest", "zeros")

    def __init__(self, bounds: tuple[float, ...] = ()) -> None:  # bounds: BucketCounts' signature, unused
        self.buckets: dict[int, list[float]] = {}  # bucket -> [count, sum]
        self.zeros = 0
        self.count = 0
        self.shortest = math.inf
        self.longest = -math.inf

    def add(self, value: float) -> None:
        if not 0 <= value < math.inf:  # NaN fails this too
            return
        self.count += 1
        if value < self.shortest:
            self.shortest = value
        if value > self.longest:
            self.longest = value
        if value > 0:
            key = math.floor(math.log2(value) * _PER_OCTAVE)
            bucket = self.buckets.get(key)
            if bucket is None:
                self.buckets[key] = [1, value]
            else:
                bucket[0] += 1
                bucket[1] += value
        else:
            self.zeros += 1

    @property
    def counts(self) -> list[int]:
        """Per bucket (then each zero), how many: with :attr:`sums`, what :func:`replay` takes."""
        return [int(bucket[0]) for bucket in self.buckets.values()] + [1] * self.zeros

    @property
    def sums(self) -> list[float]:
        return [bucket[1] for bucket in self.buckets.values()] + [0.0] * self.zeros

    def window(self) -> ExponentialWindow:
        return ExponentialWindow(self)


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


class _Value:
    """What the SDK's aggregate() reads of a measurement, for one value of a window."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


@cache
def _exponential_classes() -> tuple[type, type] | None:
    """The exponential histogram that also takes whole windows, and its ``Aggregation``; None when this SDK
    lacks the classes it builds on."""
    try:
        from opentelemetry.metrics import Synchronous
        from opentelemetry.sdk.metrics._internal.aggregation import (
            AggregationTemporality,
            _ExponentialBucketHistogramAggregation,
        )
        from opentelemetry.sdk.metrics._internal.exponential_histogram.buckets import Buckets
        from opentelemetry.sdk.metrics.view import Aggregation
    except ImportError:  # pragma: no cover - a future SDK layout
        return None

    class _ExponentialWindowHistogram(_ExponentialBucketHistogramAggregation):  # type: ignore[misc, valid-type]
        """The SDK's exponential histogram, which also takes an `ExponentialWindow` (or a `BucketWindow`) at once:
        each bucket of the window goes in as its count of values at the bucket's mean."""

        def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
            batch = measurement.value
            if type(batch) is ExponentialWindow:
                pairs = [(int(c), total / c, total) for c, total in batch.buckets.values()]
                if batch.zeros:
                    pairs.append((batch.zeros, 0.0, 0.0))
            elif type(batch) is BucketWindow:  # explicit buckets: exact count and sum, coarse placement
                pairs = _bucket_pairs(batch)
            else:
                super().aggregate(measurement, should_sample_exemplar)
                return
            if not any(count for count, _, _ in pairs):
                self._hold_empty()
            for count, placed, total in pairs:
                if count:
                    self._add(placed, count, total)
            if self._record_min_max and pairs:
                with self._lock:
                    self._min = min(self._min, batch.shortest)
                    self._max = max(self._max, batch.longest)
            batch.merged = True

        def _hold_empty(self) -> None:
            """An empty window still makes a point (count 0), as an empty explicit window does: a loaded
            adapter's request series exists before its first request, so rate() sees that request as a rise.
            The state is the SDK's own after only zeros, without them."""
            with self._lock:
                if self._value_positive is None and self._value_negative is None:
                    self._value_positive, self._value_negative = Buckets(), Buckets()
                    if self._scale is None:
                        self._scale = 0

        def _add(self, mean: float, count: int, total: float) -> None:
            """``count`` values summing to ``total``, placed in the bucket of ``mean``."""
            super().aggregate(_Value(mean), should_sample_exemplar=False)  # places one value, rescaling if needed
            if count == 1 and total == mean:
                return
            # A second lock section: no collection runs between the two, since windows are recorded from
            # the collection's own callbacks, which the SDK runs under its collect lock.
            with self._lock:
                self._count += count - 1
                self._sum += total - mean
                if mean == 0:
                    self._zero_count += count - 1
                    return
                buckets = self._value_positive if mean > 0 else self._value_negative
                index = self._mapping.map_to_index(abs(mean))  # the bucket it went to, at today's scale
                position = index - buckets.index_base
                if position < 0:
                    position += len(buckets.counts)
                buckets.increment_bucket(position, count - 1)

    class _ExponentialWindowAggregation(Aggregation):  # type: ignore[misc, valid-type]
        """Base-2 exponential buckets (the SDK's defaults) that merge whole windows."""

        def _create_aggregation(
            self, instrument: Any, attributes: Any, reservoir_factory: Any, start_time_unix_nano: int
        ) -> Any:
            return _ExponentialWindowHistogram(
                attributes,
                reservoir_factory(_ExponentialBucketHistogramAggregation),
                AggregationTemporality.DELTA
                if isinstance(instrument, Synchronous)
                else AggregationTemporality.CUMULATIVE,
                start_time_unix_nano,
            )

    return _ExponentialWindowHistogram, _ExponentialWindowAggregation


def _bucket_pairs(batch: BucketWindow) -> list[tuple[int, float, float]]:
    """An explicit window's buckets as (count, where placed, sum) triples: the sums per bucket are not kept,
    so each bucket's values are placed at the window's mean held within that bucket's bounds; the sums
    add up to the window's (the difference on the last bucket's sum, not its placement)."""
    triples = []
    mean = batch.total / max(1, sum(batch.counts))
    for index, count in enumerate(batch.counts):
        if count:
            low = batch.bounds[index - 1] if index > 0 else min(batch.shortest, batch.bounds[0])
            high = batch.bounds[index] if index < len(batch.bounds) else max(batch.longest, batch.bounds[-1])
            placed = min(max(mean, low), high)
            triples.append((count, placed, count * placed))
    if triples:
        count, placed, total = triples[-1]
        triples[-1] = (count, placed, total + batch.total - sum(t for _, _, t in triples))
    return triples


@cache
def exponential_merging_works() -> bool:
    """Check once that this SDK's exponential histogram still has the shape the window merge relies on:
    a window merged gives what its bucket means recorded one by one give."""
    classes = _exponential_classes()
    if classes is None:
        return False
    window_histogram, _ = classes
    try:
        from opentelemetry.context import Context
        from opentelemetry.sdk.metrics import SimpleFixedSizeExemplarReservoir
        from opentelemetry.sdk.metrics._internal.aggregation import AggregationTemporality
        from opentelemetry.sdk.metrics._internal.measurement import Measurement

        def measure(value: float) -> Any:
            return Measurement(value, 0, None, Context())  # type: ignore[arg-type]

        values = [0.0, 0.001, 0.0011, 0.5, 0.5, 0.5, 3.0, 120.0, 120.0]
        counts = ExponentialCounts()
        for value in values:
            counts.add(value)
        merged = window_histogram({}, SimpleFixedSizeExemplarReservoir, AggregationTemporality.DELTA, 0)
        batch = counts.window()
        merged.aggregate(measure(batch))
        one_by_one = window_histogram({}, SimpleFixedSizeExemplarReservoir, AggregationTemporality.DELTA, 0)
        for count, total in zip(counts.counts, counts.sums, strict=True):
            for _ in range(count):
                one_by_one.aggregate(measure(total / count))
        a = merged.collect(AggregationTemporality.CUMULATIVE, 1)
        b = one_by_one.collect(AggregationTemporality.CUMULATIVE, 1)
        return (
            batch.merged
            and (a.count, a.zero_count, a.scale) == (b.count, b.zero_count, b.scale) == (9, 1, a.scale)
            and list(a.positive.bucket_counts) == list(b.positive.bucket_counts)
            and a.positive.offset == b.positive.offset
            and math.isclose(a.sum, math.fsum(values))
            and (a.min, a.max) == (0.0, 120.0)
        )
    except Exception:  # an SDK whose internals moved: replaying stays exact, only slower
        _logger.debug("merging exponential histogram windows is not possible with this SDK", exc_info=True)
        return False


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


def window_view(instrument_name: str, bounds: Sequence[float], *, exponential: bool = False) -> Any:
    """The ``View`` that lets histogram ``instrument_name`` take whole windows with these ``bounds``
    (``exponential``: base-2 exponential buckets instead, taking :class:`ExponentialWindow` values).

    On an SDK where merging does not work it is a plain explicit-bucket (or exponential) view;
    callers then check the window's ``merged`` after recording and replay instead.
    """
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import (
        ExplicitBucketHistogramAggregation,
        ExponentialBucketHistogramAggregation,
        View,
    )

    if exponential:
        exponential_classes = _exponential_classes()
        chosen = (
            exponential_classes[1]()
            if exponential_classes is not None and exponential_merging_works()
            else ExponentialBucketHistogramAggregation()
        )
        return View(instrument_type=Histogram, instrument_name=instrument_name, aggregation=chosen)
    classes = _histogram_classes()
    bounds = tuple(float(b) for b in bounds)
    aggregation = (
        classes[1](bounds)
        if classes is not None and window_merging_works()
        else ExplicitBucketHistogramAggregation(list(bounds))
    )
    return View(instrument_type=Histogram, instrument_name=instrument_name, aggregation=aggregation)

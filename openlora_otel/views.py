"""Views ``setup_telemetry()`` installs so that an aborted collection never double-counts a total.

The SDK adds each observation of an observable counter to what it holds until a collection
completes, so an aborted collection leaves a total reported doubled once. :func:`observed_total_views`
makes the latest observation the value, for every observable counter and up-down counter of the
provider. It subclasses the SDK's private ``_SumAggregation``: a self-test runs once per process, and
on an SDK whose internals moved the views are left out. See docs/concepts/windows.md.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

__all__ = ["observed_total_views"]

_logger = logging.getLogger(__name__)


@cache
def _aggregation_class() -> type | None:
    """The ``Aggregation`` whose sums take the latest observation, or None when this SDK cannot have it."""
    try:
        from opentelemetry.sdk.metrics import ObservableCounter
        from opentelemetry.sdk.metrics._internal.aggregation import AggregationTemporality, _SumAggregation
        from opentelemetry.sdk.metrics.view import Aggregation
    except ImportError:  # pragma: no cover - a future SDK layout
        return None

    class _LatestTotal(_SumAggregation):  # type: ignore[misc, valid-type]
        """A cumulative sum fed with totals: each observation replaces the value instead of adding to it."""

        def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
            with self._lock:
                self._value = measurement.value
            self._sample_exemplar(measurement, should_sample_exemplar)

    class _LatestTotalAggregation(Aggregation):  # type: ignore[misc, valid-type]
        def _create_aggregation(
            self, instrument: Any, attributes: Any, reservoir_factory: Any, start_time_unix_nano: int
        ) -> Any:
            return _LatestTotal(
                attributes,
                isinstance(instrument, ObservableCounter),
                AggregationTemporality.CUMULATIVE,
                start_time_unix_nano,
                reservoir_factory(_SumAggregation),
            )

    return _LatestTotalAggregation if _works(_LatestTotal) else None


def _works(latest_total: type) -> bool:
    """Check once that the SDK's sum aggregation still has the shape `_LatestTotal` relies on."""
    try:
        from opentelemetry.context import Context
        from opentelemetry.sdk.metrics import SimpleFixedSizeExemplarReservoir
        from opentelemetry.sdk.metrics._internal.aggregation import AggregationTemporality
        from opentelemetry.sdk.metrics._internal.measurement import Measurement

        def measure(value: float) -> Any:
            return Measurement(value, 0, None, Context())  # type: ignore[arg-type]

        probe = latest_total({}, True, AggregationTemporality.CUMULATIVE, 0, SimpleFixedSizeExemplarReservoir)
        probe.aggregate(measure(5))  # a collection aborted after this observation...
        probe.aggregate(measure(7))  # ...and the next one
        first = probe.collect(AggregationTemporality.CUMULATIVE, 1)
        probe.aggregate(measure(9))
        second = probe.collect(AggregationTemporality.CUMULATIVE, 2)
        return bool(first.value == 7 and second.value == 9)
    except Exception:
        _logger.debug("the latest-total aggregation does not fit this SDK; using its default", exc_info=True)
        return False


def observed_total_views() -> list[Any]:
    """Views giving every observable counter and up-down counter the latest-observation rule (or none)."""
    aggregation = _aggregation_class()
    if aggregation is None:
        return []
    from opentelemetry.sdk.metrics import ObservableCounter, ObservableUpDownCounter
    from opentelemetry.sdk.metrics.view import View

    return [
        View(instrument_type=kind, aggregation=aggregation())
        for kind in (ObservableCounter, ObservableUpDownCounter)
    ]

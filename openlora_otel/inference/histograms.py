"""The histograms of :class:`~openlora_otel.inference.metrics.InferenceMetrics` and the windows that feed them.

A request's end adds its values to its series' window (bucket counts, :class:`~openlora_otel.window_histograms.BucketCounts`);
once per collection every window goes to the SDK whole (:func:`inference_views` lets it take one), or value by
value on a meter without those views. Kept apart from the request and adapter accounting of
:mod:`openlora_otel.inference.metrics`, which calls it under its own lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import Meter

from openlora_otel import names
from openlora_otel.names import (
    ATTR_ADAPTER,
    ATTR_ERROR_TYPE,
    ATTR_OPERATION,
    ATTR_PROVIDER,
    ATTR_REQUEST_MODEL,
    ATTR_RESPONSE_MODEL,
    ATTR_TOKEN_TYPE,
    REQUEST_DURATION_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from openlora_otel.window_histograms import (
    BucketCounts,
    ExponentialCounts,
    exponential_merging_works,
    replay,
    window_merging_works,
    window_view,
)

__all__ = ["PROVIDER", "RequestHistograms", "SeriesKey", "inference_views"]

PROVIDER = "openlora"

_SPECS = {spec.name: spec for spec in names.INFERENCE_METRICS}
_DURATION = "gen_ai.server.request.duration"
_TTFT = "gen_ai.server.time_to_first_token"
_TPOT = "gen_ai.server.time_per_output_token"
_TOKENS = "openlora.inference.token.usage"
_LOAD = "openlora.inference.adapter.load.duration"
_BOUNDS = {
    _DURATION: REQUEST_DURATION_BUCKETS,
    _TTFT: TTFT_BUCKETS,
    _TPOT: TPOT_BUCKETS,
    _TOKENS: TOKEN_BUCKETS,
}

# A request's series: (gen_ai.operation.name, gen_ai.request.model, gen_ai.response.model, adapter,
# error.type); a model value of "" is left out, an error.type of None is a success.
SeriesKey = tuple[str, str, str, str, str | None]


def inference_views(*, exponential: bool = False) -> list[Any]:
    """The views that let the request histograms take a whole window per collection (``setup_telemetry`` adds
    them); ``exponential``: base-2 exponential buckets for every serving histogram, adapter loads too."""
    views = [window_view(name, bounds, exponential=exponential) for name, bounds in _BOUNDS.items()]
    if exponential:
        from opentelemetry.sdk.metrics import Histogram
        from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

        views.append(View(instrument_type=Histogram, instrument_name=_LOAD, aggregation=ExponentialBucketHistogramAggregation()))
    return views


class _Series:
    """The windows of one attribute set since the last collection (under the owner's lock)."""

    __slots__ = ("duration", "input", "output", "tpot", "ttft")

    def __init__(self, exponential: bool = False) -> None:
        counts: Any = ExponentialCounts if exponential else BucketCounts
        self.duration = counts(REQUEST_DURATION_BUCKETS)
        self.ttft = counts(TTFT_BUCKETS)
        self.tpot = counts(TPOT_BUCKETS)
        self.input = counts(TOKEN_BUCKETS)
        self.output = counts(TOKEN_BUCKETS)


class RequestHistograms:
    """The serving histograms on ``meter`` and each series' pending window; not locked: the owner holds its lock.

    ``window_histogram``: the meter's provider has :func:`inference_views` (it is checked: a window the SDK
    does not merge turns it off, with one ``warn(key, message)``).
    """

    def __init__(
        self, meter: Meter, *, window_histogram: bool, warn: Callable[[str, str], None], exponential: bool = False
    ) -> None:
        self._exponential = exponential
        self._merge = bool(window_histogram) and (exponential_merging_works() if exponential else window_merging_works())
        self._warn_once = warn
        self._attributes: dict[SeriesKey, dict[str, str]] = {}
        self._pending: dict[SeriesKey, _Series] = {}

        def histogram(name: str) -> Any:
            spec = _SPECS[name]
            bounds = _BOUNDS.get(name, REQUEST_DURATION_BUCKETS)
            return meter.create_histogram(
                spec.name,
                unit=spec.unit,
                description=spec.description,
                explicit_bucket_boundaries_advisory=list(bounds),
            )

        self._duration = histogram(_DURATION)
        self._ttft = histogram(_TTFT)
        self._tpot = histogram(_TPOT)
        self._tokens = histogram(_TOKENS)
        self._load = histogram(_LOAD)

    @property
    def merging(self) -> bool:
        """Whether windows reach the SDK whole (else value by value)."""
        return self._merge

    def add(
        self,
        series_key: SeriesKey,
        started: float,
        ended: float,
        first: float | None,
        input: int | None,
        output: int | None,
    ) -> None:
        """One request's values into its series' window: its duration; on success also its time to first
        token (``first``: when that token was out), time per output token and token counts."""
        series = self._pending.get(series_key)
        if series is None:
            series = self._pending[series_key] = _Series(self._exponential)
        series.duration.add(ended - started)
        if series_key[4] is None:
            if first is not None:
                series.ttft.add(first - started)
                if output is not None and output >= 2:
                    series.tpot.add(max(0.0, ended - first) / (output - 1))
            if input is not None:
                series.input.add(input)
            if output is not None:
                series.output.add(output)

    def commit(self, empty: Iterable[SeriesKey] = ()) -> None:
        """Hand every pending window to the histograms; the ``empty`` series too, even without a request."""
        pending, self._pending = self._pending, {}
        for key in empty:
            pending.setdefault(key, _Series(self._exponential))
        for series_key, series in pending.items():
            try:
                attributes = self.attributes(series_key)
                self._put(self._duration, series.duration, attributes, always=True)
                if series_key[4] is None:
                    self._put(self._ttft, series.ttft, attributes)
                    self._put(self._tpot, series.tpot, attributes)
                    self._put(self._tokens, series.input, self._token_attrs(series_key, "input"))
                    self._put(self._tokens, series.output, self._token_attrs(series_key, "output"))
            except Exception:  # one series' window failing in the SDK costs that window, not the others'
                self._warn_once("commit", "handing a request window to the SDK failed; that window is lost")
                logging.getLogger(__name__).debug("committing %s failed", series_key, exc_info=True)

    def record_load(self, seconds: float, attributes: dict[str, str]) -> None:
        """An adapter's load time, recorded at once."""
        self._load.record(seconds, attributes)

    def _put(
        self, histogram: Any, counts: BucketCounts, attributes: dict[str, str], always: bool = False
    ) -> None:
        if not counts.count and not (always and self._merge):
            return
        if self._merge:
            window = counts.window()
            histogram.record(window, attributes)
            if window.merged:
                return
            # Told the views are there and they are not: that window counted as one 0. Replay its
            # values, and every later window's.
            self._merge = False
            self._warn_once(
                "merge",
                "the inference histograms are not using inference_views() on this meter's provider; "
                "values are recorded one by one from now on",
            )
        replay(histogram.record, counts.counts, counts.sums, attributes)

    def attributes(self, series_key: SeriesKey) -> dict[str, str]:
        """A series' attributes (made once, then shared)."""
        attributes = self._attributes.get(series_key)
        if attributes is None:
            operation, model, response_model, adapter, error = series_key
            attributes = {ATTR_OPERATION: operation, ATTR_PROVIDER: PROVIDER, ATTR_ADAPTER: adapter}
            if model:
                attributes[ATTR_REQUEST_MODEL] = model
            if response_model:
                attributes[ATTR_RESPONSE_MODEL] = response_model
            if error is not None:
                attributes[ATTR_ERROR_TYPE] = error
            self._attributes[series_key] = attributes
        return attributes

    def _token_attrs(self, series_key: SeriesKey, kind: str) -> dict[str, str]:
        return {**self.attributes(series_key), ATTR_TOKEN_TYPE: kind}

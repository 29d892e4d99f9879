"""Read a run history file (OTLP JSON Lines) back, with nothing but the standard library.

The files come from ``OPENLORA_HISTORY_DIR`` (see
:mod:`openlora_otel.exporters.history`), or from any writer of the same format,
such as the OpenTelemetry Collector's file exporter. Each line is one OTLP
``ExportMetricsServiceRequest`` in the OTLP/JSON encoding; :func:`read_history`
turns every resource in every line into one :class:`Snapshot`: the Resource's
attributes, the collection time and the points of each metric by its OTel name
(``openlora.training.steps``, not the Prometheus name).

Cumulative values (sums and histograms) are totals since the process started;
gauges are the value at the collection. A torn last line (a write in flight, or
a process killed mid-write) is skipped; so is any line that is not OTLP/JSON,
with a warning naming the line.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AttributeValue", "Point", "Snapshot", "read_history"]

_logger = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | tuple[Any, ...] | None

_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass(frozen=True)
class Point:
    """One data point.

    ``value`` is the number of a gauge or a sum (a float, NaN included); None
    for histograms, which have ``count``, ``sum``, ``min``, ``max`` and, for
    explicit buckets, ``bounds`` and ``bucket_counts`` (one more count than bounds).
    """

    attributes: Mapping[str, AttributeValue]
    time_s: float
    value: float | None = None
    count: int | None = None
    sum: float | None = None
    min: float | None = None
    max: float | None = None
    bounds: tuple[float, ...] = ()
    bucket_counts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """One collection of one process: its Resource, when, and every metric's points."""

    resource: Mapping[str, AttributeValue]
    time_s: float
    metrics: Mapping[str, list[Point]] = field(default_factory=dict)
    line: int = 0  # 1-based line number in the file, for messages

    def value(self, name: str, **attributes: AttributeValue) -> float | None:
        """The value of the point of ``name`` whose attributes are exactly ``attributes`` (None if absent)."""
        for point in self.metrics.get(name, ()):
            if dict(point.attributes) == attributes:
                return point.value
        return None


def read_history(path: str | os.PathLike[str]) -> Iterator[Snapshot]:
    """Every snapshot in the file at ``path``, in file order (oldest first).

    Raises ``OSError`` when the file cannot be opened; bad lines are skipped (see the module docstring).
    """
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.endswith(b"\n"):
                break  # a line still being written, or cut short: not a line yet
            if not raw.strip():
                continue
            try:
                body = json.loads(raw)
                snapshots = list(_snapshots(body, number))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                _logger.warning("%s line %d is not OTLP/JSON metrics (%s); skipped", path, number, exc)
                continue
            yield from snapshots


def _snapshots(body: Mapping[str, Any], number: int) -> Iterator[Snapshot]:
    for resource_metrics in body.get("resourceMetrics", ()):
        resource = _attributes(resource_metrics.get("resource", {}).get("attributes", ()))
        metrics: dict[str, list[Point]] = {}
        latest = 0
        for scope_metrics in resource_metrics.get("scopeMetrics", ()):
            for metric in scope_metrics.get("metrics", ()):
                found = metrics.setdefault(metric["name"], [])
                for kind, data in metric.items():
                    if not isinstance(data, dict) or "dataPoints" not in data:
                        continue
                    for raw in data["dataPoints"]:
                        nanos = int(raw.get("timeUnixNano", 0))
                        latest = max(latest, nanos)
                        found.append(_point(kind, raw, nanos))
        yield Snapshot(resource=resource, time_s=latest / 1e9, metrics=metrics, line=number)


def _point(kind: str, raw: Mapping[str, Any], nanos: int) -> Point:
    attributes = _attributes(raw.get("attributes", ()))
    if kind in ("gauge", "sum"):
        value = _float(raw["asDouble"]) if "asDouble" in raw else float(int(raw.get("asInt", 0)))
        return Point(attributes, nanos / 1e9, value=value)
    return Point(
        attributes,
        nanos / 1e9,
        count=int(raw.get("count", 0)),
        sum=_float(raw["sum"]) if "sum" in raw else None,
        min=_float(raw["min"]) if "min" in raw else None,
        max=_float(raw["max"]) if "max" in raw else None,
        bounds=tuple(_float(b) for b in raw.get("explicitBounds", ())),
        bucket_counts=tuple(int(c) for c in raw.get("bucketCounts", ())),
    )


def _float(value: Any) -> float:
    if isinstance(value, str) and value in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[value]
    return float(value)


def _attributes(pairs: Any) -> dict[str, AttributeValue]:
    return {pair["key"]: _any_value(pair.get("value", {})) for pair in pairs}


def _any_value(value: Mapping[str, Any]) -> AttributeValue:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return _float(value["doubleValue"])
    if "arrayValue" in value:
        return tuple(_any_value(v) for v in value["arrayValue"].get("values", ()))
    return None

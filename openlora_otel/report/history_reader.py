"""Read a run history file (OTLP JSON Lines) back, with nothing but the standard library.

:func:`read_history` turns every resource of every line into one :class:`Snapshot` (the Resource's
attributes, the collection time, each metric's points by its OTel name). A torn last line is skipped
and not counted; any other line the reader cannot use (not JSON, not OTLP/JSON, a field of the wrong
type or out of range) is skipped whole, counted in :attr:`HistoryReader.skipped` and named in a
warning. NaN and infinite values are data and kept. See docs/how-to/run-history.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from openlora_otel.files import open_regular_file

__all__ = ["WARNED_LINES", "AttributeValue", "HistoryReader", "Point", "Snapshot", "read_history"]

_logger = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | tuple[Any, ...] | None

_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# OTLP's integer types: fixed64 times and uint64 counts, int64 values.
_UINT64 = (0, 2**64)
_INT64 = (-(2**63), 2**63)
# A 64-bit integer as OTLP/JSON writes it: int() alone would also take "1_000", " 7 " and other scripts' digits.
_INTEGER_TEXT = re.compile(r"-?[0-9]+")
# Bad lines named in a warning per file; a file of garbage would otherwise print a line per line.
WARNED_LINES = 5


class _BadValue(ValueError):
    """A field of a line holds a value the reader cannot use: the line is skipped."""


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


def read_history(path: str | os.PathLike[str]) -> HistoryReader:
    """Every snapshot in the file at ``path``, in file order (oldest first).

    The reader's ``skipped`` counts the bad lines passed so far (see the module
    docstring for what makes a line bad). Raises ``OSError`` when the file
    cannot be opened, :class:`~openlora_otel.files.NotARegularFile` (an ``OSError``) when it is not a
    regular file (a FIFO, a device, a directory), at the first ``next()``, as the file is opened lazily.
    """
    return HistoryReader(path)


class HistoryReader(Iterator[Snapshot]):
    """The iterator :func:`read_history` returns: its snapshots, and ``skipped``, the bad lines so far."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.skipped = 0
        self._snapshots = self._read()

    def __next__(self) -> Snapshot:
        return next(self._snapshots)

    def _read(self) -> Iterator[Snapshot]:
        with open_regular_file(self.path) as handle:  # a FIFO or a device: refused, not read forever
            for number, raw in enumerate(handle, start=1):
                if not raw.endswith(b"\n"):
                    break  # a line still being written, or cut short: not a line yet
                if not raw.strip():
                    continue
                try:
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise _BadValue(f"a JSON {type(body).__name__}, not an object")
                    snapshots = list(_snapshots(body, number))
                # RecursionError: nesting deeper than json (or the attribute reader) can follow.
                # OverflowError: a number no conversion below should let through, should one be missed.
                except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as exc:
                    self.skipped += 1
                    if self.skipped <= WARNED_LINES:
                        _logger.warning(
                            "%s line %d is not OTLP/JSON metrics (%s); skipped%s",
                            self.path,
                            number,
                            _short(str(exc)),
                            "; further bad lines of this file are skipped without a warning each"
                            if self.skipped == WARNED_LINES
                            else "",
                        )
                    continue
                yield from snapshots


def _snapshots(body: Mapping[str, Any], number: int) -> Iterator[Snapshot]:
    for resource_metrics in _typed(body.get("resourceMetrics", []), list, "resourceMetrics"):
        resource = _attributes(resource_metrics.get("resource", {}).get("attributes", []))
        metrics: dict[str, list[Point]] = {}
        latest = 0
        for scope_metrics in _typed(resource_metrics.get("scopeMetrics", []), list, "scopeMetrics"):
            for metric in _typed(scope_metrics.get("metrics", []), list, "metrics"):
                name = metric["name"]
                if not isinstance(name, str):
                    raise _BadValue(f"a metric name is {_show(name)}, not a string")
                found = metrics.setdefault(name, [])
                for kind, data in metric.items():
                    if not isinstance(data, dict) or "dataPoints" not in data:
                        continue
                    for raw in _typed(data["dataPoints"], list, "dataPoints"):
                        nanos = _integer(raw.get("timeUnixNano", 0), _UINT64, "timeUnixNano")
                        latest = max(latest, nanos)
                        found.append(_point(kind, raw, nanos))
        yield Snapshot(resource=resource, time_s=latest / 1e9, metrics=metrics, line=number)


def _point(kind: str, raw: Mapping[str, Any], nanos: int) -> Point:
    attributes = _attributes(raw.get("attributes", []))
    if kind in ("gauge", "sum"):
        if "asDouble" in raw:
            value = _float(raw["asDouble"], "asDouble")
        else:
            value = float(_integer(raw.get("asInt", 0), _INT64, "asInt"))  # int64: always a finite float
        return Point(attributes, nanos / 1e9, value=value)
    return Point(
        attributes,
        nanos / 1e9,
        count=_integer(raw.get("count", 0), _UINT64, "count"),
        sum=_float(raw["sum"], "sum") if "sum" in raw else None,
        min=_float(raw["min"], "min") if "min" in raw else None,
        max=_float(raw["max"], "max") if "max" in raw else None,
        bounds=tuple(_float(b, "explicitBounds") for b in _list(raw, "explicitBounds")),
        bucket_counts=tuple(_integer(c, _UINT64, "bucketCounts") for c in _list(raw, "bucketCounts")),
    )


def _integer(value: Any, bounds: tuple[int, int], what: str) -> int:
    """An OTLP integer field: a JSON integer, an integral JSON number or a string of digits, within ``bounds``."""
    if isinstance(value, bool):  # an int to Python, never a number in OTLP/JSON
        raise _BadValue(f"{what} is {value!r}, not an integer")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():  # False for NaN and the infinities
        number = int(value)
    elif isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
        number = int(value)  # over 4300 digits: ValueError, a bad line like any other
    else:
        raise _BadValue(f"{what} is {_show(value)}, not an integer")
    low, high = bounds
    if not low <= number < high:
        raise _BadValue(f"{what} is {_show(number)}, outside [{low}, {high})")
    return number


def _float(value: Any, what: str) -> float:
    """An OTLP double field: a number or a numeric string; NaN and the infinities are data and kept."""
    if isinstance(value, float):
        return value
    if isinstance(value, bool):
        raise _BadValue(f"{what} is {value!r}, not a number")
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            raise _BadValue(f"{what} is {_show(value)}, too large for a double") from None
    if isinstance(value, str):
        if value in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value]
        try:
            return float(value)
        except ValueError:
            pass
    raise _BadValue(f"{what} is {_show(value)}, not a number")


def _list(body: Mapping[str, Any], key: str) -> list[Any]:
    """``body[key]`` when it is a list, [] when absent; a string or anything else makes the line bad."""
    return _typed(body.get(key, []), list, key)  # type: ignore[no-any-return]


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise _BadValue(f"{what} is {_show(value)}, not a {kind.__name__}")
    return value


def _show(value: Any) -> str:
    """``value`` for a message, cut short: a bad field can be megabytes (or a 4000-digit integer)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {len(str(value))} digits"
    return _short(repr(value))


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _attributes(pairs: Any) -> dict[str, AttributeValue]:
    attributes = {}
    for pair in _typed(pairs, list, "attributes"):
        key = pair["key"]
        if not isinstance(key, str):
            raise _BadValue(f"an attribute key is {_show(key)}, not a string")
        attributes[key] = _any_value(pair.get("value", {}))
    return attributes


def _any_value(value: Mapping[str, Any]) -> AttributeValue:
    if "stringValue" in value:
        return _typed(value["stringValue"], str, "stringValue")
    if "boolValue" in value:
        return _typed(value["boolValue"], bool, "boolValue")
    if "intValue" in value:
        return _integer(value["intValue"], _INT64, "intValue")
    if "doubleValue" in value:
        return _float(value["doubleValue"], "doubleValue")
    if "arrayValue" in value:
        return tuple(_any_value(v) for v in _typed(value["arrayValue"].get("values", []), list, "values"))
    return None

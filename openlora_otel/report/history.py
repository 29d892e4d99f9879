"""Read runs from history files: OTLP JSON Lines, one ``ExportMetricsServiceRequest`` per line.

That is the OpenTelemetry file format (the protobuf JSON mapping: lowerCamelCase
fields, enums as integers, 64-bit integers as decimal strings, NaN as ``"NaN"``),
as ``OPENLORA_HISTORY_DIR`` writes it: ``<run id>.jsonl``, or
``<run id>.rank<N>.jsonl`` under a launcher. Lines are grouped by the Resource's
``openlora.run.id``; a run's curves come from its lowest rank (rank 0 when it is
there: the ranks of a data-parallel run step together, and rank 0 is the one a
person reads). A line that does not parse (a process killed mid-write) is
skipped and counted, never fatal.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openlora_otel.names import RUN_METRICS
from openlora_otel.report.model import QUANTITIES, ReportError, Row, Run
from openlora_otel.resource import RUN_ID_ATTRIBUTE, RUN_NAME_ATTRIBUTE
from openlora_otel.run import HPARAM_PREFIX

__all__ = ["history_files", "read_history"]

_RANK_ATTRIBUTE = "openlora.rank"
_RANK_IN_NAME = re.compile(r"\.rank(\d+)$")
(_RUN_INFO,) = (spec.name for spec in RUN_METRICS)
_BY_NAME: dict[str, list] = {}
for _q in QUANTITIES:
    _BY_NAME.setdefault(_q.otel_name, []).append(_q)
# OTLP AggregationTemporality: 1 delta, 2 cumulative. Delta sums are added up so that
# a file from another writer (a Collector's file exporter set to delta) reads alike.
_DELTA = 1


def history_files(paths: Sequence[str]) -> list[Path]:
    """The files named by ``paths``: each a ``.jsonl`` file, or a directory whose ``*.jsonl`` are taken."""
    files: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise ReportError(f"no history files (*.jsonl) in {path}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ReportError(f"{path}: no such file or directory")
    return files


@dataclass
class _Process:
    """The lines of one (run id, rank) as read so far."""

    run_id: str
    rank: int | None
    files: set[str] = field(default_factory=set)
    rows: list[Row] = field(default_factory=list)
    name: str | None = None
    info: tuple[float, dict[str, Any]] | None = None  # (time, attributes) of the latest run.info point
    delta_totals: dict[str, float] = field(default_factory=dict)


def read_history(paths: Sequence[str]) -> list[Run]:
    """The runs in the history files ``paths`` name, in the order their files sort."""
    processes: dict[tuple[str, int | None], _Process] = {}
    for path in history_files(paths):
        skipped = 0
        try:
            with path.open("rb") as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        request = json.loads(line)
                        _read_request(request, path, processes)
                    except (ValueError, TypeError, KeyError, AttributeError):
                        skipped += 1
                        if skipped == 1:
                            first_bad = number
        except OSError as exc:
            raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
        if skipped:
            print(
                f"openlora-otel report: {path}: skipped {skipped} line(s) that are not OTLP JSON "
                f"(the first is line {first_bad})",
                file=sys.stderr,
            )
    by_run: dict[str, list[_Process]] = {}
    for process in processes.values():
        by_run.setdefault(process.run_id, []).append(process)
    runs = []
    for run_id, group in by_run.items():
        group.sort(key=lambda p: (p.rank is None, p.rank or 0))
        lowest = group[0]
        if not lowest.rows:
            continue
        info = max((p.info for p in group if p.info), default=None, key=lambda i: i[0])
        attributes = info[1] if info else {}
        hyperparameters = {
            k[len(HPARAM_PREFIX) :]: str(v) for k, v in attributes.items() if k.startswith(HPARAM_PREFIX)
        }
        name = attributes.get(RUN_NAME_ATTRIBUTE) or lowest.name or run_id
        runs.append(
            Run(
                run_id=run_id,
                name=str(name),
                hyperparameters=hyperparameters,
                source=", ".join(sorted(lowest.files)),
                rows=sorted(lowest.rows, key=lambda r: r.time_s),
                rank=lowest.rank,
                ranks=len(group),
            )
        )
    if not runs:
        raise ReportError(
            f"no training steps in {', '.join(paths)}: the history files hold no "
            "openlora.training.steps points (a run that stopped before its first step?)"
        )
    return runs


def _read_request(
    request: dict[str, Any], path: Path, processes: dict[tuple[str, int | None], _Process]
) -> None:
    for resource_metrics in request["resourceMetrics"]:
        resource = _attributes(resource_metrics.get("resource", {}).get("attributes", ()))
        run_id = str(resource.get(RUN_ID_ATTRIBUTE) or _RANK_IN_NAME.sub("", path.stem))
        rank = resource.get(_RANK_ATTRIBUTE)
        if rank is None and (match := _RANK_IN_NAME.search(path.stem)):
            rank = match.group(1)
        rank = int(rank) if rank is not None else None
        process = processes.get((run_id, rank))
        if process is None:
            process = processes[(run_id, rank)] = _Process(run_id, rank)
        process.files.add(str(path))
        if resource.get(RUN_NAME_ATTRIBUTE):
            process.name = str(resource[RUN_NAME_ATTRIBUTE])
        values: dict[str, list[float]] = {}
        newest = 0
        for metric in _metrics(resource_metrics):
            name = metric.get("name")
            if name == _RUN_INFO:
                for point in _points(metric)[1]:
                    time_ns = int(point.get("timeUnixNano", 0))
                    if process.info is None or time_ns >= process.info[0]:
                        process.info = (time_ns, _attributes(point.get("attributes", ())))
                continue
            quantities = _BY_NAME.get(name)
            if not quantities:
                continue
            temporality, points = _points(metric)
            for point in points:
                newest = max(newest, int(point.get("timeUnixNano", 0)))
                attributes = (
                    _attributes(point.get("attributes", ())) if any(q.where for q in quantities) else {}
                )
                for quantity in quantities:
                    if any(str(attributes.get(k)) != v for k, v in quantity.where):
                        continue
                    value = _value(point, quantity.field)
                    if value is None:
                        continue
                    if temporality == _DELTA:
                        value = process.delta_totals[quantity.key] = (
                            process.delta_totals.get(quantity.key, 0.0) + value
                        )
                    values.setdefault(quantity.key, []).append(value)
        if values and newest:
            folded = {}
            for key, found in values.items():
                quantity = next(q for q in QUANTITIES if q.key == key)
                folded[key] = sum(found) / len(found) if quantity.combine == "mean" else max(found)
            process.rows.append(Row(newest / 1e9, folded))


def _metrics(resource_metrics: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for scope_metrics in resource_metrics.get("scopeMetrics", ()):
        yield from scope_metrics.get("metrics", ())


def _points(metric: dict[str, Any]) -> tuple[int | None, list[dict[str, Any]]]:
    """(temporality, data points) of a gauge, sum or histogram; other kinds have none we read."""
    for kind in ("gauge", "sum", "histogram"):
        data = metric.get(kind)
        if data is not None:
            return data.get("aggregationTemporality"), data.get("dataPoints", [])
    return None, []


def _value(point: dict[str, Any], field_name: str) -> float | None:
    if field_name == "value":
        if "asDouble" in point:
            return float(point["asDouble"])  # float("NaN") and float("Infinity") as the mapping writes them
        if "asInt" in point:
            return float(int(point["asInt"]))
        return None
    raw = point.get(field_name)
    if raw is None:
        # proto3 JSON leaves out zero values: a histogram with no recording has count 0.
        return 0.0 if field_name == "count" else None
    return float(raw)


def _attributes(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """OTLP ``KeyValue`` list to a dict; arrays joined with ``,`` as the hyperparameters are."""
    return {item["key"]: _any_value(item.get("value", {})) for item in items}


def _any_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return ",".join(str(_any_value(v)) for v in value["arrayValue"].get("values", ()))
    return None

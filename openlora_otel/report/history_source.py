"""Read runs from history files: ``OPENLORA_HISTORY_DIR``'s OTLP JSON Lines.

Lines are read by :func:`openlora_otel.report.history_reader.read_history` and grouped here by the Resource's
``openlora.run.id`` (a line whose ``openlora.rank`` is not a rank is skipped and counted). A run's
curves and outcome come from its lowest rank; where the time went is summed over every process of
the run, each rank and attempt (:func:`~openlora_otel.report.goodput.time_breakdown`).
See docs/how-to/run-history.md.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openlora_otel.files import NotARegularFile
from openlora_otel.names import (
    ATTR_EVAL_METRIC,
    ATTR_RUN_OUTCOME,
    ATTR_TRAINING_PHASE,
    RANK_ATTRIBUTE,
    RUN_ATTEMPT_ATTRIBUTE,
    RUN_ID_ATTRIBUTE,
    RUN_METRICS,
    RUN_NAME_ATTRIBUTE,
    TRAINING_PHASES,
)
from openlora_otel.report import history_reader as history
from openlora_otel.report.goodput import STEPS_LOST_METRIC, TIME_METRIC, TimeSample, time_breakdown
from openlora_otel.report.model import (
    EVAL_PREFIX,
    QUANTITIES,
    SHOWN_METRIC,
    SHOWN_NAME,
    ProcessRows,
    ReportError,
    Row,
    Run,
    shown,
)
from openlora_otel.run.info import hyperparameters_from

__all__ = ["history_files", "read_runs"]

_logger = logging.getLogger(__name__)

_RANK_IN_NAME = re.compile(r"\.rank(\d+)$")
_RUN_INFO = RUN_METRICS[0].name
_OUTCOME = "openlora.run.outcome"
_EVAL_VALUE = "openlora.training.eval.value"
_INSTANCE_ATTRIBUTE = "service.instance.id"
_HOST_ATTRIBUTE = "host.name"
_NODE_ATTRIBUTE = "k8s.node.name"  # a pod's host.name is the pod's: its node is this


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
        elif os.path.lexists(path):  # a file, or something that is not one: the reader says which
            files.append(path)
        else:
            raise ReportError(f"{path}: no such file or directory")
    return files


@dataclass
class _Process:
    """The snapshots of one (run id, rank) as read so far."""

    run_id: str
    rank: int | None
    files: set[str] = field(default_factory=set)
    rows: list[Row] = field(default_factory=list)
    name: str | None = None
    info: tuple[float, dict[str, Any]] | None = None  # (time, attributes) of the latest run.info point
    outcome: tuple[float, str] | None = None  # (time, openlora.run.outcome) of the latest outcome point
    # Goodput readings of every process (attempt) of this rank, in file order.
    time: list[TimeSample] = field(default_factory=list)
    host: tuple[float, str] | None = None  # (time, node) of its latest snapshot that named one


def read_runs(paths: Sequence[str], *, skipped: MutableMapping[str, int] | None = None) -> list[Run]:
    """The runs in the history files ``paths`` name, oldest first.

    ``skipped``, when given, gets the number of bad lines of each file that had
    some (by the file's path): lines that are not OTLP/JSON metrics or hold values
    that cannot be used (see :mod:`openlora_otel.report.history_reader`), each named in a warning.
    """
    processes: dict[tuple[str, int | None], _Process] = {}
    for path in history_files(paths):
        bad = 0
        try:
            reader = history.read_history(path)
            for snapshot in reader:
                try:
                    _add(snapshot, path, processes)
                except ValueError as exc:  # raised before the snapshot changed anything
                    bad += 1
                    if bad <= history.WARNED_LINES:  # as the reader: a file of them is counted, not listed
                        _logger.warning("%s line %d: %s; skipped", path, snapshot.line, exc)
        except NotARegularFile as exc:
            raise ReportError(str(exc)) from None
        except OSError as exc:
            raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
        bad += reader.skipped
        if bad and skipped is not None:
            skipped[str(path)] = skipped.get(str(path), 0) + bad
    by_run: dict[str, list[_Process]] = {}
    for process in processes.values():
        by_run.setdefault(process.run_id, []).append(process)
    runs = []
    for run_id, group in by_run.items():
        group.sort(key=lambda p: (p.rank is None, p.rank or 0))
        lowest = group[0]
        if not any(math.isfinite(row.values.get("steps", math.nan)) for row in lowest.rows):
            continue  # no step counted, or only NaN / infinite counts (a corrupt file): nothing to draw against
        info = max((p.info for p in group if p.info), default=None, key=lambda i: i[0])
        attributes = info[1] if info else {}
        hyperparameters = hyperparameters_from(attributes)
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
                time=time_breakdown(sample for p in group for sample in p.time),
                outcome=lowest.outcome[1] if lowest.outcome else None,
                processes=[
                    ProcessRows(p.rank, sorted(p.rows, key=lambda r: r.time_s), list(p.time),
                                p.host[1] if p.host else None)
                    for p in group
                ],
            )
        )
    runs.sort(key=lambda run: run.rows[0].time_s)  # oldest first: the order they were run in
    if not runs:
        raise ReportError(
            f"no training steps in {', '.join(paths)}: the history files hold no "
            "openlora.training.steps points, or only NaN ones (a run that stopped before its first step?)"
        )
    return runs


def _add(snapshot: history.Snapshot, path: Path, processes: dict[tuple[str, int | None], _Process]) -> None:
    resource = snapshot.resource
    run_id = str(resource.get(RUN_ID_ATTRIBUTE) or _RANK_IN_NAME.sub("", path.stem))
    rank = _rank(resource.get(RANK_ATTRIBUTE))
    if rank is None and (match := _RANK_IN_NAME.search(path.stem)):
        rank = int(match.group(1))
    process = processes.get((run_id, rank))
    if process is None:
        process = processes[(run_id, rank)] = _Process(run_id, rank)
    process.files.add(str(path))
    if resource.get(RUN_NAME_ATTRIBUTE):
        process.name = str(resource[RUN_NAME_ATTRIBUTE])
    node = resource.get(_NODE_ATTRIBUTE) or resource.get(_HOST_ATTRIBUTE)
    if node and (process.host is None or snapshot.time_s >= process.host[0]):
        process.host = (snapshot.time_s, shown(node, SHOWN_NAME))
    for point in snapshot.metrics.get(_RUN_INFO, ()):
        if process.info is None or point.time_s >= process.info[0]:
            process.info = (point.time_s, dict(point.attributes))
    for point in snapshot.metrics.get(_OUTCOME, ()):
        outcome = point.attributes.get(ATTR_RUN_OUTCOME)
        if outcome is not None and (process.outcome is None or point.time_s >= process.outcome[0]):
            process.outcome = (point.time_s, str(outcome))
    values: dict[str, float] = {}
    for point in snapshot.metrics.get(_EVAL_VALUE, ()):
        metric = point.attributes.get(ATTR_EVAL_METRIC)
        if metric is not None and point.value is not None:  # its name a panel title, shown in full: bounded
            values[f"{EVAL_PREFIX}{shown(metric, SHOWN_METRIC)}"] = float(point.value)
    for quantity in QUANTITIES:
        found = []
        for point in snapshot.metrics.get(quantity.otel_name, ()):
            if not quantity.matches(point.attributes):
                continue
            value = point.value if quantity.field == "value" else getattr(point, quantity.field)
            if value is not None:
                found.append(float(value))
        if found:
            values[quantity.key] = quantity.fold(found)
    if values and snapshot.time_s:
        process.rows.append(Row(snapshot.time_s, values))
    phases = {
        str(point.attributes.get(ATTR_TRAINING_PHASE)): float(point.value)
        for point in snapshot.metrics.get(TIME_METRIC, ())
        if point.value is not None and point.attributes.get(ATTR_TRAINING_PHASE) in TRAINING_PHASES
    }
    if phases:
        lost = [p.value for p in snapshot.metrics.get(STEPS_LOST_METRIC, ()) if p.value is not None]
        instance = resource.get(_INSTANCE_ATTRIBUTE)
        process.time.append(
            TimeSample(
                time_s=snapshot.time_s,
                phases=phases,
                steps_lost=max(lost, default=0.0),
                attempt=_attempt(resource.get(RUN_ATTEMPT_ATTRIBUTE)),
                rank=rank,
                process=None if instance is None else str(instance),
            )
        )


def _attempt(value: Any) -> int | None:
    """``openlora.run.attempt`` as a number (None when absent or not a whole number: lines of one
    attempt count together, whatever a foreign writer put there)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def _rank(value: Any) -> int | None:
    """The ``openlora.rank`` attribute as a rank: an integer >= 0 (or its digits); ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:  # False for NaN and infinities
        return int(value)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    raise ValueError(f"{RANK_ATTRIBUTE} is {value!r:.40}, not a rank (an integer >= 0)")

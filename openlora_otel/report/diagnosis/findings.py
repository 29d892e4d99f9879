"""What a diagnosis is made of: findings and their evidence, the kinds and severities, and the
readings every detector shares (step times, goodput phases, how a time or a step is written)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from openlora_otel.report.model import ProcessRows, Row

RUNBOOKS = "https://openlora.github.io/openlora-otel/runbooks/"
SCHEMA_ID = "https://openlora.github.io/openlora-otel/schemas/diagnosis-v1.json"
SEVERITIES = ("critical", "warning", "info")
# The detectors, in the order their findings of one severity come: what ruins a run, then what slows it.
KINDS = ("gpu_fault", "divergence", "hang", "straggler", "input_bound")


@dataclass(frozen=True)
class Evidence:
    """One value that shows a finding: the series it came from (its OpenTelemetry name), the value,
    and where (step, rank) when it applies."""

    series: str
    value: float | str
    note: str = ""
    step: float | None = None
    rank: int | None = None


@dataclass(frozen=True)
class Finding:
    """One thing that went wrong (or is worth knowing), with its evidence and what to do."""

    severity: str  # one of SEVERITIES
    kind: str  # the detector: one of KINDS
    title: str
    cause: str
    evidence: tuple[Evidence, ...] = ()
    ruled_out: tuple[str, ...] = ()
    try_next: tuple[str, ...] = ()
    runbook: str = ""
    step: float | None = None
    time_s: float | None = None
    rank: int | None = None
    score: float = 0.0  # orders findings of one severity: the larger, the more it explains

    @property
    def order(self) -> tuple[int, int, float]:
        """Most severe first; of one severity, what ruins a run before what slows it (KINDS), then the score."""
        return (SEVERITIES.index(self.severity), KINDS.index(self.kind), -self.score)


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def finite_or_none(value: float | None) -> float | None:
    return value if finite(value) else None


def step_time_increments(rows: Sequence[Row]) -> list[tuple[Row, float, float]]:
    """(row, seconds, steps) added since the row before, from the step-duration histogram's sum and
    count; a count that went down (a new attempt's process) starts again from zero."""
    out = []
    previous: tuple[float, float] | None = None
    for row in rows:
        total, count = row.values.get("step_time_sum"), row.values.get("step_time_count")
        if not (finite(total) and finite(count)):
            continue
        if previous is None or count < previous[1] or total < previous[0]:
            base = (0.0, 0.0) if previous is not None else (total, count)
        else:
            base = previous
        steps = count - base[1]
        if steps > 0:
            out.append((row, total - base[0], steps))
        previous = (total, count)
    return out


def mean_step_time(rows: Sequence[Row]) -> float | None:
    increments = step_time_increments(rows)
    steps = sum(s for _, _, s in increments)
    return sum(t for _, t, _ in increments) / steps if steps else None


def rank_phases(process: ProcessRows) -> dict[str, float]:
    """Seconds per phase of one rank, summed over its attempts (the last reading of each)."""
    last: dict[tuple[int | None, str | None], dict[str, float]] = {}
    for sample in process.time:
        last[(sample.attempt, sample.process)] = sample.phases
    total: dict[str, float] = {}
    for phases in last.values():
        if not all(finite(seconds) and seconds >= 0 for seconds in phases.values()):
            return {}  # a reading that cannot be right: no shares from this rank at all
        for phase, seconds in phases.items():
            total[phase] = total.get(phase, 0.0) + seconds
    return total


def data_wait_share(phases: dict[str, float]) -> float | None:
    busy = sum(v for k, v in phases.items() if k in ("productive", "data_wait"))
    return phases.get("data_wait", 0.0) / busy if busy > 0 else None


def when_text(time_s: float | None) -> str:
    if not finite(time_s):
        return ""
    return datetime.fromtimestamp(time_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def times_text(ratio: float) -> str:
    """A ratio as read: 14.3, 1,432, 1.4e+19."""
    return f"{ratio:,.1f}" if ratio < 100 else (f"{ratio:,.0f}" if ratio < 1e6 else f"{ratio:.2g}")


def step_text(value: float | None) -> str:
    return f"{value:,.0f}" if finite(value) else "?"


def rank_text(rank: int | None) -> str:
    return "the process" if rank is None else f"rank {rank}"

def first_row(process: ProcessRows, key: str, above: float = 0.0) -> Row | None:
    """The rank's first row whose ``key`` is above ``above``."""
    return next((row for row in process.rows if finite(row.values.get(key)) and row.values[key] > above), None)


def rose(process: ProcessRows, key: str) -> tuple[Row, float] | None:
    """The first row at which counter ``key`` stood above the rank's first reading of it, and by how much
    (a count since the driver loaded: what it held when the run began is not the run's; a lower
    reading, another attempt's GPU, is the new base)."""
    base = None
    for row in process.rows:
        value = row.values.get(key)
        if not finite(value):
            continue
        if base is None or value < base:
            base = value
        elif value > base:
            return row, value - base
    return None


def highest(process: ProcessRows, key: str) -> float | None:
    values = [row.values[key] for row in process.rows if finite(row.values.get(key))]
    return max(values) if values else None


def mean_of(process: ProcessRows, key: str) -> float | None:
    values = [r.values[key] for r in process.rows if finite(r.values.get(key))]
    return statistics.fmean(values) if values else None

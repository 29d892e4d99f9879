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
KINDS = ("gpu_fault", "divergence", "hang", "memory", "evaluation", "straggler", "throughput", "input_bound", "goodput")


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

def attempts(process: ProcessRows) -> list[list[Row]]:
    """The rank's rows split where a new process began (a resumed attempt: its step count or step
    histogram's count went down)."""
    out: list[list[Row]] = []
    before: tuple[float, float] | None = None
    for row in process.rows:
        now = (row.values.get("steps", math.nan), row.values.get("step_time_count", math.nan))
        if not out or (before is not None and any(finite(b) and finite(n) and n < b for n, b in zip(now, before, strict=True))):
            out.append([])
        out[-1].append(row)
        before = now
    return out


def first_row(process: ProcessRows, key: str, above: float = 0.0, *, held: bool = False) -> Row | None:
    """The rank's first row whose ``key`` is above ``above``; ``held``: and so in the reading after it
    too, or the rank's last (one failed reading is not a failed GPU: a timeout reads so)."""
    rows = [row for row in process.rows if finite(row.values.get(key))]
    for index, row in enumerate(rows):
        if row.values[key] > above and (not held or index == len(rows) - 1 or rows[index + 1].values[key] > above):
            return row
    return None


def rose(process: ProcessRows, key: str) -> tuple[Row, float] | None:
    """The first row at which counter ``key`` rose within an attempt, and by how much since the attempt's
    first reading. A count since the driver loaded: what it held when an attempt began is not the
    run's, whatever the GPU; a rise must hold in the reading after it (a process's GPUs summed dip and
    come back when one GPU's read fails once), unless it is the attempt's last."""
    for rows in attempts(process):
        values = [(row, row.values[key]) for row in rows if finite(row.values.get(key))]
        if not values:
            continue
        base = values[0][1]
        for index, (row, value) in enumerate(values):
            if value > base and (index == len(values) - 1 or values[index + 1][1] > base):
                return row, value - base
    return None


def gained(process: ProcessRows, key: str) -> tuple[float, float]:
    """(what counter ``key`` added, over how many seconds): within each attempt, its rises above the
    highest reading so far (a dip and its return add nothing), over the attempt's span."""
    total = span = 0.0
    for rows in attempts(process):
        values = [(row.time_s, row.values[key]) for row in rows if finite(row.values.get(key))]
        if len(values) < 2:
            continue
        most = values[0][1]
        for _, value in values[1:]:
            if value > most:
                total, most = total + value - most, value
        span += values[-1][0] - values[0][0]
    return total, span


def highest(process: ProcessRows, key: str) -> float | None:
    values = [row.values[key] for row in process.rows if finite(row.values.get(key))]
    return max(values) if values else None


def mean_of(process: ProcessRows, key: str) -> float | None:
    values = [r.values[key] for r in process.rows if finite(r.values.get(key))]
    return statistics.fmean(values) if values else None

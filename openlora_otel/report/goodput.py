"""Where a run's time went: its processes' goodput counters (``openlora.training.time`` by phase,
``openlora.training.steps.lost``) summed into one :class:`TimeBreakdown` per run.

Each process counts from 0 and reports cumulative values, so a run's time is the sum of each
process's last reading, over its ranks and attempts, never a sum of cumulative readings. The
history files are read into :class:`TimeSample` readings by :mod:`.history`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from openlora_otel.names import TRAINING_PHASES

__all__ = [
    "STEPS_LOST_METRIC",
    "TIME_METRIC",
    "AttemptTime",
    "TimeBreakdown",
    "TimeSample",
    "time_breakdown",
]

TIME_METRIC = "openlora.training.time"
STEPS_LOST_METRIC = "openlora.training.steps.lost"


@dataclass(frozen=True)
class TimeSample:
    """One reading of one process's goodput counters: seconds per phase and steps lost, cumulative.

    ``attempt``, ``rank`` and ``process`` (``service.instance.id``, or anything that tells processes
    apart) say whose they are; readings of one process (or of processes that share those) come in
    the order they were taken.
    """

    time_s: float
    phases: dict[str, float]
    steps_lost: float = 0.0
    attempt: int | None = None
    rank: int | None = None
    process: str | None = None


@dataclass(frozen=True)
class AttemptTime:
    """One attempt of a run: its processes (one per rank), the steps it did again and their seconds."""

    label: str  # the attempt number; "2 (again)" when a restart did not change it
    attempt: int | None
    processes: int
    steps_lost: int  # the most any of its ranks reported: ranks step together
    lost_progress_s: float  # summed over its ranks
    seconds: float  # every phase, summed over its ranks


@dataclass(frozen=True)
class TimeBreakdown:
    """A run's wall time by ``openlora.training.phase``, summed over its processes' final values."""

    phases: dict[str, float]  # every phase of names.TRAINING_PHASES, in that order
    attempts: list[AttemptTime]
    processes: int

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    @property
    def goodput(self) -> float | None:
        """The ``productive`` share of the total (None when no time was counted)."""
        total = self.total
        return self.phases["productive"] / total if total > 0 else None

    def share(self, phase: str) -> float | None:
        total = self.total
        return self.phases[phase] / total if total > 0 else None

    @property
    def steps_lost(self) -> int:
        return sum(attempt.steps_lost for attempt in self.attempts)


def _finals(samples: Sequence[TimeSample]) -> list[tuple[TimeSample, float]]:
    """The last reading of each process in ``samples`` (one key's readings, in order), with when it began.

    Counters start at 0 in each process and only grow, and the phases add up to the
    process's wall time: when their sum goes down, a new process (a restart that kept
    the same attempt, rank and instance) began at that reading.
    """
    out: list[tuple[TimeSample, float]] = []
    last: TimeSample | None = None
    began = 0.0
    for sample in samples:
        if last is not None and sum(sample.phases.values()) < sum(last.phases.values()) - 1e-9:
            out.append((last, began))
            last = None
        if last is None:
            began = sample.time_s
        last = sample
    if last is not None:
        out.append((last, began))
    return out


def time_breakdown(samples: Iterable[TimeSample]) -> TimeBreakdown | None:
    """Sum each process's final counter values (never cumulative values across processes).

    ``samples``: every reading of a run's processes, each process's in the order taken.
    None when no reading has ``openlora.training.time``.
    """
    streams: dict[tuple[int | None, int | None, str | None], list[TimeSample]] = {}
    for sample in samples:
        if sample.phases:
            streams.setdefault((sample.attempt, sample.rank, sample.process), []).append(sample)
    finals = [final for stream in streams.values() for final in _finals(stream)]
    if not finals:
        return None
    phases = dict.fromkeys(TRAINING_PHASES, 0.0)
    for sample, _ in finals:
        for phase, seconds in sample.phases.items():
            if phase in phases and math.isfinite(seconds):
                phases[phase] += seconds
    # Attempts: by number; a rank with two processes of one number (a restart that did not count
    # itself) makes a second attempt of that number, in the order they began.
    finals.sort(key=lambda final: final[1])
    seen: dict[tuple[int | None, int | None], int] = {}
    groups: dict[tuple[int | None, int], list[tuple[TimeSample, float]]] = {}
    for sample, began in finals:
        again = seen.get((sample.attempt, sample.rank), 0)
        seen[(sample.attempt, sample.rank)] = again + 1
        groups.setdefault((sample.attempt, again), []).append((sample, began))
    attempts = []
    for (number, again), members in sorted(
        groups.items(), key=lambda item: min(began for _, began in item[1])
    ):
        label = "?" if number is None else str(number)
        attempts.append(
            AttemptTime(
                label=label if again == 0 else f"{label} (again)",
                attempt=number,
                processes=len(members),
                steps_lost=int(
                    max((s.steps_lost for s, _ in members if math.isfinite(s.steps_lost)), default=0)
                ),
                lost_progress_s=sum(s.phases.get("lost_progress", 0.0) for s, _ in members),
                seconds=sum(sum(s.phases.values()) for s, _ in members),
            )
        )
    return TimeBreakdown(phases=phases, attempts=attempts, processes=len(finals))

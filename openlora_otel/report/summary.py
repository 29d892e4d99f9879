"""A run's summary in words and numbers: its row of the table of runs, and where its time went.

What the command prints for each run, and the cells the PNG's and the page's tables show: the steps,
the last interval's mean loss (and where it went non-finite), the last eval loss, the time from the
first to the last step, how it diverged, and the seconds per training phase with the goodput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openlora_otel.report.formatting import number, percent
from openlora_otel.report.model import Curve, Divergence, Run, curves, divergence

__all__ = ["LAST_LOSS", "TIME_HEADING", "Summary", "nonfinite_from", "summarize", "time_lines"]

# The last collection interval's mean loss: the demo's "last train loss" is its last step's.
LAST_LOSS = "last loss (interval mean)"
TIME_HEADING = "Where the time went"


@dataclass(frozen=True)
class Summary:
    """A run's row in the table."""

    steps: int | None
    final_loss: float | None  # the last interval's mean over its finite losses, not the last step's
    final_eval_loss: float | None
    seconds: float | None
    nonfinite_from: float | None = None  # the step by which the first NaN / infinite loss was counted
    divergence: Divergence | None = None  # non-finite values, guard trips, what stopped it

    @property
    def last_loss_text(self) -> str:
        """The table's cell: the last interval's mean, and where the loss went non-finite if it did."""
        text = number(self.final_loss)
        if self.nonfinite_from is not None:
            text += f" (non-finite by step {self.nonfinite_from:,.0f})"
        return text


def summarize(run: Run, run_curves: dict[str, Curve] | None = None) -> Summary:
    """Steps, last train and eval loss, and the wall time from the first to the last step seen."""
    run_curves = curves(run.rows) if run_curves is None else run_curves
    # A step count that is NaN or infinite (a corrupt or foreign file) counts no steps, as in curves().
    steps = [v for row in run.rows if (v := row.values.get("steps")) is not None and math.isfinite(v)]
    # A NaN or infinite timestamp (a foreign or corrupt line) is no time: as in model.step_times().
    stamps = [t for _, t in run_curves.get("last_step_time", []) if math.isfinite(t) and t > 0]

    def last(key: str) -> float | None:
        points = run_curves.get(key)
        return points[-1][1] if points else None

    return Summary(
        steps=int(max(steps)) if steps else None,
        final_loss=last("loss"),
        final_eval_loss=last("eval_loss"),
        seconds=max(stamps) - min(stamps) if len(stamps) > 1 else None,
        nonfinite_from=nonfinite_from(run_curves),
        divergence=divergence(run.rows, run.outcome),
    )


def nonfinite_from(run_curves: dict[str, Curve]) -> float | None:
    """The step of the first point whose count of non-finite losses is above 0 (None: none counted)."""
    return next((step for step, count in run_curves.get("loss_nonfinite", []) if count > 0), None)


def time_lines(run: Run) -> list[str]:
    """The text of the run's "Where the time went": seconds and share per phase, goodput, attempts."""
    time = run.time
    if time is None:
        return [
            f"{TIME_HEADING}: not in the data read (openlora.training.time in a run's history files; "
            "not read from Prometheus)"
        ]
    attempts = len(time.attempts)
    lines = [
        f"{TIME_HEADING} ({attempts} attempt{'s' if attempts != 1 else ''}, {time.processes} "
        f"process{'es' if time.processes != 1 else ''}, summed over ranks and attempts):"
    ]
    width = max(len(phase) for phase in time.phases)
    for phase, seconds in time.phases.items():
        lines.append(f"  {phase:<{width}}  {seconds:12,.1f} s  {percent(time.share(phase)):>7}")
    lines.append(f"  {'total':<{width}}  {time.total:12,.1f} s  goodput {percent(time.goodput)}")
    for attempt in time.attempts:
        lines.append(
            f"  attempt {attempt.label}: {attempt.steps_lost:,} step{'s' if attempt.steps_lost != 1 else ''} "
            f"lost, {attempt.lost_progress_s:,.1f} s lost_progress, {attempt.seconds:,.1f} s in all"
            f" ({attempt.processes} process{'es' if attempt.processes != 1 else ''})"
        )
    return lines

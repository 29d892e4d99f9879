"""The goodput detector: where a run's time went that was not training, by cause, across its attempts
(restarts: the steps done again, checkpoint loads, later attempts' start-up; checkpoint saves; idle
stalls). Data waits are the input-bound detector's; the first start-up is every run's; evaluating is a
choice; the time after the last step (a merge, an upload) is no stall."""

from __future__ import annotations

from collections.abc import Sequence

from openlora_otel.report.diagnosis.findings import RUNBOOKS, Evidence, Finding, attempts, finite
from openlora_otel.report.goodput import TimeSample, time_breakdown
from openlora_otel.report.model import ProcessRows

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
WASTED_SHARE = 0.25  # of the run's rank-seconds gone to the causes below: a finding
WASTED_MIN_S = 60.0  # ... and at least this many seconds a process (a short run is mostly its start-up)


def _numbered(samples: Sequence[TimeSample]) -> bool:
    """Whether the readings tell the attempts apart: every one has its attempt number, and either its
    rank or one process to its attempt (a source without the numbers, or several processes of one
    attempt without their ranks, cannot tell a restart from a second rank)."""
    if any(s.attempt is None for s in samples):
        return False
    if all(s.rank is not None for s in samples):
        return True
    processes: dict[int | None, set[str | None]] = {}
    for sample in samples:
        processes.setdefault(sample.attempt, set()).add(sample.process)
    return all(len(members) == 1 for members in processes.values())


def _later_startups(samples: Sequence[TimeSample]) -> float:
    """Start-up seconds of every attempt but the first, when the readings tell the attempts apart."""
    numbers = {s.attempt for s in samples if s.attempt is not None}
    if len(numbers) < 2 or not _numbered(samples):
        return 0.0
    first = min(numbers)
    last: dict[tuple[int | None, int | None, str | None], TimeSample] = {}
    for sample in samples:
        last[(sample.attempt, sample.rank, sample.process)] = sample
    return sum(s.phases.get("startup", 0.0) for s in last.values() if s.attempt is not None and s.attempt > first)


def _tails(processes: Sequence[ProcessRows]) -> float:
    """Seconds from each attempt's last step to its last reading, over the ranks: the time after
    training (a merge, an upload, the process lingering) that the clock books as idle, and no stall."""
    total = 0.0
    for process in processes:
        for rows in attempts(process):
            steps = [row.values["last_step_time"] for row in rows if finite(row.values.get("last_step_time"))]
            if steps and max(steps) > 0:
                total += max(0.0, rows[-1].time_s - max(steps))
    return total


def wasted(processes: Sequence[ProcessRows]) -> list[Finding]:
    samples = [sample for process in processes for sample in process.time]
    breakdown = time_breakdown(samples)
    if breakdown is None or breakdown.total <= 0:
        return []
    phases, total = breakdown.phases, breakdown.total
    later_startup = _later_startups(samples)
    restarts = len({s.attempt for s in samples}) - 1 if _numbered(samples) else 0
    causes = {
        "restarts": phases["lost_progress"] + phases["checkpoint_load"] + later_startup if restarts > 0 else 0.0,
        "checkpoint saves": phases["checkpoint_save"],
        "idle (stalls)": max(0.0, phases["idle"] - _tails(processes)),
    }
    # Evaluating is a choice, not lost time: shown, never what makes the finding.
    lost = sum(causes.values())
    per_process = lost / max(1, breakdown.processes)
    if per_process < WASTED_MIN_S or lost / total < WASTED_SHARE:
        # Too little lost to warn about; a restart is still worth knowing (an attempt ended early).
        return [_restarted(restarts, causes["restarts"], total, breakdown.steps_lost, phases)] if restarts > 0 else []
    ranked = sorted(causes.items(), key=lambda item: -item[1])
    top, top_s = ranked[0]
    evidence = [
        Evidence("openlora.training.time", round(seconds, 3), f"{name}: {seconds / total:.0%} of the run's "
                 f"{total:,.0f} rank-seconds", None, None)
        for name, seconds in ranked if seconds > 0
    ]  # fmt: skip
    if restarts > 0:
        evidence.append(Evidence("openlora.training.steps.lost", breakdown.steps_lost, f"steps done again over "
                                 f"{restarts} restart(s): {phases['lost_progress']:,.0f} s; checkpoint loads "
                                 f"{phases['checkpoint_load']:,.0f} s; later attempts' start-up {later_startup:,.0f} s"))  # fmt: skip
    advice = {
        "restarts": ("checkpoint more often (each restart redoes the steps since the last one)",
                     "find why the attempts ended: `openlora-otel report` lists their outcomes"),
        "checkpoint saves": ("save less often, or asynchronously (torch.distributed.checkpoint.async_save)",
                             "save only the adapter's weights, to faster storage"),
        "idle (stalls)": ("look for stalls between steps: the hang findings, the ranks' stacks (py-spy dump --pid)",),
    }[top]  # fmt: skip
    return [
        Finding(
            "warning", "goodput",
            f"{lost / total:.0%} of the run's time went to other work than training, most of it to {top} "
            f"({top_s / total:.0%})",
            f"goodput {phases['productive'] / total:.0%} over {len(breakdown.attempts)} attempt(s) and "
            f"{breakdown.processes} process(es): "
            + ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in ranked if seconds > 0),
            tuple(evidence),
            (f"waiting for data ({phases['data_wait'] / total:.0%}): the input-bound finding's", "the first start-up: "
             f"every run's ({(phases['startup'] - later_startup) / total:.0%})", "evaluation "
             f"({phases['evaluation'] / total:.0%}): a choice, not lost time", "the time after the last step (a "
             "merge, an upload, a process lingering): not a stall"),
            advice, f"{RUNBOOKS}#openloralowgoodput", None, None, None, lost / total,
        )
    ]  # fmt: skip


def _restarted(restarts: int, seconds: float, total: float, steps_lost: float, phases: dict[str, float]) -> Finding:
    """The info of a run that restarted at little cost: how many times, the steps done again, the time."""
    return Finding(
        "info", "goodput",
        f"the run restarted {restarts} time(s): {steps_lost:,.0f} step(s) done again; the restarts cost "
        f"{seconds:,.0f} s ({seconds / total:.0%} of the run's time)",
        "an attempt ended before the run did (killed, failed or preempted) and the next resumed from its "
        "checkpoint",
        (Evidence("openlora.training.steps.lost", steps_lost, f"steps done again over {restarts} restart(s): "
                  f"{phases['lost_progress']:,.1f} s; checkpoint loads {phases['checkpoint_load']:,.1f} s"),),
        (f"time lost worth a warning: under {WASTED_SHARE:.0%} of the run's time or {WASTED_MIN_S:.0f} s a process",),
        ("find why the attempt ended: `openlora-otel report` lists the attempts, and OpenloraRunVanished or "
         "OpenloraRunFailed paged when it did", "checkpoint more often if restarts are frequent"),
        f"{RUNBOOKS}#openloralowgoodput", None, None, None, seconds / total,
    )  # fmt: skip

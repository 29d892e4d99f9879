"""The throughput detector: the step at which the run's steps became lastingly slower, found as a
change point (medians before and after, against the spread before: robust to single slow steps),
and what changed at the same time: the data wait, the GPUs' clocks and throttling."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from openlora_otel.report.diagnosis.findings import (
    RUNBOOKS,
    Evidence,
    Finding,
    attempts,
    finite,
    gained,
    mean_of,
    step_text,
    step_time_increments,
    when_text,
)
from openlora_otel.report.model import SLOWDOWN_REASONS, ProcessRows, Row

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
CHANGE_RATIO = 1.3  # steps at least this much slower after the change than before (medians)
CHANGE_SPREAD = 5.0  # ... and by at least this many times the spread before it (scaled median absolute deviation)
CHANGE_MIN_READINGS = 5  # readings on each side of a change
CHANGE_EXPLAINS = 0.10  # a share of time (waiting for data, throttled) at least this much larger after
CLOCK_DROP = 0.90  # a mean SM clock after at most this fraction of the one before
CHANGE_TOGETHER_READINGS = 3  # ranks whose changes are this many readings apart at most changed together


def _change(process: ProcessRows) -> tuple[Row, float, float, Row, Row, Row, str] | None:
    """(the first reading after the change, seconds a step (or a token) before, after, the first and last
    readings of the attempt, the reading before the change, the unit) of the rank's largest lasting
    slowdown, per attempt. Per token where every interval counted tokens: longer batches (a second stage
    of longer sequences, data sorted by length) make longer steps, not a slower run."""
    best: tuple[float, tuple[Row, float, float, Row, Row, Row, str]] | None = None
    for rows in attempts(process):
        increments = step_time_increments(rows)
        tokens = _tokens_added(rows, [row for row, _, _ in increments])
        unit = "token" if tokens and all(t > 0 for t in tokens) else "step"
        if unit == "token":
            times = [seconds / added for (_, seconds, _), added in zip(increments, tokens, strict=True)]
        else:
            times = [seconds / steps for _, seconds, steps in increments]
        if len(times) < 2 * CHANGE_MIN_READINGS:
            continue
        # Where it changed: the split whose two sides lie closest to their own medians (least absolute deviations).
        k = min(range(CHANGE_MIN_READINGS, len(times) - CHANGE_MIN_READINGS + 1),
                key=lambda k: _cost(times[:k]) + _cost(times[k:]))  # fmt: skip
        before, after = times[:k], times[k:]
        median_before, median_after = statistics.median(before), statistics.median(after)
        if median_before <= 0:
            continue  # steps that took no time (a foreign writer's zeros): nothing to compare with
        spread = 1.4826 * statistics.median(abs(t - median_before) for t in before)
        # A floor of 2 % of the median: steps of a steady run may vary by less than a clock's resolution.
        score = (median_after - median_before) / max(spread, 0.02 * median_before)
        if median_after >= CHANGE_RATIO * median_before and score >= CHANGE_SPREAD and (best is None or score > best[0]):
            best = (score, (increments[k][0], median_before, median_after, rows[0], rows[-1], increments[k - 1][0], unit))
    return best[1] if best else None


def _tokens_added(rows: Sequence[Row], at: Sequence[Row]) -> list[float]:
    """Tokens counted in the interval that ends at each row of ``at`` (empty when any is unknown)."""
    out = []
    previous = None
    wanted = iter(at)
    target = next(wanted, None)
    for row in rows:
        tokens = row.values.get("tokens")
        if row is target:
            if previous is None or not finite(tokens):
                return []
            out.append(tokens - previous)
            target = next(wanted, None)
        if finite(tokens):
            previous = tokens
    return out if len(out) == len(at) else []


def _cost(values: Sequence[float]) -> float:
    median = statistics.median(values)
    return sum(abs(v - median) for v in values)


def _share(process: ProcessRows, start: float, end: float, phase: str) -> float | None:
    """The share of the busy time (productive and data_wait) between ``start`` and ``end`` spent in ``phase``,
    from the rank's goodput readings (None without two of them in the span)."""
    readings = [t for t in process.time if start <= t.time_s <= end]
    if len(readings) < 2:
        return None
    first, last = readings[0].phases, readings[-1].phases
    busy = sum(last.get(p, 0.0) - first.get(p, 0.0) for p in ("productive", "data_wait"))
    return (last.get(phase, 0.0) - first.get(phase, 0.0)) / busy if busy > 0 else None


def _window(process: ProcessRows, start: float, end: float) -> ProcessRows:
    """The rank's readings between ``start`` and ``end``, as a rank of their own."""
    return ProcessRows(process.rank, [row for row in process.rows if start <= row.time_s <= end])


def _throttled(window: ProcessRows, reason: str) -> float | None:
    """The share of the window's time the clock was held down for ``reason`` (as the straggler detector reads it)."""
    added, span = gained(window, f"throttle_{reason}")
    return added / span if span > 0 else None


def _explain(process: ProcessRows, at: Row, first: Row, last: Row) -> tuple[list[str], list[str], list[Evidence]]:
    """What changed on this rank at the change: (causes found, ruled out, evidence)."""
    causes: list[str] = []
    ruled_out: list[str] = []
    evidence: list[Evidence] = []
    rank = process.rank
    # Before: up to the reading before the change's (that one holds the interval it happened in).
    before, after = (first.time_s, math.nextafter(at.time_s, -math.inf)), (at.time_s, last.time_s)
    waited = (_share(process, *before, "data_wait"), _share(process, *after, "data_wait"))
    if waited[0] is not None and waited[1] is not None:
        words = f"waiting for data {waited[1]:.0%} of its time after, {waited[0]:.0%} before"
        if waited[1] - waited[0] >= CHANGE_EXPLAINS:
            causes.append(f"the data loader: {words}")
            note = f"share waiting for data after ({waited[0]:.1%} before)"
            evidence.append(Evidence("openlora.training.time", round(waited[1], 4), note, None, rank))
        else:
            ruled_out.append(f"the data loader: {words}")
    rows_before, rows_after = _window(process, *before), _window(process, *after)
    shares: dict[str, tuple[float, float]] = {}
    for reason in SLOWDOWN_REASONS:
        was, now = _throttled(rows_before, reason), _throttled(rows_after, reason)
        if was is not None and now is not None:
            shares[reason] = (was, now)
    if shares:
        reason = max(shares, key=lambda r: shares[r][1] - shares[r][0])
        was, now = shares[reason]
        if now - was >= CHANGE_EXPLAINS:
            causes.append(f"the GPU's clock held down ({reason}) {now:.0%} of the time after, {was:.0%} before")
            note = f"share of the time throttled for {reason} after ({was:.0%} before)"
            evidence.append(Evidence("openlora.gpu.throttle.time", round(now, 4), note, None, rank))
        else:
            ruled_out.append("the GPU's throttling: no more after than before")
    clock = (mean_of(rows_before, "gpu_clock_sm"), mean_of(rows_after, "gpu_clock_sm"))
    if clock[0] and clock[1] is not None:
        words = f"{clock[1] / 1e6:,.0f} MHz after, {clock[0] / 1e6:,.0f} MHz before"
        if clock[1] <= CLOCK_DROP * clock[0]:
            evidence.append(Evidence("openlora.gpu.clock.sm", round(clock[1]), f"its GPU's mean SM clock: {words}", None, rank))
            if not any(c.startswith("the GPU's clock") for c in causes):
                causes.append(f"the GPU's clock dropped: {words}")
        else:
            ruled_out.append(f"the GPU's clock: {words}")
    return causes, ruled_out, evidence


def throughput(processes: Sequence[ProcessRows]) -> list[Finding]:
    """The run's lasting slowdown, when more than half of its ranks (each with a change point of its own)
    slowed: one rank alone is a straggler, left to that detector."""
    found = {i: change for i, p in enumerate(processes) if (change := _change(p)) is not None}
    if not found:
        return []
    # Ranks that changed together: within a few readings of each other (each rank's own interval). The
    # largest such group; ranks that slowed at other times are stragglers or changes of their own.
    def together(anchor: int) -> dict[int, tuple]:
        at = found[anchor][0].time_s
        window = CHANGE_TOGETHER_READINGS * max(found[anchor][0].time_s - found[anchor][5].time_s, 1e-9)
        return {i: change for i, change in found.items() if abs(change[0].time_s - at) <= window}

    changes = max((together(i) for i in sorted(found, key=lambda i: found[i][0].time_s)), key=len)
    if len(processes) > 1 and len(changes) * 2 <= len(processes):
        return []
    index = min(changes, key=lambda i: changes[i][0].time_s)
    at, before, after, first, last, prior, unit = changes[index]
    process = processes[index]
    causes, ruled_out, evidence = _explain(process, at, first, last)
    step = at.values.get("steps")
    ranks = len(processes)
    who = "the run" if ranks == 1 else ("every rank" if len(changes) == ranks else f"{len(changes)} of its {ranks} ranks")
    steps = [Evidence("openlora.training.step.duration", round(a, 9), f"median seconds per {u} before: {b:.3g} s, after: "
                      f"{a:.3g} s ({a / b:.2f}x), from step {step_text(r.values.get('steps'))}", r.values.get("steps"),
                      processes[i].rank)
             for i, (r, b, a, _, _, _, u) in sorted(changes.items())[:8]]  # fmt: skip
    if causes:
        cause = "what changed then on " + ("the rank" if ranks == 1 else f"rank {process.rank}") + ": " + "; ".join(causes)
    elif len(changes) > 1:
        cause = ("no cause found among the signals recorded: the slowed ranks changed together, so something "
                 "they share (the network, the storage, another job on their nodes, a new phase of the data)")  # fmt: skip
    else:
        cause = "no cause found among the signals recorded: its own steps take longer (its compute, a host busy elsewhere)"
    return [
        Finding(
            "warning", "throughput",
            f"{who} became {after / before:.2f}x slower per {unit} between steps {step_text(prior.values.get('steps'))} "
            f"and {step_text(step)} ({when_text(at.time_s)}) and stayed so",
            cause, (*steps, *evidence), tuple(ruled_out),
            ("compare the dashboards at that time: data wait, GPU clocks and throttle reasons, the network",
             "look at what else started on the nodes then"),
            f"{RUNBOOKS}#openlorathroughputdegraded", step if step is None or math.isfinite(step) else None,
            at.time_s, None if ranks > 1 else process.rank, after / before,
        )
    ]  # fmt: skip

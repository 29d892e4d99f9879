"""Why a run went wrong, found from its own metrics: ranked findings with their evidence.

:func:`diagnose` runs small detectors over a :class:`~openlora_otel.report.model.Run` read from
history files (every rank's samples, :attr:`Run.processes`) and returns :class:`Finding` objects,
most severe first. Each says what happened and when (step, wall time, rank), the values that show
it and the series they came from, the likely cause with the alternatives it ruled out and why,
what to try, and the runbook entry. A healthy run gets no finding.

The detectors so far (issue 34 lists the rest):

- ``divergence``: the first non-finite loss or gradient norm; whether the gradient norm grew before
  it, a loss spike preceded it, and the learning rate then.
- ``hang``: a rank that stopped stepping while the others went on, or a run whose telemetry kept
  reporting after its steps stopped.
- ``straggler``: a rank whose mean step time is well above the others', since when, and whether
  its own data wait explains it.
- ``input_bound``: the share of the run's time spent waiting for data.

:func:`to_json` gives the documented JSON form (:data:`JSON_SCHEMA`); :func:`text_lines` the printed one.
See docs/how-to/diagnose.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from openlora_otel.report.model import ProcessRows, Row, Run

__all__ = ["JSON_SCHEMA", "KINDS", "SCHEMA_ID", "SEVERITIES", "Evidence", "Finding", "diagnose", "text_lines", "to_json"]

RUNBOOKS = "https://openlora.github.io/openlora-otel/runbooks/"
SCHEMA_ID = "https://openlora.github.io/openlora-otel/schemas/diagnosis-v1.json"
SEVERITIES = ("critical", "warning", "info")
# The detectors, in the order their findings of one severity come: what ruins a run, then what slows it.
KINDS = ("divergence", "hang", "straggler", "input_bound")

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
GRADIENT_GROWTH = 10.0  # the gradient norm's recent max over its early median before a divergence
LOSS_SPIKE = 5.0  # a window's largest loss over its mean before a divergence
GRADIENT_NORM_EXTREME = 1e3  # a gradient norm that high, with nothing earlier to compare: exploded
LEARNING_RATE_FAR_TOO_HIGH = 0.05  # a learning rate no fine-tune uses: it alone explains a divergence
TYPICAL_LEARNING_RATES = "1e-5 to 3e-3"
STRAGGLER_RATIO = 1.25  # a rank's mean step time over the other ranks' median: a straggler (warning)
STRAGGLER_CRITICAL = 2.0  # ... and critical from this ratio
STRAGGLER_MIN_EXTRA_S = 0.005  # below this many seconds more a step, noise on a tiny step
DATA_WAIT_EXPLAINS = 0.10  # a straggler's data-wait share above the other ranks' median by this: its data loader
INPUT_BOUND_SHARE = 0.20  # of the run's time waiting for data: input-bound (warning)
INPUT_BOUND_CRITICAL = 0.50
RECOVERED_STEPS = 10  # steps after a divergence, most of them finite: the run recovered (a warning)
HANG_MIN_S = 60.0  # no step for this long (and for HANG_STEPS step times) while others step: hung
HANG_STEPS = 20.0
# Goodput phases that are work without optimizer steps: time in them is not a hang.
_NOT_STEPPING = ("evaluation", "checkpoint_save", "checkpoint_load", "idle")


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
    kind: str  # the detector: divergence, hang, straggler, input_bound
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


def diagnose(run: Run) -> list[Finding]:
    """Every detector's findings for ``run``, most severe (then most telling) first."""
    processes = run.processes or [ProcessRows(run.rank, run.rows, [])]
    found: list[Finding] = [*_divergence(processes), *_hang(processes, run.outcome), *_straggler(processes),
                            *_input_bound(processes)]  # fmt: skip
    return sorted(found, key=lambda f: f.order)


# -- helpers -------------------------------------------------------------------------------


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _finite_or_none(value: float | None) -> float | None:
    return value if _finite(value) else None


def _step_time_increments(rows: Sequence[Row]) -> list[tuple[Row, float, float]]:
    """(row, seconds, steps) added since the row before, from the step-duration histogram's sum and
    count; a count that went down (a new attempt's process) starts again from zero."""
    out = []
    previous: tuple[float, float] | None = None
    for row in rows:
        total, count = row.values.get("step_time_sum"), row.values.get("step_time_count")
        if not (_finite(total) and _finite(count)):
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


def _mean_step_time(rows: Sequence[Row]) -> float | None:
    increments = _step_time_increments(rows)
    steps = sum(s for _, _, s in increments)
    return sum(t for _, t, _ in increments) / steps if steps else None


def _phases(process: ProcessRows) -> dict[str, float]:
    """Seconds per phase of one rank, summed over its attempts (the last reading of each)."""
    last: dict[tuple[int | None, str | None], dict[str, float]] = {}
    for sample in process.time:
        last[(sample.attempt, sample.process)] = sample.phases
    total: dict[str, float] = {}
    for phases in last.values():
        if not all(_finite(seconds) and seconds >= 0 for seconds in phases.values()):
            return {}  # a reading that cannot be right: no shares from this rank at all
        for phase, seconds in phases.items():
            total[phase] = total.get(phase, 0.0) + seconds
    return total


def _data_wait_share(phases: dict[str, float]) -> float | None:
    busy = sum(v for k, v in phases.items() if k in ("productive", "data_wait"))
    return phases.get("data_wait", 0.0) / busy if busy > 0 else None


def _when(time_s: float | None) -> str:
    if not _finite(time_s):
        return ""
    return datetime.fromtimestamp(time_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _times(ratio: float) -> str:
    """A ratio as read: 14.3, 1,432, 1.4e+19."""
    return f"{ratio:,.1f}" if ratio < 100 else (f"{ratio:,.0f}" if ratio < 1e6 else f"{ratio:.2g}")


def _step(value: float | None) -> str:
    return f"{value:,.0f}" if _finite(value) else "?"


def _rank(rank: int | None) -> str:
    return "the process" if rank is None else f"rank {rank}"


# -- detectors -----------------------------------------------------------------------------


def _divergence(processes: Sequence[ProcessRows]) -> list[Finding]:
    first: tuple[float, ProcessRows, Row, str] | None = None
    for process in processes:
        for row in process.rows:
            what = next(
                (name for key, name in (("loss_nonfinite", "loss"), ("grad_norm_nonfinite", "gradient norm"))
                 if row.values.get(key, 0.0) > 0),
                None,
            )  # fmt: skip
            if what is not None:
                if first is None or row.time_s < first[0]:
                    first = (row.time_s, process, row, what)
                break
    if first is None:
        return []
    _, process, row, what = first
    before = [r for r in process.rows if r.time_s < row.time_s]
    step = _first_nonfinite_step(before, row, "loss_nonfinite" if what == "loss" else "grad_norm_nonfinite")
    evidence = [
        Evidence(
            "openlora.training.loss.nonfinite" if what == "loss" else "openlora.training.gradient_norm.nonfinite",
            row.values.get("loss_nonfinite" if what == "loss" else "grad_norm_nonfinite", 0.0),
            f"non-finite values counted by this step, none by step {_step(before[-1].values.get('steps'))}"
            if before else "non-finite values counted by this step",
            row.values.get("steps"),
            process.rank,
        )
    ]
    # The gradient norm up to the divergence: the rows before it, and the window of the row that
    # counted it (its means and maxima are of the finite values, the steps before the first NaN).
    upto = [*before, row]
    peaks = [v for r in upto[-3:] if _finite(v := r.values.get("grad_norm_max", r.values.get("grad_norm")))]
    peak = max(peaks, default=None)
    early = [r.values["grad_norm"] for r in before[: max(1, len(before) // 2)] if _finite(r.values.get("grad_norm"))]
    baseline = statistics.median(early) if early else None
    growth = peak / baseline if peak is not None and baseline else None
    if peak is not None:
        note = (
            f"{_times(growth)}x the early gradient norm ({baseline:.3g}) just before"
            if growth is not None
            else "the largest gradient norm in the window that ended with it"
        )
        evidence.append(Evidence("openlora.training.gradient_norm.max", peak, note, row.values.get("steps"), process.rank))
    spikes = [
        (r.values["loss_max"] / r.values["loss"], r)
        for r in before
        if _finite(r.values.get("loss_max")) and _finite(r.values.get("loss")) and r.values["loss"] > 0
    ]
    spike = max(spikes, key=lambda s: s[0], default=None)
    if spike is not None:
        evidence.append(
            Evidence("openlora.training.loss.max", spike[1].values["loss_max"],
                     f"{spike[0]:.1f}x its window's mean loss", spike[1].values.get("steps"), process.rank)
        )  # fmt: skip
    lr_row = next((r for r in reversed(upto) if _finite(r.values.get("learning_rate"))), None)
    lr = lr_row.values["learning_rate"] if lr_row is not None else None
    if lr is not None:
        evidence.append(Evidence("openlora.training.learning_rate", lr, "the learning rate then", step, process.rank))
    exploded = (growth is not None and growth >= GRADIENT_GROWTH) or (
        growth is None and peak is not None and peak >= GRADIENT_NORM_EXTREME
    )
    lr_far_too_high = lr is not None and lr >= LEARNING_RATE_FAR_TOO_HIGH
    lr_text = (
        f"; the learning rate, {lr:.3g}, is far above what fine-tunes use ({TYPICAL_LEARNING_RATES})"
        if lr_far_too_high
        else (f" (the learning rate was {lr:.3g})" if lr is not None else "")
    )
    if exploded or lr_far_too_high:
        grew = (
            f"the gradient norm grew {_times(growth)}x"
            if growth is not None and growth >= GRADIENT_GROWTH
            else (f"the gradient norm reached {peak:.3g}" if peak is not None and exploded else "")
        )
        cause = (
            (f"{grew} before the {what} went non-finite: the optimisation became unstable, most often a learning "
             f"rate too high for this model{lr_text}") if grew
            else f"a learning rate too high{lr_text}: the first steps at it blew the weights up"
        )  # fmt: skip
        ruled_out = ("a single bad batch: the gradients grew over several steps, not in one"
                     if growth is not None else "a bad batch or a numerical problem: the learning rate alone explains it",)  # fmt: skip
        try_next = ("lower the learning rate (a third to a tenth), or warm it up over more steps",
                    "clip the gradient norm (max_grad_norm 1.0)", "resume from the last checkpoint before the growth")  # fmt: skip
        score = max(growth or 0.0, GRADIENT_GROWTH)
    elif spike is not None and spike[0] >= LOSS_SPIKE:
        cause = (
            f"one step's loss jumped to {spike[0]:.0f}x its window's mean (step {_step(spike[1].values.get('steps'))}) "
            "before it: a bad batch, or an example the model cannot represent in this precision"
        )
        ruled_out = ("a learning rate too high: the gradient norm did not grow before it"
                     if growth is not None else "a learning rate too high: no gradient norm recorded to say",)  # fmt: skip
        try_next = ("find the batch of that step (its data order, seed) and check it for empty or extreme examples",
                    "skip non-finite steps (the divergence guard) and resume from the last checkpoint")  # fmt: skip
        score = spike[0]
    else:
        signs = [f"the gradient norm{f' (at most {growth:.1f}x its early value)' if growth is not None else ''}",
                 f"the loss{f' (at most {spike[0]:.1f}x its mean)' if spike is not None else ''}"]  # fmt: skip
        cause = (
            f"the {what} went non-finite without warning: neither {signs[0]} nor {signs[1]} grew first: a "
            "numerical problem (an overflow in half precision, a division by zero in the loss) or a corrupted input"
        )
        ruled_out = ("a learning rate too high, and a loss spike: neither preceded it",)
        try_next = ("run the step in float32 (or bf16 instead of fp16) to see whether precision is the cause",
                    "check the batch of that step for empty sequences or all-padding labels")  # fmt: skip
        score = 1.0
    # A run that went on stepping with finite values after it (the guard skipped the bad steps) recovered.
    key = "loss_nonfinite" if what == "loss" else "grad_norm_nonfinite"
    after = [r for r in process.rows if r.time_s > row.time_s and _finite(r.values.get("steps"))
             and _finite(r.values.get(key)) and r.values["steps"] >= (row.values.get("steps") or 0)]  # fmt: skip
    severity, title_end = "critical", ""
    if after and _finite(row.values.get("steps")) and _finite(row.values.get(key)):
        since = after[-1].values["steps"] - row.values["steps"]
        more = after[-1].values[key] - row.values[key]
        if since >= RECOVERED_STEPS and more < since / 2:
            severity = "warning"
            title_end = f"; then it recovered ({more:,.0f} more non-finite in the {since:,.0f} steps after)"
    return [
        Finding(
            severity, "divergence",
            f"the {what} went non-finite at step {_step(step)} ({_rank(process.rank)}, {_when(row.time_s)}){title_end}",
            cause, tuple(evidence), ruled_out, try_next, f"{RUNBOOKS}#openloralossnonfinite",
            step, row.time_s, process.rank, score,
        )
    ]  # fmt: skip


def _first_nonfinite_step(before: Sequence[Row], row: Row, key: str) -> float | None:
    """The step of the first non-finite value, as when it stayed non-finite (NaN does): ``count`` of
    them by this row's step make it ``count - 1`` steps before; after the step of the row before, of
    the same attempt (whose count was 0; a resumed process counts its steps from 0 again); at least 1."""
    step, count = row.values.get("steps"), row.values.get(key, 0.0)
    if not (_finite(step) and _finite(count)):
        return None
    previous = next((r.values.get("steps") for r in reversed(before) if _finite(r.values.get("steps"))), None)
    if previous is not None and previous > step:
        previous = None  # an earlier attempt's
    first = step - count + 1
    if previous is not None:
        first = max(previous + 1, first)
    return min(max(first, 1.0), step)


def _last_step(process: ProcessRows) -> tuple[float, float | None] | None:
    """(wall time, step) of the rank's latest optimizer step."""
    best = None
    for row in process.rows:
        stamp = row.values.get("last_step_time")
        if _finite(stamp) and stamp > 0 and (best is None or stamp > best[0]):
            best = (stamp, row.values.get("steps"))
    return best


def _busy_between(process: ProcessRows, start: float, end: float) -> float:
    """Seconds the rank spent between ``start`` and ``end`` on what is not a step but is work: an
    evaluation, a checkpoint, or idle time the run marked (its goodput readings)."""

    def at(moment: float) -> float:
        readings = [t for t in process.time if t.time_s <= moment]
        if not readings:
            return 0.0
        phases = readings[-1].phases
        return sum(v for k, v in phases.items() if k in _NOT_STEPPING and _finite(v))

    return max(0.0, at(end) - at(start))


def _hang(processes: Sequence[ProcessRows], outcome: str | None = None) -> list[Finding]:
    lasts = {index: _last_step(p) for index, p in enumerate(processes)}
    lasts = {i: v for i, v in lasts.items() if v is not None}
    if not lasts:
        return []
    times = [t for p in processes if (t := _mean_step_time(p.rows)) is not None]
    step_time = statistics.median(times) if times else 0.0
    limit = max(HANG_MIN_S, HANG_STEPS * step_time)
    newest = max(t for t, _ in lasts.values())
    findings = []
    for index, (stamp, step) in lasts.items():
        process = processes[index]
        gap = newest - stamp
        # Hung: it kept reporting (its telemetry runs on threads of its own) without stepping while the
        # others stepped; a rank whose rows end with its steps ended (an attempt with more ranks than the
        # next), and one busy evaluating or checkpointing was not stuck.
        reported = max((r.time_s for r in process.rows), default=stamp) - stamp
        busy = _busy_between(process, stamp, stamp + reported)
        if len(lasts) > 1 and gap >= limit and reported >= limit and reported - busy >= limit:
            findings.append(
                Finding(
                    "critical", "hang",
                    f"{_rank(process.rank)} stopped stepping at step {_step(step)} ({_when(stamp)}); the other ranks "
                    f"stepped for {gap:,.0f} s more",
                    "this rank is stuck (a collective waiting for a peer, a deadlock in its data loader, a hung GPU) "
                    "while the others went on: the rank that stopped first is where to look",
                    (Evidence("openlora.training.last_step.timestamp", stamp, f"{gap:,.0f} s before the newest rank's; "
                              f"it went on reporting for {reported:,.0f} s", _finite_or_none(step), process.rank),),
                    ("a slow rank: it made no step at all in that time, "
                     f"{gap / step_time:,.0f} step times" if step_time else "a slow rank: it made no step at all",),
                    ("look at this rank's stack (py-spy dump --pid), its log and its GPU (XIDs, a GPU off the bus)",),
                    f"{RUNBOOKS}#openlorarankhung", _finite_or_none(step), stamp, process.rank, gap,
                )
            )  # fmt: skip
    # Every rank stopped while telemetry went on: the rows keep coming, the steps do not. Not a run that
    # ended (its outcome says so), nor one evaluating or saving a checkpoint in that time.
    newest_row = max((r.time_s for p in processes for r in p.rows), default=newest)
    silent = newest_row - newest
    busy = max((_busy_between(p, newest, newest_row) for p in processes), default=0.0)
    if not findings and outcome in (None, "running") and silent >= limit and silent - busy >= limit:
        stamp, step = lasts[max(lasts, key=lambda i: lasts[i][0])]
        findings.append(
            Finding(
                "critical", "hang",
                f"no rank stepped after step {_step(step)} ({_when(stamp)}) while the telemetry went on for {silent:,.0f} s",
                "the training loop stopped without ending the process: every rank stuck in the same collective or "
                "waiting for input, or a loop that ended without shutting down",
                (Evidence("openlora.training.last_step.timestamp", stamp, f"{silent:,.0f} s before the last sample",
                          _finite_or_none(step)),),
                (f"an evaluation or a checkpoint: {busy:,.0f} s of that time went to them" if _recorded_phases(processes)
                 else "an evaluation or a checkpoint: no goodput phases recorded to say",),
                ("look at the ranks' stacks (py-spy dump --pid) and their logs",),
                f"{RUNBOOKS}#openloratrainingstalled", _finite_or_none(step), stamp, None, silent,
            )
        )  # fmt: skip
    return findings


def _recorded_phases(processes: Sequence[ProcessRows]) -> bool:
    """Whether any rank recorded its goodput phases."""
    return any(p.time for p in processes)


def _straggler(processes: Sequence[ProcessRows]) -> list[Finding]:
    times = {i: t for i, p in enumerate(processes) if (t := _mean_step_time(p.rows)) is not None}
    if len(times) < 2:
        return []
    shares = {i: _data_wait_share(_phases(p)) for i, p in enumerate(processes)}
    findings = []
    for index, mean in times.items():
        # Against the other ranks (with two, the median of all would be half the straggler itself).
        median = statistics.median(t for i, t in times.items() if i != index)
        others_shares = [s for i, s in shares.items() if i != index and s is not None]
        median_share = statistics.median(others_shares) if others_shares else None
        if median <= 0:
            continue  # nothing to compare with
        ratio = mean / median
        if ratio < STRAGGLER_RATIO or mean - median < STRAGGLER_MIN_EXTRA_S:
            continue
        process = processes[index]
        since = next(
            ((row, t / s) for row, t, s in _step_time_increments(process.rows) if t / s >= STRAGGLER_RATIO * median),
            None,
        )
        evidence = [
            Evidence("openlora.training.step.duration", round(mean, 6),
                     f"mean seconds per step, {ratio:.2f}x the other ranks' median {median:.3g} s", None, process.rank)
        ]  # fmt: skip
        share = shares.get(index)
        if share is not None and median_share is not None:
            evidence.append(
                Evidence("openlora.training.time", round(share, 4),
                         f"share of its time waiting for data (the other ranks' median {median_share:.1%})", None, process.rank)
            )  # fmt: skip
        if share is not None and median_share is not None and share - median_share >= DATA_WAIT_EXPLAINS:
            cause = f"its data loader: it waits for data {share:.0%} of its time, the other ranks {median_share:.0%}"
            ruled_out = ("its compute: without the extra data wait its steps take what the others' do",)
            try_next = ("give this rank's DataLoader more workers, or check its node's storage and CPU",)
        else:
            cause = (
                "no cause found among the signals recorded: its own steps take longer (compute, a GPU clocked "
                "down, a PCIe link trained narrow, a host busy elsewhere); the GPU and host series of that rank's "
                "node say which"
            )
            ruled_out = (
                (f"its data loader: it waits for data {share:.0%} of its time, like the others ({median_share:.0%})",)
                if share is not None and median_share is not None
                else ("its data loader: not recorded (no goodput phases in these files)",)
            )
            try_next = ("compare the rank's GPU clocks, throttle reasons, temperature and power with the others' "
                        "(the cluster dashboard)", "move the rank to another node to see whether the slowness follows it")  # fmt: skip
        findings.append(
            Finding(
                "critical" if ratio >= STRAGGLER_CRITICAL else "warning", "straggler",
                f"{_rank(process.rank)} is a straggler: {ratio:.2f}x the other ranks' step time"
                + (f" since step {_step(since[0].values.get('steps'))} ({_when(since[0].time_s)})" if since else ""),
                cause, tuple(evidence), ruled_out, try_next, f"{RUNBOOKS}#openlorarankstraggling",
                since[0].values.get("steps") if since else None, since[0].time_s if since else None, process.rank, ratio,
            )
        )  # fmt: skip
    return findings


def _input_bound(processes: Sequence[ProcessRows]) -> list[Finding]:
    total: dict[str, float] = {}
    for process in processes:
        for phase, seconds in _phases(process).items():
            total[phase] = total.get(phase, 0.0) + seconds
    share = _data_wait_share(total)
    if share is None or share < INPUT_BOUND_SHARE:
        return []
    return [
        Finding(
            "critical" if share >= INPUT_BOUND_CRITICAL else "warning", "input_bound",
            f"the run is input-bound: {share:.0%} of its training time went waiting for data",
            "the data loader does not keep up with the GPU: every step waits for its batch",
            (Evidence("openlora.training.time", round(total.get("data_wait", 0.0), 3),
                      f"seconds waiting for data, of {sum(total.get(p, 0.0) for p in ('productive', 'data_wait')):,.1f} s "
                      "of training (phase data_wait, all ranks and attempts)"),),
            (f"the model's own compute: {total.get('productive', 0.0):,.1f} s of it against "
             f"{total.get('data_wait', 0.0):,.1f} s waiting; a faster GPU would leave the waits as they are",),
            ("more DataLoader workers (num_workers), pin_memory, prefetch_factor",
             "pre-tokenise the dataset; read it from local storage"),
            f"{RUNBOOKS}#openlorainputbound", None, None, None, share,
        )
    ]  # fmt: skip


# -- output --------------------------------------------------------------------------------


def _json_value(value: float | str) -> float | str:
    """A number as JSON can carry it: a non-finite one (a foreign writer's NaN) as its text."""
    return value if isinstance(value, str) or _finite(value) else str(value)


def _finding_json(finding: Finding) -> dict[str, Any]:
    time_s = _finite_or_none(finding.time_s)
    return {
        "severity": finding.severity,
        "kind": finding.kind,
        "title": finding.title,
        "step": _finite_or_none(finding.step),
        "time": _when(time_s) or None,
        "time_unix_s": time_s,
        "rank": finding.rank,
        "evidence": [
            {"series": e.series, "value": _json_value(e.value), "note": e.note, "step": _finite_or_none(e.step),
             "rank": e.rank}
            for e in finding.evidence
        ],
        "cause": finding.cause,
        "ruled_out": list(finding.ruled_out),
        "try": list(finding.try_next),
        "runbook": finding.runbook,
    }


def to_json(runs: Iterable[tuple[Run, list[Finding]]]) -> dict[str, Any]:
    """The diagnosis of each run as :data:`JSON_SCHEMA` describes it."""
    return {
        "$schema": SCHEMA_ID,
        "runs": [
            {
                "run_id": run.run_id,
                "name": run.name,
                "source": run.source,
                "ranks": run.ranks,
                "steps": max(
                    (r.values["steps"] for r in run.rows if _finite(r.values.get("steps")) and r.values["steps"] >= 0),
                    default=0.0,
                ),
                "outcome": run.outcome,
                "findings": [_finding_json(f) for f in findings],
            }
            for run, findings in runs
        ],
    }


def text_lines(run: Run, findings: Sequence[Finding]) -> list[str]:
    """The diagnosis of ``run`` as printed: a line for the run, then each finding, numbered."""
    name = f" ({run.name})" if run.name != run.run_id else ""
    lines = [f"run {run.run_id}{name}: {len(run.processes) or 1} rank(s), from {run.source}"]
    if not findings:
        lines.append("  no findings: no divergence, hang, straggler or input wait found in its metrics")
    for number, finding in enumerate(findings, 1):
        lines.append(f"  {number}. [{finding.severity}] {finding.title}")
        lines.append(f"     likely cause: {finding.cause}")
        for item in finding.evidence:
            where = ", ".join(
                part for part in (f"step {_step(item.step)}" if item.step is not None else "",
                                  _rank(item.rank) if item.rank is not None else "") if part
            )  # fmt: skip
            value = item.value if isinstance(item.value, str) else f"{item.value:.6g}"
            lines.append(f"     evidence: {item.series} = {value}{f' ({where})' if where else ''}: {item.note}")
        for text in finding.ruled_out:
            lines.append(f"     ruled out: {text}")
        for text in finding.try_next:
            lines.append(f"     try: {text}")
        if finding.runbook:
            lines.append(f"     runbook: {finding.runbook}")
    return lines


_NUMBER_OR_NULL = {"type": ["number", "null"]}
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "openlora-otel diagnose --json",
    "type": "object",
    "required": ["$schema", "runs"],
    "additionalProperties": False,
    "properties": {
        "$schema": {"const": SCHEMA_ID},
        "runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["run_id", "name", "source", "ranks", "steps", "outcome", "findings"],
                "additionalProperties": False,
                "properties": {
                    "run_id": {"type": "string"},
                    "name": {"type": "string"},
                    "source": {"type": "string"},
                    "ranks": {"type": "integer", "minimum": 1},
                    "steps": {"type": "number", "minimum": 0},
                    "outcome": {"type": ["string", "null"]},
                    "findings": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["severity", "kind", "title", "step", "time", "time_unix_s", "rank",
                                         "evidence", "cause", "ruled_out", "try", "runbook"],
                            "additionalProperties": False,
                            "properties": {
                                "severity": {"enum": list(SEVERITIES)},
                                "kind": {"enum": list(KINDS)},
                                "title": {"type": "string"},
                                "step": _NUMBER_OR_NULL,
                                "time": {"type": ["string", "null"]},
                                "time_unix_s": _NUMBER_OR_NULL,
                                "rank": {"type": ["integer", "null"]},
                                "evidence": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["series", "value", "note", "step", "rank"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "series": {"type": "string"},
                                            "value": {"type": ["number", "string"]},
                                            "note": {"type": "string"},
                                            "step": _NUMBER_OR_NULL,
                                            "rank": {"type": ["integer", "null"]},
                                        },
                                    },
                                },
                                "cause": {"type": "string"},
                                "ruled_out": {"type": "array", "items": {"type": "string"}},
                                "try": {"type": "array", "items": {"type": "string"}},
                                "runbook": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}  # fmt: skip

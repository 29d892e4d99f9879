"""The detectors of the training loop itself: a divergence, a hang, a run waiting for its data."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from openlora_otel.report.diagnosis.findings import (
    RUNBOOKS,
    Evidence,
    Finding,
    attempts,
    data_wait_share,
    finite,
    finite_or_none,
    mean_step_time,
    rank_phases,
    rank_text,
    step_text,
    times_text,
    when_text,
)
from openlora_otel.report.model import ProcessRows, Row

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
GRADIENT_GROWTH = 10.0  # the gradient norm's recent max over its early median before a divergence
LOSS_SPIKE = 5.0  # a window's largest loss over its mean before a divergence
GRADIENT_NORM_EXTREME = 1e3  # a gradient norm that high, with nothing earlier to compare: exploded
LEARNING_RATE_FAR_TOO_HIGH = 0.05  # a learning rate no fine-tune uses: it alone explains a divergence
TYPICAL_LEARNING_RATES = "1e-5 to 3e-3"
INPUT_BOUND_SHARE = 0.20  # of the run's time waiting for data: input-bound (warning)
INPUT_BOUND_CRITICAL = 0.50
RECOVERED_STEPS = 10  # steps after a divergence, most of them finite: the run recovered (a warning)
HANG_MIN_S = 60.0  # no step for this long (and for HANG_STEPS step times) while others step: hung
HANG_STEPS = 20.0
# Goodput phases that are work without optimizer steps: time in them is not a hang.
# What a rank may do for long between steps without being stuck: the phases the run marks itself. Not
# idle: the goodput clock books a stall (no step for a minute) as idle, and a stall is what a hang is.
_NOT_STEPPING = ("evaluation", "checkpoint_save", "checkpoint_load")


def divergence(processes: Sequence[ProcessRows]) -> list[Finding]:
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
            f"non-finite values counted by this step, none by step {step_text(before[-1].values.get('steps'))}"
            if before else "non-finite values counted by this step",
            row.values.get("steps"),
            process.rank,
        )
    ]
    # The gradient norm up to the divergence: the rows before it, and the window of the row that
    # counted it (its means and maxima are of the finite values, the steps before the first NaN).
    upto = [*before, row]
    peaks = [v for r in upto[-3:] if finite(v := r.values.get("grad_norm_max", r.values.get("grad_norm")))]
    peak = max(peaks, default=None)
    early = [r.values["grad_norm"] for r in before[: max(1, len(before) // 2)] if finite(r.values.get("grad_norm"))]
    baseline = statistics.median(early) if early else None
    growth = peak / baseline if peak is not None and baseline else None
    if peak is not None:
        note = (
            f"{times_text(growth)}x the early gradient norm ({baseline:.3g}) just before"
            if growth is not None
            else "the largest gradient norm in the window that ended with it"
        )
        evidence.append(Evidence("openlora.training.gradient_norm.max", peak, note, row.values.get("steps"), process.rank))
    spikes = [
        (r.values["loss_max"] / r.values["loss"], r)
        for r in before
        if finite(r.values.get("loss_max")) and finite(r.values.get("loss")) and r.values["loss"] > 0
    ]
    spike = max(spikes, key=lambda s: s[0], default=None)
    if spike is not None:
        evidence.append(
            Evidence("openlora.training.loss.max", spike[1].values["loss_max"],
                     f"{spike[0]:.1f}x its window's mean loss", spike[1].values.get("steps"), process.rank)
        )  # fmt: skip
    lr_row = next((r for r in reversed(upto) if finite(r.values.get("learning_rate"))), None)
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
            f"the gradient norm grew {times_text(growth)}x"
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
            f"one step's loss jumped to {spike[0]:.0f}x its window's mean (step {step_text(spike[1].values.get('steps'))}) "
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
    after = [r for r in process.rows if r.time_s > row.time_s and finite(r.values.get("steps"))
             and finite(r.values.get(key)) and r.values["steps"] >= (row.values.get("steps") or 0)]  # fmt: skip
    severity, title_end = "critical", ""
    if after and finite(row.values.get("steps")) and finite(row.values.get(key)):
        since = after[-1].values["steps"] - row.values["steps"]
        more = after[-1].values[key] - row.values[key]
        if since >= RECOVERED_STEPS and more < since / 2:
            severity = "warning"
            title_end = f"; then it recovered ({more:,.0f} more non-finite in the {since:,.0f} steps after)"
    return [
        Finding(
            severity, "divergence",
            f"the {what} went non-finite at step {step_text(step)} ({rank_text(process.rank)}, {when_text(row.time_s)}){title_end}",
            cause, tuple(evidence), ruled_out, try_next, f"{RUNBOOKS}#openloralossnonfinite",
            step, row.time_s, process.rank, score,
        )
    ]  # fmt: skip


def _first_nonfinite_step(before: Sequence[Row], row: Row, key: str) -> float | None:
    """The step of the first non-finite value, as when it stayed non-finite (NaN does): ``count`` of
    them by this row's step make it ``count - 1`` steps before; after the step of the row before, of
    the same attempt (whose count was 0; a resumed process counts its steps from 0 again); at least 1."""
    step, count = row.values.get("steps"), row.values.get(key, 0.0)
    if not (finite(step) and finite(count)):
        return None
    previous = next((r.values.get("steps") for r in reversed(before) if finite(r.values.get("steps"))), None)
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
        if finite(stamp) and stamp > 0 and (best is None or stamp > best[0]):
            best = (stamp, row.values.get("steps"))
    return best


def _busy_between(process: ProcessRows, start: float, end: float) -> float:
    """Seconds the rank spent between ``start`` and ``end`` on what is not a step but is work: an
    evaluation or a checkpoint (its goodput readings)."""

    def at(moment: float) -> float:
        readings = [t for t in process.time if t.time_s <= moment]
        if not readings:
            return 0.0
        phases = readings[-1].phases
        return sum(v for k, v in phases.items() if k in _NOT_STEPPING and finite(v))

    return max(0.0, at(end) - at(start))


def _attempt_end(process: ProcessRows) -> float | None:
    """When the rank's attempt that holds its latest step last reported: the silence after a step is
    measured there (not across a requeue's gap, nor into a later attempt that has not stepped yet)."""
    best: tuple[float, float] | None = None  # (latest step's time, its attempt's last row's time)
    for rows in attempts(process):
        stamps = [r.values["last_step_time"] for r in rows if finite(r.values.get("last_step_time"))]
        if stamps and max(stamps) > 0 and (best is None or max(stamps) > best[0]):
            best = (max(stamps), rows[-1].time_s)
    return best[1] if best else None


def hang(processes: Sequence[ProcessRows], outcome: str | None = None, max_steps: float | None = None) -> list[Finding]:
    lasts = {index: _last_step(p) for index, p in enumerate(processes)}
    lasts = {i: v for i, v in lasts.items() if v is not None}
    if not lasts:
        return []
    times = [t for p in processes if (t := mean_step_time(p.rows)) is not None]
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
                    f"{rank_text(process.rank)} stopped stepping at step {step_text(step)} ({when_text(stamp)}); the other ranks "
                    f"stepped for {gap:,.0f} s more",
                    "this rank is stuck (a collective waiting for a peer, a deadlock in its data loader, a hung GPU) "
                    "while the others went on: the rank that stopped first is where to look",
                    (Evidence("openlora.training.last_step.timestamp", stamp, f"{gap:,.0f} s before the newest rank's; "
                              f"it went on reporting for {reported:,.0f} s", finite_or_none(step), process.rank),),
                    ("a slow rank: it made no step at all in that time, "
                     f"{gap / step_time:,.0f} step times" if step_time else "a slow rank: it made no step at all",),
                    ("look at this rank's stack (py-spy dump --pid), its log and its GPU (XIDs, a GPU off the bus)",),
                    f"{RUNBOOKS}#openlorarankhung", finite_or_none(step), stamp, process.rank, gap,
                )
            )  # fmt: skip
    # Every rank stopped while telemetry went on: the rows keep coming, the steps do not. Not a run that
    # finished (after its last step come a merge, an upload) or that its guard stopped, nor one evaluating
    # or saving a checkpoint in that time. A hung run is often terminated (a scheduler's time limit, a
    # person) or fails (a collective's timeout) in the end: that is how it ended, not why it stopped.
    newest_row = max((end for p in processes if (end := _attempt_end(p)) is not None), default=newest)
    silent = newest_row - newest
    busy = max((_busy_between(p, newest, newest_row) for p in processes), default=0.0)
    ended = f"; then the run {outcome}" if outcome in ("terminated", "failed") else ""
    stamp, step = lasts[max(lasts, key=lambda i: lasts[i][0])]
    # A run of one attempt that reached its planned last step (max_steps) finished training: what it
    # does after (a save, a merge, an upload) is no hang, whatever its outcome says.
    done = max_steps is not None and step is not None and step >= max_steps and all(len(attempts(p)) == 1 for p in processes)
    if not findings and not done and outcome not in _ENDED_WELL and silent >= limit and silent - busy >= limit:
        findings.append(
            Finding(
                "critical", "hang",
                f"no rank stepped after step {step_text(step)} ({when_text(stamp)}) while the telemetry went on for "
                f"{silent:,.0f} s{ended}",
                "the training loop stopped without ending the process: every rank stuck in the same collective or "
                "waiting for input, or a loop that ended without shutting down",
                (Evidence("openlora.training.last_step.timestamp", stamp, f"{silent:,.0f} s before the last sample",
                          finite_or_none(step)),),
                (f"an evaluation or a checkpoint: {busy:,.0f} s of that time went to them" if _recorded_phases(processes)
                 else "an evaluation or a checkpoint: no goodput phases recorded to say",),
                ("look at the ranks' stacks (py-spy dump --pid) and their logs",),
                f"{RUNBOOKS}#openloratrainingstalled", finite_or_none(step), stamp, None, silent,
            )
        )  # fmt: skip
    return findings


# Outcomes after which a silence since the last step is no hang (see hang()).
_ENDED_WELL = ("finished", "stopped_by_guard")


def _recorded_phases(processes: Sequence[ProcessRows]) -> bool:
    """Whether any rank recorded its goodput phases."""
    return any(p.time for p in processes)


def input_bound(processes: Sequence[ProcessRows]) -> list[Finding]:
    total: dict[str, float] = {}
    for process in processes:
        for phase, seconds in rank_phases(process).items():
            total[phase] = total.get(phase, 0.0) + seconds
    share = data_wait_share(total)
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

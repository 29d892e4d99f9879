"""The straggler detector: a rank slower than the others, since when, and which of its own signals
explains it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from openlora_otel.report.diagnosis.findings import (
    RUNBOOKS,
    Evidence,
    Finding,
    data_wait_share,
    mean_step_time,
    rank_phases,
    rank_text,
    step_text,
    step_time_increments,
    when_text,
)
from openlora_otel.report.model import ProcessRows

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
STRAGGLER_RATIO = 1.25  # a rank's mean step time over the other ranks' median: a straggler (warning)
STRAGGLER_CRITICAL = 2.0  # ... and critical from this ratio
STRAGGLER_MIN_EXTRA_S = 0.005  # below this many seconds more a step, noise on a tiny step
DATA_WAIT_EXPLAINS = 0.10  # a straggler's data-wait share above the other ranks' median by this: its data loader


def straggler(processes: Sequence[ProcessRows]) -> list[Finding]:
    times = {i: t for i, p in enumerate(processes) if (t := mean_step_time(p.rows)) is not None}
    if len(times) < 2:
        return []
    shares = {i: data_wait_share(rank_phases(p)) for i, p in enumerate(processes)}
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
            ((row, t / s) for row, t, s in step_time_increments(process.rows) if t / s >= STRAGGLER_RATIO * median),
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
                f"{rank_text(process.rank)} is a straggler: {ratio:.2f}x the other ranks' step time"
                + (f" since step {step_text(since[0].values.get('steps'))} ({when_text(since[0].time_s)})" if since else ""),
                cause, tuple(evidence), ruled_out, try_next, f"{RUNBOOKS}#openlorarankstraggling",
                since[0].values.get("steps") if since else None, since[0].time_s if since else None, process.rank, ratio,
            )
        )  # fmt: skip
    return findings

"""The straggler detector: a rank slower than the others, since when, and which of its own signals
explains it."""

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
    gained,
    highest,
    mean_of,
    mean_step_time,
    rank_phases,
    rank_text,
    step_text,
    step_time_increments,
    when_text,
)
from openlora_otel.report.model import SLOWDOWN_REASONS, ProcessRows

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
STRAGGLER_RATIO = 1.25  # a rank's mean step time over the other ranks' median: a straggler (warning)
STRAGGLER_CRITICAL = 2.0  # ... and critical from this ratio
STRAGGLER_MIN_EXTRA_S = 0.005  # below this many seconds more a step, noise on a tiny step
DATA_WAIT_EXPLAINS = 0.10  # a straggler's data-wait share above the other ranks' median by this: its data loader
THROTTLE_EXPLAINS = 0.10  # a straggler's share of time throttled for a reason, above the other ranks' median by this
CLOCK_EXPLAINS = 0.90  # a straggler's mean SM clock at most this fraction of the other ranks' median
HOST_BUSY_EXPLAINS = 0.25  # a straggler's node's CPUs busier than the other ranks' nodes' median by this share
HOST_RANK = 0.05  # the host cause's score per share busier: under any direct sign's (see _host_cause)


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
        cause, ruled_out, try_next, more = straggler_cause(processes, index, share, median_share)
        evidence.extend(more)
        findings.append(
            Finding(
                "critical" if ratio >= STRAGGLER_CRITICAL else "warning", "straggler",
                f"{rank_text(process.rank)} is a straggler: {ratio:.2f}x the other ranks' step time"
                + (f" since step {step_text(since[0].values.get('steps'))} ({when_text(since[0].time_s)})" if since else ""),
                cause, tuple(evidence), tuple(ruled_out), tuple(try_next), f"{RUNBOOKS}#openlorarankstraggling",
                since[0].values.get("steps") if since else None, since[0].time_s if since else None, process.rank, ratio,
            )
        )  # fmt: skip
    return findings


def _throttled(process: ProcessRows) -> dict[str, float]:
    """Share of the rank's reported time its GPU clock was held down, per reason (SLOWDOWN_REASONS): what
    the throttle counters added within each attempt, over the attempts' spans (a counter since the
    driver loaded: another attempt's GPU starts from its own reading)."""
    out = {}
    for reason in SLOWDOWN_REASONS:
        added, span = gained(process, f"throttle_{reason}")
        if span > 0:
            out[reason] = min(1.0, added / span)
    return out


def _narrow_link(process: ProcessRows) -> tuple[float, float] | None:
    """(lanes, lanes supported) of the rank's latest reading whose PCIe link ran narrow."""
    narrow = [(r.values["pcie_width"], r.values["pcie_width_max"]) for r in process.rows
              if finite(r.values.get("pcie_width")) and finite(r.values.get("pcie_width_max"))
              and r.values["pcie_width"] < r.values["pcie_width_max"]]  # fmt: skip
    return narrow[-1] if narrow else None


def _busy_nodes(processes: Sequence[ProcessRows]) -> dict[str, float]:
    """Each node's mean share of CPU time busy (1 - ``system.cpu.utilization`` idle), from the processes
    that report it (LOCAL_RANK 0 reports its node's), by node name (:attr:`ProcessRows.host`)."""
    busy: dict[str, float] = {}
    for process in processes:
        # Its latest attempt's readings: the node its host names (a resume may run on another).
        latest = attempts(process)[-1] if process.rows else []
        readings = [r.values["host_cpu_idle"] for r in latest if finite(r.values.get("host_cpu_idle"))]
        idle = statistics.fmean(readings) if readings else None
        if process.host is not None and idle is not None:
            busy[process.host] = max(busy.get(process.host, 0.0), min(1.0, max(0.0, 1.0 - idle)))
    return busy


def _host_cause(
    processes: Sequence[ProcessRows], process: ProcessRows, others: Sequence[ProcessRows]
) -> tuple[tuple[float, str, list[str], list[Evidence]] | None, str]:
    """Whether the straggler's node was busier than the other ranks' nodes: a candidate, and its words."""
    if process.host is None:
        return None, "its node's CPUs: its node unknown (no host.name or k8s.node.name in its resource)"
    nodes = _busy_nodes(processes)
    mine = nodes.get(process.host)
    if mine is None:
        return None, "its node's CPUs: no host series (system.cpu.utilization of its node's LOCAL_RANK 0) recorded"
    theirs = [nodes[host] for host in {p.host for p in others} - {process.host} if host in nodes]
    if not theirs:
        return None, f"its node's CPUs: {mine:.0%} busy, but no other rank ran on another node to compare with"
    median = statistics.median(theirs)
    words = f"its node {process.host}'s CPUs were {mine:.0%} busy, the other ranks' nodes {median:.0%}"
    if mine - median < HOST_BUSY_EXPLAINS:
        return None, f"its host: {words}"
    evidence = [Evidence("system.cpu.utilization", round(mine, 4), f"share of its node's CPU time busy (1 - idle), "
                         f"the other ranks' nodes' median {median:.1%}", None, process.rank)]  # fmt: skip
    # Ranked below every direct sign (a GPU held down, a data loader that starves it: their scores are
    # shares of its time, at least 0.10) and above a narrow link (0): a busy node is a share of CPU
    # time, not of the rank's, and its own loader's workers may be what keeps it busy.
    return (HOST_RANK * (mine - median), f"its host was busy elsewhere: {words} (another job or process on that node, or this "
            "rank's own CPU work)", [f"find what else runs on {process.host} (top, ps), or move the rank to another "
            "node"], evidence), words  # fmt: skip


_REASON_WORDS = {
    "sw_power_cap": "its power cap (sw_power_cap)",
    "thermal": "heat (thermal)",
    "hw_thermal_slowdown": "heat, by the hardware (hw_thermal_slowdown)",
    "hw_power_brake_slowdown": "the power brake (hw_power_brake_slowdown)",
}


def straggler_cause(
    processes: Sequence[ProcessRows], index: int, share: float | None, median_share: float | None
) -> tuple[str, list[str], list[str], list[Evidence]]:
    """Why rank ``index`` steps slower, among its own signals against the other ranks': its GPU's clock
    held down (throttle reasons, the SM clock), its data loader, its node's CPUs busy, its PCIe link
    trained narrow. The
    largest excess of time lost is the cause; ``(cause, ruled out, what to try, evidence)``."""
    process, others = processes[index], [p for i, p in enumerate(processes) if i != index]
    rank = process.rank
    candidates: list[tuple[float, str, list[str], list[Evidence]]] = []
    ruled_out: list[str] = []
    starved = share is not None and median_share is not None and share - median_share >= DATA_WAIT_EXPLAINS
    if share is not None and median_share is not None:
        words = f"it waits for data {share:.0%} of its time, the other ranks {median_share:.0%}"
        if starved:
            candidates.append((share - median_share, f"its data loader: {words}",
                               ["give this rank's DataLoader more workers, or check its node's storage and CPU"], []))  # fmt: skip
        else:
            ruled_out.append(f"its data loader: {words}")
    else:
        ruled_out.append("its data loader: not recorded (no goodput phases in these files)")
    host, host_words = _host_cause(processes, process, others)
    if host is not None:
        candidates.append(host)
    else:
        ruled_out.append(host_words)
    throttled = _throttled(process)
    if throttled:
        theirs = {reason: statistics.median([t.get(reason, 0.0) for t in map(_throttled, others)] or [0.0])
                  for reason in throttled}  # fmt: skip
        reason = max(throttled, key=lambda r: throttled[r] - theirs[r])
        excess = throttled[reason] - theirs[reason]
        words = f"{_REASON_WORDS[reason]} {throttled[reason]:.0%} of its time, the other ranks {theirs[reason]:.0%}"
        if excess >= THROTTLE_EXPLAINS:
            fix = ("check the node's cooling, fans and airflow and the GPU's temperature" if "thermal" in reason
                   else "check the GPU's power limit (nvidia-smi -q -d POWER) and the node's power supply")  # fmt: skip
            shown = [Evidence("openlora.gpu.throttle.time", round(throttled[reason], 4),
                              f"share of its time throttled for {reason}", None, rank)]  # fmt: skip
            hottest = highest(process, "gpu_temperature")
            theirs_hottest = [t for p in others if (t := highest(p, "gpu_temperature")) is not None]
            if hottest is not None and theirs_hottest:
                shown.append(Evidence("hw.temperature", hottest, f"its GPU's highest temperature, °C (the other ranks' "
                                      f"median {statistics.median(theirs_hottest):.0f})", None, rank))  # fmt: skip
            candidates.append((excess, f"its GPU's clock was held down by {words}", [fix], shown))
        else:
            ruled_out.append(f"its GPU's throttle counters: held down by {words}, under "
                             f"{THROTTLE_EXPLAINS:.0%} of its time more")  # fmt: skip
    clock = mean_of(process, "gpu_clock_sm")
    their_clocks = [c for p in others if (c := mean_of(p, "gpu_clock_sm")) is not None]
    if clock is not None and their_clocks:
        median_clock = statistics.median(their_clocks)
        words = f"its GPU's SM clock averaged {clock / 1e6:,.0f} MHz, the other ranks' {median_clock / 1e6:,.0f} MHz"
        clock_evidence = Evidence("openlora.gpu.clock.sm", round(clock), words, None, rank)
        throttling = [c for c in candidates if c[1].startswith("its GPU's clock was held down")]
        if median_clock > 0 and clock <= CLOCK_EXPLAINS * median_clock:
            if throttling:  # the throttling's own evidence
                throttling[0][3].append(clock_evidence)
            elif starved:  # a GPU waiting for its data idles, and idles at a lower clock
                ruled_out.append(f"its GPU's clock: {words}, as a GPU waiting for data clocks down")
            else:
                candidates.append((1.0 - clock / median_clock, f"{words}: it runs slower, for a reason "
                                   "its throttle counters do not show", ["compare the GPU's clocks and power "
                                   "limit with nvidia-smi -q -d CLOCK,POWER"], [clock_evidence]))  # fmt: skip
        elif not throttling:
            ruled_out.append(f"its GPU's clock: {words}")
    if not throttled and clock is None:
        ruled_out.append("its GPU: no throttle or clock series recorded for this rank")
    link = _narrow_link(process)
    if link is not None:
        words = f"its GPU's PCIe link ran on {link[0]:.0f} of the {link[1]:.0f} lanes GPU and slot support"
        if any(_narrow_link(p) is None for p in others):
            # Slows copies between host and GPU, not the GPU's compute: the cause only when nothing else is.
            candidates.append((0.0, words, ["reseat the GPU or its riser (a link trains its width at reset)"],
                               [Evidence("openlora.gpu.pcie.link.width", link[0], words, None, rank)]))  # fmt: skip
    if not candidates:
        return (
            "no cause found among the signals recorded: its own steps take longer (its compute, its network, "
            "or its host, where no host series say otherwise)",
            ruled_out,
            ["move the rank to another node to see whether the slowness follows it"],
            [],
        )
    candidates.sort(key=lambda c: -c[0])
    (_, cause, try_next, evidence), *rest = candidates
    ruled_out[:0] = [f"{other}: it explains less" for _, other, _, _ in rest]
    return cause, ruled_out, try_next, evidence


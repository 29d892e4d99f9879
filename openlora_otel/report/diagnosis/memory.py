"""The memory detector: a rank whose GPU ran out of memory, whose allocated memory grows step after
step (and at which step it would run out), or whose allocator holds ever more than it hands out
(fragmentation). From the torch allocator's series, so only for processes that use CUDA."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

from openlora_otel.report.diagnosis.findings import (
    RUNBOOKS,
    Evidence,
    Finding,
    attempts,
    finite,
    finite_or_none,
    rank_text,
    rose,
    step_text,
    when_text,
)
from openlora_otel.report.model import ProcessRows, Row

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
GROWTH_MIN_BYTES = 2**30  # allocated memory that rose less than this over an attempt did not grow
GROWTH_OF_LIMIT = 0.05  # ... nor less than this share of the GPU's memory
GROWTH_FIT = 0.8  # the correlation of allocated memory with the step: a steady climb, not noise
GROWTH_MIN_READINGS = 12  # after the warm-up: three a quarter (the least of each quarter must rise)
WARMUP_SHARE = 0.1  # the first tenth of an attempt's readings (the optimizer's state, the caches fill up)
FRAGMENTATION_SHARE = 0.3  # reserved but not allocated, of what is reserved, at the end of an attempt
FRAGMENTATION_GROWTH_BYTES = 2**30  # ... having grown by at least this much over the attempt, as what is reserved
FRAGMENTATION_WINDOW = 5  # readings whose most allocated memory is a step's need
GIB = 2**30


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB"


def _readings(rows: Sequence[Row], *keys: str) -> list[tuple[Row, float, list[float]]]:
    """(row, step, values of ``keys``) of the readings that have them all, after the warm-up."""
    out = [(row, row.values["steps"], [row.values[k] for k in keys]) for row in rows
           if finite(row.values.get("steps")) and all(finite(row.values.get(k)) for k in keys)]  # fmt: skip
    return out[max(1, round(len(out) * WARMUP_SHARE)) if len(out) > 3 else 0 :]


def _stopped_after(process: ProcessRows, row: Row) -> bool:
    """Whether the rank made no more step after ``row``, or its attempt ended within two readings."""
    for rows in attempts(process):
        if row in rows:
            after = rows[rows.index(row) + 1 :]
            steps = [r.values["steps"] for r in after if finite(r.values.get("steps"))]
            return len(after) <= 2 or not steps or max(steps) <= row.values.get("steps", math.inf)
    return True


def _oom(process: ProcessRows) -> Finding | None:
    found = rose(process, "torch_ooms")
    if found is None:
        return None
    row, count = found
    step = finite_or_none(row.values.get("steps"))
    if not _stopped_after(process, row):
        # Caught and gone on from (auto_find_batch_size, an evaluation's fallback): worth knowing only.
        return Finding(
            "warning", "memory",
            f"{rank_text(process.rank)} ran out of GPU memory by step {step_text(step)} ({when_text(row.time_s)}) "
            "and went on: the error was caught",
            "a step or an evaluation asked for more memory than was free, and the program caught the error "
            "(a batch size search, a fallback) and carried on",
            (Evidence("openlora.torch.memory.ooms", count, "out-of-memory errors the allocator raised", step, process.rank),),
            ("a run that died of it: the rank went on stepping",),
            ("if it was not meant to happen: a smaller micro-batch, or shorter sequences",),
            f"{RUNBOOKS}#openloragpumemorynearlimit", step, row.time_s, process.rank, count,
        )  # fmt: skip
    evidence = [Evidence("openlora.torch.memory.ooms", count, "out-of-memory errors the allocator raised", step, process.rank)]
    for key, series, note in (("torch_allocated", "openlora.torch.memory.allocated", "allocated then"),
                              ("torch_reserved", "openlora.torch.memory.reserved", "reserved then"),
                              ("gpu_memory_limit", "hw.gpu.memory.limit", "the GPU's memory")):  # fmt: skip
        if finite(row.values.get(key)):
            evidence.append(Evidence(series, row.values[key], f"{note}: {_gib(row.values[key])}", step, process.rank))
    return Finding(
        "critical", "memory", f"{rank_text(process.rank)} ran out of GPU memory by step {step_text(step)} "
        f"({when_text(row.time_s)}) and stopped stepping",
        "the allocator could not get the memory a step asked for: the batch, the sequence length or the "
        "activations need more than the GPU has, or memory grew over the run until it ran out",
        tuple(evidence), ("a GPU fault: the allocator raised it, not the driver",),
        ("a smaller micro-batch with more gradient accumulation, or shorter sequences",
         "gradient checkpointing; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation"),
        f"{RUNBOOKS}#openloragpumemorynearlimit", step, row.time_s, process.rank, count,
    )  # fmt: skip


def _growth(process: ProcessRows) -> Finding | None:
    for rows in attempts(process):
        readings = _readings(rows, "torch_allocated")
        if len(readings) < GROWTH_MIN_READINGS:
            continue
        steps = [step for _, step, _ in readings]
        allocated = [values[0] for _, _, values in readings]
        if len(set(steps)) < 2 or len(set(allocated)) < 2:
            continue
        # It must keep growing: the least of each quarter of the readings (the memory that stays between
        # steps) above the quarter's before. A single jump (a buffer kept from the first evaluation, a cache
        # grown to the longest batch) is a plateau, not a climb.
        quarter = len(allocated) // 4
        floors = [min(allocated[i * quarter : (i + 1) * quarter if i < 3 else None]) for i in range(4)]
        if any(b <= a for a, b in itertools.pairwise(floors)):
            continue
        fit = statistics.correlation(steps, allocated)
        slope, intercept = statistics.linear_regression(steps, allocated)
        rise = slope * (steps[-1] - steps[0])
        limit = max((row.values["gpu_memory_limit"] for row, _, _ in readings if finite(row.values.get("gpu_memory_limit"))),
                    default=None)  # fmt: skip
        least = max(GROWTH_MIN_BYTES, GROWTH_OF_LIMIT * limit) if limit else GROWTH_MIN_BYTES
        if fit < GROWTH_FIT or rise < least:
            continue
        first, last = readings[0], readings[-1]
        evidence = [
            Evidence("openlora.torch.memory.allocated", first[2][0], f"allocated at step {step_text(first[1])}: "
                     f"{_gib(first[2][0])}", first[1], process.rank),
            Evidence("openlora.torch.memory.allocated", last[2][0], f"allocated at step {step_text(last[1])}: "
                     f"{_gib(last[2][0])}, {_gib(slope * 1000)} more every 1,000 steps (correlation with the step "
                     f"{fit:.2f})", last[1], process.rank),
        ]  # fmt: skip
        out_at = None
        if limit:
            evidence.append(Evidence("hw.gpu.memory.limit", limit, f"the GPU's memory: {_gib(limit)}", None, process.rank))
            out_at = last[1] + max(0.0, limit - (intercept + slope * last[1])) / slope  # from the fitted line
        return Finding(
            "warning", "memory",
            f"{rank_text(process.rank)}'s allocated GPU memory grows steadily: {_gib(rise)} from step "
            f"{step_text(first[1])} to {step_text(last[1])}"
            + (f"; at this rate it runs out near step {step_text(out_at)}" if out_at is not None else ""),
            "memory held from one step to the next: tensors kept alive (a loss or an output appended to a list "
            "without .item() or .detach(), a growing cache, gradients kept for a metric)",
            tuple(evidence), ("the warm-up: the first tenth of the readings (the optimizer's state, the caches) is left out",),
            ("look for tensors kept across steps (torch.cuda.memory_snapshot(), or record the allocations "
             "with torch.cuda.memory._record_memory_history())", "detach or .item() what is logged"),
            f"{RUNBOOKS}#openloragpumemorynearlimit", first[1], first[0].time_s, process.rank, rise / GIB,
        )  # fmt: skip
    return None


def _fragmentation(process: ProcessRows) -> Finding | None:
    for rows in attempts(process):
        readings = _readings(rows, "torch_allocated", "torch_reserved")
        if len(readings) < 2 * FRAGMENTATION_WINDOW:
            continue
        # Against the most allocated over several readings (one reading between steps, or after the last,
        # holds less than the steps need): what the allocator keeps beyond any step's need. And what it
        # reserves must itself have grown: a reserve flat at the activations' peak is no fragmentation.
        (_, first_step, (_, r0)), (last, last_step, (a1, r1)) = readings[0], readings[-1]
        need0 = max(values[0] for _, _, values in readings[:FRAGMENTATION_WINDOW])
        need1 = max(values[0] for _, _, values in readings[-FRAGMENTATION_WINDOW:])
        gap0, gap1 = r0 - need0, r1 - need1
        if (r1 <= 0 or gap1 / r1 < FRAGMENTATION_SHARE or gap1 - gap0 < FRAGMENTATION_GROWTH_BYTES
                or r1 - r0 < FRAGMENTATION_GROWTH_BYTES):  # fmt: skip
            continue
        return Finding(
            "warning", "memory",
            f"{rank_text(process.rank)}'s allocator holds {_gib(gap1)} it does not hand out ({gap1 / r1:.0%} of what it "
            f"reserved) by step {step_text(last_step)}, {_gib(gap0)} at step {step_text(first_step)}",
            "fragmentation: the caching allocator keeps freed blocks it cannot reuse for requests of other sizes "
            "(sequences of varying length), so it reserves ever more from the GPU",
            (Evidence("openlora.torch.memory.reserved", r1, f"reserved: {_gib(r1)}", last_step, process.rank),
             Evidence("openlora.torch.memory.allocated", a1, f"allocated: {_gib(a1)}", last_step, process.rank)),
            ("a leak: what is allocated does not grow as much as what is reserved",),
            ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "pad or bucket sequences to a few lengths"),
            f"{RUNBOOKS}#openloragpumemorynearlimit", last_step, last.time_s, process.rank, gap1 / GIB,
        )  # fmt: skip
    return None


def memory(processes: Sequence[ProcessRows]) -> list[Finding]:
    """Per rank: an out-of-memory error, else allocated memory that grows, else fragmentation."""
    findings = []
    for process in processes:
        found = _oom(process) or _growth(process) or _fragmentation(process)
        if found is not None:
            findings.append(found)
    return findings

"""The GPU fault detector: what a rank's GPU series show went wrong, the most specific sign first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openlora_otel.names import XID_BAD_GPU
from openlora_otel.report.diagnosis.findings import (
    RUNBOOKS,
    Evidence,
    Finding,
    finite,
    finite_or_none,
    first_row,
    highest,
    rank_text,
    rose,
    step_text,
    when_text,
)
from openlora_otel.report.model import ProcessRows, Row


@dataclass(frozen=True)
class _GpuSign:
    """One thing a GPU's series can show (report.model's GPU quantities), as :func:`gpu_fault` reads it."""

    key: str
    series: str
    label: str  # what the evidence calls it
    severity: str
    title: str  # of "rank 1's GPU ..."
    cause: str
    ruled_out: str
    try_next: tuple[str, ...]
    runbook: str
    rose: bool = False  # a count since the driver loaded: only an increase during the run counts
    held: bool = False  # shown in two readings in a row (or the rank's last): one is not enough


_DRAIN = "drain the node and resume the run from its last checkpoint on another GPU"


# Most specific first: a rank's first sign that shows is its finding; the others it shows are evidence.
_GPU_SIGNS = (
    _GpuSign("xid_off_bus", "openlora.gpu.xid.errors{openlora.gpu.xid.code=79}", "XID 79 errors", "critical", "fell off the bus (XID 79)",
             "the driver lost the GPU from the PCIe bus: every CUDA call on it fails from then on, so the rank "
             "stopped, hung or died there and the run with it", "a fault of the program: XID 79 is the driver's, "
             "whatever the code did", (_DRAIN, "reboot the node; check dmesg | grep -i xid and the GPU's "
             "temperature just before; XID 79 again means reseating the GPU or replacing it"),
             "openloragpufelloffthebus"),
    _GpuSign("remap_failed", "openlora.gpu.remap.failed", "a row remap failed", "critical", "failed to remap a bad memory row",
             "a memory row went bad with no spare row left: the GPU's memory can no longer be repaired and "
             "results computed on it since are suspect", "a one-off error: the GPU has run out of spare rows",
             ("take the GPU out of service and have it replaced", _DRAIN), "openloragpurowremapfailed"),
    _GpuSign("ecc_uncorrected", "hw.errors{error.type=uncorrected}", "uncorrected ECC errors", "critical", "had uncorrected ECC errors",
             "corrupted GPU memory: results computed on it since cannot be trusted (a loss gone NaN or a crash "
             "can follow)", "corrected errors: ECC fixed those; these it could not",
             ("stop the run and resume it from a checkpoint written before this step, on another GPU",
              "have the GPU checked: recurring errors mean replacing it"), "openloragpuuncorrectedeccerrors",
             rose=True),
    _GpuSign("gpu_failed", "hw.status{hw.state=failed}", "GPU status failed", "critical", "failed",
             "NVML lost the GPU (it stopped answering) or the driver asks for a node reboot: the rank's work on it "
             "stopped", "XID 79 and a failed row remap: not reported", (_DRAIN, "reboot the node; check nvidia-smi "
             "and dmesg"), "openloragpufailed", held=True),
    _GpuSign("xid_bad_gpu", f"openlora.gpu.xid.errors{{openlora.gpu.xid.code=~{'|'.join(map(str, XID_BAD_GPU))}}}",
             "XIDs of a bad GPU", "critical", "reported an XID of a bad GPU",
             "the driver reported an XID that means a bad GPU (48 a double-bit ECC error, 62 a micro-controller halt, "
             "74 NVLink, 94/95 contained or uncontained ECC errors, 119/120 GSP: the process's log names the code): "
             "the work on it was killed or may be corrupt", "a program's own XIDs (13, 31, 43): these codes are the "
             "GPU's", ("resume from a checkpoint written before this step", "reset the GPU (nvidia-smi -r) or drain "
             "its node; ECC XIDs again mean replacing it"), "openloragpuhardwarexid"),
    _GpuSign("remap_pending", "openlora.gpu.remap.pending", "a row remap pending", "warning", "has a row remap waiting for a reset",
             "a memory row went bad and stays in use until the GPU is reset", "a failed remap: spare rows are left",
             ("let the run finish or checkpoint, then reset the GPU (nvidia-smi -r) or reboot the node",),
             "openloragpurowremappending"),
    _GpuSign("gpu_degraded", "hw.status{hw.state=degraded}", "GPU status degraded", "warning", "is degraded",
             "the driver reported an XID that means a bad GPU (ECC, NVLink, GSP, a micro-controller halt: the "
             "process's log names the code), or asks for a GPU reset or a drain", "a program's own XIDs (13, 31, "
             "43): those leave the GPU ok", ("reset the GPU (nvidia-smi -r) or drain its node before the next job",),
             "openloragpudegraded"),
    _GpuSign("xid_errors", "openlora.gpu.xid.errors", "XID errors, all codes", "info", "reported XIDs",
             "XIDs that leave the GPU ok are the program's own faults (13, 31, 43: an illegal address, a page "
             "fault, a stopped context): the process's log names the code", "a bad GPU: its status stayed ok",
             ("read the process's log for the XID's code and the error the program raised",),
             "openloragpuhardwarexid"),
)


def gpu_fault(processes: Sequence[ProcessRows]) -> list[Finding]:
    """Per rank, what its GPU series show went wrong: the most specific sign, its step and time."""
    findings = []
    for process in processes:
        shown: list[tuple[_GpuSign, Row, float]] = []
        for sign in _GPU_SIGNS:
            if sign.rose:
                increase = rose(process, sign.key)
                if increase is not None:
                    shown.append((sign, increase[0], increase[1]))
            elif (row := first_row(process, sign.key, held=sign.held)) is not None:
                shown.append((sign, row, highest(process, sign.key) or 0.0))
        if not shown:
            continue
        sign, row, _ = shown[0]
        step = finite_or_none(row.values.get("steps"))
        # Between the reading before, which did not show it, and this one.
        before = [r.values.get("steps") for r in process.rows if r.time_s < row.time_s and finite(r.values.get("steps"))]
        if step is None:
            when = "before the first step"
        elif before and before[-1] < step:
            when = f"between steps {step_text(before[-1])} and {step_text(step)}"
        else:
            when = f"at step {step_text(step)}"
        evidence = tuple(
            Evidence(other.series, value, f"{other.label}: first at step {step_text(at.values.get('steps'))} "
                     f"({when_text(at.time_s)})" + (", its increase since its attempt's first reading" if other.rose else ""),
                     finite_or_none(at.values.get("steps")), process.rank)
            for other, at, value in shown
        )  # fmt: skip
        findings.append(
            Finding(
                sign.severity, "gpu_fault",
                f"{rank_text(process.rank)}'s GPU {sign.title} {when} ({when_text(row.time_s)})",
                sign.cause, evidence, (sign.ruled_out,), sign.try_next, f"{RUNBOOKS}#{sign.runbook}",
                step, row.time_s, process.rank, float(len(_GPU_SIGNS) - _GPU_SIGNS.index(shown[0][0])),  # the more specific, the higher
            )
        )  # fmt: skip
    return findings


"""The quantities a report and a diagnosis read: each raw value a row can hold, named once by its
OpenTelemetry name (history files) and its Prometheus name (:meth:`Quantity.promql`), and how the
points of one collection fold into one value. :mod:`openlora_otel.report.model` re-exports them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from openlora_otel.names import (
    ATTR_HW_STATE,
    ATTR_THROTTLE_REASON,
    ATTR_XID_CODE,
    GPU_METRICS,
    GUARD_REASONS,
    HOST_METRICS,
    TRAINING_METRICS,
    XID_BAD_GPU,
    MetricSpec,
)

__all__ = ["COMBINE", "QUANTITIES", "SLOWDOWN_REASONS", "Quantity", "promql_string", "run_target"]


# The throttle reasons that slow a GPU down against its own clocks (sync_boost only lines a GPU up
# with the others of its group).
SLOWDOWN_REASONS = ("sw_power_cap", "thermal", "hw_thermal_slowdown", "hw_power_brake_slowdown")
_SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in (*TRAINING_METRICS, *GPU_METRICS, *HOST_METRICS)}


@dataclass(frozen=True)
class Quantity:
    """One raw value a row can hold: where it comes from in a history file and in Prometheus.

    ``field`` is ``value`` (gauge or sum point), ``sum`` or ``count`` (histogram point).
    ``combine`` folds several points of one collection (one per GPU, or per attribute value the
    ``where`` leaves open) into one value: ``max``, ``mean``, ``min`` or ``sum``.
    """

    key: str
    otel_name: str
    field: str = "value"
    combine: str = "max"  # one of COMBINE
    # Points must carry these attributes (OTel keys) with these values (a tuple: any of them).
    where: tuple[tuple[str, str | tuple[str, ...]], ...] = ()

    @property
    def spec(self) -> MetricSpec:
        return _SPECS[self.otel_name]

    def promql(self, selector: str, run_id: str | None = None, by: Sequence[str] = ()) -> str:
        """The PromQL for this quantity of one process (``selector`` holds its job and instance).

        With ``run_id``, only while that process's ``target_info`` named that run: two runs
        that used the same port one after the other stay apart. ``by``: the labels kept apart
        (``job``, ``instance``: every process of the run, ``selector`` empty).
        """
        spec = self.spec
        names = {spec.prometheus, spec.prometheus_collector}
        if spec.kind == "histogram":
            names = {f"{name}_{self.field}" for name in names}
        matchers = [selector] if selector else []
        matchers += [
            f'{key.replace(".", "_")}="{value}"' if isinstance(value, str) else f'{key.replace(".", "_")}=~"{"|".join(value)}"'
            for key, value in self.where
        ]
        if len(names) == 1:
            inner = f"{names.pop()}{{{', '.join(matchers)}}}"
        else:  # the semantic conventions' unit-1 gauges: hw_gpu_utilization, or _ratio via the Collector
            pattern = "|".join(sorted(names))
            inner = f'{{__name__=~"{pattern}", {", ".join(matchers)}}}'
        if run_id is not None:
            inner = f"{inner} * on (job, instance) group_left () {run_target(run_id, selector)}"
        grouping = f" by ({', '.join(by)}) " if by else ""
        return f"{_PROMQL_COMBINE[self.combine]}{grouping}({inner})"

    def matches(self, attributes: Mapping[str, object]) -> bool:
        """Whether a point with these attributes is one of this quantity's."""
        return all(
            str(attributes.get(key)) == value if isinstance(value, str) else str(attributes.get(key)) in value
            for key, value in self.where
        )

    def fold(self, values: Sequence[float]) -> float:
        """The points of one collection as one value, as :meth:`promql` folds them."""
        if self.combine == "mean":
            return sum(values) / len(values)
        return {"max": max, "min": min, "sum": sum}[self.combine](values)


_PROMQL_COMBINE = {"max": "max", "mean": "avg", "min": "min", "sum": "sum"}
COMBINE = tuple(_PROMQL_COMBINE)


def promql_string(value: str) -> str:
    """A PromQL string literal (json's escaping is PromQL's for the characters that matter)."""
    return json.dumps(value)


def run_target(run_id: str, selector: str = "") -> str:
    """The ``target_info`` series of run ``run_id`` (of the process ``selector`` names, if given)."""
    matchers = [f"openlora_run_id={promql_string(run_id)}"] + ([selector] if selector else [])
    return f"target_info{{{', '.join(matchers)}}}"


QUANTITIES: tuple[Quantity, ...] = (
    Quantity("steps", "openlora.training.steps"),
    Quantity("last_step_time", "openlora.training.last_step.timestamp"),
    Quantity("loss", "openlora.training.loss"),
    Quantity("loss_max", "openlora.training.loss.max"),
    # Steps whose loss was NaN or infinite so far: the window means leave them out, this does not.
    Quantity("loss_nonfinite", "openlora.training.loss.nonfinite"),
    Quantity("grad_norm_nonfinite", "openlora.training.gradient_norm.nonfinite"),
    # The divergence guard's trips so far, per openlora.guard.reason.
    *(
        Quantity(f"guard_trips_{reason}", "openlora.training.guard.trips", where=(("openlora.guard.reason", reason),))
        for reason in GUARD_REASONS
    ),
    Quantity("eval_loss", "openlora.training.eval.loss"),
    Quantity("grad_norm", "openlora.training.gradient_norm"),
    Quantity("grad_norm_max", "openlora.training.gradient_norm.max"),
    Quantity("learning_rate", "openlora.training.learning_rate"),
    # The counter, not the tokens/s gauge: the gauge's interval is one collection, which a slow step
    # outlasts (a 200 ms line after an 8 s step would read 40 times the real rate).
    Quantity("tokens", "openlora.training.tokens"),
    Quantity("step_time_sum", "openlora.training.step.duration", field="sum"),
    Quantity("step_time_count", "openlora.training.step.duration", field="count"),
    # One process may report several GPUs (OPENLORA_GPU_DEVICES=all): the mean busy
    # fraction, and the fullest GPU's memory (the one that runs out first).
    Quantity("gpu_utilization", "hw.gpu.utilization", combine="mean", where=(("hw.gpu.task", "general"),)),
    Quantity("gpu_memory", "hw.gpu.memory.usage"),
    # GPU health and speed, for `diagnose` (report.diagnosis): the worst of the process's GPUs.
    # hw.status is 1 for the state a GPU is in (failed: lost by NVML, XID 79, a failed row remap,
    # a reboot asked for; degraded: an XID of a bad GPU, a remap pending, a reset asked for).
    Quantity("gpu_failed", "hw.status", where=(("hw.type", "gpu"), (ATTR_HW_STATE, "failed"))),
    Quantity("gpu_degraded", "hw.status", where=(("hw.type", "gpu"), (ATTR_HW_STATE, "degraded"))),
    # XIDs since the process started watching: all codes, 79 (the GPU fell off the bus), and the
    # codes of a bad GPU (names.XID_BAD_GPU: ECC, NVLink, GSP; a program's own 13, 31, 43 are not).
    Quantity("xid_errors", "openlora.gpu.xid.errors", combine="sum"),
    Quantity("xid_off_bus", "openlora.gpu.xid.errors", combine="sum", where=((ATTR_XID_CODE, "79"),)),
    Quantity(
        "xid_bad_gpu", "openlora.gpu.xid.errors", combine="sum", where=((ATTR_XID_CODE, tuple(map(str, XID_BAD_GPU))),)
    ),
    # Uncorrected ECC errors since the driver loaded: what matters is an increase during the run.
    Quantity("ecc_uncorrected", "hw.errors", combine="sum", where=(("hw.type", "gpu"), ("error.type", "uncorrected"))),
    Quantity("remap_pending", "openlora.gpu.remap.pending"),
    Quantity("remap_failed", "openlora.gpu.remap.failed"),
    # Seconds the clock was held down per reason (counters: their increase over a span, over the
    # span, is the share of it throttled), the SM clock, the temperature, and the PCIe link's width
    # against what GPU and slot support (the narrowest of the process's GPUs).
    *(
        Quantity(f"throttle_{reason}", "openlora.gpu.throttle.time", where=((ATTR_THROTTLE_REASON, reason),))
        for reason in SLOWDOWN_REASONS
    ),
    Quantity("gpu_clock_sm", "openlora.gpu.clock.sm", combine="mean"),
    Quantity("gpu_temperature", "hw.temperature"),
    Quantity("pcie_width", "openlora.gpu.pcie.link.width", combine="min"),
    Quantity("pcie_width_max", "openlora.gpu.pcie.link.width.max", combine="min"),
    # The torch allocator's memory on the process's fullest device, its GPU's total memory, and the
    # allocations it could not make (diagnose's memory findings).
    Quantity("torch_allocated", "openlora.torch.memory.allocated"),
    Quantity("torch_reserved", "openlora.torch.memory.reserved"),
    Quantity("gpu_memory_limit", "hw.gpu.memory.limit"),
    Quantity("torch_ooms", "openlora.torch.memory.ooms", combine="sum"),
    # Steps an attempt did again after resuming (goodput's lost progress; from Prometheus, where a
    # process's goodput reading takes it from its last row).
    Quantity("steps_lost", "openlora.training.steps.lost"),
    # The node's CPUs: their mean idle share (LOCAL_RANK 0 reports it for its node), for diagnose's
    # straggler whose host is busy elsewhere.
    Quantity("host_cpu_idle", "system.cpu.utilization", combine="mean", where=(("cpu.mode", "idle"),)),
)

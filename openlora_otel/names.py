"""Metric names, units and attribute keys: the one list docs, dashboards and tests are checked against.

Names follow OpenTelemetry conventions: dot-separated, snake_case inside a
segment, no unit in the name, UCUM units, never ``_total``. Where no semantic
convention exists (model training has none) they live under ``openlora.*``.

Units are chosen so that the Prometheus series name is the same on both paths:
pulled from the Python exporter, or pushed over OTLP (through the Collector, or into
Prometheus 3's OTLP receiver, which names alike). The one unit that differs between them is ``1`` on a gauge
(the Collector appends ``_ratio``, Python does not), so dimensionless gauges
here have an empty unit and counts use a ``{annotation}``, which both paths drop.
:func:`prometheus_name` implements both translations so tests can check this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ADAPTER_METRICS",
    "ATTR_EVAL_METRIC",
    "ATTR_GUARD_REASON",
    "ATTR_RUN_OUTCOME",
    "ATTR_RUN_SIGNAL",
    "ATTR_TRAINING_PHASE",
    "GPU_METRICS",
    "GUARD_REASONS",
    "INFERENCE_METRICS",
    "REQUEST_DURATION_BUCKETS",
    "RUN_METRICS",
    "RUN_OUTCOMES",
    "STEP_DURATION_BUCKETS",
    "TOKEN_BUCKETS",
    "TPOT_BUCKETS",
    "TRAINING_METRICS",
    "TRAINING_PHASES",
    "TTFT_BUCKETS",
    "MetricSpec",
    "prometheus_name",
]

Kind = Literal["gauge", "counter", "histogram", "updowncounter"]

# Attribute on openlora.training.eval.value naming the evaluation metric (accuracy, perplexity, ...).
ATTR_EVAL_METRIC = "openlora.eval.metric"
# Attribute on openlora.training.guard.trips: why the guard tripped (two values).
ATTR_GUARD_REASON = "openlora.guard.reason"
GUARD_REASONS = ("nonfinite_loss", "loss_spike")
# Attribute on openlora.training.time: where the time went (openlora_otel.training.goodput). Eight
# values; `productive` is goodput, the others badput by cause.
ATTR_TRAINING_PHASE = "openlora.training.phase"
TRAINING_PHASES = (
    "startup", "productive", "data_wait", "evaluation", "checkpoint_save", "checkpoint_load",
    "lost_progress", "idle",
)  # fmt: skip
# Attributes on openlora.run.outcome: how the run ended, and for `terminated` the signal's name.
ATTR_RUN_OUTCOME = "openlora.run.outcome"
ATTR_RUN_SIGNAL = "openlora.run.signal"
# What openlora.run.outcome reports: `running` until shutdown begins, then how the run ended. The
# sixth outcome, `vanished`, is never reported: the rules derive it (a run gone while `running`).
RUN_OUTCOMES = ("running", "finished", "stopped_by_guard", "terminated", "failed")

# Step duration buckets in seconds. From 10 ms to 10 s, 25 per decade (neighbours at
# most 1.097x apart, 4 significant digits): histogram_quantile interpolates inside the
# bucket that holds the true quantile, so its answer is within 9.7 % of it for any
# step time in that range. The series starts one step below 10 ms (0.00912), so that
# 10 ms itself lies in a narrow bucket, not in (0.005, 0.01]. Coarser bounds below
# (1 ms) and above (60 s) keep the tails. 83 bounds: 84 `_bucket` series per process,
# plus `_sum` and `_count`.
STEP_DURATION_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    *(float(f"{0.01 * 10 ** (k / 25):.4g}") for k in range(-1, 76)),
    20.0,
    30.0,
    60.0,
)


@dataclass(frozen=True)
class MetricSpec:
    """One instrument: OpenTelemetry name, kind, unit, meaning, and the seeds' name it replaces (if any)."""

    name: str
    kind: Kind
    unit: str
    description: str
    seed_name: str = ""

    @property
    def prometheus(self) -> str:
        """The Prometheus series name (histograms: the base of ``_bucket``/``_sum``/``_count``)."""
        return prometheus_name(self.name, self.unit, self.kind, path="pull")

    @property
    def prometheus_collector(self) -> str:
        """The series name when it arrives through the Collector's Prometheus exporter."""
        return prometheus_name(self.name, self.unit, self.kind, path="collector")


TRAINING_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "openlora.training.loss",
        "gauge",
        "",
        "Training loss: mean over the finite losses of the steps since the previous collection "
        "(the previous mean is repeated when no step happened).",
        "openlora_training_loss",
    ),
    MetricSpec(
        "openlora.training.gradient_norm",
        "gauge",
        "",
        "Gradient norm: mean over the finite values of the steps since the previous collection.",
        "openlora_gradient_norm",
    ),
    MetricSpec(
        "openlora.training.loss.max",
        "gauge",
        "",
        "Largest finite loss among the steps since the previous collection: a single spike shows in full.",
    ),
    MetricSpec(
        "openlora.training.loss.min",
        "gauge",
        "",
        "Smallest finite loss among the steps since the previous collection.",
    ),
    MetricSpec(
        "openlora.training.gradient_norm.max",
        "gauge",
        "",
        "Largest finite gradient norm among the steps since the previous collection.",
    ),
    MetricSpec(
        "openlora.training.gradient_norm.min",
        "gauge",
        "",
        "Smallest finite gradient norm among the steps since the previous collection.",
    ),
    MetricSpec("openlora.training.learning_rate", "gauge", "", "Learning rate of the latest step."),
    MetricSpec(
        "openlora.training.window.steps",
        "gauge",
        "{step}",
        "Optimizer steps averaged into the latest loss and gradient-norm values.",
    ),
    MetricSpec(
        "openlora.training.epoch",
        "gauge",
        "{epoch}",
        "Current epoch (fractional when the trainer reports it so).",
        "openlora_epoch_count",
    ),
    MetricSpec(
        "openlora.training.steps", "counter", "{step}", "Optimizer steps taken.", "openlora_batch_count"
    ),
    MetricSpec("openlora.training.samples", "counter", "{sample}", "Training samples processed."),
    MetricSpec("openlora.training.tokens", "counter", "{token}", "Training tokens processed."),
    MetricSpec(
        "openlora.training.step.duration",
        "histogram",
        "s",
        "Time of one optimizer step: the `step_time_s` given to `record_step` (the callbacks give the "
        "step's wall time), else the time since the previous `record_step`.",
    ),
    MetricSpec(
        "openlora.training.last_step.timestamp",
        "gauge",
        "s",
        "When this process recorded its latest optimizer step, in seconds since the epoch "
        "(absent until the first step); `time() - ...` is how long ago a rank last stepped.",
    ),
    MetricSpec(
        "openlora.training.throughput.tokens",
        "gauge",
        "{token}/s",
        "Tokens per second over the interval since the previous collection.",
    ),
    MetricSpec(
        "openlora.training.throughput.samples",
        "gauge",
        "{sample}/s",
        "Samples per second over the interval since the previous collection.",
    ),
    MetricSpec(
        "openlora.training.data_wait.duration",
        "gauge",
        "s",
        "Mean time a step waited for its batch, over the steps since the previous collection "
        "(the `data_time_s` given to `record_step`).",
    ),
    MetricSpec(
        "openlora.training.data_wait.fraction",
        "gauge",
        "",
        "Fraction of wall time spent waiting for data since the previous collection: data waits over "
        "the time between consecutive `record_step` calls, 0 to 1.",
    ),
    MetricSpec(
        "openlora.model.flops_per_token",
        "gauge",
        "{flop}",
        "Training FLOPs per token of the model (forward and backward; frozen weights get no "
        "weight-gradient matmul), as given to `set_model_flops`.",
    ),
    MetricSpec(
        "openlora.training.throughput.flops",
        "gauge",
        "{flop}/s",
        "Achieved model FLOP/s: tokens per second times FLOPs per token.",
    ),
    MetricSpec(
        "openlora.training.peak_flops",
        "gauge",
        "{flop}/s",
        "Peak FLOP/s of this process's device that utilization is measured against "
        "(`OPENLORA_PEAK_FLOPS`, else the datasheet table).",
    ),
    MetricSpec(
        "openlora.training.model_flops.utilization",
        "gauge",
        "",
        "Model FLOPs utilization (MFU): achieved FLOP/s over the peak, 0 to 1 (above 1: the peak given is too low); absent without a peak.",
    ),
    MetricSpec(
        "openlora.training.loss.nonfinite", "counter", "{step}", "Steps whose loss was NaN or infinite."
    ),
    MetricSpec(
        "openlora.training.gradient_norm.nonfinite",
        "counter",
        "{step}",
        "Steps whose gradient norm was NaN or infinite.",
    ),
    MetricSpec(
        "openlora.training.guard.trips",
        "counter",
        "{trip}",
        f"Times a divergence guard tripped, per `{ATTR_GUARD_REASON}` (`nonfinite_loss`, `loss_spike`); "
        "present once a guard is attached.",
    ),
    MetricSpec(
        "openlora.training.time",
        "counter",
        "s",
        f"Wall time of this process by `{ATTR_TRAINING_PHASE}`: `startup` (process start to the first step), "
        "`productive`, `data_wait`, `evaluation`, `checkpoint_save`, `checkpoint_load` (marked with "
        "`training.phase()` or by the callbacks), `lost_progress` (steps done again after a restart) and "
        "`idle` (a stall, the time after the last step). Goodput is the `productive` share.",
    ),
    MetricSpec(
        "openlora.training.steps.lost",
        "counter",
        "{step}",
        "Steps this attempt does again because it resumed from a checkpoint older than the step an earlier "
        "attempt reached (`training.resumed()`; the callbacks read it from `openlora-progress.json`).",
    ),
    MetricSpec("openlora.training.eval.loss", "gauge", "", "Loss of the latest evaluation."),
    MetricSpec(
        "openlora.training.eval.value",
        "gauge",
        "",
        f"Other metrics of the latest evaluation, one series per `{ATTR_EVAL_METRIC}` attribute.",
    ),
    MetricSpec(
        "openlora.training.eval.nonfinite",
        "counter",
        "{evaluation}",
        f"Evaluation values that were NaN or infinite, per `{ATTR_EVAL_METRIC}` (`loss` for the eval loss).",
    ),
)

# The run's name and hyperparameters (openlora_otel.run): one info-style series per process.
RUN_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "openlora.run.info",
        "gauge",
        "",
        "1 while the process runs; attributes `openlora.run.name` (the run id when no name is given) and "
        "`openlora.hparam.<key>` per hyperparameter (at most 32, values at most 100 characters). "
        "One series per process: join it on `(job, instance)` for names in legends and alerts.",
    ),
    MetricSpec(
        "openlora.run.outcome",
        "gauge",
        "",
        "1; attribute `openlora.run.outcome`: `running` while the process runs, then, in the final "
        "collection, how the run ended: `finished`, `stopped_by_guard`, `terminated` (with `openlora.run.signal`: "
        "`SIGTERM`, `SIGINT`) or `failed` (with `error.type`, the exception's type). Carries `openlora.run.id` and "
        "`openlora.run.attempt`, so that it names its run and attempt after the target is gone. A run gone while `running` is `vanished` "
        "(derived by the rules).",
    ),
)

# Serving (openlora_otel.inference). The gen_ai.server.* names, units, attributes and bucket
# advisories are the OpenTelemetry GenAI semantic conventions (Development). Those define token
# usage for clients only (gen_ai.client.token.usage); a server's own count lives under
# openlora.inference.* with the same attribute and buckets. The adapter is an attribute of its
# own (no convention has one), capped per process (OPENLORA_INFERENCE_MAX_ADAPTERS).
ATTR_OPERATION = "gen_ai.operation.name"
ATTR_PROVIDER = "gen_ai.provider.name"
ATTR_REQUEST_MODEL = "gen_ai.request.model"
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_TOKEN_TYPE = "gen_ai.token.type"
ATTR_ERROR_TYPE = "error.type"
ATTR_ADAPTER = "openlora.adapter.name"
# On openlora.inference.adapter.info only: where a served adapter came from (its training run, which
# labels its own series openlora.run.id / openlora.run.name; here under openlora.training.* so that
# they never clash with the serving process's own openlora.run.id, its Resource's), the base it
# runs on and the training's last evaluation loss.
ATTR_TRAINING_RUN_ID = "openlora.training.run.id"
ATTR_TRAINING_RUN_NAME = "openlora.training.run.name"
ATTR_TRAINING_EVAL_LOSS = "openlora.training.final_eval_loss"
ATTR_BASE_MODEL = "openlora.adapter.base_model"
ATTR_BASE_FINGERPRINT = "openlora.adapter.base_fingerprint"

REQUEST_DURATION_BUCKETS: tuple[float, ...] = tuple(round(0.01 * 2**k, 2) for k in range(14))  # 0.01 .. 81.92
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(4**k) for k in range(14))  # 1 .. 67108864

INFERENCE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gen_ai.server.request.duration",
        "histogram",
        "s",
        "Time from a request's arrival to its last output token (queue wait included); `error.type` on "
        "failed requests. Its count is the request count.",
    ),
    MetricSpec(
        "gen_ai.server.time_to_first_token",
        "histogram",
        "s",
        "Time from a request's arrival to its first output token (queue wait included); successful requests.",
    ),
    MetricSpec(
        "gen_ai.server.time_per_output_token",
        "histogram",
        "s",
        "Time per output token after the first: (duration - time to first token) / (output tokens - 1); "
        "successful requests with at least two output tokens.",
    ),
    MetricSpec(
        "openlora.inference.token.usage",
        "histogram",
        "{token}",
        "Tokens per successful request, `gen_ai.token.type` `input` (prompt) or `output` (generated); "
        "its sum over time is tokens/s.",
    ),
    MetricSpec(
        "openlora.inference.requests.running",
        "updowncounter",
        "{request}",
        "Requests being generated now (left the queue, not finished).",
    ),
    MetricSpec(
        "openlora.inference.requests.waiting",
        "updowncounter",
        "{request}",
        "Requests waiting in the server's queue for a generation slot.",
    ),
    MetricSpec(
        "openlora.inference.adapter.loaded",
        "gauge",
        "",
        f"1 per adapter (`{ATTR_ADAPTER}`) while it is loaded, 0 after it was unloaded; a loaded adapter "
        "shows whether or not it has requests.",
    ),
    MetricSpec(
        "openlora.inference.adapter.info",
        "gauge",
        "",
        f"1 per loaded adapter (`{ATTR_ADAPTER}`; none for adapters past the cap), with what is known of "
        f"where it came from: `{ATTR_TRAINING_RUN_ID}`, `{ATTR_TRAINING_RUN_NAME}` (its training run), "
        f"`{ATTR_BASE_MODEL}`, `{ATTR_BASE_FINGERPRINT}`, `{ATTR_TRAINING_EVAL_LOSS}`. Replaced when the "
        "adapter is loaded again, gone once it is unloaded; no request series carries these.",
    ),
    MetricSpec(
        "openlora.inference.adapter.load.duration",
        "histogram",
        "s",
        "Time to load an adapter; `error.type` on failed loads (their count is the failure count).",
    ),
)

ADAPTER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("openlora.adapter.rank", "gauge", "", "LoRA rank r."),
    MetricSpec("openlora.adapter.alpha", "gauge", "", "LoRA alpha (scaling is alpha / r)."),
    MetricSpec("openlora.adapter.dropout", "gauge", "", "LoRA dropout probability."),
    MetricSpec(
        "openlora.adapter.target_modules", "gauge", "{module}", "Number of module names LoRA targets."
    ),
    MetricSpec("openlora.adapter.parameters.trainable", "gauge", "{parameter}", "Trainable parameters."),
    MetricSpec(
        "openlora.model.parameters",
        "gauge",
        "{parameter}",
        "All parameters of the model, frozen base included.",
    ),
    MetricSpec("openlora.adapter.trainable.ratio", "gauge", "", "Trainable parameters / all parameters."),
)

# GPU metrics. The hw.* names, units and attributes are the OpenTelemetry semantic
# conventions (hardware / GPU, status Development); those keep their unit `1`
# even though the Collector then names them *_ratio, because the conventions
# say so. openlora.* names cover what the conventions have no word for.
ATTR_GPU_INDEX = "openlora.gpu.index"
ATTR_GPU_PARENT = "openlora.gpu.parent_id"
ATTR_THROTTLE_REASON = "openlora.gpu.throttle.reason"
ATTR_XID_CODE = "openlora.gpu.xid.code"
ATTR_REMAP_CAUSE = "openlora.gpu.remap.cause"
ATTR_IO_DIRECTION = "network.io.direction"
ATTR_HW_STATE = "hw.state"

# openlora.gpu.throttle.time: why the clock was held below what was asked for. Each reason is a
# cumulative duration NVML keeps; they overlap in time, so they are not summed.
THROTTLE_REASONS = ("sw_power_cap", "thermal", "sync_boost", "hw_thermal_slowdown", "hw_power_brake_slowdown")

# hw.errors `error.type` on a GPU: ECC (volatile, since the driver loaded), the two values the conventions'
# GPU refinement of hw.errors has. PCIe link errors have no place there: they are their own counter,
# openlora.gpu.pcie.errors, whose `error.type` is one of GPU_PCIE_ERROR_TYPES.
GPU_ERROR_TYPES = ("corrected", "uncorrected")
GPU_PCIE_ERROR_TYPES = ("replay", "correctable", "non_fatal", "fatal")

# XID codes counted under their own `openlora.gpu.xid.code` value; every other code counts as "other",
# so the attribute has at most len(XID_CODES) + 1 values. The classes drive hw.status and the alerts:
# - XID_FAILED: the GPU is gone (fell off the bus): hw.state failed.
# - XID_BAD_GPU: a hardware or firmware fault that needs a reset, a drain or a replacement: degraded.
# - the rest are raised by what a program did (illegal address, a killed context...) or are
#   informational (a row remap was recorded; the pending remap shows on its own series).
XID_FAILED = (79,)
XID_BAD_GPU = (48, 62, 64, 74, 92, 94, 95, 119, 120, 140, 143, 154)
XID_OTHER_KNOWN = (13, 31, 32, 43, 45, 61, 63, 68, 69, 109, 121)
XID_CODES: tuple[int, ...] = tuple(sorted((*XID_FAILED, *XID_BAD_GPU, *XID_OTHER_KNOWN)))
XID_OTHER = "other"

GPU_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "hw.gpu.utilization",
        "gauge",
        "1",
        "Fraction of time the GPU was busy over the driver's sample period, per `hw.gpu.task` (general, encoder, decoder). Not reported for MIG instances.",
        "openlora_gpu_utilization",
    ),
    MetricSpec(
        "hw.gpu.memory.usage",
        "updowncounter",
        "By",
        "GPU memory in use, all processes.",
        "openlora_vram_usage_mb",
    ),
    MetricSpec("hw.gpu.memory.limit", "updowncounter", "By", "GPU memory in total."),
    MetricSpec("hw.gpu.memory.utilization", "gauge", "1", "GPU memory in use / total."),
    MetricSpec("hw.power", "gauge", "W", "Power draw of the GPU (`hw.type=gpu`)."),
    MetricSpec("hw.energy", "counter", "J", "Energy the GPU used since the driver loaded (`hw.type=gpu`)."),
    MetricSpec(
        "hw.temperature",
        "gauge",
        "Cel",
        f"GPU core temperature, with the attributes the conventions give a temperature sensor (`hw.id`, `hw.name`) "
        f"and `{ATTR_GPU_INDEX}`; no `hw.type`, vendor, model or driver version.",
    ),
    MetricSpec(
        "hw.errors",
        "counter",
        "{error}",
        "GPU ECC memory errors (`hw.type=gpu`) since the driver loaded, per `error.type`: `corrected`, `uncorrected`.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.errors",
        "counter",
        "{error}",
        "PCIe link errors of the GPU since the driver loaded, per `error.type`: `replay` (packets resent), and where "
        "the driver counts them `correctable`, `non_fatal`, `fatal`.",
    ),
    MetricSpec("openlora.gpu.clock.sm", "gauge", "Hz", "Current SM clock."),
    MetricSpec(
        "openlora.gpu.throttle.time",
        "counter",
        "s",
        f"Time the clock was held down, per `{ATTR_THROTTLE_REASON}` (`sw_power_cap`, `thermal`, `sync_boost`, "
        "`hw_thermal_slowdown`, `hw_power_brake_slowdown`), as NVML accumulates it: its rate is the fraction of "
        "time throttled for that reason. Reasons overlap; each is absent where the GPU or driver lacks its counter.",
    ),
    MetricSpec(
        "hw.gpu.io",
        "counter",
        "By",
        f"Bytes moved over PCIe, `{ATTR_IO_DIRECTION}` `transmit` (GPU to host) or `receive`: from GPM's "
        "traffic rates since the collector started (Hopper and later, no wrap), else NVML's byte fields "
        "with 32-bit wraps added back.",
    ),
    MetricSpec(
        "openlora.gpu.nvlink.io",
        "counter",
        "By",
        f"Data bytes moved over all NVLinks of the GPU (protocol overhead excluded), `{ATTR_IO_DIRECTION}` "
        "`transmit` or `receive`; absent on GPUs without NVLink.",
    ),
    MetricSpec(
        "openlora.gpu.xid.errors",
        "counter",
        "{error}",
        f"XID errors the driver reported since this process started watching, per `{ATTR_XID_CODE}` (a known "
        "code such as `79`, or `other`); a series appears with its first error.",
    ),
    MetricSpec(
        "openlora.gpu.remap.rows",
        "counter",
        "{row}",
        f"Memory rows remapped over the GPU's life, per `{ATTR_REMAP_CAUSE}` (`correctable`, `uncorrectable`).",
    ),
    MetricSpec(
        "openlora.gpu.remap.pending",
        "gauge",
        "",
        "1 while a row remap waits for a GPU reset to take effect, else 0.",
    ),
    MetricSpec(
        "openlora.gpu.remap.failed",
        "gauge",
        "",
        "1 once a row remap failed (no spare rows left: the GPU needs replacing), else 0.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.width",
        "gauge",
        "{lane}",
        "PCIe lanes the link runs on now (read at most once a minute).",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.width.max",
        "gauge",
        "{lane}",
        "Most PCIe lanes this GPU and its slot support together.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.generation",
        "gauge",
        "",
        "PCIe generation the link runs at now (read at most once a minute); idle GPUs drop it to save power.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.generation.max",
        "gauge",
        "",
        "Highest PCIe generation this GPU and its slot support together.",
    ),
    MetricSpec(
        "hw.status",
        "updowncounter",
        "1",
        f"1 for the GPU's current `{ATTR_HW_STATE}` and 0 for the other two (`ok`, `degraded`, `failed`; "
        "`hw.type=gpu`): failed when NVML lost the GPU, an XID 79 was seen, a row remap failed or the driver asks "
        "for a node reboot; degraded after an XID that means a bad GPU, while a remap is pending, or when the "
        "driver asks for any other recovery (a GPU or bus reset, a drain).",
    ),
    MetricSpec(
        "openlora.gpu.sm.activity",
        "gauge",
        "",
        "Fraction of SMs busy between two snapshots, 0 to 1 (NVML GPM; Hopper and later, not for MIG instances).",
    ),
    MetricSpec(
        "openlora.gpu.sm.occupancy",
        "gauge",
        "",
        "Resident warps over the SMs' maximum between two snapshots, 0 to 1 (NVML GPM; Hopper and later).",
    ),
    MetricSpec(
        "openlora.gpu.tensor.activity",
        "gauge",
        "",
        "Fraction of time the tensor cores were busy between two snapshots, 0 to 1 (NVML GPM; Hopper and later).",
    ),
    MetricSpec(
        "openlora.gpu.dram.activity",
        "gauge",
        "",
        "DRAM bandwidth used over its peak between two snapshots, 0 to 1 (NVML GPM; Hopper and later).",
    ),
    MetricSpec(
        "openlora.process.gpu.memory.usage",
        "updowncounter",
        "By",
        "GPU memory this process holds, as the driver accounts it (absent where the driver cannot see the process, as in some containers).",
    ),
    MetricSpec(
        "openlora.torch.memory.allocated",
        "updowncounter",
        "By",
        "Bytes the torch caching allocator has handed out on this device.",
    ),
    MetricSpec(
        "openlora.torch.memory.reserved",
        "updowncounter",
        "By",
        "Bytes the torch caching allocator holds from the driver.",
    ),
    MetricSpec(
        "openlora.torch.memory.peak",
        "gauge",
        "By",
        "Peak of allocated bytes since the process started (or since the peak was reset).",
    ),
    MetricSpec(
        "openlora.torch.memory.ooms", "counter", "{error}", "Out-of-memory errors the torch allocator raised."
    ),
    MetricSpec(
        "openlora.torch.memory.alloc_retries",
        "counter",
        "{retry}",
        "Allocations that succeeded only after freeing the allocator's cache.",
    ),
    MetricSpec(
        "openlora.gpu.snapshot.age",
        "gauge",
        "s",
        "Age of the NVML snapshot behind the GPU values: 0 when fresh, more when NVML was too slow and the last good one was served.",
    ),
)

_UNITS = {
    "s": "seconds", "ms": "milliseconds", "By": "bytes", "W": "watts", "J": "joules",
    "Cel": "celsius", "Hz": "hertz", "%": "percent", "1": "",
}  # fmt: skip
_PER = {"s": "second", "m": "minute", "h": "hour", "d": "day"}


def prometheus_name(name: str, unit: str, kind: Kind, *, path: Literal["pull", "collector"] = "pull") -> str:
    """Translate an OpenTelemetry metric to its Prometheus series name on one of the two paths.

    ``pull``: opentelemetry-exporter-prometheus (unit ``1`` adds nothing).
    ``collector``: pushed over OTLP (unit ``1`` on a gauge adds ``_ratio``): the Collector's
    prometheus and prometheus_remote_write exporters, and Prometheus 3's OTLP receiver, name alike
    (the tests check every name against each of them).
    Both drop ``{annotations}``, map ``s``/``By``/... to words, ``X/s`` to ``X_per_second``,
    and add ``_total`` to monotonic counters.
    """
    base = re.sub(r"[^a-zA-Z0-9:]+", "_", name)
    stripped = re.sub(r"\{.*?\}", "", unit)
    if stripped in _UNITS:
        suffix = _UNITS[stripped]
    elif "/" in stripped:
        top, _, bottom = stripped.partition("/")
        top = _UNITS.get(top, top)
        bottom = _PER.get(bottom, bottom)
        suffix = f"{top}_per_{bottom}" if top else f"per_{bottom}"
    else:
        suffix = re.sub(r"[^a-zA-Z0-9:]+", "_", stripped)
    if path == "collector" and unit == "1" and kind == "gauge":
        suffix = "ratio"
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if kind == "counter" and not base.endswith("_total"):
        base += "_total"
    return base

"""Training-run metrics (openlora_otel.training): the step, evaluation, FLOPs and goodput series, the
LoRA adapter's shape, and their attribute keys and values."""

from __future__ import annotations

from openlora_otel.names.common import MetricSpec

__all__ = [
    "ADAPTER_METRICS",
    "ATTR_EVAL_METRIC",
    "ATTR_GUARD_REASON",
    "ATTR_TRAINING_PHASE",
    "GUARD_REASONS",
    "STEP_DURATION_BUCKETS",
    "TRAINING_METRICS",
    "TRAINING_PHASES",
]

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

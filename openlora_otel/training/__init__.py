"""Training-run metrics: the step metrics, the divergence guard and the FLOPs for MFU.

- :mod:`openlora_otel.training.metrics`: :class:`TrainingMetrics`, one cheap call per
  optimizer step (the step path and the API), read when metrics are collected. Beneath it:
  :mod:`~openlora_otel.training.collection` (each collection: the window taken, committed,
  read back, judged by the guard and reported; :func:`step_duration_view`),
  :mod:`~openlora_otel.training.values` (epoch, evaluation, adapter, model FLOPs),
  :mod:`~openlora_otel.training.arguments` (what the record calls accept),
  :mod:`~openlora_otel.training.window` (the window of steps and each metric reader's span,
  with :func:`collecting_for`) and :mod:`~openlora_otel.training.readback` (kept tensors folded
  on their device and read back without a sync).
- :mod:`openlora_otel.training.guard`: :class:`DivergenceGuard`, which notices a diverged
  run (NaN losses, a loss spike) without adding a sync to the step.
- :mod:`openlora_otel.training.flops`: training FLOPs per token from a model's weights
  (LoRA-aware) and the GPU peak table, for MFU.

The public names are re-exported here, so ``from openlora_otel.training import
TrainingMetrics`` keeps working as it did when this was one module. Code that reaches
private names, or monkeypatches, goes to the module that defines them. None of these
imports torch: the FLOPs walk imports it when called.
"""

from openlora_otel.training.flops import (
    GPU_PEAKS,
    FlopsEstimate,
    GpuPeak,
    device_peak_flops,
    peak_flops,
    peak_table_markdown,
    report_model_flops,
    training_flops_per_token,
)
from openlora_otel.training.guard import DivergenceGuard, Trip
from openlora_otel.training.metrics import TrainingMetrics, step_duration_view
from openlora_otel.training.window import collecting_for

__all__ = [
    "GPU_PEAKS",
    "DivergenceGuard",
    "FlopsEstimate",
    "GpuPeak",
    "TrainingMetrics",
    "Trip",
    "collecting_for",
    "device_peak_flops",
    "peak_flops",
    "peak_table_markdown",
    "report_model_flops",
    "step_duration_view",
    "training_flops_per_token",
]

"""Training-run metrics: the step metrics, the divergence guard and the FLOPs for MFU.

:mod:`.metrics` (:class:`TrainingMetrics`, over :mod:`.collection`, :mod:`.values`, :mod:`.arguments`,
:mod:`.window` and :mod:`.readback`), :mod:`.guard` (:class:`DivergenceGuard`), :mod:`.goodput` and
:mod:`.flops`. Their public names are re-exported here, as when this was one module; code that
reaches private names, or monkeypatches, goes to the module that defines them. None of them imports
torch (the FLOPs walk does when called). See docs/architecture.md.
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

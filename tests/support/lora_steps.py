"""What a simulated LoRA fine-tune records at each step, and how its fake GPUs' readings move: shared
by the simulated ranks of tests/support/rank_group.py (many per process) and of
benchmarks/_sizing_rank.py (one per process), so that both export the same series with changing
values (constant ones would compress better than real ones do)."""

from __future__ import annotations

import math

from tests.support.fake_nvml import FakeGpu

EVAL_EVERY = 40


def move_gpus(gpus: list[FakeGpu], phase: float, step: int, step_s: float) -> None:
    """The readings of a node's GPUs after ``step`` steps of ``step_s``; ``phase`` sets each rank apart."""
    for gpu in gpus:
        gpu.utilization = 0.8 + 0.15 * math.sin(phase + gpu.index)
        gpu.memory_used = int((40 + 5 * math.sin(phase)) * 2**30)
        gpu.power_w = 550.0 + 100.0 * math.sin(phase + 1.0)
        gpu.energy_j += gpu.power_w * step_s
        gpu.temperature_c = 65.0 + 5.0 * math.sin(phase / 3.0)
        gpu.sm_clock_hz = 1.98e9 - 1e8 * (step % 3)


def record_lora_step(training, step: int, phase: float, *, step_time_s: float | None = None,
                     nonfinite_loss: bool = False) -> None:  # fmt: skip
    """Step ``step`` (from 1) of ``training`` (a TrainingMetrics): loss, grad norm, learning rate,
    tokens and samples, the epoch, and an evaluation at the first step and every 40 after;
    ``nonfinite_loss``: the loss is NaN (a run gone bad)."""
    loss = math.nan if nonfinite_loss else 2.0 / math.sqrt(step) + 0.01 * math.sin(phase)
    training.record_step(
        loss=loss,
        grad_norm=1.0 + 0.2 * math.sin(phase * 1.7),
        learning_rate=2e-4 * min(1.0, step / 100.0),
        tokens=8 * 2048,
        samples=8,
        **({} if step_time_s is None else {"step_time_s": step_time_s}),
    )
    training.record_epoch(step / 1000.0)
    if step == 1 or step % EVAL_EVERY == 0:
        training.record_eval(loss=2.1 / math.sqrt(step), accuracy=0.5 + step / 10_000.0)

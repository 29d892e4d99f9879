"""Hugging Face ``transformers.Trainer`` callback feeding `TrainingMetrics`.

    from openlora_otel.integrations.hf import TelemetryCallback
    trainer = Trainer(..., callbacks=[TelemetryCallback(telemetry)])

Per optimizer step (``on_step_end``): one ``record_step`` with the step's wall
time, the tokens the Trainer counted (``include_num_input_tokens_seen``; else
none) and the nominal samples (per-device batch size x gradient accumulation).
Loss, gradient norm and learning rate come from the Trainer's own logs
(``on_log``, every ``logging_steps``): the Trainer has already read them to the
host there, so the callback adds no device sync of its own. Evaluations
(``on_evaluate``) go to ``record_eval``; a PEFT LoRA config on the model is
described at train start; metrics are flushed at train end. Independent of
``report_to``: it works with ``"none"`` and next to other reporters.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from openlora_otel.integrations._common import TelemetryOwner, describe_lora, safe
from openlora_otel.telemetry import Telemetry

__all__ = ["TelemetryCallback"]

# Keys of Trainer logs and eval metrics that are bookkeeping, not model quality.
_NOT_EVAL_METRICS = {"epoch", "runtime", "samples_per_second", "steps_per_second", "loss"}


class TelemetryCallback(TrainerCallback):
    """Report a ``transformers.Trainer`` run through openlora-otel.

    ``telemetry``: the handle from ``setup_telemetry()``; when omitted, the
    callback calls ``setup_telemetry()`` at train start and shuts it down at
    train end. Every hook is guarded: a failure is logged once and never
    reaches the training loop.
    """

    def __init__(self, telemetry: Telemetry | None = None) -> None:
        self._owner = TelemetryOwner(telemetry)
        self._step_started: float | None = None
        self._tokens_seen = 0
        self._samples_per_step = 0

    @safe
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        training = self._owner.training
        if model is not None:
            describe_lora(model, training)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._samples_per_step = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)

    @safe
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_started = time.perf_counter()

    @safe
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        tokens = max(seen - self._tokens_seen, 0) if seen else None
        self._tokens_seen = seen
        step_time = None if self._step_started is None else now - self._step_started
        self._owner.training.record_step(tokens=tokens, samples=self._samples_per_step, step_time_s=step_time)

    @safe
    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not logs:
            return
        training = self._owner.training
        loss = _number(logs.get("loss"))
        grad_norm = _number(logs.get("grad_norm"))
        learning_rate = _number(logs.get("learning_rate"))
        if grad_norm is not None and grad_norm < 0:
            grad_norm = None
        training.record_values(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate)
        if state.epoch is not None:
            training.record_epoch(float(state.epoch))

    @safe
    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not metrics:
            return
        others = {}
        for key, value in metrics.items():
            name = key.removeprefix("eval_")
            number = _number(value)
            if number is not None and name not in _NOT_EVAL_METRICS:
                others[name] = number
        self._owner.training.record_eval(loss=_number(metrics.get("eval_loss")), **others)

    @safe
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.epoch is not None:
            self._owner.training.record_epoch(float(state.epoch))

    @safe
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._owner.finish()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)  # NaN/inf pass through: TrainingMetrics counts them as non-finite
    return None

"""Hugging Face ``transformers.Trainer`` callback feeding `TrainingMetrics`.

    from openlora_otel.integrations.hf import TelemetryCallback
    trainer = Trainer(..., callbacks=[TelemetryCallback(telemetry)])

One ``record_step`` per optimizer step, whatever ``logging_steps`` says, from hooks that never read a
tensor; evaluations, saves and resumes are marked for goodput. Only the gradient norm comes from the
Trainer's logs: no callback sees it unclipped. See docs/getting-started/callbacks.md.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from transformers import TrainerCallback

from openlora_otel.integrations.common import (
    GUARD_SYNC_EVERY,
    ModelFlops,
    OpenMarks,
    StepClock,
    TelemetryOwner,
    describe_lora,
    model_hyperparameters,
    safe,
    start_progress,
)
from openlora_otel.telemetry import Telemetry
from openlora_otel.training.guard import DivergenceGuard

__all__ = ["TelemetryCallback"]

_logger = logging.getLogger("openlora_otel.integrations")

# The forward hook each model carries from this module, so that a run that raised (no
# on_train_end, its hook left on the model) does not leave a second one summing losses
# forever when the model is trained again, by any callback instance.
_TAPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

# Keys of Trainer logs and eval metrics that are bookkeeping, not model quality.
_NOT_EVAL_METRICS = {"epoch", "runtime", "samples_per_second", "steps_per_second", "loss"}


class _ForwardTap:
    """A forward hook that keeps each training forward's loss tensor and batch shape, reading nothing."""

    def __init__(self, main_input: str) -> None:
        self.main_input = main_input
        self.handle: Any = None
        self.failed = False
        self.reset()

    def reset(self) -> None:
        self.loss: Any = None  # sum of the step's micro-batch losses, on their device
        self.parts = 0
        self.scaled = False  # the model divided by the step's token count (num_items_in_batch)
        self.tokens = 0
        self.samples = 0
        self.forwards = 0

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        # Runs inside the model's forward: never raise into it.
        try:
            if not (module.training and torch.is_grad_enabled()):
                return  # evaluation or prediction
            self.forwards += 1
            ids = kwargs.get(self.main_input)
            if ids is None and args:
                ids = args[0]
            if isinstance(ids, torch.Tensor) and ids.dim() > 0:
                self.tokens += ids.numel()  # shape facts: no device read
                self.samples += ids.shape[0]
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                return
            loss = loss.detach().reshape(())
            self.loss = loss if self.loss is None else self.loss + loss  # on the device, not read
            self.parts += 1
            if kwargs.get("num_items_in_batch") is not None:
                self.scaled = True
        except Exception:
            if not self.failed:
                self.failed = True
                _logger.warning("openlora-otel forward hook failed; training continues", exc_info=True)


class TelemetryCallback(TrainerCallback):
    """Report a ``transformers.Trainer`` run through openlora-otel.

    ``telemetry``: the handle from ``setup_telemetry()``; when omitted, the
    callback calls ``setup_telemetry()`` at train start and shuts it down at
    train end. Every hook is guarded: a failure is logged once and never
    reaches the training loop.

    ``guard``: a :class:`~openlora_otel.training.guard.DivergenceGuard`, attached at train
    start; once it trips, the step it is seen at sets
    ``control.should_training_stop`` and clears ``should_save`` and
    ``should_evaluate`` (there and at the epoch end that follows), so the
    diverged weights are not saved over the last good checkpoint. With several processes (DDP) the ranks
    agree first, every ``GUARD_SYNC_EVERY`` steps (one all-reduce of one number),
    so all of them stop at the same step.
    ``flops``: report the model's FLOPs per token (and MFU where the GPU's peak
    is known) from the first step's sequence length.
    """

    def __init__(
        self,
        telemetry: Telemetry | None = None,
        *,
        guard: DivergenceGuard | None = None,
        flops: bool = True,
    ) -> None:
        if guard is not None and not isinstance(guard, DivergenceGuard):
            raise TypeError(f"guard must be a DivergenceGuard, got {type(guard).__name__}")
        self._owner = TelemetryOwner(telemetry)
        self._guard = guard
        self._flops_wanted = flops
        self._flops = ModelFlops(None)
        self._clock = StepClock()
        self._tap: _ForwardTap | None = None
        self._loss_scale = 1
        self._tokens_seen = 0
        self._trainer_counts_tokens = False
        self._samples_per_step = 0
        self._learning_rate: Any = None
        self._step_loss_seen = False  # a per-step loss reached the window since the last on_log
        self._step_lr_seen = False
        self._said_no_loss = False
        self._said_no_input = False
        self._stopped = False  # the guard stopped this run: nothing more is saved or evaluated
        self._marks = OpenMarks()  # goodput phases open across hooks (evaluation, checkpoint_save)
        self._save_after_eval = False  # the Trainer saves right after the evaluation it is about to run

    @safe
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        training = self._owner.training
        if model is not None:
            describe_lora(model, training)
        self._owner.telemetry.fill_run_info(
            name=_run_name(args),
            hyperparameters={
                **trainer_hyperparameters(args),
                **(model_hyperparameters(model) if model is not None else {}),
            },
        )
        if self._guard is not None:
            training.attach_guard(self._guard)
        if self._flops_wanted and model is not None:
            dtype = torch.bfloat16 if getattr(args, "bf16", False) else None
            dtype = torch.float16 if getattr(args, "fp16", False) else dtype
            self._flops = ModelFlops(model, dtype)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._trainer_counts_tokens = getattr(args, "include_num_input_tokens_seen", "no") not in (
            "no",
            False,
        )
        self._samples_per_step = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
        # The Trainer multiplies a loss normalised over all processes' tokens back by the process count.
        world = int(getattr(args, "world_size", 1) or 1)
        self._loss_scale = world if getattr(args, "average_tokens_across_devices", False) and world > 1 else 1
        self._remove_tap()
        if model is not None:
            left = _TAPS.pop(model, None)
            if left is not None:
                left.remove()  # an earlier run on this model raised before on_train_end
        if model is not None and int(getattr(args, "n_gpu", 1) or 1) <= 1:
            self._tap = _ForwardTap(str(getattr(model, "main_input_name", "input_ids") or "input_ids"))
            self._tap.handle = model.register_forward_hook(self._tap, with_kwargs=True)
            _TAPS[model] = self._tap.handle
        else:
            _logger.warning(
                "openlora-otel: no forward hook (%s); loss comes from the Trainer's logs every "
                "logging_steps, tokens only with include_num_input_tokens_seen",
                "no model given" if model is None else "DataParallel over several GPUs",
            )
        every = getattr(state, "logging_steps", None) or getattr(args, "logging_steps", None)
        strategy = getattr(args, "logging_strategy", "steps")
        if not (getattr(strategy, "value", strategy) == "steps" and every == 1):
            _logger.warning(
                "openlora-otel: the gradient norm is reported from the Trainer's logs only (logging_steps=%s): "
                "the Trainer gives each step's norm to no callback, and the gradients a callback sees are "
                "already clipped. Loss, learning rate and tokens are reported every step.",
                every,
            )
        self._stopped = False
        self._marks.leave_all()
        self._save_after_eval = False
        # Goodput across restarts: the run's highest step is kept next to its checkpoints, and a
        # Trainer resumed from one (global_step > 0 here: the Trainer loaded its state already)
        # does the steps after it again, up to where the earlier attempt got.
        if getattr(args, "output_dir", None):
            start_progress(
                training,
                args.output_dir,
                int(getattr(state, "global_step", 0) or 0),
                run_id=self._owner.telemetry.run_id,
                write=bool(getattr(state, "is_local_process_zero", True)),
            )
        self._clock = StepClock()
        self._clock.idle()

    @safe
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._clock.idle()  # the epoch's iterator is created and its first batches fetched next

    @safe
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._clock.batch_started()
        if self._marks:  # an evaluation or save announced by a flag that a later callback cleared
            self._marks.leave_all()
            self._save_after_eval = False

    @safe
    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
    ) -> None:
        groups = getattr(optimizer, "param_groups", None)
        self._learning_rate = groups[0].get("lr") if groups else None

    @safe
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step_time, data_time = self._clock.step_ended()
        loss = tokens = samples = None
        tap = self._tap
        if tap is not None:
            if tap.parts:
                loss = tap.loss
                if tap.scaled:
                    if self._loss_scale != 1:
                        loss = loss * self._loss_scale
                elif tap.parts > 1:
                    loss = loss / tap.parts
                self._step_loss_seen = True
            elif tap.forwards and not self._said_no_loss:
                self._said_no_loss = True
                _logger.warning(
                    "openlora-otel: the model's forward returns no loss (label smoothing, compute_loss_func "
                    "or tuple outputs); the loss comes from the Trainer's logs every logging_steps"
                )
            if tap.samples:
                tokens, samples = tap.tokens, tap.samples
            elif tap.forwards and not self._said_no_input:
                self._said_no_input = True
                _logger.warning(
                    "openlora-otel: the model's forward gets no %r tensor; tokens are counted only with "
                    "include_num_input_tokens_seen, samples are the nominal batch size",
                    tap.main_input,
                )
            tap.reset()
        if self._trainer_counts_tokens or tokens is None:
            seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            # The Trainer's count is gathered over all processes; each process reports its
            # own share (an even split: the per-rank detail is not kept), as every series here.
            world = max(int(getattr(args, "world_size", 1) or 1), 1)
            tokens = max(seen - self._tokens_seen, 0) // world if seen else tokens
            self._tokens_seen = seen
        learning_rate, self._learning_rate = _rate(self._learning_rate), None
        if learning_rate is not None:
            self._step_lr_seen = True
        self._owner.training.record_step(
            loss=loss,
            learning_rate=learning_rate,
            tokens=tokens,
            samples=samples if samples else self._samples_per_step,
            step_time_s=step_time,
            data_time_s=data_time,
        )
        if self._guard is not None and _agreed_trip(self._guard.tripped, args, state.global_step):
            control.should_training_stop = True
            if not self._stopped:
                self._stopped = True
                _logger.warning(
                    "openlora-otel: the divergence guard tripped; the run stops at step %d and saves no "
                    "checkpoint, so the diverged weights do not replace the last good one",
                    state.global_step,
                )
        if self._stopped:
            self._skip_save_and_evaluate(control)
        self._clock.idle()
        self._flops.step(self._owner.training, tokens, samples or self._samples_per_step)
        self._mark_what_follows(control)

    def _mark_what_follows(self, control: Any) -> None:
        """After on_step_end and on_epoch_end the Trainer evaluates, then saves, as ``control`` says
        (DefaultFlowCallback, first in the list, has set the flags by now). Their time starts here."""
        if control.should_evaluate:
            self._marks.enter(self._owner.training, "evaluation")
            self._save_after_eval = bool(control.should_save)
        elif control.should_save:
            self._marks.enter(self._owner.training, "checkpoint_save")

    @safe
    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self._clock.idle()  # logging is not waiting for data
        if not logs:
            return
        training = self._owner.training
        # Values the hooks already took for these steps are not added twice.
        loss = None if self._step_loss_seen else _number(logs.get("loss"))
        learning_rate = None if self._step_lr_seen else _number(logs.get("learning_rate"))
        if "loss" in logs:  # a training log (not an evaluation's): the next one starts afresh
            self._step_loss_seen = self._step_lr_seen = False
        grad_norm = _number(logs.get("grad_norm"))
        if grad_norm is not None and grad_norm < 0:
            grad_norm = None
        training.record_values(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate)
        if state.epoch is not None:
            training.record_epoch(float(state.epoch))

    @safe
    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self._clock.idle()
        if self._marks.is_open("evaluation"):
            self._marks.leave("evaluation")
            if self._save_after_eval:
                self._marks.enter(self._owner.training, "checkpoint_save")
        self._save_after_eval = False
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
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # An evaluation no flag announced (eval_on_start, trainer.evaluate() or predict() in a
        # script): from its first batch on. Never sets up a Telemetry after train end.
        if self._owner.active and not self._marks.is_open("evaluation"):
            self._marks.enter(self._owner.training, "evaluation")

    @safe
    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._marks.leave("evaluation")

    @safe
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._marks.leave("checkpoint_save")
        self._clock.idle()

    @safe
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stopped:  # first: nothing below may keep it from happening
            self._skip_save_and_evaluate(control)  # after DefaultFlowCallback's epoch-end save
        if state.epoch is not None:
            self._owner.training.record_epoch(float(state.epoch))
        self._mark_what_follows(control)

    @staticmethod
    def _skip_save_and_evaluate(control: Any) -> None:
        """After a trip: the weights have diverged. Saving them would let ``save_total_limit``
        delete the last good checkpoint; evaluating them only costs time. The Trainer reads
        these flags right after on_step_end and on_epoch_end, and DefaultFlowCallback (first
        in the list) has already set them by then."""
        control.should_save = False
        control.should_evaluate = False

    @safe
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._marks.leave_all()
        self._remove_tap()
        self._owner.finish()

    def _remove_tap(self) -> None:
        if self._tap is not None and self._tap.handle is not None:
            self._tap.handle.remove()
        self._tap = None


def trainer_hyperparameters(args: Any) -> dict[str, object]:
    """What ``TrainingArguments`` say about the run, under the keys ``openlora.run.info`` uses."""
    strategy = getattr(args, "lr_scheduler_type", None)
    max_steps = getattr(args, "max_steps", -1)
    warmup_steps = getattr(args, "warmup_steps", 0)
    if getattr(args, "bf16", False):
        precision = "bf16"
    elif getattr(args, "fp16", False):
        precision = "fp16"
    else:
        precision = "fp32"
    return {
        "learning_rate": getattr(args, "learning_rate", None),
        "batch_size": getattr(args, "per_device_train_batch_size", None),
        "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
        # max_steps > 0 overrides the epoch count in the Trainer: only one of them is the run's.
        "max_steps": max_steps if isinstance(max_steps, int) and max_steps > 0 else None,
        "epochs": None
        if isinstance(max_steps, int) and max_steps > 0
        else getattr(args, "num_train_epochs", None),
        "seed": getattr(args, "seed", None),
        "weight_decay": getattr(args, "weight_decay", None),
        "warmup_steps": warmup_steps if warmup_steps else None,
        "warmup_ratio": getattr(args, "warmup_ratio", None) or None,
        "lr_scheduler": strategy,
        "optimizer": getattr(args, "optim", None),
        "max_grad_norm": getattr(args, "max_grad_norm", None),
        "precision": precision,
        "world_size": getattr(args, "world_size", None),
    }


def _run_name(args: Any) -> str | None:
    """``TrainingArguments.run_name`` when someone chose it (older versions default it to output_dir)."""
    name = getattr(args, "run_name", None)
    return None if name == getattr(args, "output_dir", None) else name


def _rate(value: Any) -> Any:
    """A learning rate as the optimizer holds it: a float, or a one-element tensor passed on unread."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.numel() == 1 else None
    return _number(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)  # NaN/inf pass through: TrainingMetrics counts them as non-finite
    return None


def _agreed_trip(tripped: bool, args: Any, step: int) -> bool:
    """This process's trip, or under DDP whether any rank tripped, asked every ``GUARD_SYNC_EVERY`` steps.

    Every rank reaches the same global step, so the all-reduce lines up; in between no rank
    stops (one rank leaving while the others wait in a gradient all-reduce would hang them).
    """
    world = int(getattr(args, "world_size", 1) or 1)
    if world <= 1:
        return tripped
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return tripped
    if step % GUARD_SYNC_EVERY:
        return False
    flag = torch.tensor([1.0 if tripped else 0.0], device=args.device)
    distributed.all_reduce(flag)
    return bool(flag.item() > 0)

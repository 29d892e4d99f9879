"""PyTorch Lightning callback feeding `TrainingMetrics`.

    from openlora_otel.integrations.lightning import TelemetryCallback
    trainer = lightning.Trainer(..., callbacks=[TelemetryCallback(telemetry)])

One ``record_step`` per optimizer step: the micro-batch losses summed and the gradient norm computed
on the device, never read on the training thread. Validation and checkpoint saves and loads are
marked for goodput. See docs/getting-started/callbacks.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

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


class TelemetryCallback(pl.Callback):
    """Report a Lightning run through openlora-otel.

    ``telemetry``: the handle from ``setup_telemetry()``; when omitted, the
    callback calls ``setup_telemetry()`` at train start and shuts it down at
    train end. ``grad_norm=False`` skips the gradient norm. Every hook is
    guarded: a failure is logged once and never reaches the training loop.

    ``guard``: a :class:`~openlora_otel.training.guard.DivergenceGuard`, attached at train
    start; once it trips, the step it is seen at sets ``trainer.should_stop``
    and the trainer's checkpoint callbacks save nothing more in this fit (the
    weights have diverged; the last good checkpoint is kept).
    With several processes the ranks agree first, every ``GUARD_SYNC_EVERY``
    steps (``strategy.reduce_boolean_decision``), so all stop at the same step.
    ``flops``: report the model's FLOPs per token (and MFU where the GPU's peak
    is known) from the first step's sequence length.
    """

    def __init__(
        self,
        telemetry: Telemetry | None = None,
        *,
        grad_norm: bool = True,
        tokens_fn: Callable[[Any], int] | None = None,
        samples_fn: Callable[[Any], int] | None = None,
        guard: DivergenceGuard | None = None,
        flops: bool = True,
    ) -> None:
        if guard is not None and not isinstance(guard, DivergenceGuard):
            raise TypeError(f"guard must be a DivergenceGuard, got {type(guard).__name__}")
        self._owner = TelemetryOwner(telemetry)
        self._guard = guard
        self._flops_wanted = flops
        self._flops = ModelFlops(None)
        self._grad_norm = grad_norm
        self._tokens_fn = tokens_fn
        self._samples_fn = samples_fn
        self._clock = StepClock()
        self._last_global_step = 0
        self._tokens = 0
        self._samples = 0
        self._loss: Any = None  # the step's micro-batch losses summed on their device, never read
        self._loss_parts = 0
        self._automatic = True  # automatic optimization: Lightning divides each micro-batch's loss
        self._muted: list[Any] = []  # checkpoint callbacks silenced after a guard trip
        self._marks = OpenMarks()  # evaluation, open between the validation hooks
        self._wrapped: list[tuple[Any, str]] = []  # (object, method) wrapped for this fit

    @safe
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._unwrap()
        # The fit's saves and its checkpoint read, timed whole (the marks are taken at call time).
        # A save after train end (ModelCheckpoint's last one, after a Telemetry this callback set up
        # was shut down) is not marked: no new Telemetry is set up for it.
        self._wrap(trainer, "save_checkpoint", "checkpoint_save", set_up=False)
        # Called only when fit(ckpt_path=...) resumes (trainer.ckpt_path is set later, inside the load).
        self._wrap(trainer.strategy, "load_checkpoint", "checkpoint_load", set_up=True)

    def _wrap(self, target: Any, method: str, phase: str, *, set_up: bool) -> None:
        original = getattr(target, method)
        owner = self._owner

        def marked(*args: Any, **kwargs: Any) -> Any:
            if not (set_up or owner.active):
                return original(*args, **kwargs)
            try:
                mark = owner.training.phase(phase)
            except Exception:  # telemetry must not stop a save or a load
                return original(*args, **kwargs)
            with mark:
                return original(*args, **kwargs)

        marked.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(target, method, marked)
        self._wrapped.append((target, method))

    def _unwrap(self) -> None:
        for target, method in self._wrapped:
            target.__dict__.pop(method, None)
        self._wrapped = []

    @safe
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        training = self._owner.training
        describe_lora(pl_module, training)
        self._owner.telemetry.fill_run_info(
            hyperparameters={
                **trainer_hyperparameters(trainer, pl_module),
                **model_hyperparameters(pl_module),
            }
        )
        if self._guard is not None:
            training.attach_guard(self._guard)
        if self._flops_wanted:
            self._flops = ModelFlops(pl_module, _compute_dtype(str(getattr(trainer, "precision", ""))))
        self._last_global_step = trainer.global_step
        self._loss, self._loss_parts = None, 0
        self._automatic = bool(getattr(pl_module, "automatic_optimization", True))
        self._unmute_checkpoints()  # a trainer reused after a fit that tripped and then raised
        self._owner.telemetry._outcome.forget_exception()  # ... or that raised: this fit may finish
        # Goodput across restarts: the run's highest step next to its checkpoints, and the steps
        # an earlier attempt did past the checkpoint this fit resumed from (if any) are lost.
        # Only where checkpoints are saved (a fit without them cannot resume; no file in its cwd).
        checkpoint = getattr(trainer, "checkpoint_callback", None)
        directory = getattr(checkpoint, "dirpath", None) if checkpoint is not None else None
        if directory:
            start_progress(
                training,
                directory,
                int(trainer.global_step),
                run_id=self._owner.telemetry.run_id,
                write=int(getattr(trainer, "local_rank", 0) or 0) == 0,
            )
        self._clock = StepClock()
        self._clock.idle()

    @safe
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._marks.leave_all()
        self._unwrap()
        # The fit ends with this exception. Lightning turns a KeyboardInterrupt (noted as SIGINT) into
        # exit status 1, and a SIGTERM its signal connector took into an exception of its own: the
        # shutdown at exit then reports `terminated`, not `finished` or a failure.
        self._owner.telemetry._outcome.note_exception(exception)

    @safe
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.idle()  # the epoch's iterator is created and its first batch fetched next

    @safe
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._clock.batch_started()
        self._tokens += self._count_tokens(batch)
        self._samples += self._count_samples(batch)

    @safe
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if not self._grad_norm:
            return
        norms = [
            p.grad.detach().norm(2) for p in pl_module.parameters() if p.requires_grad and p.grad is not None
        ]
        if norms:
            total = torch.linalg.vector_norm(torch.stack(norms), 2)
            self._owner.training.record_values(grad_norm=total)

    @safe
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        try:
            self._batch_end(trainer, outputs)
        finally:
            self._clock.idle()  # from here to the next on_train_batch_start: fetching the next batch

    def _batch_end(self, trainer: pl.Trainer, outputs: Any) -> None:
        training = self._owner.training
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss  # on the device, not read
            self._loss_parts += 1
        elif loss is not None:
            training.record_values(loss=loss)  # not a one-element tensor: TrainingMetrics judges it
        if trainer.global_step == self._last_global_step:
            return  # a micro-batch under gradient accumulation: no optimizer step yet
        self._last_global_step = trainer.global_step
        step_time, data_time = self._clock.step_ended()
        # The step's loss: the mean of its micro-batches' losses, one value per optimizer step (so
        # the guard and the window count steps, as with Hugging Face). Under automatic
        # optimization each came divided by accumulate_grad_batches, read now: a
        # GradientAccumulationScheduler changes it at epoch starts. An epoch's last step may have
        # had fewer micro-batches than that.
        normalize = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1) if self._automatic else 1
        step_loss, self._loss = self._loss, None
        if step_loss is not None and normalize != self._loss_parts:
            step_loss = step_loss * (normalize / self._loss_parts)
        self._loss_parts = 0
        learning_rate = None
        if trainer.optimizers:
            learning_rate = trainer.optimizers[0].param_groups[0].get("lr")
        training.record_step(
            loss=step_loss,
            learning_rate=learning_rate if isinstance(learning_rate, float) else None,
            tokens=self._tokens,
            samples=self._samples,
            step_time_s=step_time,
            data_time_s=data_time,
        )
        tokens, samples = self._tokens, self._samples
        self._tokens = self._samples = 0
        if self._guard is not None:
            tripped = self._guard.tripped
            if trainer.world_size > 1:
                # Every rank is at the same global step: the collective lines up. Between
                # agreements no rank stops alone (the others would wait for it forever).
                tripped = (
                    trainer.global_step % GUARD_SYNC_EVERY == 0
                    and trainer.strategy.reduce_boolean_decision(tripped, all=False)
                )
            if tripped:
                trainer.should_stop = True
                self._mute_checkpoints(trainer)
        self._flops.step(training, tokens, samples)

    def _mute_checkpoints(self, trainer: pl.Trainer) -> None:
        """Keep the trainer's checkpoint callbacks from saving for the rest of this fit.

        Stopping still runs the epoch-end, validation-end and train-end hooks, where a
        `ModelCheckpoint` would save the diverged weights and its rotation (``save_top_k``)
        delete the last good checkpoint. Their saving hooks become no-ops on the instance
        (the public hook names; ``on_fit_end``, or the next fit's start after a fit that raised,
        puts them back), so ``best_model_path`` still
        names the last good one. Every rank reaches this at the same step (the agreed trip), so
        the collectives inside a save are skipped on all of them alike.
        """
        muted = []
        for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
            if callback in self._muted:
                continue  # already: Lightning ignores should_stop before min_steps, the trip repeats
            for hook in _CHECKPOINT_SAVING_HOOKS:
                setattr(callback, hook, _skip_save)
            self._muted.append(callback)
            muted.append(callback)
        if muted:
            _logger.warning(
                "openlora-otel: the divergence guard tripped; %s will not save for the rest of this fit, so "
                "the diverged weights do not replace the last good checkpoint",
                ", ".join(sorted({type(callback).__name__ for callback in muted})),
            )

    def _unmute_checkpoints(self) -> None:
        for callback in self._muted:
            for hook in _CHECKPOINT_SAVING_HOOKS:
                callback.__dict__.pop(hook, None)
        self._muted = []

    @safe
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unmute_checkpoints()
        self._unwrap()

    @safe
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._owner.training.record_epoch(trainer.current_epoch + 1)

    @safe
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.pause()
        if trainer.state.fn == "fit":  # not trainer.validate(): no fit, no Telemetry to set up for it
            self._marks.enter(self._owner.training, "evaluation")

    @safe
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.resume()  # validation is neither the step nor waiting for its data
        self._marks.leave("evaluation")
        if trainer.sanity_checking:
            return
        metrics: dict[str, float] = {}
        loss = None
        for key, value in trainer.callback_metrics.items():
            if not (key.startswith("val") or key.startswith("eval")):
                continue
            number = float(value)  # validation end, not the step path: reading is fine here
            name = key.split("_", 1)[1] if "_" in key else key
            if name == "loss":
                loss = number
            else:
                metrics[name] = number
        self._owner.training.record_eval(loss=loss, **metrics)

    @safe
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._marks.leave_all()
        self._owner.finish()

    def _count_tokens(self, batch: Any) -> int:
        if self._tokens_fn is not None:
            return int(self._tokens_fn(batch))
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0

    def _count_samples(self, batch: Any) -> int:
        if self._samples_fn is not None:
            return int(self._samples_fn(batch))
        first = batch.get("input_ids") if isinstance(batch, dict) else batch
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 0


# The Checkpoint hooks that save (ModelCheckpoint: every n steps, at epoch and validation end,
# the last one at train end, and on an exception).
_CHECKPOINT_SAVING_HOOKS = (
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_end",
    "on_train_end",
    "on_exception",
)


def _skip_save(*args: Any, **kwargs: Any) -> None:
    """A checkpoint callback's saving hook after a divergence guard trip: nothing is saved."""


def trainer_hyperparameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, object]:
    """The run's settings under the keys ``openlora.run.info`` uses, then the module's own
    ``save_hyperparameters()`` values (plain values only; never overriding a value the trainer gave)."""
    learning_rate = None
    optimizers = getattr(trainer, "optimizers", None) or []
    if optimizers and getattr(optimizers[0], "param_groups", None):
        learning_rate = optimizers[0].param_groups[0].get("lr")
    max_steps = getattr(trainer, "max_steps", -1)
    values: dict[str, object] = {
        "learning_rate": learning_rate if isinstance(learning_rate, (int, float)) else None,
        "optimizer": type(optimizers[0]).__name__ if optimizers else None,
        "gradient_accumulation_steps": getattr(trainer, "accumulate_grad_batches", None),
        "max_steps": max_steps if isinstance(max_steps, int) and max_steps > 0 else None,
        "epochs": getattr(trainer, "max_epochs", None)
        if not (isinstance(max_steps, int) and max_steps > 0)
        else None,
        "precision": str(getattr(trainer, "precision", "")) or None,
        "world_size": getattr(trainer, "world_size", None),
        "seed": os.environ.get("PL_GLOBAL_SEED") or None,  # what seed_everything() set
    }
    hparams = getattr(pl_module, "hparams", None) or {}
    for key, value in dict(hparams).items():
        # A key the trainer left empty (no seed_everything(), no max_epochs) takes the module's value.
        if isinstance(value, (bool, int, float, str, list, tuple)) and values.get(key) is None:
            values[key] = value
    return values


def _compute_dtype(precision: str) -> Any:
    """The matmuls' dtype under a Lightning precision setting ("bf16-mixed", "16-true", ...); None: the model's."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None

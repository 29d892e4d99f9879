"""The demo's two ways to train, the steps after the first evaluation: its own loop (:func:`train_loop`,
with DDP under torchrun, checkpoints, and the faults its flags inject: ``--nan-at-step`` and
``--straggle-rank`` here, ``--data-delay-ms`` in :class:`~openlora_otel.demo.llama.Data`) and the Hugging
Face Trainer (:func:`train_hf`, ``--hf-trainer``), with what both use: the stop flag that SIGINT,
SIGTERM, the caller's event or the divergence guard sets, and the progress line.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from openlora_otel.demo.checkpoint import CHECKPOINT_FILE, CheckpointError, first_line, save_checkpoint
from openlora_otel.demo.ddp import StepSync, TrainingGroup
from openlora_otel.demo.llama import Data, evaluate, perplexity
from openlora_otel.demo.options import STOP_AT_STEP, DemoOptions, DemoResult
from openlora_otel.model.device import Placement
from openlora_otel.telemetry import Telemetry
from openlora_otel.training.guard import DivergenceGuard

__all__ = ["ProgressLine", "Stop", "stop_on_signals", "train_hf", "train_loop"]


class Stop:
    """Set by SIGINT/SIGTERM (or the caller's event); the loop checks it once per step."""

    def __init__(self, event: threading.Event | None = None) -> None:
        self._signal: str | None = None
        self._agreed: str | None = None
        self._diverged = False
        self.event = event or threading.Event()

    def diverge(self) -> None:
        """The divergence guard tripped on this rank."""
        self._diverged = True

    def __call__(self, signum: int, frame: Any) -> None:
        self._signal = signal.Signals(signum).name
        self.event.set()

    def adopt(self, reason: str) -> None:
        """The reason all ranks agreed to stop for (it may have come from another rank)."""
        self._agreed = reason

    @property
    def signal(self) -> str | None:
        """ "SIGINT" / "SIGTERM", "requested" when the caller's event was set, else None."""
        if self._agreed:
            return self._agreed
        if self._signal:
            return self._signal
        if self._diverged:
            return "diverged"
        return "requested" if self.event.is_set() else None


@contextmanager
def stop_on_signals(stop: Stop) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ProgressLine:
    """One updating line on a terminal, a line every ~10% otherwise; nothing when quiet."""

    def __init__(self, total: int, where: str, out: TextIO, quiet: bool) -> None:
        self.total = total
        self.where = where
        self.out = out
        self.quiet = quiet
        self.tty = out.isatty()
        self.last = 0.0
        self.last_step = 0
        self.every = max(1, total // 10)

    def update(self, step: int, loss: Callable[[], float], tokens_per_s: float, force: bool = False) -> None:
        if self.quiet or step == self.last_step:
            return
        now = time.monotonic()
        if self.tty:
            if not force and now - self.last < 0.2:
                return
            width = 24
            filled = int(width * step / self.total)
            bar = "=" * filled + ">" * (filled < width) + " " * (width - filled - 1)
            line = f"\rstep {step}/{self.total} [{bar}] loss {loss():.3f} | {tokens_per_s:,.0f} tok/s | metrics {self.where}"
            self.out.write(line.ljust(110))
            self.out.flush()
        elif force or step % self.every == 0:
            self.out.write(f"step {step}/{self.total} loss {loss():.3f} | {tokens_per_s:,.0f} tok/s\n")
            self.out.flush()
        else:
            return
        self.last = now
        self.last_step = step

    def close(self) -> None:
        if self.tty and not self.quiet:
            self.out.write("\n")
            self.out.flush()


def train_loop(
    options: DemoOptions,
    training: Any,
    model: Any,
    data: Data,
    stop: Stop,
    where: str,
    out: TextIO,
    group: TrainingGroup | None = None,
    guard: DivergenceGuard | None = None,
    placement: Placement | None = None,
    resume_state: dict[str, Any] | None = None,
) -> DemoResult:
    torch = data.torch
    placement = placement or Placement(torch.device("cpu"))
    sync = StepSync()
    # Training goes through DDP under torchrun; evaluation uses the bare model, per rank.
    network = group.wrap(model, sync) if group is not None else model
    straggle_s = (
        options.straggle_ms / 1000.0 if group is not None and group.rank == options.straggle_rank else 0.0
    )
    hangs = options.hang_at_step is not None and (group.rank if group is not None else 0) == (options.hang_rank or 0)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=options.lr, weight_decay=0.0)
    warmup = max(1, options.steps // 10)

    def schedule(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, options.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    start = 0
    if resume_state is not None:
        with training.phase("checkpoint_load"):
            try:
                optimizer.load_state_dict(resume_state["optimizer"])
                scheduler.load_state_dict(resume_state["scheduler"])
                data.generator.set_state(resume_state["generator"])
            except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
                raise CheckpointError(
                    f"{Path(options.checkpoint_dir or '.') / CHECKPOINT_FILE} does not fit this run "
                    f"(another --lora-r?): {first_line(exc)}"
                ) from None
            start = int(resume_state["step"])
    progress = ProgressLine(options.steps, where, out, options.quiet)
    tokens_per_step = options.batch_size * options.seq_len
    started = time.perf_counter()
    best_eval = last_eval = math.inf  # inf: no evaluation after the first
    last_loss = None
    loss = None
    step = start
    model.train()
    for step in range(start + 1, options.steps + 1):
        if group is None and stop.signal:
            step -= 1
            break
        if hangs and step == options.hang_at_step:
            # --hang-at-step: stuck before its batch, as a rank whose data loader deadlocked; its telemetry
            # goes on. Under DDP the other ranks wait for it in this step's all-reduce. Only a signal (or
            # the caller's event) ends it: this rank then leaves as a stopped run; its peers' collective fails.
            stop.event.wait()
            step -= 1
            break
        # Under DDP this rank's reason to stop goes out with this step's gradients (see ddp.py).
        sync.start(offer=stop.signal)
        fetch_started = time.perf_counter()
        batch = data.batch(options.batch_size)
        data_time = time.perf_counter() - fetch_started
        if straggle_s:
            time.sleep(straggle_s)  # --straggle-rank: this rank's work is slower, inside its timed step
        with placement.autocast(torch):
            loss = network(input_ids=batch, labels=batch).loss
        if options.nan_at_step is not None and step >= options.nan_at_step:
            loss = loss * math.nan  # --nan-at-step: the gradients and then the weights go NaN too
        loss.backward()
        # Under DDP, backward() ends with the wait for the other ranks' gradients: not this rank's work.
        waited = sync.waited_since_grads_ready(time.perf_counter())
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Tensors go in as they are: the telemetry reads them at collection, not here.
        training.record_step(
            loss=loss.detach(),
            grad_norm=grad_norm,
            learning_rate=learning_rate,
            tokens=tokens_per_step,
            samples=options.batch_size,
            step_time_s=time.perf_counter() - sync.started - waited,
            data_time_s=data_time,
        )
        if guard is not None and guard.tripped:
            stop.diverge()  # this rank stops next step; under DDP all ranks stop with it
        training.record_epoch(step * options.batch_size / data.windows_per_epoch)
        elapsed = time.perf_counter() - started
        detached = loss.detach()
        progress.update(
            step, lambda detached=detached: float(detached), (step - start) * tokens_per_step / elapsed
        )
        if sync.agreed:  # some rank wants to stop: every rank learned it in this step's all-reduce
            stop.adopt(sync.agreed)
            break
        if options.eval_every and step % options.eval_every == 0 and step < options.steps:
            eval_loss = last_eval = evaluate(model, data, placement, training)
            training.record_eval(loss=eval_loss, perplexity=perplexity(eval_loss))
            if eval_loss < best_eval:  # a NaN is never the best
                best_eval = eval_loss
        if options.checkpoint_dir and options.checkpoint_every and step % options.checkpoint_every == 0:
            save_checkpoint(options, step, model, optimizer, scheduler, data, training)
        if options.stop_at_step is not None and step >= options.stop_at_step and step < options.steps:
            stop.adopt(STOP_AT_STEP)  # as if the run had been killed here: nothing more happens
            break
    elapsed = time.perf_counter() - started
    if loss is not None:
        last_loss = float(loss.detach())
        progress.update(
            step, lambda: last_loss, (step - start) * tokens_per_step / max(elapsed, 1e-9), force=True
        )
    progress.close()
    return DemoResult(
        steps=step,
        seconds=elapsed,
        first_eval_loss=math.nan,
        final_eval_loss=last_eval,
        best_eval_loss=best_eval,
        last_train_loss=last_loss,
        tokens_per_s=(step - start) * tokens_per_step / max(elapsed, 1e-9),
        interrupted=None,
    )


def train_hf(
    options: DemoOptions,
    telemetry: Telemetry,
    model: Any,
    data: Data,
    stop: Stop,
    where: str,
    out: TextIO,
    guard: DivergenceGuard | None = None,
    placement: Placement | None = None,
) -> DemoResult:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from openlora_otel.integrations.hf import TelemetryCallback

    torch = data.torch
    placement = placement or Placement(torch.device("cpu"))

    class Windows(torch.utils.data.Dataset):
        def __init__(self, count: int) -> None:
            self.rows = data.batch(count).cpu()  # the Trainer moves (and pins) its batches itself

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int) -> dict[str, Any]:
            row = self.rows[index]
            return {"input_ids": row, "labels": row}

    class StopOnSignal(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if guard is not None and guard.tripped:
                stop.diverge()
            if stop.signal:
                control.should_training_stop = True
            return control

    class Progress(TrainerCallback):
        def __init__(self) -> None:
            self.bar = ProgressLine(options.steps, where, out, options.quiet)
            self.loss: float | None = None
            self.started = time.perf_counter()

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
        ) -> None:
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])
            if self.loss is not None:
                rate = (
                    state.global_step
                    * options.batch_size
                    * options.seq_len
                    / (time.perf_counter() - self.started)
                )
                self.bar.update(state.global_step, lambda: self.loss, rate)

    eval_rows = data.eval_batch.cpu()
    eval_set = [{"input_ids": row, "labels": row} for row in eval_rows]
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="openlora-demo-") as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=options.steps,
            per_device_train_batch_size=options.batch_size,
            per_device_eval_batch_size=64,
            learning_rate=options.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, options.steps // 10),
            max_grad_norm=1.0,
            logging_steps=1,
            eval_strategy="steps" if options.eval_every else "no",
            eval_steps=options.eval_every or None,
            save_strategy="no",
            report_to="none",
            use_cpu=not placement.is_cuda,
            bf16=placement.autocast_dtype is not None,
            disable_tqdm=True,
            include_num_input_tokens_seen=True,
            seed=options.seed,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Windows(options.steps * options.batch_size),
            eval_dataset=eval_set,
            callbacks=[TelemetryCallback(telemetry), StopOnSignal(), progress],
        )
        # Our progress line replaces the Trainer's own printing of every log.
        trainer.remove_callback(PrinterCallback)
        started = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - started
    progress.bar.close()
    evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    best = min((e for e in evals if math.isfinite(e)), default=math.inf)
    steps = trainer.state.global_step
    return DemoResult(
        steps=steps,
        seconds=elapsed,
        first_eval_loss=math.nan,
        final_eval_loss=evals[-1] if evals else math.inf,
        best_eval_loss=best,
        last_train_loss=progress.loss,
        tokens_per_s=steps * options.batch_size * options.seq_len / max(elapsed, 1e-9),
        interrupted=None,
    )

"""The demo's fine-tune: a small Llama built from a config, LoRA through PEFT, with live telemetry.

:func:`run_demo` runs it (setup, the first and final evaluation, ``--save``, ``--linger``) on the
``--device`` chosen; its parts are :mod:`.options`, :mod:`.llama`, :mod:`.loops` and
:mod:`.checkpoint`. No plain-torch LoRA fallback: the demo shows the callbacks on PEFT, what users
fine-tune with, and without it stops naming the extra to install. See docs/getting-started/demo.md.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from openlora_otel.demo.checkpoint import load_checkpoint
from openlora_otel.demo.ddp import TrainingGroup
from openlora_otel.demo.llama import Data, build_model, evaluate, perplexity, require_libraries
from openlora_otel.demo.loops import Stop, stop_on_signals, train_hf, train_loop
from openlora_otel.demo.options import BASE_MODEL, DemoOptions, DemoResult
from openlora_otel.model.device import Placement, resolve_device
from openlora_otel.telemetry import Telemetry
from openlora_otel.training.flops import report_model_flops
from openlora_otel.training.guard import DivergenceGuard

__all__ = ["run_demo"]

# The demo's guard: this many non-finite losses in a row stop the run, checked this often.
GUARD_NONFINITE_LOSSES = 3
GUARD_CHECK_INTERVAL_S = 0.5


def run_demo(
    options: DemoOptions,
    telemetry: Telemetry,
    *,
    where: str,
    out: TextIO | None = None,
    stop_event: threading.Event | None = None,
) -> DemoResult:
    """Fine-tune and report through ``telemetry``; returns the summary. The progress goes to ``out``
    (default: ``sys.stderr`` as it is at the call, not at import).

    Stops at the next step on SIGINT/SIGTERM (when run on the main thread) or
    when ``stop_event`` is set; never raises for either. With
    ``options.distributed`` it joins torchrun's process group (gloo) and trains
    data-parallel; all ranks then stop at the same step (see ``demo/ddp.py``).
    """
    torch, _, _ = require_libraries()
    from openlora_otel.integrations.common import describe_lora

    if options.hf_trainer and options.distributed:
        raise ValueError("the Hugging Face Trainer path runs one process; distributed runs use the plain loop")
    if options.distributed and options.device not in ("auto", "cpu"):
        raise ValueError(f"device {options.device!r}: under torchrun the demo trains on CPU (gloo)")
    placement = resolve_device("cpu" if options.distributed else options.device, torch)
    if options.hf_trainer and placement.is_cuda and placement.device.index not in (None, 0):
        raise ValueError(
            f"device {placement.name}: the Hugging Face Trainer picks cuda:0 itself; "
            f"run with CUDA_VISIBLE_DEVICES={placement.device.index} --device cuda instead"
        )
    out = sys.stderr if out is None else out
    stop = Stop(stop_event)
    group = None
    # From the first moment: a signal while the model is built or first evaluated stops the run
    # before its first step (it used to raise KeyboardInterrupt there, with no final export).
    with stop_on_signals(stop):
        try:
            group = TrainingGroup(torch) if options.distributed else None
            return _run(options, telemetry, torch, describe_lora, group, where, out, stop, placement)
        finally:
            if group is not None:
                group.close()


def _run(
    options: DemoOptions,
    telemetry: Telemetry,
    torch: Any,
    describe_lora: Callable[[Any, Any], None],
    group: TrainingGroup | None,
    where: str,
    out: TextIO,
    stop: Stop,
    placement: Placement,
) -> DemoResult:
    # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(options.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rank = group.rank if group else 0
    data = Data(options, rank=rank, device=placement.device)
    saving = _Saving(options, rank)
    model = build_model(options, data.vocab_size, base_path=saving.base_path, on_base=saving.on_base)
    model.to(placement.device)
    training = telemetry.training
    describe_lora(model, training)
    # FLOPs per token for achieved FLOP/s (and MFU where a peak is known: on a GPU of the peak
    # table, at the autocast dtype; not on a CPU unless OPENLORA_PEAK_FLOPS gives one).
    report_model_flops(training, model, seq_len=options.seq_len, dtype=placement.autocast_dtype)
    guard = training.attach_guard(
        DivergenceGuard(nonfinite_losses=GUARD_NONFINITE_LOSSES, check_interval_s=GUARD_CHECK_INTERVAL_S)
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if not options.quiet:
        out.write(
            f"openlora-otel demo: LoRA r={options.lora_r} alpha={options.lora_alpha} on a 4-layer Llama "
            f"({total:,} parameters, {trainable:,} trainable), {len(data.train):,} training characters, "
            f"{options.steps} steps of {options.batch_size}x{options.seq_len} tokens"
            + (f" on each of {group.world_size} ranks (DDP, gloo)" if group else "")
            + f", on {placement.name} ({placement.precision})"
            + "\n"
        )
        out.flush()
    resume_state = load_checkpoint(options, model, training, torch) if options.resume else None
    if options.checkpoint_dir:
        from openlora_otel.integrations.common import start_progress

        # The run's highest step next to its checkpoints; resumed, the steps the earlier attempt did
        # after the checkpoint (the progress file says how far it got) count as lost_progress.
        start_progress(
            training,
            options.checkpoint_dir,
            int(resume_state["step"]) if resume_state else 0,
            run_id=telemetry.run_id,
        )
    first_eval = evaluate(model, data, placement, training)
    training.record_eval(loss=first_eval, perplexity=perplexity(first_eval))
    if options.hf_trainer:
        result = train_hf(options, telemetry, model, data, stop, where, out, guard, placement)
    else:
        result = train_loop(
            options, training, model, data, stop, where, out, group, guard, placement, resume_state
        )
    if group is not None:
        group.close()  # no collective after the loop: evaluation and lingering are per rank
    result.first_eval_loss = first_eval
    if result.steps and not stop.signal:
        final = evaluate(model, data, placement, training)
        training.record_eval(loss=final, perplexity=perplexity(final))
        result.final_eval_loss = final
        if final < result.best_eval_loss:  # a NaN is never the best
            result.best_eval_loss = final
    result.interrupted = stop.signal
    if result.steps and not stop.signal:  # an adapter from a run stopped early is not saved
        result.saved = saving.save_adapter(model, result, telemetry.run_id, telemetry.run_name)
    if stop.signal == "diverged":
        result.stop_detail = guard.trip.detail if guard.trip is not None else "another rank's guard tripped"
    if options.linger > 0 and not stop.signal:
        if not options.quiet:
            out.write(f"keeping the final values for {options.linger:g} s: metrics {where} (Ctrl-C to stop)\n")
            out.flush()
        with stop_on_signals(stop):
            stop.event.wait(options.linger)
        result.interrupted = stop.signal
    if stop.signal in ("SIGINT", "SIGTERM"):
        # The demo handles these itself, so the telemetry's own SIGTERM handler stood aside: the run's
        # outcome says terminated, with its signal, as it would have without the demo's handler.
        telemetry._outcome.note_signal(signal.Signals[stop.signal])
    return result


class _Saving:
    """``--save DIR``: the base the adapter is trained on, saved first when DIR has none yet."""

    def __init__(self, options: DemoOptions, rank: int) -> None:
        from openlora_otel.model.layout import BASE, SavedBase, read_base

        self.options = options
        self.rank = rank
        self.base: SavedBase | None = None
        # A base already in DIR is read and trained on; else the seed's base is drawn and saved.
        self.existing = (Path(options.save_dir) / BASE).exists() if options.save_dir else False
        if self.existing:
            self.base = read_base(options.save_dir)

    @property
    def base_path(self) -> str | None:
        return str(self.base.path) if self.existing and self.base else None

    def on_base(self, base: Any) -> None:
        """The fresh base, before LoRA: rank 0 saves it (every rank draws the same from the seed)."""
        if self.options.save_dir and self.rank == 0:
            from openlora_otel.model.corpus import ALPHABET
            from openlora_otel.model.layout import save_base

            self.base = save_base(
                self.options.save_dir,
                base,
                alphabet=ALPHABET,
                base_model=BASE_MODEL,
                context_length=self.options.seq_len,
            )

    def save_adapter(self, model: Any, result: DemoResult, run_id: str, run_name: str) -> str | None:
        if not self.options.save_dir or self.rank != 0 or self.base is None:
            return None
        from openlora_otel.model.layout import save_adapter

        options = self.options
        info = {
            "seed": options.seed,
            "steps": result.steps,
            "lora_r": options.lora_r,
            "lora_alpha": options.lora_alpha,
            "final_eval_loss": result.final_eval_loss,
            "run_id": run_id,
            "run_name": run_name,
        }
        return str(save_adapter(options.save_dir, options.saved_adapter_name, model, base=self.base, info=info))

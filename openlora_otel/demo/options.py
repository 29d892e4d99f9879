"""What a demo run is and what it gives back: :class:`DemoOptions` (the command line's choices, as
:func:`~openlora_otel.demo.train.run_demo` takes them), :class:`DemoResult` with its exit status, and the
demo's fixed choices (the base model's name, LoRA's dropout and target modules).

A module of its own so that the command, the training loops and the checkpoint code share these
without importing one another, and without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BASE_MODEL",
    "EXIT_CODES",
    "LORA_DROPOUT",
    "LORA_TARGET_MODULES",
    "STOP_AT_STEP",
    "DemoOptions",
    "DemoResult",
]

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "requested": 1, "diverged": 3}
# --stop-at-step: a run stopped on purpose (to try --resume); exit status 0.
STOP_AT_STEP = "--stop-at-step"


# The demo's fixed choices, named once for the model and for openlora.run.info.
BASE_MODEL = "tiny-llama"
LORA_DROPOUT = 0.0
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DemoOptions:
    steps: int = 800
    batch_size: int = 16
    lr: float = 3e-3
    lora_r: int = 8
    lora_alpha: int = 16
    seed: int = 0
    eval_every: int = 50
    seq_len: int = 64
    # auto, cpu, cuda or cuda:N (openlora_otel/model/device.py); distributed runs train on CPU.
    device: str = "auto"
    hf_trainer: bool = False
    quiet: bool = False
    linger: float = 0.0
    # Under torchrun (WORLD_SIZE > 1): data-parallel training through DDP, gloo on CPU.
    distributed: bool = False
    # This rank sleeps straggle_ms inside each of its steps (distributed only).
    straggle_rank: int | None = None
    straggle_ms: float = 0.0
    # At this step this rank (hang_rank, 0 by default) blocks before its batch until the run is stopped.
    hang_rank: int | None = None
    hang_at_step: int | None = None
    # From this step on the loss is made NaN (the guard then stops the run).
    nan_at_step: int | None = None
    # Each batch takes this much longer to arrive (an input-bound run).
    data_delay_ms: float = 0.0
    # Save the base model (first run into the directory) and the trained adapter for `serve`
    # (layout: openlora_otel/model/layout.py); rank 0 saves, after a run that was not stopped early.
    save_dir: str | None = None
    adapter_name: str | None = None  # default: seed-<seed>
    # Checkpoints (the plain loop, one process): the adapter, optimizer, scheduler, data generator and
    # step, saved to checkpoint_dir/checkpoint.pt every checkpoint_every steps; resume loads it.
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    resume: bool = False
    # Stop after this step as if interrupted (no final evaluation, no --save): a run to resume.
    stop_at_step: int | None = None

    @property
    def saved_adapter_name(self) -> str:
        """The name the adapter is saved (and served) under."""
        return self.adapter_name or f"seed-{self.seed}"

    def hyperparameters(self, world_size: int = 1) -> dict[str, object]:
        """What this run is, for ``openlora.run.info``: the keys the callbacks use too."""
        return {
            "learning_rate": self.lr,
            "batch_size": self.batch_size,
            "max_steps": self.steps,
            "seed": self.seed,
            "lora_r": self.lora_r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": LORA_DROPOUT,
            "lora_target_modules": LORA_TARGET_MODULES,
            "base_model": BASE_MODEL,
            "world_size": world_size,
            "trainer": "hf" if self.hf_trainer else "loop",
        }


@dataclass
class DemoResult:
    steps: int
    seconds: float
    first_eval_loss: float
    final_eval_loss: float
    best_eval_loss: float
    last_train_loss: float | None
    tokens_per_s: float
    # "SIGINT" / "SIGTERM" / "requested" (stop_event) / "diverged" / "--stop-at-step" when stopped early
    interrupted: str | None
    stop_detail: str | None = None  # what the divergence guard saw, when it stopped the run
    saved: str | None = None  # the adapter's directory, when --save saved it

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.interrupted or "", 0)

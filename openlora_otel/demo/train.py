"""The demo's fine-tune: a small Llama built from a config, LoRA through PEFT, with live telemetry.

It runs where ``--device`` says (``auto``: the first CUDA device when there is one, else the
CPU; see ``openlora_otel/model/device.py``): the model, the corpus and every batch live there, and
on a CUDA device with bfloat16 the forward passes run under autocast. Under torchrun the
ranks train on CPU with gloo.

Why no plain-torch LoRA fallback: PEFT is what users fine-tune with, the demo
exists to show our callbacks and adapter pick-up working on the real thing,
and a second LoRA implementation would be code to maintain that no user runs.
Without PEFT the demo stops with the package and the extra to install.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from openlora_otel.demo.ddp import StepSync, TrainingGroup
from openlora_otel.model.corpus import CharTokenizer, generate_corpus
from openlora_otel.model.device import Placement, resolve_device
from openlora_otel.telemetry import Telemetry
from openlora_otel.training.flops import report_model_flops
from openlora_otel.training.guard import DivergenceGuard

__all__ = ["CheckpointError", "DemoOptions", "DemoResult", "read_checkpoint", "run_demo"]

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "requested": 1, "diverged": 3}
# --stop-at-step: a run stopped on purpose (to try --resume); exit status 0.
STOP_AT_STEP = "--stop-at-step"
# In --checkpoint-dir: the latest checkpoint, and the run id and attempt that wrote to the directory.
CHECKPOINT_FILE = "checkpoint.pt"
RUN_FILE = "run.json"
# The most read of each: run.json is a few dozen bytes; a checkpoint of the demo's model a few MB (a
# LoRA rank in the thousands makes it some hundreds).
MAX_RUN_FILE_BYTES = 64 * 1024
MAX_CHECKPOINT_BYTES = 4 * 2**30
# The demo's guard: this many non-finite losses in a row stop the run, checked this often.
GUARD_NONFINITE_LOSSES = 3
GUARD_CHECK_INTERVAL_S = 0.5


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


def require_libraries() -> tuple[Any, Any, Any]:
    from openlora_otel._deps import require

    for module in ("torch", "transformers", "peft"):
        require(module, "openlora-otel demo", extra="demo")
    import peft
    import torch
    import transformers

    return torch, transformers, peft


def build_model(
    options: DemoOptions,
    vocab_size: int,
    *,
    base_path: str | None = None,
    on_base: Callable[[Any], object] | None = None,
) -> Any:
    """A 4-layer Llama from a config (about 0.73 M parameters with the adapter), LoRA on every linear layer.

    With ``base_path`` the base weights are read from a saved base (``demo --save``) instead
    of drawn from the seed; otherwise ``on_base`` gets the fresh base before LoRA is added.
    """
    torch, transformers, peft = require_libraries()
    torch.manual_seed(options.seed)
    if base_path is not None:
        base = transformers.LlamaForCausalLM.from_pretrained(base_path, local_files_only=True)
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=options.seq_len,
            tie_word_embeddings=False,
        )
        base = transformers.LlamaForCausalLM(config)
        if on_base is not None:
            on_base(base)
    with warnings.catch_warnings():
        # transformers' own deprecation notice, raised inside PEFT: noise in the demo's output.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(base, _lora_config(peft, options))


def _lora_config(peft: Any, options: DemoOptions) -> Any:
    return peft.LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        lora_dropout=LORA_DROPOUT,
        target_modules=list(LORA_TARGET_MODULES),
        task_type="CAUSAL_LM",
    )


class Data:
    """The corpus on the training device; batches are windows of it, drawn there (no copy per step)."""

    def __init__(self, options: DemoOptions, rank: int = 0, device: Any = None) -> None:
        torch, _, _ = require_libraries()
        self.torch = torch
        tokenizer = CharTokenizer()
        self.vocab_size = tokenizer.vocab_size
        ids = torch.tensor(tokenizer.encode(generate_corpus(seed=1234)), dtype=torch.long, device=device)
        split = int(len(ids) * 0.95)
        self.train, self.eval = ids[:split], ids[split:]
        self.seq_len = options.seq_len
        self.delay_s = options.data_delay_ms / 1000.0
        # Each rank draws its own windows: its shard of the data in a data-parallel run. The
        # window starts come from a CPU generator on every device: the same seed draws the same batches.
        self.generator = torch.Generator().manual_seed(options.seed + rank)
        # A fixed evaluation set, so eval losses are comparable across the run.
        eval_starts = torch.arange(0, len(self.eval) - self.seq_len - 1, self.seq_len)[:64]
        self.eval_batch = torch.stack([self.eval[s : s + self.seq_len] for s in eval_starts.tolist()])

    @property
    def windows_per_epoch(self) -> int:
        return max(1, len(self.train) // self.seq_len)

    def batch(self, size: int) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)  # --data-delay-ms: a slow input pipeline
        starts = self.torch.randint(0, len(self.train) - self.seq_len - 1, (size,), generator=self.generator)
        return self.torch.stack([self.train[s : s + self.seq_len] for s in starts.tolist()])


def perplexity(loss: float) -> float:
    """exp(loss), inf past what a float holds (a diverged model's loss; math.exp would raise)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def evaluate(model: Any, data: Data, placement: Placement, training: Any = None) -> float:
    """The eval loss; with ``training``, its time counts as ``evaluation`` in ``openlora.training.time``."""
    from contextlib import nullcontext

    torch = data.torch
    with training.phase("evaluation") if training is not None else nullcontext():
        model.eval()
        with torch.no_grad(), placement.autocast(torch):
            loss = float(model(input_ids=data.eval_batch, labels=data.eval_batch).loss)
        model.train()
    return loss


class CheckpointError(ValueError):
    """A file of --checkpoint-dir (``run.json``, ``checkpoint.pt``) that cannot be used; ``str()`` says why in one line."""


def read_run_file(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``DIR/run.json``: the run id and the attempt that last trained into a checkpoint directory.

    None when there is none; :class:`CheckpointError` when it is there but not a regular file of at most
    :data:`MAX_RUN_FILE_BYTES` holding a JSON object.
    """
    import json

    from openlora_otel.files import read_regular_file

    path = Path(directory) / RUN_FILE
    try:
        data = json.loads(read_regular_file(path, max_bytes=MAX_RUN_FILE_BYTES))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(_os_problem(path, exc)) from None
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json follows
        reason = "nested too deeply" if isinstance(exc, RecursionError) else "not JSON"
        raise CheckpointError(f"{path} is {reason}; it should hold the run id and attempt") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not the run id and attempt")
    return data


def write_run_file(directory: str | os.PathLike[str], run_id: str, attempt: int) -> None:
    """Replace ``DIR/run.json`` atomically (nothing is left behind when that fails)."""
    import json

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{RUN_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"run_id": run_id, "attempt": attempt}))
        os.replace(tmp, path / RUN_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_checkpoint(directory: str | os.PathLike[str], torch: Any) -> dict[str, Any]:
    """``DIR/checkpoint.pt``, as :func:`save_checkpoint` writes it: a regular file of at most
    :data:`MAX_CHECKPOINT_BYTES`, loaded with ``weights_only`` (tensors and plain containers only, no
    code), holding the step, the adapter, optimizer and scheduler state and the data generator's.
    Anything else raises :class:`CheckpointError`."""
    import io

    from openlora_otel.files import read_regular_file

    path = Path(directory) / CHECKPOINT_FILE
    try:
        data = read_regular_file(path, max_bytes=MAX_CHECKPOINT_BYTES)
    except OSError as exc:
        raise CheckpointError(_os_problem(path, exc)) from None
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr, lines of them
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # garbage, empty, cut short, or a pickle weights_only refuses (code in it)
        # weights_only's refusal is paragraphs about trusting the file around the line that says what
        # it refused ("Unsupported operand 0", "Trying to load unsupported GLOBAL posix.system ...").
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if not line.startswith(_TORCH_LOAD_BOILERPLATE)), "")
        raise CheckpointError(
            f"{path} is not a checkpoint torch reads with weights_only=True "
            f"({type(exc).__name__}{': ' if detail.strip() else ''}{first_line(detail, 120)})"
        ) from None
    problem = _checkpoint_state_problem(state, torch)
    if problem:
        raise CheckpointError(f"{path} is not a checkpoint of this demo: {problem}")
    return state


_TORCH_LOAD_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _checkpoint_state_problem(state: Any, torch: Any) -> str | None:
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    missing = [key for key in ("step", "adapter", "optimizer", "scheduler", "generator") if key not in state]
    if missing:
        return f"no {', '.join(missing)} in it"
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"its step is {step!r:.40}, not a step number"
    tensors = state["adapter"].values() if isinstance(state["adapter"], dict) else ()
    if not tensors or not all(isinstance(v, torch.Tensor) for v in tensors):
        return "its adapter is not a set of tensors"
    if not isinstance(state["optimizer"], dict) or not isinstance(state["scheduler"], dict):
        return "its optimizer or scheduler state is not a dict"
    if not isinstance(state["generator"], torch.Tensor):
        return "its data generator state is not a tensor"
    return None


def load_checkpoint(options: DemoOptions, model: Any, training: Any, torch: Any) -> dict[str, Any]:
    """--resume: the latest checkpoint's adapter into ``model``; the rest (optimizer, ...) is returned."""
    import peft

    with training.phase("checkpoint_load"):
        state = read_checkpoint(options.checkpoint_dir or ".", torch)
        try:
            peft.set_peft_model_state_dict(model, state["adapter"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:  # another --lora-r, another model
            raise CheckpointError(
                f"{Path(options.checkpoint_dir or '.') / CHECKPOINT_FILE} does not fit this model "
                f"(another --lora-r?): {first_line(exc)}"
            ) from None
    return state


def _os_problem(path: Path, exc: OSError) -> str:
    """One line for a file that could not be read: what NotARegularFile says, else the path and why."""
    return str(exc) if exc.filename is None else f"{path}: {exc.strerror or exc}"


def first_line(message: object, limit: int = 200) -> str:
    """The message's first line (and the next, when the first only introduces it), at most ``limit`` long."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()] or [""]
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def save_checkpoint(
    options: DemoOptions, step: int, model: Any, optimizer: Any, scheduler: Any, data: Data, training: Any
) -> None:
    """The adapter, optimizer, scheduler, data generator and step, replacing DIR/checkpoint.pt atomically."""
    import peft

    torch = data.torch
    with training.phase("checkpoint_save"):
        directory = Path(options.checkpoint_dir)
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "step": step,
            "adapter": {k: v.detach().cpu() for k, v in peft.get_peft_model_state_dict(model).items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "generator": data.generator.get_state(),
        }
        tmp = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
        try:
            torch.save(state, tmp)
            os.replace(tmp, directory / CHECKPOINT_FILE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def run_demo(
    options: DemoOptions,
    telemetry: Telemetry,
    *,
    where: str,
    out: TextIO = sys.stderr,
    stop_event: threading.Event | None = None,
) -> DemoResult:
    """Fine-tune and report through ``telemetry``; returns the summary.

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

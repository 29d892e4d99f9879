"""The files of ``--checkpoint-dir``: ``run.json`` (the run id and attempt that last trained into the
directory) and ``checkpoint.pt`` (step, adapter, optimizer, scheduler and data generator state): how the
demo's loop writes them, each replaced atomically, and how ``--resume`` reads them back, refusing
(:class:`CheckpointError`, one line) a file that is too large, not a regular file or not this demo's.

Apart from the loop because the command reads both files before any training starts, and what such
a file may hold (``weights_only``, sizes) is a question of its own.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from openlora_otel.demo.llama import Data
from openlora_otel.demo.options import DemoOptions

__all__ = [
    "CHECKPOINT_FILE",
    "MAX_CHECKPOINT_BYTES",
    "MAX_RUN_FILE_BYTES",
    "RUN_FILE",
    "CheckpointError",
    "first_line",
    "load_checkpoint",
    "read_checkpoint",
    "read_run_file",
    "save_checkpoint",
    "write_run_file",
]

# In --checkpoint-dir: the latest checkpoint, and the run id and attempt that wrote to the directory.
CHECKPOINT_FILE = "checkpoint.pt"
RUN_FILE = "run.json"
# The most read of each: run.json is a few dozen bytes; a checkpoint of the demo's model a few MB (a
# LoRA rank in the thousands makes it some hundreds).
MAX_RUN_FILE_BYTES = 64 * 1024
MAX_CHECKPOINT_BYTES = 4 * 2**30


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

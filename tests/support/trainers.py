"""Quiet trainers for the framework tests: Lightning's ``quiet_trainer`` and Hugging Face's ``hf_args``,
both on the CPU, without loggers, progress bars or other reporting, unless the options say otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def quiet_trainer(**options: Any) -> Any:
    """A CPU ``lightning.pytorch.Trainer`` without logger, checkpoints, progress bar or model summary."""
    import lightning.pytorch as pl

    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**quiet, **options})


def hf_args(output_dir: Path | str, **options: Any) -> Any:
    """``transformers.TrainingArguments`` on the CPU with no reporting integration and no progress bar."""
    from transformers import TrainingArguments

    quiet = {"report_to": "none", "use_cpu": True, "disable_tqdm": True}
    return TrainingArguments(output_dir=str(output_dir), **{**quiet, **options})

"""The demo's model and data: a 4-layer Llama built from a config with LoRA on every linear layer
(PEFT), the generated corpus as batches on the training device, and the evaluation loss.

The run, both training loops and the checkpoint code build on these. torch, transformers and peft are
imported when :func:`require_libraries` runs, never when this module is imported, so the command can
first say which extra to install.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

from openlora_otel.demo.options import LORA_DROPOUT, LORA_TARGET_MODULES, DemoOptions
from openlora_otel.model.corpus import CharTokenizer, generate_corpus
from openlora_otel.model.device import Placement

__all__ = ["Data", "build_model", "evaluate", "perplexity", "require_libraries"]


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

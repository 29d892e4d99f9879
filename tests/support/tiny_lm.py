"""A tiny causal language model and a learnable synthetic corpus, built locally (no downloads)."""

from __future__ import annotations

import torch

VOCAB = 64
SEQ = 16


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ * 2,
    )
    return LlamaForCausalLM(config)


def with_lora(model, r: int = 4, alpha: int = 8):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


class CountingCorpus(torch.utils.data.Dataset):
    """Sequences that count upward modulo the vocabulary from a random start: easy to learn."""

    def __init__(self, size: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (size,), generator=generator)
        self.rows = (starts[:, None] + torch.arange(SEQ)[None, :]) % VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.rows[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

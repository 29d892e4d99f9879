"""Model FLOPs per token against hand counts, and the GPU peak table (names, dtypes, the documented copy)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from openlora_otel.training.flops import (
    GPU_PEAKS,
    device_peak_flops,
    peak_flops,
    peak_table_markdown,
    training_flops_per_token,
)
from tests.support import docs_text
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
MFU_PAGE = "docs/reference/mfu.md"  # the page with the peak table


def _torch() -> Any:
    return pytest.importorskip("torch")


def _llama(**overrides: Any) -> Any:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    _torch().manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings))


# The tiny Llama above, counted by hand: per layer q (32x32), k and v (32x16 each: 2 key/value
# heads of 8), o (32x32), gate and up (32x48), down (48x32).
LLAMA_LAYER = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 32 * 48 + 48 * 32
LLAMA_HEAD = 40 * 32  # lm_head
LLAMA_MATMUL = 2 * LLAMA_LAYER + LLAMA_HEAD


def _llama_attention(seq_len: int, *, backward: bool = True) -> int:
    # Scores and values: 4 x seq_len x (4 heads x head_dim 8) per layer forward, twice that backward.
    forward = 4 * seq_len * 32
    return 2 * (forward + (2 * forward if backward else 0))


# --- the demo's model, counted by hand ----------------------------------------------------------

# openlora_otel/demo/llama.py build_model(): LlamaConfig(hidden_size=128, intermediate_size=256,
# num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False) on the
# demo's character vocabulary, LoRA r=8 on all seven projections; trained at seq_len 64.
DEMO_LAYERS = 4
DEMO_HIDDEN = 128
DEMO_FFN = 256
DEMO_VOCAB = 32
DEMO_HEADS = 4
DEMO_HEAD_DIM = DEMO_HIDDEN // DEMO_HEADS
DEMO_R = 8
DEMO_SEQ = 64
# (in, out) of each LoRA target in one decoder layer.
DEMO_TARGETS = {
    "q_proj": (DEMO_HIDDEN, DEMO_HIDDEN),
    "k_proj": (DEMO_HIDDEN, DEMO_HIDDEN),
    "v_proj": (DEMO_HIDDEN, DEMO_HIDDEN),
    "o_proj": (DEMO_HIDDEN, DEMO_HIDDEN),
    "gate_proj": (DEMO_HIDDEN, DEMO_FFN),
    "up_proj": (DEMO_HIDDEN, DEMO_FFN),
    "down_proj": (DEMO_FFN, DEMO_HIDDEN),
}
DEMO_FROZEN = DEMO_LAYERS * sum(i * o for i, o in DEMO_TARGETS.values()) + DEMO_HIDDEN * DEMO_VOCAB
DEMO_LORA = DEMO_LAYERS * sum(DEMO_R * (i + o) for i, o in DEMO_TARGETS.values())
DEMO_ATTENTION = 12 * DEMO_LAYERS * DEMO_SEQ * DEMO_HEADS * DEMO_HEAD_DIM
DEMO_PER_TOKEN = 4 * DEMO_FROZEN + 6 * DEMO_LORA + DEMO_ATTENTION


def test_the_hand_count_of_the_demo_model_in_numbers() -> None:
    # 4 x (4 x 128x128 + 2 x 128x256 + 256x128) + 128 x 32 for the untied head.
    assert DEMO_FROZEN == 4 * 163_840 + 4_096 == 659_456
    # 4 x 8 x (4 x 256 + 2 x 384 + 384)
    assert DEMO_LORA == 4 * 17_408 == 69_632
    assert DEMO_ATTENTION == 12 * 4 * 64 * 128 == 393_216
    assert DEMO_PER_TOKEN == 2_637_824 + 417_792 + 393_216 == 3_448_832


def test_demo_model_matches_the_hand_count() -> None:
    pytest.importorskip("peft")
    from openlora_otel.demo.llama import build_model
    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.model.corpus import CharTokenizer

    options = DemoOptions()
    vocab = CharTokenizer().vocab_size
    assert (vocab, options.lora_r, options.seq_len) == (DEMO_VOCAB, DEMO_R, DEMO_SEQ)
    model = build_model(options, vocab)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (4, 128, 256)
    assert (config.num_attention_heads, config.tie_word_embeddings) == (DEMO_HEADS, False)

    estimate = training_flops_per_token(model, seq_len=options.seq_len)

    assert estimate.frozen_matmul_params == DEMO_FROZEN
    assert estimate.trainable_matmul_params == DEMO_LORA
    assert estimate.attention_flops == DEMO_ATTENTION
    assert estimate.per_token == DEMO_PER_TOKEN
    assert (estimate.layers, estimate.attention_width, estimate.seq_len) == (4, 128, 64)
    assert estimate.embedding_params == DEMO_VOCAB * DEMO_HIDDEN
    assert estimate.uncounted_params == 0
    # Everything the walk did not count as a matmul or a lookup is a norm scale: 2 per layer and a final one.
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == DEMO_LORA
    norms = (2 * DEMO_LAYERS + 1) * DEMO_HIDDEN
    assert total == DEMO_FROZEN + DEMO_LORA + estimate.embedding_params + norms


def _measured_per_token(model: Any, vocab: int, seq_len: int, *, backward: bool = True) -> float:
    """Matmul FLOPs per token as torch's own FLOP counter sees one training step (eager attention)."""
    torch = _torch()
    from torch.utils.flop_counter import FlopCounterMode

    getattr(model, "get_base_model", lambda: model)().set_attn_implementation("eager")  # sdpa on CPU is not counted
    batch = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model(input_ids=batch, labels=batch).loss
        if backward:
            loss.backward()
    return counter.get_total_flops() / batch.numel()


def test_torchs_flop_counter_agrees_with_the_demo_count_up_to_the_documented_skip() -> None:
    pytest.importorskip("peft")
    from openlora_otel.demo.llama import build_model
    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.model.corpus import CharTokenizer

    model = build_model(DemoOptions(), CharTokenizer().vocab_size)
    # Layer 0's q/k/v read the embedding's output, which needs no gradient: autograd skips the input
    # gradient of those three base weights (128x128) and of their LoRA A (128 -> 8). The estimate
    # counts it, as docs/reference/mfu.md says.
    skipped = 2 * 3 * DEMO_HIDDEN * DEMO_HIDDEN + 2 * 3 * DEMO_HIDDEN * DEMO_R
    assert skipped == 104_448
    assert _measured_per_token(model, DEMO_VOCAB, DEMO_SEQ) == DEMO_PER_TOKEN - skipped


def test_torchs_flop_counter_agrees_exactly_on_a_full_fine_tune_and_a_forward_pass() -> None:
    model = _llama()
    assert _measured_per_token(model, 40, 16) == training_flops_per_token(model, seq_len=16).per_token
    model.requires_grad_(False)
    forward = _measured_per_token(model, 40, 16, backward=False)
    assert forward == training_flops_per_token(model, seq_len=16).per_token


def test_a_plain_linear_stack_counts_frozen_weights_at_4_and_trained_ones_at_6() -> None:
    torch = _torch()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)

    estimate = training_flops_per_token(model, seq_len=128)

    assert (estimate.frozen_matmul_params, estimate.trainable_matmul_params) == (8 * 16, 16 * 4)
    assert estimate.per_token == 4 * 128 + 6 * 64 == 896
    assert estimate.attention_flops == 0 and estimate.layers is None
    assert any("no Hugging Face config" in note for note in estimate.assumptions)


def test_a_fully_trained_model_costs_6n_plus_attention() -> None:
    model = _llama()

    estimate = training_flops_per_token(model, seq_len=16)

    assert estimate.frozen_matmul_params == 0
    assert estimate.trainable_matmul_params == LLAMA_MATMUL
    assert estimate.per_token == 6 * LLAMA_MATMUL + _llama_attention(16)
    # Grouped-query attention: the scores use the query heads (4 x 8), not the 2 key/value heads.
    assert estimate.attention_width == 32
    assert estimate.embedding_params == 40 * 32


def test_a_frozen_model_runs_forward_only() -> None:
    model = _llama()
    model.requires_grad_(False)

    estimate = training_flops_per_token(model, seq_len=16)

    assert estimate.backward is False
    assert estimate.frozen_matmul_params == LLAMA_MATMUL and estimate.trainable_matmul_params == 0
    assert estimate.per_token == 2 * LLAMA_MATMUL + _llama_attention(16, backward=False)
    assert any("forward only" in note for note in estimate.assumptions)


def test_a_tied_head_is_one_matmul_and_the_embedding_a_lookup() -> None:
    tied = training_flops_per_token(_llama(tie_word_embeddings=True), seq_len=16)
    untied = training_flops_per_token(_llama(tie_word_embeddings=False), seq_len=16)

    assert tied.trainable_matmul_params == untied.trainable_matmul_params == LLAMA_MATMUL
    assert tied.per_token == untied.per_token
    assert tied.embedding_params == 40 * 32


def test_without_seq_len_attention_is_left_out_and_said_so() -> None:
    estimate = training_flops_per_token(_llama())

    assert estimate.attention_flops == 0 and estimate.seq_len is None
    assert estimate.per_token == 6 * LLAMA_MATMUL
    assert any("no seq_len" in note for note in estimate.assumptions)


def _lora(model: Any, **extra: Any) -> Any:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
    return peft.get_peft_model(model, config)


# LoRA r=4 on q (32->32) and v (32->16) in both layers.
LLAMA_LORA = 2 * 4 * ((32 + 32) + (32 + 16))


def test_lora_counts_only_the_active_adapter() -> None:
    peft = pytest.importorskip("peft")
    model = _lora(_llama())
    one = training_flops_per_token(model, seq_len=16)
    assert one.trainable_matmul_params == LLAMA_LORA
    assert one.frozen_matmul_params == LLAMA_MATMUL
    assert one.per_token == 4 * LLAMA_MATMUL + 6 * LLAMA_LORA + _llama_attention(16)

    # A second adapter that is loaded but not active runs in no forward pass.
    model.add_adapter("other", peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    assert training_flops_per_token(model, seq_len=16) == one

    model.set_adapter("other")
    other = training_flops_per_token(model, seq_len=16)
    assert other.trainable_matmul_params == 2 * 16 * ((32 + 32) + (32 + 16))


def test_dora_counts_like_lora_and_says_what_it_leaves_out() -> None:
    estimate = training_flops_per_token(_lora(_llama(), use_dora=True), seq_len=16)

    assert estimate.trainable_matmul_params == LLAMA_LORA
    assert any("DoRA" in note for note in estimate.assumptions)


def test_disabled_or_merged_adapters_cost_nothing() -> None:
    model = _lora(_llama())
    with model.disable_adapter():
        disabled = training_flops_per_token(model, seq_len=16)
    assert disabled.trainable_matmul_params == 0
    assert disabled.frozen_matmul_params == LLAMA_MATMUL

    model.merge_adapter()
    merged = training_flops_per_token(model, seq_len=16)
    assert merged.trainable_matmul_params == 0 and merged.frozen_matmul_params == LLAMA_MATMUL


def test_modules_to_save_counts_the_trained_copy_instead_of_the_original() -> None:
    model = _lora(_llama(), modules_to_save=["lm_head"])

    estimate = training_flops_per_token(model, seq_len=16)

    assert estimate.trainable_matmul_params == LLAMA_LORA + LLAMA_HEAD
    assert estimate.frozen_matmul_params == LLAMA_MATMUL - LLAMA_HEAD


def test_lora_on_the_embedding_counts_its_b_as_a_matmul_and_its_a_as_a_lookup() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["embed_tokens"]))

    estimate = training_flops_per_token(model, seq_len=16)

    # lora_embedding_A (4 x 40) is indexed by token id; lora_embedding_B (32 x 4) multiplies its output.
    assert estimate.trainable_matmul_params == 32 * 4
    assert estimate.frozen_matmul_params == LLAMA_MATMUL
    assert estimate.embedding_params == 40 * 32 + 4 * 40


def test_quantized_linear_layers_count_by_shape_not_by_packed_storage() -> None:
    torch = _torch()

    class Packed4bit(torch.nn.Linear):
        """Like bitsandbytes' Linear4bit: two 4-bit weights per byte, stored flat."""

        def __init__(self, in_features: int, out_features: int) -> None:
            super().__init__(in_features, out_features, bias=False)
            packed = torch.zeros(in_features * out_features // 2, 1, dtype=torch.uint8)
            self.weight = torch.nn.Parameter(packed, requires_grad=False)

    model = torch.nn.Sequential(Packed4bit(64, 32), torch.nn.Linear(32, 8))

    estimate = training_flops_per_token(model)

    assert estimate.frozen_matmul_params == 64 * 32
    assert estimate.per_token == 4 * 64 * 32 + 6 * 32 * 8


def test_gpt2_conv1d_layers_and_config_names() -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    _torch().manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4))

    estimate = training_flops_per_token(model, seq_len=16)

    # c_attn 32->96, attn c_proj 32->32, c_fc 32->128, mlp c_proj 128->32; tied head 32->50.
    matmul = 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 32 * 50
    assert estimate.trainable_matmul_params == matmul
    assert estimate.per_token == 6 * matmul + 12 * 2 * 16 * 32
    assert estimate.embedding_params == 50 * 32 + 16 * 32  # token and position tables


def test_multihead_attention_projection_is_counted() -> None:
    torch = _torch()
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32)

    estimate = training_flops_per_token(layer)

    # in_proj (3 x 16x16, a parameter of the attention module), out_proj 16x16, two feed-forward layers.
    assert estimate.trainable_matmul_params == 3 * 256 + 256 + 2 * 16 * 32
    assert estimate.uncounted_params == 0


def test_unknown_weights_are_reported_not_guessed() -> None:
    torch = _torch()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8, 2))

    estimate = training_flops_per_token(model)

    assert estimate.uncounted_params == 8 * 3 * 3 * 3
    assert estimate.trainable_matmul_params == 16
    assert any("216 parameters" in note for note in estimate.assumptions)


def test_bad_arguments() -> None:
    torch = _torch()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        training_flops_per_token(object())
    with pytest.raises(ValueError, match="seq_len"):
        training_flops_per_token(model, seq_len=0)
    with pytest.raises(TypeError, match="seq_len"):
        training_flops_per_token(model, seq_len=64.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_len"):
        training_flops_per_token(model, seq_len=True)


@pytest.mark.process
def test_importing_the_module_does_not_import_torch() -> None:
    code = "import sys, openlora_otel, openlora_otel.training.flops; sys.exit('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# --- peak FLOP/s ---------------------------------------------------------------------------------


def test_every_listed_name_finds_its_own_row() -> None:
    for row in GPU_PEAKS:
        for name in row.names:
            for dtype, tflops in row.tflops.items():
                assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12), (name, dtype)


def test_form_factors_with_different_peaks_are_told_apart() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H100 SXM5 80GB", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops("NVIDIA H100 NVL", "bf16") == 835.5e12
    assert peak_flops("NVIDIA H200", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H200 NVL", "fp8") == 1670.5e12
    assert peak_flops("NVIDIA GH200 480GB", "fp8") == 1979e12
    assert peak_flops("Tesla V100-SXM2-32GB", "fp16") == 125e12
    assert peak_flops("Tesla V100-PCIE-16GB", "fp16") == 112e12
    assert peak_flops("Tesla V100S-PCIE-32GB", "fp16") == 130e12
    # A100: the datasheet gives SXM4 and PCIe the same peaks.
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == peak_flops("NVIDIA A100 80GB PCIe", "bf16") == 312e12


def test_names_are_matched_by_whole_words_and_loosely_spelled() -> None:
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("NVIDIA L40", "bf16") == 181.05e12
    assert peak_flops("NVIDIA L40S", "bf16") == 362.05e12
    assert peak_flops("NVIDIA A10", "bf16") == 125e12
    assert peak_flops("nvidia  a100-sxm4-80gb", "BF16") == 312e12
    assert peak_flops("NVIDIA A100-SXM-80GB", "bf16") == 312e12


def test_unknown_devices_slices_and_missing_dtypes_give_none() -> None:
    assert peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    assert peak_flops("AMD Instinct MI300X", "bf16") is None
    # No NVIDIA datasheet exists for the A10G and third parties disagree: no figure rather than a guess.
    assert peak_flops("NVIDIA A10G", "bf16") is None
    # A MIG slice has a fraction of the GPU's peak.
    assert peak_flops("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "bf16") is None
    # A board the table does not list (V100 FHHL) is not given another board's figure.
    assert peak_flops("Tesla V100-FHHL-16GB", "fp16") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 before Ampere
    assert peak_flops("Tesla T4", "tf32") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 before Ada/Hopper


def test_dtype_spellings() -> None:
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == peak_flops("NVIDIA H100 PCIe", "bf16")
    assert peak_flops("NVIDIA H100 PCIe", "float16") == peak_flops("NVIDIA H100 PCIe", "fp16")
    assert peak_flops("NVIDIA H100 PCIe", "float32") == 51e12
    assert peak_flops("NVIDIA H100 PCIe", "tf32") == 378e12
    assert peak_flops("NVIDIA H100 PCIe", "float8_e4m3fn") == 1513e12
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        peak_flops("NVIDIA H100 PCIe", "int8")


def test_device_peak_flops_is_none_off_cuda() -> None:
    torch = _torch()
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert device_peak_flops("cpu", torch.float32) is None
    assert device_peak_flops("meta", torch.bfloat16) is None


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch.cuda reports a GPU of the test's choosing; the matmul precision is restored afterwards."""
    torch = _torch()
    names: dict[int, str] = {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[torch.device(device).index or 0])
    precision = torch.backends.cuda.matmul.fp32_precision
    yield names
    torch.backends.cuda.matmul.fp32_precision = precision


def test_device_peak_flops_reads_the_cuda_device_name(fake_gpu: dict[int, str]) -> None:
    torch = _torch()
    fake_gpu[0] = "NVIDIA H100 PCIe"
    fake_gpu[1] = "NVIDIA H100 80GB HBM3"
    assert device_peak_flops(torch.device("cuda", 0), torch.bfloat16) == 756.5e12
    assert device_peak_flops("cuda:1", torch.bfloat16) == 989.5e12
    assert device_peak_flops("cuda:1", torch.float16) == 989.5e12
    assert device_peak_flops("cuda:1", torch.float8_e4m3fn) == 1979e12
    assert device_peak_flops("cuda:1", torch.float64) is None


def test_float32_follows_torchs_tf32_setting(fake_gpu: dict[int, str]) -> None:
    torch = _torch()
    fake_gpu[0] = "NVIDIA A100-SXM4-80GB"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert device_peak_flops("cuda:0", torch.float32) == 19.5e12
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert device_peak_flops("cuda:0", torch.float32) == 156e12
    # No TF32 before Ampere: float32 matmuls run at the FP32 rate whatever the setting.
    fake_gpu[0] = "Tesla V100-SXM2-32GB"
    assert device_peak_flops("cuda:0", torch.float32) == 15.7e12


def test_documented_peak_table_matches_the_module() -> None:
    assert peak_table_markdown() in docs_text.text(MFU_PAGE)

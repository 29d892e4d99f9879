"""Model FLOPs for MFU: training FLOPs per token from a model's weights (LoRA-aware), and GPU peak FLOP/s.

Matmuls only, per token, as MFU is usually defined: a frozen weight of N elements costs 4N (no weight
gradient), a trainable one 6N, plus attention's scores and values when the config and ``seq_len``
are known. No torch import at module level: the walk is duck-typed and :func:`device_peak_flops`
imports torch when called. See docs/reference/mfu.md, whose peak table is checked against this
one (:func:`peak_table_markdown`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "GPU_PEAKS",
    "FlopsEstimate",
    "GpuPeak",
    "device_peak_flops",
    "peak_flops",
    "peak_table_markdown",
    "report_model_flops",
    "training_flops_per_token",
]

_logger = logging.getLogger(__name__)

# FLOPs per weight element per token: forward, input (activation) gradient, weight gradient.
_FORWARD = 2
_INPUT_GRAD = 2
_WEIGHT_GRAD = 2


@dataclass(frozen=True)
class FlopsEstimate:
    """Training FLOPs per token and the parts they are made of (see the module docstring for the formula)."""

    per_token: int
    """Training FLOPs per token: forward and backward, LoRA-aware."""
    frozen_matmul_params: int
    """Weights of matrix multiplications that get no gradient (LoRA's frozen base, a frozen head)."""
    trainable_matmul_params: int
    """Weights of matrix multiplications that are trained (LoRA's A and B, or every layer in a full fine-tune)."""
    attention_flops: int
    """Per token, forward and backward, for attention scores and values; 0 when not counted."""
    backward: bool
    """False when no parameter requires a gradient: the count is then forward only."""
    embedding_params: int = 0
    """Embedding tables: lookups, no FLOPs (listed so the parameter total can be reconciled)."""
    uncounted_params: int = 0
    """Parameters in two- or more-dimensional tensors of modules the walk does not know (convolutions, ...)."""
    layers: int | None = None
    attention_width: int | None = None
    """Attention heads x head dimension, from the model's config."""
    seq_len: int | None = None
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def frozen_matmul_flops(self) -> int:
        """Per token: forward plus input gradient (4 per weight) when training, forward only (2) otherwise."""
        per_weight = _FORWARD + (_INPUT_GRAD if self.backward else 0)
        return per_weight * self.frozen_matmul_params

    @property
    def trainable_matmul_flops(self) -> int:
        """Per token: forward, input gradient and weight gradient (6 per weight)."""
        return (_FORWARD + _INPUT_GRAD + _WEIGHT_GRAD) * self.trainable_matmul_params


# --- the model walk --------------------------------------------------------------------------


def training_flops_per_token(model: Any, *, seq_len: int | None = None) -> FlopsEstimate:
    """Training FLOPs per token of ``model`` (a torch ``nn.Module``, PEFT-wrapped or not).

    ``seq_len`` is the training sequence length; with it and a Hugging Face
    config on the model, attention's score and value matmuls are counted.
    Raises ``TypeError`` for something that is not a module and ``ValueError``
    for a ``seq_len`` below 1.
    """
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int):
            raise TypeError(f"seq_len must be an int or None, got {type(seq_len).__name__}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    named_modules = getattr(model, "named_modules", None)
    if not callable(named_modules):
        raise TypeError(f"expected a torch nn.Module, got {type(model).__name__}")
    walk = _Walk()
    walk.run([module for _, module in named_modules()])
    notes = list(walk.notes)

    layers = width = None
    attention = 0
    config = _text_config(model)
    if config is None:
        notes.append("no Hugging Face config on the model: attention score/value matmuls not counted")
    elif bool(getattr(config, "is_encoder_decoder", False)):
        notes.append("encoder-decoder model: attention score/value matmuls not counted")
    else:
        layers, width = _attention_shape(config)
        if layers is None or width is None:
            notes.append("the config gives no layers/heads/hidden size: attention score/value matmuls not counted")
        elif seq_len is None:
            notes.append("no seq_len given: attention score/value matmuls not counted")
        else:
            per_layer_forward = 4 * seq_len * width  # Q K^T and A V: 2 FLOPs per multiply-add each
            backward = 2 * per_layer_forward if walk.backward else 0  # both operands' gradients
            attention = layers * (per_layer_forward + backward)
            notes.append(
                "attention counts the full seq_len x seq_len scores (causal kernels skip about half)"
            )
            window = getattr(config, "sliding_window", None)
            if isinstance(window, int) and not isinstance(window, bool) and 0 < window < seq_len:
                notes.append(
                    f"the config has a sliding window of {window} < seq_len: layers using it do less "
                    "attention work than counted"
                )
        experts = getattr(config, "num_experts_per_tok", None)
        if isinstance(experts, int) and experts > 0:
            notes.append(
                "mixture of experts: every expert's weights are counted though each token uses only "
                f"{experts} of them, so the estimate is high"
            )

    if not walk.backward:
        notes.append("no parameter requires a gradient: forward only")
    estimate = FlopsEstimate(
        per_token=0,
        frozen_matmul_params=walk.frozen,
        trainable_matmul_params=walk.trainable,
        attention_flops=attention,
        backward=walk.backward,
        embedding_params=walk.embedding,
        uncounted_params=walk.uncounted,
        layers=layers,
        attention_width=width,
        seq_len=seq_len,
        assumptions=tuple(notes),
    )
    total = estimate.frozen_matmul_flops + estimate.trainable_matmul_flops + attention
    return replace(estimate, per_token=total)


class _Walk:
    """Sorts a model's weights into matmul (frozen / trainable), lookup and unknown, skipping what never runs."""

    def __init__(self) -> None:
        self.frozen = 0
        self.trainable = 0
        self.embedding = 0
        self.uncounted = 0
        self.backward = False
        self.notes: list[str] = []
        self._dora = False
        self._skipped: set[int] = set()  # modules the forward pass does not run (inactive adapters, ...)
        self._done: set[int] = set()  # modules whose parameters were already accounted for
        self._seen_params: set[int] = set()

    def run(self, modules: list[Any]) -> None:
        for module in modules:  # first the wrappers, which decide what the forward pass skips
            if _is_tuner_layer(module):
                self._tuner_layer(module)
            elif _is_modules_to_save(module):
                self._modules_to_save(module)
        for module in modules:
            if id(module) in self._skipped or id(module) in self._done:
                continue
            self._module(module)
        if self._dora:
            self.notes.append("DoRA's weight norm, computed once per forward call rather than per token, is not counted")
        if self.uncounted:
            self.notes.append(
                f"{self.uncounted} parameters in modules that are not linear layers or embeddings "
                "(convolutions, fused experts, ...) are not counted"
            )

    def _module(self, module: Any) -> None:
        has_children = next(iter(module.children()), None) is not None
        if not has_children and _is_int(getattr(module, "in_features", None)) and _is_int(
            getattr(module, "out_features", None)
        ):
            # nn.Linear and its quantized subclasses (bitsandbytes packs 4-bit weights, so the
            # weight's numel undercounts: the layer's shape does not).
            self._matmul(module.in_features * module.out_features, getattr(module, "weight", None))
            self._account(module)
        elif not has_children and _is_int(getattr(module, "nf", None)) and _is_int(getattr(module, "nx", None)):
            # transformers' Conv1D (GPT-2 family): a linear layer with the weight transposed.
            self._matmul(module.nf * module.nx, getattr(module, "weight", None))
            self._account(module)
        elif (
            not has_children
            and _is_int(getattr(module, "num_embeddings", None))
            and _is_int(getattr(module, "embedding_dim", None))
        ):
            # A lookup: no multiply. A tied LM head is its own linear module and counted there.
            self.embedding += module.num_embeddings * module.embedding_dim
            self._account(module)
        elif _is_int(getattr(module, "embed_dim", None)) and hasattr(module, "in_proj_weight"):
            # nn.MultiheadAttention: the packed (or separate) Q/K/V projection is a parameter, not a
            # child; its out_proj is a child linear layer, counted on its own.
            for attribute in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                weight = getattr(module, attribute, None)
                if weight is not None:
                    self._matmul(int(weight.numel()), weight)
            self._account(module)
        else:
            for parameter in _own_parameters(module):
                if id(parameter) in self._seen_params:
                    continue
                self._seen_params.add(id(parameter))
                self._note_grad(parameter)
                if len(parameter.shape) >= 2:
                    self.uncounted += int(parameter.numel())
                # One-dimensional: biases, norm scales, DoRA magnitudes: a few FLOPs per
                # element, negligible next to the matmuls.

    def _matmul(self, count: int, weight: Any) -> None:
        if bool(getattr(weight, "requires_grad", False)):
            self.trainable += count
            self.backward = True
        else:
            self.frozen += count

    def _account(self, module: Any) -> None:
        """Mark the module's own parameters (weight, bias) as seen, noting any that is trained."""
        for parameter in _own_parameters(module):
            self._seen_params.add(id(parameter))
            self._note_grad(parameter)

    def _note_grad(self, parameter: Any) -> None:
        if bool(getattr(parameter, "requires_grad", False)):
            self.backward = True

    def _skip(self, module: Any) -> None:
        for inner in module.modules():
            self._skipped.add(id(inner))

    def _tuner_layer(self, layer: Any) -> None:
        """A PEFT tuner layer (LoRA and others): the base layer runs; only the active adapters run beside it."""
        active = set(_active_adapters(layer))
        off = bool(getattr(layer, "merged", False)) or bool(getattr(layer, "disable_adapters", False))
        for attribute in getattr(layer, "adapter_layer_names", ()):
            container = getattr(layer, attribute, None)
            items = getattr(container, "items", None)
            if container is None or not callable(items):
                continue
            # A ParameterDict holds its adapters' tensors as its own parameters; a ModuleDict holds modules.
            parameter_dict = bool(_own_parameters(container))
            for key, value in list(items()):
                running = not off and key in active
                if hasattr(value, "modules"):  # a module (lora_A / lora_B / DoRA magnitude)
                    if not running:
                        self._skip(value)
                    elif attribute == "lora_magnitude_vector":
                        self._dora = True
                    continue
                # A parameter of a ParameterDict (LoRA on an embedding layer).
                self._seen_params.add(id(value))
                if not running:
                    continue
                self._note_grad(value)
                if attribute == "lora_embedding_B":  # after the A lookup: a matmul from r to the width
                    self._matmul(int(value.numel()), value)
                elif attribute == "lora_embedding_A":  # indexed by token id, like the table it adapts
                    self.embedding += int(value.numel())
            if parameter_dict:
                self._done.add(id(container))

    def _modules_to_save(self, wrapper: Any) -> None:
        """PEFT's modules_to_save: the first active adapter's trained copy runs instead of the original."""
        copies = wrapper.modules_to_save
        active = _active_adapters(wrapper)
        if bool(getattr(wrapper, "disable_adapters", False)) or not active or active[0] not in copies:
            running = None
        else:
            running = active[0]
        for key, copy in list(copies.items()):
            if key != running:
                self._skip(copy)
        if running is not None:
            self._skip(wrapper.original_module)


def _is_tuner_layer(module: Any) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "adapter_layer_names", None), tuple)


def _is_modules_to_save(module: Any) -> bool:
    copies = getattr(module, "modules_to_save", None)
    return (
        hasattr(module, "original_module")
        and callable(getattr(copies, "items", None))
        and hasattr(copies, "modules")
    )


def _active_adapters(module: Any) -> list[str]:
    active = getattr(module, "active_adapters", None)
    if isinstance(active, str):
        return [active]
    if isinstance(active, Iterable):
        return [name for name in active if isinstance(name, str)]
    return []


def _own_parameters(module: Any) -> list[Any]:
    named = getattr(module, "named_parameters", None)
    if not callable(named):
        return []
    return [parameter for _, parameter in named(recurse=False)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text_config(model: Any) -> Any:
    """The Hugging Face config of ``model`` or of the first module that has one (DDP, PEFT, compile wrappers)."""
    candidates: list[Any] = [model]
    modules = getattr(model, "modules", None)
    if callable(modules):
        candidates.extend(modules())
    for candidate in candidates:
        try:
            config = getattr(candidate, "config", None)
        except Exception:  # a wrapper's __getattr__ may raise anything
            continue
        if config is None or not hasattr(config, "to_dict"):
            continue
        text = getattr(config, "get_text_config", None)
        if callable(text):
            with contextlib.suppress(Exception):  # multimodal models: the language model's config
                config = text()
        return config
    return None


def _attention_shape(config: Any) -> tuple[int | None, int | None]:
    """(layers, heads x head_dim) from a Hugging Face config; None where it does not say."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None)
    if not (_is_int(layers) and layers > 0):
        layers = None
    if not (_is_int(heads) and heads > 0):
        return layers, None
    if not (_is_int(head_dim) and head_dim > 0):
        if not (_is_int(hidden) and hidden > 0):
            return layers, None
        head_dim = hidden // heads
    # Query heads, not key/value heads: with grouped-query attention every query head still
    # scores the whole sequence.
    return layers, heads * head_dim


# --- peak FLOP/s ------------------------------------------------------------------------------

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
    "tfloat32": "tf32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}

# Words in a device name that say which board of a chip it is; a name carrying one that no row
# of its family lists is not guessed at (MIG slices, for one, have a fraction of the peak).
_FORM_WORDS = ("SXM", "PCIE", "NVL", "FHHL", "CNX", "MIG")


@dataclass(frozen=True)
class GpuPeak:
    """Dense peak FLOP/s of one GPU model per dtype, and the names NVML / torch report for it."""

    label: str
    names: tuple[str, ...]
    family: str
    forms: frozenset[str]
    """Form words (``_FORM_WORDS``) that select this row; "" selects it when the name carries none."""
    tflops: Mapping[str, float]
    source: str

    def flops(self, dtype: str) -> float | None:
        value = self.tflops.get(dtype)
        return None if value is None else float(round(value * 1e12))  # 16.4e12, not 16399999999999.998


def _peak(
    label: str,
    names: tuple[str, ...],
    family: str,
    forms: tuple[str, ...],
    source: str,
    **tflops: float,
) -> GpuPeak:
    return GpuPeak(label, names, family, frozenset(forms), tflops, source)


# TFLOP/s, dense (no 2:4 sparsity). Where a datasheet prints only the "with sparsity" figure,
# the dense one is half of it. fp32 is the CUDA-core rate (float32 matmuls without TF32).
GPU_PEAKS: tuple[GpuPeak, ...] = (
    _peak("B200", ("NVIDIA B200",), "B200", ("", "SXM"), "NVIDIA HGX B200 datasheet (per GPU)",
          fp32=75, tf32=1100, bf16=2250, fp16=2250, fp8=4500),
    _peak("H200 SXM", ("NVIDIA H200",), "H200", ("", "SXM"), "NVIDIA H200 datasheet",
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979),
    _peak("H200 NVL", ("NVIDIA H200 NVL",), "H200", ("NVL",), "NVIDIA H200 datasheet",
          fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5),
    _peak("GH200", ("NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e"), "GH200", ("",),
          "NVIDIA GH200 datasheet", fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979),
    _peak("H100 SXM", ("NVIDIA H100 80GB HBM3",), "H100", ("", "SXM"), "NVIDIA H100 datasheet",
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979),
    _peak("H100 NVL", ("NVIDIA H100 NVL",), "H100", ("NVL",), "NVIDIA H100 datasheet",
          fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5),
    _peak("H100 PCIe", ("NVIDIA H100 PCIe",), "H100", ("PCIE",), "NVIDIA H100 datasheet",
          fp32=51, tf32=378, bf16=756.5, fp16=756.5, fp8=1513),
    _peak("L40S", ("NVIDIA L40S",), "L40S", ("",), "NVIDIA L40S datasheet",
          fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733),
    _peak("L40", ("NVIDIA L40",), "L40", ("",), "NVIDIA L40 datasheet",
          fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05, fp8=362),
    _peak("L4", ("NVIDIA L4",), "L4", ("",), "NVIDIA L4 datasheet",
          fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5),
    _peak("A100 (SXM4 and PCIe)",
          ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB"),
          "A100", ("", "SXM", "PCIE"), "NVIDIA A100 datasheet (the same figures for SXM4 and PCIe)",
          fp32=19.5, tf32=156, bf16=312, fp16=312),
    _peak("A40", ("NVIDIA A40",), "A40", ("",), "NVIDIA A40 datasheet",
          fp32=37.4, tf32=74.8, bf16=149.7, fp16=149.7),
    _peak("A30", ("NVIDIA A30",), "A30", ("",), "NVIDIA A30 datasheet",
          fp32=10.3, tf32=82, bf16=165, fp16=165),
    _peak("A10", ("NVIDIA A10",), "A10", ("",), "NVIDIA A10 datasheet",
          fp32=31.2, tf32=62.5, bf16=125, fp16=125),
    _peak("T4", ("Tesla T4",), "T4", ("",), "NVIDIA T4 datasheet", fp32=8.1, fp16=65),
    _peak("V100 SXM2", ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"), "V100", ("SXM",),
          "NVIDIA V100 datasheet", fp32=15.7, fp16=125),
    _peak("V100 PCIe", ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"), "V100", ("PCIE",),
          "NVIDIA V100 datasheet", fp32=14, fp16=112),
    _peak("V100S PCIe", ("Tesla V100S-PCIE-32GB",), "V100S", ("", "PCIE"), "NVIDIA V100 datasheet",
          fp32=16.4, fp16=130),
)

_FAMILIES = {row.family for row in GPU_PEAKS}


def _dtype_key(dtype: str) -> str:
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a string such as 'bf16', got {type(dtype).__name__}")
    key = _DTYPE_ALIASES.get(dtype.strip().lower())
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(sorted(_DTYPE_ALIASES))}")
    return key


def _identify(device_name: str) -> GpuPeak | None:
    """The table row for an NVML / torch device name, or None when the name is not one we know."""
    words = [word.upper() for word in re.split(r"[^0-9A-Za-z]+", device_name) if word]
    family = next((word for word in words if word in _FAMILIES), None)
    if family is None:
        return None
    forms = set()
    for word in words:
        for form in _FORM_WORDS:
            if word.startswith(form):  # SXM4, SXM5, PCIE, ...
                forms.add(form)
    if "MIG" in forms or len(forms) > 1:
        return None
    form = forms.pop() if forms else ""
    return next((row for row in GPU_PEAKS if row.family == family and form in row.forms), None)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one GPU named ``device_name`` (as NVML or torch reports it) for ``dtype``.

    ``dtype`` is one of fp32, tf32, bf16, fp16, fp8 (torch's spellings such as
    ``bfloat16`` work too; anything else raises ``ValueError``). None when the
    GPU is not in the table, is a MIG slice, or has no such peak (bf16 on a V100).
    """
    key = _dtype_key(dtype)
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a string, got {type(device_name).__name__}")
    row = _identify(device_name)
    return None if row is None else row.flops(key)


def device_peak_flops(device: Any, dtype: Any) -> float | None:
    """Dense peak FLOP/s of the torch ``device`` for matmuls in ``dtype`` (a torch dtype or a name).

    None for anything but a CUDA device, and for a GPU or dtype the table does
    not have. float32 means TF32 when torch is set to use it for matmuls
    (``torch.backends.cuda.matmul.fp32_precision = "tf32"`` or
    ``torch.set_float32_matmul_precision("high")``), else plain FP32; on GPUs
    without TF32 it is always FP32.
    """
    import torch

    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"not a torch device: {device!r}") from None
    if device.type != "cuda":
        return None
    key = _torch_dtype_key(torch, dtype)
    if key is None:
        return None
    try:
        name = torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError) as exc:  # CUDA not built in, or no such device
        _logger.warning("openlora-otel: cannot read the name of %s for its peak FLOP/s: %s", device, exc)
        return None
    peak = peak_flops(name, key)
    if peak is None and key == "tf32":
        # Before Ampere there is no TF32: float32 matmuls run at the FP32 rate whatever the setting.
        peak = peak_flops(name, "fp32")
    return peak


def _torch_dtype_key(torch: Any, dtype: Any) -> str | None:
    if isinstance(dtype, str):
        return _dtype_key(dtype)
    if dtype == torch.float32:
        return "tf32" if _tf32_matmuls(torch) else "fp32"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if str(dtype).startswith("torch.float8"):
        return "fp8"
    return None  # float64, integers: not in the table


def _tf32_matmuls(torch: Any) -> bool:
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # torch >= 2.9
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)  # legacy flag; raises when the two APIs were mixed
    except RuntimeError:
        return False


def peak_table_markdown() -> str:
    """The peak table as Markdown (TFLOP/s); docs/reference/mfu.md carries the same table."""
    rows = [
        "| GPU | Name as NVML / torch report it | FP32 | TF32 | BF16 | FP16 | FP8 | Source |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in GPU_PEAKS:
        names = ", ".join(f"`{name}`" for name in row.names)
        cells = [f"{row.tflops[d]:g}" if d in row.tflops else "-" for d in DTYPES]
        rows.append(f"| {row.label} | {names} | {' | '.join(cells)} | {row.source} |")
    return "\n".join(rows)


def report_model_flops(
    training: Any, model: Any, *, seq_len: int | None = None, device: Any = None, dtype: Any = None
) -> FlopsEstimate:
    """Estimate ``model``'s FLOPs per token and hand them, with its device's peak, to ``training``.

    ``training`` is a :class:`~openlora_otel.training.metrics.TrainingMetrics`. ``device`` and
    ``dtype`` default to those of the model's first parameter; pass the compute dtype
    under mixed precision (bf16 autocast over float32 weights, say), since that is what
    the matmuls run at. The framework callbacks call this at the first optimizer step
    (``seq_len`` from that step's batch).
    """
    estimate = training_flops_per_token(model, seq_len=seq_len)
    if device is None or dtype is None:
        first = next(iter(model.parameters()), None)
        if first is not None:
            device = first.device if device is None else device
            dtype = first.dtype if dtype is None else dtype
    peak = None if device is None or dtype is None else device_peak_flops(device, dtype)
    if estimate.per_token > 0:
        training.set_model_flops(estimate.per_token, peak_flops=peak)
    for note in estimate.assumptions:
        _logger.debug("openlora-otel: FLOPs estimate: %s", note)
    return estimate

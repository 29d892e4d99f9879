"""The saved demo model served: its base and LoRA adapters on one device, generation token by token.

Each adapter is merged into its own copy of the base at load time, so a request's adapter is just the
module it runs: no adapter switch shared by concurrent requests, no LoRA matmuls per token, and any
number of worker threads may run one module at once. Generation is greedy, or sampled with a
generator the caller seeds (drawn on the CPU: a seed means the same on any device). torch,
transformers and peft are imported when a model is built. See docs/how-to/serving.md.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openlora_otel.model.corpus import CharTokenizer
from openlora_otel.model.device import Placement, resolve_device
from openlora_otel.model.layout import SavedAdapter, SavedBase, quiet_progress

__all__ = ["AdapterMismatchError", "Cancelled", "Completion", "PromptError", "Sampling", "ServedModels"]


class PromptError(ValueError):
    """The prompt cannot be encoded by the model's tokenizer (the message says which character)."""


class AdapterMismatchError(ValueError):
    """The adapter was trained on another base than the one served."""


class Cancelled(Exception):
    """Generation stopped because its request was cancelled (client gone, server stopping)."""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "length" or "stop"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Sampling:
    """Sample instead of argmax: ``temperature`` > 0, keep the smallest set of tokens whose probability
    reaches ``top_p``, draw with ``generator`` (a CPU ``torch.Generator``, seeded by the caller)."""

    temperature: float
    top_p: float = 1.0
    generator: Any = None


def _require() -> tuple[Any, Any, Any]:
    from openlora_otel._deps import require

    for module in ("torch", "transformers", "peft"):
        require(module, "openlora-otel serve", extra="serve")
    import peft
    import torch
    import transformers

    return torch, transformers, peft


class ServedModels:
    """The base model and the adapters loaded so far; ``generate`` is safe from many threads at once."""

    def __init__(self, base: SavedBase, *, device: str = "auto") -> None:
        self.torch, transformers, self._peft = _require()
        self.placement: Placement = resolve_device(device, self.torch)
        self.base = base
        self.tokenizer = CharTokenizer(base.alphabet)
        with quiet_progress():
            module = transformers.LlamaForCausalLM.from_pretrained(str(base.path), local_files_only=True)
        module.eval()
        # Adapters are merged into copies of this CPU base (PEFT loads their weights on the CPU).
        self._cpu_base = module
        self._base_module = copy.deepcopy(module).to(self.placement.device) if self.placement.is_cuda else module
        self._adapters: dict[str, Any] = {}
        self._lock = threading.Lock()  # guards the dict, not generation

    @property
    def base_model(self) -> str:
        return self.base.base_model

    @property
    def adapters(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def has_adapter(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def load_adapter(self, adapter: SavedAdapter) -> None:
        """Merge ``adapter`` into a copy of the base; raises on a bad directory or another base's adapter."""
        if adapter.base_fingerprint is not None and adapter.base_fingerprint != self.base.fingerprint:
            raise AdapterMismatchError(
                f"adapter {adapter.name!r} ({adapter.path}) was trained on base {adapter.base_fingerprint}, "
                f"not on the served base {self.base.fingerprint}"
            )
        module = copy.deepcopy(self._cpu_base)
        with warnings.catch_warnings(), quiet_progress():
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = self._peft.PeftModel.from_pretrained(module, str(adapter.path), is_trainable=False)
            merged = peft_model.merge_and_unload()
        merged.to(self.placement.device)
        merged.eval()
        with self._lock:
            self._adapters[adapter.name] = merged

    def encode(self, prompt: str) -> list[int]:
        try:
            return self.tokenizer.encode(prompt)
        except ValueError as exc:
            raise PromptError(f"{exc}; the model knows {self.base.alphabet!r}") from None

    def generate(
        self,
        adapter: str | None,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        stop: tuple[str, ...] = (),
        sampling: Sampling | None = None,
        on_token: Callable[[str], object] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Completion:
        """Up to ``max_tokens`` tokens after ``prompt_ids`` with ``adapter`` (None: the base): greedy, or
        drawn as ``sampling`` says.

        ``on_token`` is called once per generated token, as soon as it is decoded (the first
        call is the first token), with the text that became final: "" while the text ends with
        the start of a stop string, which may yet complete. ``cancelled`` is checked before
        each token: when it says so, :class:`Cancelled` is raised.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        if adapter is None:
            module = self._base_module
        else:
            with self._lock:
                module = self._adapters[adapter]
        torch = self.torch
        stops = tuple(text for text in stop if text)
        window = list(prompt_ids[-self.base.context_length :])
        text = ""
        sent = 0  # characters of text already given to on_token
        finish = "length"
        generated = 0
        device = self.placement.device
        with torch.inference_mode(), self.placement.autocast(torch):
            for _ in range(max_tokens):
                if cancelled is not None and cancelled():
                    raise Cancelled()
                logits = module(input_ids=torch.tensor([window], device=device)).logits
                if sampling is None:
                    token = int(logits[0, -1].argmax())
                else:
                    token = _draw(torch, logits[0, -1], sampling)
                generated += 1
                text += self.tokenizer.decode([token])
                # The longest stop string that ends here starts earliest: the text ends before it.
                hit = max((s for s in stops if text.endswith(s)), key=len, default=None)
                if hit is not None:
                    finish = "stop"
                    text = text[: len(text) - len(hit)]
                    final = len(text)
                elif generated == max_tokens:
                    final = len(text)  # the last token: nothing can complete a stop string now
                else:
                    final = len(text) - _held_back(text, stops)
                if on_token is not None:
                    on_token(text[sent:final])
                sent = max(sent, final)
                if hit is not None:
                    break
                window.append(token)
                if len(window) > self.base.context_length:
                    del window[0]
        return Completion(
            text=text,
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            completion_tokens=generated,
        )


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _draw(torch: Any, logits: Any, sampling: Sampling) -> int:
    """One token drawn from ``softmax(logits / temperature)`` cut to its ``top_p`` nucleus.

    On the CPU in float64: the generator is a CPU one (a seed then means the same on any device), and
    the vocabulary is the demo's 32 characters, so the copy costs nothing next to the forward pass.
    The logits are shifted so that their largest is 0 before the division: then no temperature, down
    to the smallest a float holds (5e-324), makes an infinity or a NaN (``inf - inf``); the other
    logits go to -inf, probability 0, and a tiny temperature is greedy. In float32, or unshifted,
    a temperature of 1e-40 overflowed and ``torch.multinomial`` refused the NaNs (a 500).
    """
    logits = logits.float().cpu().double()  # copied as float32 (half the bytes of float64), widened here
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p.
        keep = torch.cumsum(ordered, dim=-1) - ordered < sampling.top_p
        keep[0] = True  # top_p 0: the most likely token alone
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=sampling.generator))

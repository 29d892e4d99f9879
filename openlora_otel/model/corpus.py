"""The demo's data: a deterministic synthetic corpus and a character tokenizer, nothing downloaded.

Sentences come from a small grammar (subjects, verbs, objects, places, times),
so the text has structure a small model can learn within a minute: the loss
falls from about ln(vocabulary) to well under half of that.
"""

from __future__ import annotations

import random

__all__ = ["ALPHABET", "CharTokenizer", "generate_corpus"]

_SUBJECTS = [
    "the engineer", "a careful student", "the old robot", "my neighbour", "the small team", "a tired pilot",
    "the night shift", "our teacher", "the data scientist", "a curious child", "the gardener", "the captain",
]  # fmt: skip
_VERBS = [
    "trains", "reads", "repairs", "watches", "measures", "paints", "builds", "checks", "cleans", "writes",
]  # fmt: skip
_OBJECTS = [
    "a new model", "the long report", "every gradient", "the blue boat", "a quiet garden", "the loss curve",
    "three old clocks", "the server rack", "a paper map", "the small adapter",
]  # fmt: skip
_PLACES = [
    "in the lab", "by the river", "at the station", "on the roof", "near the market", "under the bridge",
]  # fmt: skip
_TIMES = ["every morning", "before dinner", "late at night", "on sunday", "after the rain", "all week"]
_ENDINGS = [".", ".", ".", "!", "?"]

ALPHABET = "\n !?,.abcdefghijklmnopqrstuvwxyz"


def generate_corpus(sentences: int = 4000, seed: int = 1234) -> str:
    """``sentences`` sentences of the grammar, one per line, the same for the same seed."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            parts.append(rng.choice(_PLACES))
        if rng.random() < 0.5:
            parts.append(rng.choice(_TIMES))
        lines.append(" ".join(parts) + rng.choice(_ENDINGS))
    return "\n".join(lines) + "\n"


class CharTokenizer:
    """One token per character of :data:`ALPHABET`; anything else is refused."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        self.alphabet = alphabet
        self._ids = {ch: i for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the demo alphabet") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)

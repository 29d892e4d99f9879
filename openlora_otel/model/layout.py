"""The directory ``openlora-otel demo --save DIR`` writes and ``openlora-otel serve DIR`` reads.

``DIR/base/`` holds the demo's tiny Llama (config, weights, character tokenizer, and an
``openlora.json`` with its fingerprint); ``DIR/adapters/NAME/`` one PEFT adapter each, whose
``openlora.json`` names its base's fingerprint (``serve`` refuses an adapter of another base) and its
training run (:meth:`SavedAdapter.origin`). Nothing here imports torch: the demo passes its models
in. See docs/how-to/serving.md (Saving).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openlora_otel.inference.metrics import AdapterOrigin

__all__ = [
    "ADAPTER_NAME_RULE",
    "FORMAT",
    "LayoutError",
    "SavedAdapter",
    "SavedBase",
    "adapter_name_problem",
    "quiet_progress",
    "read_adapter",
    "read_base",
    "read_saved",
    "save_adapter",
    "save_base",
]

FORMAT = 1
BASE = "base"
ADAPTERS = "adapters"
MANIFEST = "openlora.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

# Adapter names travel as the request's "model" field and as a metric label value: short, plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADAPTER_NAME_RULE = "1 to 64 characters: letters, digits, '.', '_', '-', starting with a letter or digit"
# The metric labels' own values for "no adapter" and "past the cap" (openlora_otel.inference).
_RESERVED = ("base", "other")


class LayoutError(ValueError):
    """DIR (or an adapter directory) is not what ``demo --save`` writes; the message says what is wrong."""


@dataclass(frozen=True)
class SavedBase:
    path: Path
    base_model: str
    context_length: int
    alphabet: str
    fingerprint: str


@dataclass(frozen=True)
class SavedAdapter:
    name: str
    path: Path
    # The base it was trained on; None for an adapter not written by the demo (no openlora.json).
    base_fingerprint: str | None
    # Its training run and last evaluation loss, from openlora.json; None where not known.
    run_id: str | None = None
    run_name: str | None = None
    final_eval_loss: float | None = None

    def origin(self, base: SavedBase) -> AdapterOrigin:
        """Where it came from, for ``InferenceMetrics.loading_adapter(trained_by=...)``: its training run
        and eval loss where known, and ``base``, the base it is served on (its fingerprint only when
        openlora.json says the adapter was trained on it)."""
        return AdapterOrigin(
            run_id=self.run_id,
            run_name=self.run_name,
            base_model=base.base_model,
            base_fingerprint=self.base_fingerprint,
            final_eval_loss=self.final_eval_loss,
        )


def adapter_name_problem(name: str, base_model: str | None = None) -> str | None:
    """Why ``name`` cannot name an adapter, or None when it can."""
    if not _NAME.fullmatch(name):
        return f"{name!r} is not a valid adapter name ({ADAPTER_NAME_RULE})"
    if name in _RESERVED:
        return f"{name!r} is reserved (the metrics use it for requests without an adapter / past the cap)"
    if base_model is not None and name == base_model:
        return f"{name!r} is the base model's name (requests for it get no adapter)"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{path} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LayoutError(f"{path} is not a JSON object")
    return data


def read_base(root: str | os.PathLike[str]) -> SavedBase:
    """The base model saved under ``root`` (``root/base``); LayoutError when there is none or it is broken."""
    root = Path(root)
    if not root.is_dir():
        raise LayoutError(f"{root} is not a directory")
    base = root / BASE
    if not (base / MANIFEST).is_file():
        raise LayoutError(
            f"{root} is not a directory saved by `openlora-otel demo --save` ({base / MANIFEST} is missing)"
        )
    manifest = _read_json(base / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise LayoutError(
            f"{base / MANIFEST}: format {manifest.get('format')!r}, this version reads {FORMAT}"
        )
    tokenizer = _read_json(base / TOKENIZER)
    if tokenizer.get("type") != "char" or not isinstance(tokenizer.get("alphabet"), str):
        raise LayoutError(f"{base / TOKENIZER}: expected {{'type': 'char', 'alphabet': <string>}}")
    for needed in ("config.json", WEIGHTS):
        if not (base / needed).is_file():
            raise LayoutError(f"{base / needed} is missing")
    try:
        return SavedBase(
            path=base,
            base_model=str(manifest["base_model"]),
            context_length=int(manifest["context_length"]),
            alphabet=tokenizer["alphabet"],
            fingerprint=str(manifest["fingerprint"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"{base / MANIFEST}: missing or bad field {exc}") from None


def read_adapter(name: str, path: str | os.PathLike[str]) -> SavedAdapter:
    """An adapter directory (PEFT ``save_pretrained``); LayoutError when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise LayoutError(f"adapter {name!r}: {path} is not a directory")
    if not (path / ADAPTER_CONFIG).is_file():
        raise LayoutError(
            f"adapter {name!r}: {path} holds no {ADAPTER_CONFIG} (not a PEFT adapter directory)"
        )
    manifest: dict[str, Any] = {}
    if (path / MANIFEST).is_file():
        manifest = _read_json(path / MANIFEST)

    def text(key: str) -> str | None:
        value = manifest.get(key)
        return str(value) if value not in (None, "") else None

    loss = manifest.get("final_eval_loss")
    return SavedAdapter(
        name=name,
        path=path,
        base_fingerprint=text("base_fingerprint"),
        run_id=text("run_id"),
        run_name=text("run_name"),
        final_eval_loss=float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None,
    )


def read_saved(root: str | os.PathLike[str]) -> tuple[SavedBase, list[SavedAdapter]]:
    """The base and every adapter under ``root/adapters`` (sorted by name)."""
    base = read_base(root)
    adapters = []
    folder = Path(root) / ADAPTERS
    if folder.is_dir():
        for entry in sorted(folder.iterdir()):
            if entry.name.startswith("."):
                continue  # a save in progress (see _replace_dir)
            problem = adapter_name_problem(entry.name, base.base_model)
            if problem:
                raise LayoutError(f"{entry}: {problem}")
            adapters.append(read_adapter(entry.name, entry))
    return base, adapters


def _fingerprint(weights: Path) -> str:
    digest = hashlib.sha256()
    with weights.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No transformers progress bars ("Writing model shards", "Loading weights") for a 3 MB model."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _replace_dir(target: Path, write: Any, *, keep_existing: bool) -> bool:
    """Write a directory through ``write(tmp)`` next to ``target`` and move it into place.

    A reader (``serve``, another rank) sees the old directory, the whole new one, or for the
    instant between two renames none, never half of one: the old one is renamed aside (to a
    dot name, which readers skip) before the new one is renamed in, and only then deleted.
    With ``keep_existing`` an existing ``target`` wins (another process saved it first): False then.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    old: Path | None = None
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the saved model from a server running as another user
        write(tmp)
        if target.exists():
            if keep_existing:
                return False
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            os.replace(target, old)  # an empty directory is replaced by the old one
        os.replace(tmp, target)
        return True
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def save_base(
    root: str | os.PathLike[str], model: Any, *, alphabet: str, base_model: str, context_length: int
) -> SavedBase:
    """Save ``model`` (a transformers model, before LoRA is added) as ``root/base``; an existing base stays."""

    def write(tmp: Path) -> None:
        with quiet_progress():
            model.save_pretrained(tmp)
        (tmp / TOKENIZER).write_text(
            json.dumps({"type": "char", "alphabet": alphabet}) + "\n", encoding="utf-8"
        )
        manifest = {
            "format": FORMAT,
            "base_model": base_model,
            "context_length": context_length,
            "fingerprint": _fingerprint(tmp / WEIGHTS),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")

    _replace_dir(Path(root) / BASE, write, keep_existing=True)
    return read_base(root)


def save_adapter(
    root: str | os.PathLike[str], name: str, model: Any, *, base: SavedBase, info: dict[str, Any]
) -> Path:
    """Save the PEFT ``model``'s adapter as ``root/adapters/NAME`` (replacing one of that name)."""
    problem = adapter_name_problem(name, base.base_model)
    if problem:
        raise LayoutError(problem)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        manifest = {"format": FORMAT, "base_fingerprint": base.fingerprint, **info}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")

    target = Path(root) / ADAPTERS / name
    _replace_dir(target, write, keep_existing=False)
    return target

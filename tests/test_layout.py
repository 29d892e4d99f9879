"""The package layout: modules moved into subpackages still import from their old paths, as the same objects."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import openlora_otel.training as training
from openlora_otel.training import flops, guard, metrics
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parent.parent

# Old path -> where the module lives now, and one of its attributes to patch through the old path.
MOVED = {
    "openlora_otel.guard": ("openlora_otel.training.guard", "_BASELINE_WEIGHT"),
    "openlora_otel.flops": ("openlora_otel.training.flops", "_FORWARD"),
    "openlora_otel.gpu": ("openlora_otel.hardware.gpu", "_FRESH_FOR_S"),
    "openlora_otel.nvml": ("openlora_otel.hardware.nvml", "load_pynvml_backend"),
    "openlora_otel.host": ("openlora_otel.hardware.host", "_missing_warned"),
}

# The packages the package must not load on import (as tests/test_setup.py's import test).
BLOCKED = ("torch", "transformers", "peft", "lightning", "pytorch_lightning", "pynvml", "grpc")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_moved_module_itself(old: str) -> None:
    new, _ = MOVED[old]
    moved = importlib.import_module(new)
    assert importlib.import_module(old) is moved
    assert sys.modules[old] is moved
    # `from openlora_otel import guard` and `openlora_otel.guard.X` read the package's attribute.
    package, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(package), leaf) is moved


@pytest.mark.parametrize("old", sorted(MOVED))
def test_monkeypatching_through_an_old_path_reaches_the_moved_module(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    new, attribute = MOVED[old]
    marker = object()
    monkeypatch.setattr(f"{old}.{attribute}", marker)
    assert getattr(importlib.import_module(new), attribute) is marker


@pytest.mark.process
def test_old_paths_import_first_in_a_fresh_interpreter_and_load_nothing_heavy() -> None:
    # Imported before the new paths, in a process where the heavy packages cannot load.
    code = f"""
import importlib, json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked " + name)
        return None
sys.meta_path.insert(0, Block())
moved = json.loads(sys.argv[1])
old_first = {{old: importlib.import_module(old) for old in moved}}
for old, (new, _) in moved.items():
    assert old_first[old] is importlib.import_module(new), old
import openlora_otel.hardware, openlora_otel.training
assert not [m for m in sys.modules if m.split(".")[0] in {BLOCKED!r}]
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(MOVED)],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_the_training_package_re_exports_the_public_names_of_its_modules() -> None:
    public = {name: getattr(module, name) for module in (metrics, guard, flops) for name in module.__all__}
    # What `from openlora_otel.training import X` gave when it was one module is still there.
    assert {"TrainingMetrics", "collecting_for", "step_duration_view"} <= set(training.__all__)
    assert sorted(training.__all__) == sorted(public)
    for name in training.__all__:
        assert getattr(training, name) is public[name], name
    namespace: dict[str, object] = {}
    exec("from openlora_otel.training import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(training.__all__)

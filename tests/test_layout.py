"""The package layout: the subpackages' public names, and no module left at a path it moved from."""

from __future__ import annotations

import importlib

import pytest

import openlora_otel.training as training
from openlora_otel.training import flops, guard, metrics

# Modules that lived at the package root for a day before moving into a subpackage. Nothing was
# released under those paths, and the aliases that kept them importing are gone (issue 22).
MOVED = {
    "openlora_otel.guard": "openlora_otel.training.guard",
    "openlora_otel.flops": "openlora_otel.training.flops",
    "openlora_otel.gpu": "openlora_otel.hardware.gpu",
    "openlora_otel.nvml": "openlora_otel.hardware.nvml",
    "openlora_otel.host": "openlora_otel.hardware.host",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_lives_only_at_its_new_path(old: str) -> None:
    importlib.import_module(MOVED[old])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


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

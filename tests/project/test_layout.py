"""The package layout: the subpackages' public names, and no module left at a path it moved from."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

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
    # What the demo and the server share, and a private module the demo reached into (issue 30).
    "openlora_otel.demo.layout": "openlora_otel.model.layout",
    "openlora_otel.demo.corpus": "openlora_otel.model.corpus",
    "openlora_otel.integrations._common": "openlora_otel.integrations.common",
    # Names that say their side and their job (issue 30).
    "openlora_otel.report.history": "openlora_otel.report.history_source",
    "openlora_otel.exporters.history": "openlora_otel.exporters.history_writer",
    "openlora_otel.exporters.guard": "openlora_otel.exporters.outage",
}


# Program parts that left the package root (issue 30). Checked by file, not by import: an editable install
# of another checkout answers a root-level name that this one lacks from that checkout.
ROOT_MOVED = {
    "doctor": "openlora_otel.commands.doctor",
    "_args": "openlora_otel.commands._args",
    "_device": "openlora_otel.model.device",
    # A run's identity and life, gathered in openlora_otel/run/ (issue 30).
    "resource": "openlora_otel.run.resource",
    "run": "openlora_otel.run.info",
    "outcome": "openlora_otel.run.outcome",
    "sigterm": "openlora_otel.run.sigterm",
    "distributed": "openlora_otel.run.identity",
    "history": "openlora_otel.report.history_reader",
    "windows": "openlora_otel.window_histograms",
    "discovery": "openlora_otel.exporters.discovery",
}

PACKAGE = Path(__file__).resolve().parents[2] / "openlora_otel"


@pytest.mark.parametrize("old", sorted(ROOT_MOVED))
def test_a_program_part_is_no_longer_at_the_package_root(old: str) -> None:
    importlib.import_module(ROOT_MOVED[old])
    assert not (PACKAGE / f"{old}.py").exists()


def _imported(path: Path) -> set[str]:
    """The modules ``path`` imports, at its top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_server_imports_nothing_from_the_demo() -> None:
    """What both use (the saved-model layout, the tokenizer, the device) lives in openlora_otel.model."""
    for path in sorted((PACKAGE / "serving").glob("*.py")):
        demo = {name for name in _imported(path) if name == "openlora_otel.demo" or name.startswith("openlora_otel.demo.")}
        assert not demo, (path.name, demo)


def test_no_command_imports_another() -> None:
    """What two commands share is in commands/_args.py or below the commands."""
    commands = {path.stem for path in (PACKAGE / "commands").glob("*.py")} - {"__init__", "_args"}
    for path in sorted((PACKAGE / "commands").glob("*.py")):
        if path.stem == "__init__":
            continue
        others = {
            name
            for name in _imported(path)
            if name.split(".")[:2] == ["openlora_otel", "commands"]
            and len(name.split(".")) > 2
            and name.split(".")[2] in commands
            and name.split(".")[2] != path.stem
        }
        assert not others, (path.name, others)


def _private_imports(path: Path) -> set[str]:
    """The underscore names ``path`` imports from another module of the package."""
    return {
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("openlora_otel"))
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    }


def test_no_module_imports_a_private_name_of_another() -> None:
    """What modules share has a public name (issue 30); the private modules ``_version``, ``_deps`` and
    ``commands._args`` are imported by their public names."""
    found = {str(path.relative_to(PACKAGE)): _private_imports(path) for path in sorted(PACKAGE.rglob("*.py"))}
    assert {path: names for path, names in found.items() if names} == {}


# A module past ~700 lines or a class past 400 usually holds two jobs (docs/architecture.md, issue 30).
MAX_MODULE_LINES, MAX_CLASS_LINES = 700, 400


def test_no_module_over_700_lines_and_no_class_over_400() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(PACKAGE))
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


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


def test_no_training_module_reaches_a_private_name_of_another_or_of_the_guard() -> None:
    """What the training modules share has a public name, and the guard's thread and verdicts are driven
    through its public methods (issue 30, move 3)."""
    for path in sorted((PACKAGE / "training").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not _private_imports(path), (path.name, _private_imports(path))
        if path.name != "guard.py":
            of_the_guard = {
                ast.unparse(node)
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and ast.unparse(node.value).split(".")[-1].lstrip("_") == "guard"
            }
            assert not of_the_guard, (path.name, of_the_guard)


def test_the_names_package_re_exports_the_public_names_of_its_modules() -> None:
    """The catalogue was one module (openlora_otel/names.py): ``from openlora_otel.names import X`` still gives every name."""
    import openlora_otel.names as names

    stems = sorted(path.stem for path in (PACKAGE / "names").glob("*.py") if path.stem != "__init__")
    modules = [importlib.import_module(f"openlora_otel.names.{stem}") for stem in stems]
    public = {name: getattr(module, name) for module in modules for name in module.__all__}
    assert {"MetricSpec", "prometheus_name", "TRAINING_METRICS", "GPU_METRICS", "XID_CODES"} <= set(names.__all__)
    assert sorted(names.__all__) == sorted(public)
    for name in names.__all__:
        assert getattr(names, name) is public[name], name
    assert not (PACKAGE / "names.py").exists()

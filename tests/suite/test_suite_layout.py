"""The test suite's own layout and tiers: helpers live in tests/support/, no test module imports
another (or conftest.py), and the tiers' check in conftest.py stops an unmarked test's child process."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SUPPORT = TESTS / "support"
# An import of a test module or of conftest.py, in code or in a child script's text.
IMPORTS_A_TEST = re.compile(
    r"^\s*(from tests\.(\w+\.)?(test_\w+|conftest)\b|import tests\.(\w+\.)?(test_\w+|conftest)\b"
    r"|from tests(\.\w+)? import .*\b(test_\w+|conftest)\b)",
    re.MULTILINE,
)


def _modules() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_no_module_imports_a_test_module_or_conftest() -> None:
    found = [
        f"{path.relative_to(TESTS.parent)}: {match.group(0).strip()}"
        for path in _modules()
        for match in IMPORTS_A_TEST.finditer(path.read_text())
    ]
    assert found == [], (
        "shared helpers belong in tests/support/, fixtures in tests/conftest.py:\n" + "\n".join(found)
    )


def test_support_holds_no_tests_and_no_fixtures() -> None:
    """pytest collects neither from tests/support/: a test there would never run, a fixture there only
    where it is imported by name."""
    for path in sorted(SUPPORT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert not node.name.startswith(("test_", "Test")), f"{path.name}: {node.name}"
                decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
                assert not any("fixture" in d for d in decorators), f"{path.name}: {node.name} is a fixture"


def test_an_unmarked_test_can_neither_fork_nor_start_a_process() -> None:
    """The check refuses before anything starts (this test is in the fast tier, which starts none)."""
    with pytest.raises(RuntimeError, match="without the `process` mark"):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - only if the check is gone
            os._exit(0)
        os.waitpid(pid, 0)
    with pytest.raises(RuntimeError, match="without the `process` mark"):
        subprocess.run([sys.executable, "-c", "pass"], timeout=30)
    with pytest.raises(RuntimeError, match="without the `e2e` mark"):
        subprocess.Popen(["/nonexistent/prometheus", "--version"])
    with pytest.raises(RuntimeError, match="without the `e2e` mark"):
        subprocess.Popen(["/nonexistent/otelcol-openlora", "--version"])


def test_the_tests_mirror_the_package_a_folder_per_domain() -> None:
    """No test module at the top of tests/: each is in its domain's folder (training/, hardware/, serving/,
    run/, ... and project/ and suite/ for the repository's and the suite's own checks), a package of its
    own so that two folders may hold files of one name."""
    assert sorted(path.name for path in TESTS.glob("test_*.py")) == []
    folders = sorted(path.parent for path in TESTS.rglob("test_*.py"))
    assert folders
    for folder in set(folders):
        assert folder.parent == TESTS, folder
        assert (folder / "__init__.py").is_file(), folder


def test_the_files_run_first_exist() -> None:
    """tests/support/order.py's SLOW_FILES_FIRST names files that are there (a moved file would
    silently drop back to the end of the run)."""
    from tests.support.order import SLOW_FILES_FIRST

    tests = Path(__file__).resolve().parent.parent
    assert [name for name in SLOW_FILES_FIRST if not (tests / name).is_file()] == []

"""What a release would publish: the sdist and the wheel that .ci/run builds into build/packaging/dist,
checked by twine, the wheel installed in a fresh virtual environment (build/packaging/wheel-venv) and its
command run. Nothing is downloaded here: without the artifacts the tests skip (fail under CI, where
.ci/run must have made them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from openlora_otel import __version__

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "build" / "packaging"
DIST = PACKAGING / "dist"
WHEEL_VENV = PACKAGING / "wheel-venv"
# Files every archive must hold beside the modules: the rules the stack writes, the typing marker, and
# what the report's HTML page inlines (the vendored uPlot, the page's own style and script).
PACKAGE_DATA = (
    "openlora_otel/rules/openlora.yml",
    "openlora_otel/py.typed",
    "openlora_otel/report/vendor/uplot/uPlot.iife.min.js",
    "openlora_otel/report/vendor/uplot/uPlot.min.css",
    "openlora_otel/report/assets/page.css",
    "openlora_otel/report/assets/page.js",
)


def artifacts() -> tuple[Path, Path]:
    """The sdist and the wheel of this version; skips (fails under CI) when .ci/run has not built them."""
    sdists = sorted(DIST.glob(f"openlora_otel-{__version__}.tar.gz"))
    wheels = sorted(DIST.glob(f"openlora_otel-{__version__}-py3-none-any.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        message = f"no sdist and wheel of {__version__} in {DIST}: run the packaging step of .ci/run"
        if os.environ.get("CI"):
            pytest.fail(message + " (.ci/run must build them)")
        pytest.skip(message)
    return sdists[0], wheels[0]


def modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "openlora_otel").rglob("*.py")}


def test_ci_builds_with_the_dev_extra_pins() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name in ("build", "twine"):
        pin = re.search(rf'"({name}==[\w.]+)"', pyproject).group(1)
        assert f'"{pin}"' in ci, pin
    assert "--outdir build/packaging/dist" in ci and "build/packaging/wheel-venv/bin/openlora-otel --help" in ci
    # Before the README's test command runs.
    assert ci.index("build/packaging/wheel-venv") < ci.index('bash -c "$test_command"')


STALE = "built before these files existed? run the packaging lines of .ci/run again"


def test_wheel_holds_the_modules_the_rules_and_py_typed() -> None:
    _, wheel = artifacts()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert modules() <= names, f"missing: {sorted(modules() - names)} ({STALE})"
        for name in PACKAGE_DATA:
            assert archive.read(name) == (ROOT / name).read_bytes(), name
        info = f"openlora_otel-{__version__}.dist-info"
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        assert "openlora-otel = openlora_otel.cli:main" in entry_points
        metadata = archive.read(f"{info}/METADATA").decode()
    assert "Requires-Python: >=3.11" in metadata
    assert "Provides-Extra: docs" in metadata and "Provides-Extra: serve" in metadata
    # No tests, docs or build outputs in the wheel: only the package and its metadata.
    assert {name.split("/", 1)[0] for name in names} == {"openlora_otel", info}


def test_sdist_holds_the_sources_the_rules_and_py_typed() -> None:
    sdist, _ = artifacts()
    top = f"openlora_otel-{__version__}"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(top + "/") for name in archive.getnames()}
        for name in (*PACKAGE_DATA, "pyproject.toml", "README.md", "PKG-INFO"):
            assert name in names, name
        assert modules() <= names, f"missing: {sorted(modules() - names)} ({STALE})"
        rules = archive.extractfile(f"{top}/openlora_otel/rules/openlora.yml").read()
    assert rules == (ROOT / "openlora_otel" / "rules" / "openlora.yml").read_bytes()


@pytest.mark.process
def test_twine_check_passes() -> None:
    sdist, wheel = artifacts()
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


@pytest.mark.process
def test_the_installed_wheel_runs_its_command() -> None:
    artifacts()
    command = WHEEL_VENV / "bin" / "openlora-otel"
    if not command.is_file():
        message = f"{command} is missing: run the packaging step of .ci/run"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    env = {"PATH": os.environ.get("PATH", ""), "COLUMNS": "100"}
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: openlora-otel")
    # The installed copy, not this checkout: the wheel's package and its rules.
    where = subprocess.run(
        [
            str(WHEEL_VENV / "bin" / "python"),
            "-c",
            "import openlora_otel, openlora_otel.stack as s; print(openlora_otel.__file__); print(len(s.rules_text()))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/",
    )
    assert where.returncode == 0, where.stderr
    path, size = where.stdout.split()
    assert str(WHEEL_VENV) in path and ROOT.as_posix() not in path.replace(str(WHEEL_VENV), "")
    assert int(size) == len((ROOT / "openlora_otel" / "rules" / "openlora.yml").read_text())

"""The skips for a missing real part (tests/support/real_parts.py) are counted by part after the run, with
the one command that sets them all up (tests/conftest.py); nothing is said when none is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import real_parts
from tests.support.built import TARGETS
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]

# A tiny suite that needs one part of each kind, through the helpers the real tests use, a module-scoped
# fixture that skips for every test that uses it, and one skip for another reason.
TESTS = '''
import pytest

from tests.support.aiperf import aiperf_binary
from tests.support.built import built
from tests.support.prometheus_server import prometheus_binary


@pytest.fixture(scope="module")
def vmalert():
    return built("vmalert")


def test_debian_prometheus():
    prometheus_binary(2)


def test_built_collector():
    built("otelcol-openlora")


def test_built_prometheus():
    prometheus_binary(3)


def test_first_of_a_module_fixture(vmalert):
    pass


def test_second_of_a_module_fixture(vmalert):
    pass


def test_aiperf():
    aiperf_binary()


def test_another_reason():
    pytest.skip("not a real part")


def test_passes():
    pass
'''

HEADER = "skipped: real parts missing on this machine"


def run_suite(tmp_path: Path, *, present: bool, ci: bool = False) -> subprocess.CompletedProcess[str]:
    """The tiny suite with tests/conftest.py as its plugin, the real parts all there (executables of one
    line each: nothing runs them) or none."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_needs_parts.py").write_text(TESTS)
    bin_dir, path_dir = tmp_path / "bin", tmp_path / "path"
    bin_dir.mkdir()
    path_dir.mkdir()
    if present:
        for directory, name in (
            (bin_dir, "otelcol-openlora"),
            (bin_dir, "prometheus"),
            (bin_dir, "vmalert"),
            (bin_dir, "aiperf"),
            (path_dir, "prometheus"),
        ):
            (directory / name).write_text("#!/bin/sh\nexit 0\n")
            (directory / name).chmod(0o755)
    env = child_env(
        OPENLORA_BIN_DIR=str(bin_dir),
        OPENLORA_AIPERF=str(bin_dir / "aiperf"),
        PATH=str(path_dir),  # Debian's prometheus is looked up there
        PYTHONPATH=str(ROOT),
    )
    for name in ("CI", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    if ci:
        env["CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "tests.conftest", str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.process
def test_the_skips_for_missing_parts_are_counted_by_part_with_the_set_up_command(tmp_path: Path) -> None:
    result = run_suite(tmp_path, present=False)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    lines = out.splitlines()
    # The block: its header, one line per part in the registry's order, the command; then the counts.
    start = next(i for i, line in enumerate(lines) if HEADER in line)
    assert re.fullmatch(rf"-+ 6 {HEADER} -+", lines[start]), lines[start]
    assert lines[start + 1 : start + 5] == [
        f"1 need {real_parts.PARTS['debian:prometheus']}",
        f"4 need {real_parts.PARTS['build/bin']}",
        f"1 need {real_parts.PARTS['.venv-aiperf']}",
        f"Set them all up with one command, then run the tests again: {real_parts.SETUP}",
    ], out
    assert re.fullmatch(r"1 passed, 7 skipped in [\d.]+s", lines[start + 5]), out
    # The skip messages themselves are the ones each helper says.
    assert "otelcol-openlora is not built: run tools/build.sh collector" in out
    assert "not a real part" in out


@pytest.mark.process
def test_nothing_is_said_when_no_real_part_is_missing(tmp_path: Path) -> None:
    result = run_suite(tmp_path, present=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert HEADER not in result.stdout and real_parts.SETUP not in result.stdout, result.stdout
    assert re.search(r"^7 passed, 1 skipped in ", result.stdout, re.M), result.stdout


@pytest.mark.process
def test_under_ci_a_missing_part_fails_and_is_not_counted_as_a_skip(tmp_path: Path) -> None:
    result = run_suite(tmp_path, present=False, ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert HEADER not in result.stdout, result.stdout
    assert f"{real_parts.SETUP}, which .ci/run runs, sets it up" in result.stdout
    assert re.search(r"^4 failed, 1 passed, 1 skipped, 2 errors in ", result.stdout, re.M), result.stdout


def test_every_part_is_one_the_set_up_command_sets_up() -> None:
    """Each Debian part is a package the set-up installs; build/bin and .venv-aiperf are its other steps."""
    setup = (ROOT / real_parts.SETUP).read_text()
    install = re.search(r"apt-get install [^\n]*", setup.replace("\\\n", " ")).group(0)
    for part in real_parts.PARTS:
        if part.startswith("debian:"):
            assert re.search(rf"\s{re.escape(part.removeprefix('debian:'))}\s", install), part
    assert "\ntools/build.sh\n" in setup and "python3 -m venv .venv-aiperf" in setup
    assert set(real_parts.PARTS) - {p for p in real_parts.PARTS if p.startswith("debian:")} == {
        "build/bin",
        ".venv-aiperf",
    }
    assert os.access(ROOT / real_parts.SETUP, os.X_OK)


def test_every_binary_tools_build_makes_names_its_target() -> None:
    """A missing binary's skip names the tools/build.sh target that builds it: each target is there."""
    script = (ROOT / "tools" / "build.sh").read_text()
    (default,) = re.findall(r'^names="([^"]*)"$', script, re.MULTILINE)
    assert "|| targets=($names)" in script
    assert set(TARGETS.values()) == set(default.split())

"""The README stays true: its variable table, its two commands, and CI running the same test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from openlora_otel.commands.env import variables_markdown
from tests.support import docs_text
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
README = docs_text.text("README.md")
# The pages that carry the generated tables and the AIPerf install line.
CONFIGURATION_PAGE = "docs/reference/configuration.md"
METRICS_PAGE = "docs/reference/metrics.md"
TESTING_PAGE = "docs/testing.md"


def block(marker: str) -> str:
    return docs_text.fenced("README.md", marker, "bash")


def test_environment_table_matches_the_config_module() -> None:
    assert variables_markdown() in docs_text.text(CONFIGURATION_PAGE)


@pytest.mark.process
def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = block("test-command")
    assert "pytest" in command
    extracted = subprocess.run(
        [
            "bash",
            "-c",
            "sed -n '/<!-- test-command:start -->/,/<!-- test-command:end -->/p' README.md "
            "| grep -v -e '^<!--' -e '^```'",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == command
    assert 'bash -c "$test_command"' in (ROOT / ".ci" / "run").read_text()


def test_the_test_command_runs_a_test_file_to_a_worker() -> None:
    """The suite runs on pytest-xdist workers, a file to a worker (--dist loadfile): the module-scoped
    fixtures (a trained adapter, a running server) are then built once, not once per worker."""
    command = block("test-command")
    assert re.search(r"pytest -q -n \d+ --dist loadfile$", command), command


def test_ci_sets_up_the_real_parts_with_the_newcomers_command() -> None:
    """.ci/run sets up the real parts with tools/setup-real-parts.sh, the command the README and the skip
    summary name, before the test command, and keeps no copy of its steps."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^tools/setup-real-parts\.sh$", ci, re.M)
    assert ci.index("tools/setup-real-parts.sh") < ci.index('bash -c "$test_command"')
    for step in ("apt-get", "tools/build.sh\n", "aiperf_version="):
        assert step not in ci, step
    setup = (ROOT / "tools" / "setup-real-parts.sh").read_text()
    for step in ("apt-get install", "\ntools/build.sh\n", "aiperf_version="):
        assert step in setup, step


def test_ci_installs_the_aiperf_the_tests_and_readme_name() -> None:
    """The set-up's pinned AIPerf is the version tests/support/aiperf.py checks and the README installs."""
    from tests.support.aiperf import VERSION

    ci = (ROOT / "tools" / "setup-real-parts.sh").read_text()
    assert re.search(r"^aiperf_version=(\S+)$", ci, re.M).group(1) == VERSION
    assert '.venv-aiperf/bin/pip install -q "aiperf==$aiperf_version"' in ci
    install = f"python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install -q aiperf=={VERSION}"
    assert install in docs_text.text(TESTING_PAGE)
    assert ".venv-aiperf/" in (ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.process
def test_run_command_installs_pinned_torch_first_and_runs_the_demo() -> None:
    command = block("run-command")
    assert command.index("torch==2.13.0") < command.index('-e ".[demo')
    assert re.search(r"openlora-otel demo\b", command)
    # The same entry point, briefly (the full run is tests/demo/test_demo.py).
    env = child_env(OTEL_EXPORTER_PROMETHEUS_PORT="0")
    result = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "demo", "--steps", "3", "--eval-every", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"metrics: served at http://localhost:\d+/metrics", result.stderr)
    assert "3 steps" in result.stdout


@pytest.mark.process
def test_quickstart_example_runs_and_serves() -> None:
    env = child_env(OTEL_EXPORTER_PROMETHEUS_PORT="0")
    script = ROOT / "examples" / "quickstart.py"
    result = subprocess.run(
        [sys.executable, str(script), "--steps", "5", "--step-time", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"metrics -> http://localhost:\d+/metrics", result.stdout)
    assert "step 5/5" in result.stdout
    bad = subprocess.run(
        [sys.executable, str(script), "--steps", "-1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "must be > 0" in bad.stderr
    bad_env = subprocess.run(
        [sys.executable, str(script)],
        env={**env, "OTEL_METRICS_EXPORTER": "zipkin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_env.returncode == 2 and "OTEL_METRICS_EXPORTER='zipkin'" in bad_env.stderr


def test_metric_table_matches_the_names_module() -> None:
    from openlora_otel.commands.metrics import metrics_markdown, seeds_markdown

    assert metrics_markdown() in docs_text.text(METRICS_PAGE)
    assert seeds_markdown() in docs_text.text(METRICS_PAGE)


def test_gpu_metric_table_matches_the_names_module() -> None:
    from openlora_otel.commands.metrics import metrics_markdown
    from openlora_otel.names import GPU_METRICS

    assert metrics_markdown(GPU_METRICS) in docs_text.marked("docs/reference/gpu-metrics.md", "gpu-metrics-table")


def test_host_metric_table_matches_the_names_module() -> None:
    from openlora_otel.commands.metrics import metrics_markdown
    from openlora_otel.names import HOST_METRICS

    assert metrics_markdown(HOST_METRICS) in docs_text.marked("docs/reference/host-metrics.md", "host-metrics-table")

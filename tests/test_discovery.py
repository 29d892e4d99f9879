"""File-based discovery (OPENLORA_PROMETHEUS_FILE_SD_DIR): files, their lifetime, and a real Prometheus using them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openlora_otel import setup_telemetry
from openlora_otel.config import ConfigError, TelemetryConfig
from openlora_otel.discovery import FileSdRegistration, scrape_address
from tests.conftest import child_env, free_port
from tests.prometheus_server import Prometheus, prometheus_binary

ROOT = Path(__file__).resolve().parents[1]


def _config(directory: Path, **changes: object) -> TelemetryConfig:
    settings: dict[str, object] = {"prometheus_host": "127.0.0.1", "prometheus_port": 0, "handle_sigterm": False}
    settings.update(changes)
    return TelemetryConfig(file_sd_dir=str(directory), **settings)  # type: ignore[arg-type]


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


def test_a_running_process_is_registered_and_removed_at_shutdown(tmp_path: Path) -> None:
    directory = tmp_path / "sd" / "nested"  # created when missing
    telemetry = setup_telemetry(config=_config(directory))
    port = int(telemetry.prometheus_url.rsplit(":", 1)[1].split("/")[0])  # type: ignore[union-attr]
    [path] = _files(directory)
    assert path.name == f"openlora-{socket.gethostname()}-{port}.json"
    assert json.loads(path.read_text()) == [{"targets": [f"127.0.0.1:{port}"], "labels": {}}]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no temporary left
    telemetry.shutdown()
    assert _files(directory) == []


def test_no_file_without_the_variable_or_without_the_pull_endpoint(tmp_path: Path) -> None:
    telemetry = setup_telemetry(config=_config(tmp_path, exporters=("none",)))
    telemetry.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_a_wildcard_bind_is_registered_under_the_host_name() -> None:
    assert scrape_address("0.0.0.0", 9464) == f"{socket.gethostname()}:9464"
    assert scrape_address("::1", 9464) == "[::1]:9464"
    assert scrape_address("node-3.cluster", 9465) == "node-3.cluster:9465"


def test_an_unusable_directory_fails_setup_naming_the_variable_and_frees_the_port(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    port = free_port()
    config = _config(blocker / "sd", prometheus_port=port)
    with pytest.raises(ConfigError) as info:
        setup_telemetry(config=config)
    assert info.value.variable == "OPENLORA_PROMETHEUS_FILE_SD_DIR"
    assert str(blocker / "sd") in str(info.value)
    with socket.socket() as probe:  # the endpoint bound before the failure was closed again
        probe.bind(("127.0.0.1", port))


def test_a_file_left_by_a_killed_process_is_removed_by_the_next_one(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead_port = free_port()  # nothing listens there
    stale = tmp_path / f"openlora-{host}-{dead_port}.json"
    stale.write_text(json.dumps([{"targets": [f"127.0.0.1:{dead_port}"], "labels": {}}]))
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live_port = listening.getsockname()[1]
        live = tmp_path / f"openlora-{host}-{live_port}.json"
        live.write_text(json.dumps([{"targets": [f"127.0.0.1:{live_port}"], "labels": {}}]))
        other_host = tmp_path / f"openlora-elsewhere-{dead_port}.json"  # another node's: not ours to judge
        other_host.write_text(json.dumps([{"targets": [f"127.0.0.1:{dead_port}"], "labels": {}}]))
        telemetry = setup_telemetry(config=_config(tmp_path))
        try:
            assert not stale.exists()
            assert live.exists()
            assert other_host.exists()
        finally:
            telemetry.shutdown()


def test_a_forked_child_leaves_the_parents_file(tmp_path: Path) -> None:
    path = tmp_path / "openlora-x-1.json"
    path.write_text("[]")
    registration = FileSdRegistration(path)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        registration.remove()
        os._exit(0)
    os.waitpid(pid, 0)
    assert path.exists()
    registration.remove()
    assert not path.exists()
    registration.remove()  # idempotent


_RANK = """
import sys, time
from openlora_otel import setup_telemetry
telemetry = setup_telemetry()
for _ in range({steps}):
    telemetry.training.record_step(loss=1.0, tokens=10)
print(telemetry.prometheus_url, flush=True)
time.sleep(120)
"""


@pytest.mark.e2e
def test_prometheus_discovers_two_ranks_and_drops_them_when_they_exit(tmp_path: Path) -> None:
    prometheus_binary()
    directory = tmp_path / "sd"
    ranks = []
    prometheus = None
    try:
        for rank, steps in ((0, 30), (1, 20)):
            env = child_env(
                OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                OTEL_EXPORTER_PROMETHEUS_PORT=str(free_port()),
                OPENLORA_PROMETHEUS_FILE_SD_DIR=str(directory),
                OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
                OPENLORA_RUN_ID="sd-run",
                OPENLORA_QUIET="true",
                RANK=str(rank),
                WORLD_SIZE="2",
                PYTHONPATH=str(ROOT),
            )
            process = subprocess.Popen(
                [sys.executable, "-c", _RANK.format(steps=steps)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            ranks.append(process)
        for process in ranks:
            assert process.stdout is not None
            assert process.stdout.readline().startswith("http://127.0.0.1:"), process.stderr
        assert len(_files(directory)) == 2
        prometheus = Prometheus(tmp_path, [], file_sd=[str(directory / "*.json")])
        found = prometheus.wait_for('count(up{job="openlora"} == 1) == 2', timeout=30)
        assert found, prometheus.active_targets()
        info = prometheus.wait_for('target_info{openlora_run_id="sd-run"}')
        assert sorted(series["metric"]["openlora_rank"] for series in info) == ["0", "1"]
        steps = prometheus.wait_for("openlora_training_steps_total")
        assert sorted(float(series["value"][1]) for series in steps) == [20.0, 30.0]
        for process in ranks:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)
        assert [process.returncode for process in ranks] == [143, 143]
        assert _files(directory) == []
        deadline = time.monotonic() + 30
        while prometheus.active_targets() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert prometheus.active_targets() == []
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        if prometheus is not None:
            prometheus.stop()

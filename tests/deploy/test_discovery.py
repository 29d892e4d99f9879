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
from openlora_otel.exporters import discovery
from openlora_otel.exporters.discovery import FileSdRegistration, _host_label, scrape_address
from tests.support.processes import child_env, free_port
from tests.support.prometheus_server import Prometheus, prometheus_binary

ROOT = Path(__file__).resolve().parents[2]


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
    assert path.name == f"openlora-{_host_label()}-{port}.json"
    assert json.loads(path.read_text()) == [{"targets": [f"127.0.0.1:{port}"], "labels": {}}]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no temporary left
    telemetry.shutdown()
    assert _files(directory) == []


def test_no_file_without_the_variable_or_without_the_pull_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    telemetry = setup_telemetry(config=_config(tmp_path, exporters=("none",)))
    telemetry.shutdown()
    monkeypatch.chdir(tmp_path)
    telemetry = setup_telemetry(config=_config(tmp_path).replace(file_sd_dir=None))
    telemetry.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_the_directory_variable_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert TelemetryConfig.from_env({"OPENLORA_PROMETHEUS_FILE_SD_DIR": "sd"}).file_sd_dir == str(tmp_path / "sd")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert TelemetryConfig.from_env({"OPENLORA_PROMETHEUS_FILE_SD_DIR": "~/x"}).file_sd_dir == str(tmp_path / "x")


def test_odd_files_of_this_host_neither_hang_nor_break_registration(tmp_path: Path) -> None:
    prefix = f"openlora-{_host_label()}-"
    os.mkfifo(tmp_path / f"{prefix}1.json")  # reading it would block forever
    (tmp_path / f"{prefix}2.json").write_text("[" * 100_000 + "]" * 100_000)  # RecursionError in json
    (tmp_path / f"{prefix}3.json").write_text("x" * 100_000)
    (tmp_path / f"{prefix}4.json").write_text('{"targets": 1}')
    started = time.monotonic()
    telemetry = setup_telemetry(config=_config(tmp_path))
    telemetry.shutdown()
    assert time.monotonic() - started < 10
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{prefix}{n}.json" for n in (1, 2, 3, 4)]


def test_a_file_rewritten_by_a_new_process_during_the_check_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restarted rank binds the dead rank's port and writes its file between our
    # refused connect and the removal: the new file must stay.
    dead_port = free_port()
    stale = tmp_path / f"openlora-{_host_label()}-{dead_port}.json"
    stale.write_text(json.dumps([{"targets": [f"127.0.0.1:{dead_port}"], "labels": {}}]))
    refused = discovery._refused

    def refused_then_replaced(address: tuple[str, int]) -> bool:
        answer = refused(address)
        replacement = tmp_path / ".replacement"
        replacement.write_text(stale.read_text())
        os.replace(replacement, stale)
        return answer

    monkeypatch.setattr(discovery, "_refused", refused_then_replaced)
    telemetry = setup_telemetry(config=_config(tmp_path))
    telemetry.shutdown()
    assert stale.exists()


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
    host = _host_label()
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


@pytest.mark.process  # a forked child
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
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            ranks.append(process)
        deadline = time.monotonic() + 60
        while len(_files(directory)) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in ranks), [p.communicate()[1][-2000:] for p in ranks]
            time.sleep(0.1)
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

"""Many ranks, one run: the run id in every launch form, and two torchrun nodes on one host.

Real launchers (torchrun, plain torch.distributed with gloo) on CPU and loopback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openlora_otel import setup_telemetry
from openlora_otel.config import TelemetryConfig
from openlora_otel.run import identity
from tests.support.processes import child_env, free_port
from tests.support.prometheus_server import Prometheus, prometheus_binary

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# One rank: set up telemetry, report what it got, optionally wait for the test to say stop.
_RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from openlora_otel import setup_telemetry
if os.environ.get("INIT_FIRST") == "1":
    import torch.distributed as dist
    dist.init_process_group("gloo")
try:
    telemetry = setup_telemetry()
except ValueError as error:  # ConfigError; exit 0 so that torchrun's exit barrier does not wait 300 s
    print(f"SETUP FAILED: {error}", file=sys.stderr, flush=True)
    if os.environ.get("STOP_FILE"):
        Path(os.environ["STOP_FILE"]).touch()  # the other ranks need not hold their ports any longer
    sys.exit(0)
for _ in range(int(os.environ.get("STEPS", "0"))):
    telemetry.training.record_step(loss=1.0, tokens=5)
# One write() of the whole line: the ranks share torchrun's stdout, and print() may write the text
# and its newline apart, so that another rank's line lands between them.
sys.stdout.flush()
os.write(1, ("REPORT " + json.dumps({"rank": os.environ.get("RANK"), "run_id": telemetry.run_id,
                                     "url": telemetry.prometheus_url}) + "\\n").encode())
stop = os.environ.get("STOP_FILE")
deadline = time.monotonic() + float(os.environ.get("HOLD_S", "0"))
while time.monotonic() < deadline and not (stop and Path(stop).exists()):
    time.sleep(0.1)
telemetry.shutdown()
"""


def _env(**extra: str) -> dict[str, str]:
    settings = {"OTEL_METRICS_EXPORTER": "none", "OPENLORA_QUIET": "true", "PYTHONPATH": str(ROOT)}
    return child_env(**{**settings, **extra})


def _reports(output: str) -> list[dict]:
    """Every rank's REPORT object, wherever the shared stdout put it (two once ran together on a line)."""
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(part)[0] for part in output.split("REPORT ")[1:]]
    return sorted(found, key=lambda report: int(report["rank"]))


def _launch(arguments: list[str], script: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*TORCHRUN, *arguments, str(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate(timeout=10)
        pytest.fail(f"launcher did not finish: {err[-3000:]}")


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(_RANK_SCRIPT)
    return path


@pytest.mark.process
@pytest.mark.parametrize(
    "form",
    ["standalone", "static", "c10d-with-rdzv-id"],
)
def test_every_rank_of_a_torchrun_job_gets_the_same_run_id(form: str, script: Path) -> None:
    port = free_port()
    arguments = {
        "standalone": ["--standalone"],
        # The usual multi-node form: no --rdzv-id, so TORCHELASTIC_RUN_ID is "none".
        "static": ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"],
        "c10d-with-rdzv-id": [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=job-42",
        ],
    }[form]
    out, err = _finish(_launch([*arguments, "--nproc-per-node=2"], script, _env()))
    reports = _reports(out)
    assert [r["rank"] for r in reports] == ["0", "1"], err[-3000:]
    run_ids = {r["run_id"] for r in reports}
    assert len(run_ids) == 1, reports
    (run_id,) = run_ids
    assert run_id != "none"
    if form == "c10d-with-rdzv-id":
        assert run_id == "job-42"
    assert "made up its own run id" not in err


def _plain_ranks(script: Path, *, init_first: bool) -> tuple[list[dict], str]:
    """Two processes started the way mp.spawn or srun would, with torch.distributed's env:// variables."""
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                INIT_FIRST="1" if init_first else "0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [_finish(process) for process in processes]
    return _reports("".join(out for out, _ in outputs)), "".join(err for _, err in outputs)


@pytest.mark.process
def test_plain_torch_distributed_ranks_share_the_run_id_of_the_process_group(script: Path) -> None:
    reports, err = _plain_ranks(script, init_first=True)
    assert [r["rank"] for r in reports] == ["0", "1"], err[-3000:]
    assert reports[0]["run_id"] == reports[1]["run_id"]


@pytest.mark.process
def test_a_rank_that_cannot_share_an_id_says_how_to(script: Path) -> None:
    reports, err = _plain_ranks(script, init_first=False)
    assert len(reports) == 2, err[-3000:]
    assert reports[0]["run_id"] != reports[1]["run_id"]
    assert "made up its own run id" in err
    assert "OPENLORA_RUN_ID" in err


def test_srun_tasks_share_the_slurm_job_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "81234")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), handle_sigterm=False))
    assert telemetry.run_id == "slurm-81234.3"
    telemetry.shutdown()


def test_runs_one_after_another_in_an_interactive_slurm_step_get_their_own_ids() -> None:
    # srun --pty bash, salloc: every python started there sees the same job and step.
    env = {"SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    first, second = identity.shared_run_id(env), identity.shared_run_id(env)
    assert first[1] == second[1] == "random"
    assert first[0] != second[0]


def test_the_explicit_run_id_wins_over_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "81234")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    monkeypatch.setenv("OPENLORA_RUN_ID", "mine")
    telemetry = setup_telemetry(config=TelemetryConfig.from_env().replace(exporters=("none",)))
    assert telemetry.run_id == "mine"
    telemetry.shutdown()


def test_an_unreachable_torchrun_store_is_survived(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(identity, "STORE_TIMEOUT_S", 0.5)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with caplog.at_level(logging.WARNING):
        run_id, source = identity.shared_run_id(env)
    assert source == "random" and len(run_id) == 16
    assert "could not agree on a run id through torchrun's store" in caplog.text


_SILENT_STORE = """
import os, time
os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1")
from openlora_otel import setup_telemetry
from openlora_otel.run import identity
identity.STORE_TIMEOUT_S = 1.0
started = time.monotonic()
telemetry = setup_telemetry()
print("SETUP TOOK", round(time.monotonic() - started, 2), telemetry.run_id, flush=True)
telemetry.shutdown()
"""

# The store's side, in a process of its own as torchrun's agent is: the kernel accepts, nobody
# ever answers, and the connection stays open while the worker exits.
_SILENT_SERVER = """
import socket, time
silent = socket.socket()
silent.bind(("127.0.0.1", 0))
silent.listen()
print(silent.getsockname()[1], flush=True)
time.sleep(120)
"""


@pytest.mark.process
def test_a_store_that_accepts_and_never_answers_does_not_hold_setup() -> None:
    # In a child: the process then ends with the agreeing thread still waiting in torch's
    # C++ code, which must not turn the exit into an abort.
    server = subprocess.Popen([sys.executable, "-c", _SILENT_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        result = subprocess.run(
            [sys.executable, "-c", _SILENT_STORE],
            cwd=ROOT,
            env=_env(MASTER_PORT=port),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.kill()
        server.wait(10)
    assert result.returncode == 0, result.stderr[-3000:]
    took = float(result.stdout.split("SETUP TOOK ")[1].split()[0])
    assert took < 10  # 1 s bound; generous for a loaded machine, far below "forever"
    assert "no answer within 1 s" in result.stderr


def _two_free_ports(gap: int) -> int:
    """A free port whose neighbour ``gap`` above is free too (the second node's base)."""
    for _ in range(50):
        base = free_port()
        if base + gap > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + gap))
            except OSError:
                continue
        return base
    pytest.fail("no two free ports found")


@pytest.mark.e2e
def test_two_torchrun_nodes_on_one_host(tmp_path: Path, script: Path) -> None:
    """Two launchers (--nnodes=2, c10d on 127.0.0.1): first on one base port, then one base port per node."""
    prometheus_binary()
    # 1. Same base port on both "nodes": LOCAL_RANK 0 twice, one of them cannot bind, and the error says why.
    base = _two_free_ports(8)
    rendezvous = free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rendezvous}"]
    stop = tmp_path / "stop-clash"
    env = _env(
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(base),
        HOLD_S="90",
        STOP_FILE=str(stop),
    )
    nodes = [_launch([*common, f"--node-rank={n}", "--rdzv-id=clash"], script, env) for n in (0, 1)]
    # The rank that cannot bind touches the stop file; the other holds its port until then.
    outputs = [_finish(node) for node in nodes]
    errors = "".join(err for _, err in outputs)
    assert len(_reports("".join(out for out, _ in outputs))) == 1, errors[-3000:]
    assert f"cannot serve metrics on 127.0.0.1:{base}" in errors
    assert "OPENLORA_PROMETHEUS_PORT_OFFSET=rank" in errors

    # 2. One base port per node (the documented recipe), registered for file-based discovery.
    directory = tmp_path / "sd"
    stop = tmp_path / "stop"
    rendezvous = free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rendezvous}"]
    prometheus = None
    nodes = []
    try:
        for node in (0, 1):
            env = _env(
                OTEL_METRICS_EXPORTER="prometheus",
                OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                OTEL_EXPORTER_PROMETHEUS_PORT=str(base + 8 * node),
                OPENLORA_PROMETHEUS_FILE_SD_DIR=str(directory),
                OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
                STEPS=str(10 * (node + 1)),
                HOLD_S="90",
                STOP_FILE=str(stop),
            )
            nodes.append(_launch([*common, f"--node-rank={node}", "--rdzv-id=two-nodes"], script, env))
        deadline = time.monotonic() + 90
        while len(list(directory.glob("*.json"))) < 2 and time.monotonic() < deadline:
            assert all(node.poll() is None for node in nodes), [node.communicate() for node in nodes]
            time.sleep(0.2)
        prometheus = Prometheus(tmp_path, [], file_sd=[str(directory / "*.json")])
        info = prometheus.wait_for('count(target_info{openlora_run_id="two-nodes"}) == 2', timeout=30)
        assert info, prometheus.active_targets()
        series = prometheus.query("target_info")
        assert {s["metric"]["openlora_world_size"] for s in series} == {"2"}
        assert sorted(s["metric"]["openlora_rank"] for s in series) == ["0", "1"]
        assert {s["metric"]["openlora_local_rank"] for s in series} == {"0"}
        ports = sorted(int(s["metric"]["instance"].rsplit(":", 1)[1]) for s in series)
        assert ports == [base, base + 8]
        steps = prometheus.wait_for("openlora_training_steps_total")
        assert sorted(float(s["value"][1]) for s in steps) == [10.0, 20.0]
        stop.touch()
        for node in nodes:
            _, err = _finish(node, timeout=60)
            assert node.returncode == 0, err[-3000:]
        assert list(directory.glob("*.json")) == []
    finally:
        stop.touch()
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=10)
        if prometheus is not None:
            prometheus.stop()
        shutil.rmtree(directory, ignore_errors=True)


_SLOW_TORCH = '''
import threading, time
print("TORCH IMPORTED ON", threading.current_thread().name, flush=True)
time.sleep(1.5)  # longer than the store bound: a slow import on a loaded machine
'''

_SLOW_TORCH_DISTRIBUTED = '''
import time


class TCPStore:
    def __init__(self, *args, **kwargs):
        pass

    def compare_set(self, key, expected, desired):
        time.sleep(3600)  # a store that never answers
'''


@pytest.mark.process
def test_torch_is_imported_before_the_bounded_wait_not_inside_it(tmp_path: Path) -> None:
    """The store's bound covers only the store: an import running past it would be cut by the exit."""
    fake = tmp_path / "torch"
    (fake / "distributed").mkdir(parents=True)
    (fake / "__init__.py").write_text(_SLOW_TORCH)
    (fake / "distributed" / "__init__.py").write_text(_SLOW_TORCH_DISTRIBUTED)
    script = (
        "from openlora_otel import setup_telemetry\n"
        "from openlora_otel.run import identity\n"
        "identity.STORE_TIMEOUT_S = 1.0\n"
        "telemetry = setup_telemetry()\n"
        "print('RUN ID', telemetry.run_id, flush=True)\n"
        "telemetry.shutdown()\n"
    )
    env = _env(
        PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TORCH IMPORTED ON MainThread" in result.stdout, result.stdout
    assert "RUN ID" in result.stdout and "no answer within 1 s" in result.stderr

"""Training-like rank processes of one run (a fake NVML each, steps of a given time, some of it
waiting for data) and the rules file the stores load: the run the cluster dashboard tests, and the
scale-out tests, query."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.processes import child_env, free_port_range, reap

ROOT = Path(__file__).resolve().parent.parent.parent
# The shipped rules file; it must define every record the cluster dashboard reads.
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"


# STAND-IN, for tests only: the contract's records with the expression shapes it describes,
# so that the dashboard can be run before the real group exists. Not shipped, not the
# reference: openlora_otel/rules/openlora.yml is. PromQL cannot turn a label into a value, so the
# stand-in's world size enumerates the sizes this test can meet.
def rules_text() -> str:
    """The rules the stores load: the shipped file."""
    return RULES.read_text()


def write_rules(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "openlora.yml"
    path.write_text(rules_text())
    return path


# -- the training-like rank processes ----------------------------------------------------------

# One rank: setup_telemetry() from the environment torchrun would set (and OPENLORA_RUN_NAME),
# its learning rate and LoRA r as hyperparameters, a fake NVML of
# WORLD_SIZE GPUs (the rank reports its own, by LOCAL_RANK), the adapter, a divergence guard,
# the model's FLOPs per token and its device's peak (argv[4], argv[5]), and steps of argv[1]
# seconds, of which argv[2] waiting for the batch, until SIGTERM (the SIGTERM guard shuts
# telemetry down) or argv[3] seconds. The first evaluation of LOCAL_RANK 1 has nothing to
# count (an empty shard): its accuracy is NaN.
RANK_SCRIPT = r"""
import os, sys, time
from openlora_otel import setup_telemetry
from openlora_otel.hardware import gpu, nvml
from openlora_otel.training.guard import DivergenceGuard
from tests.support.fake_nvml import FakeNvml, h100s

step_s, data_s, lifetime_s = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
flops_per_token, peak_flops = float(sys.argv[4]), float(sys.argv[5])
local_rank = int(os.environ["LOCAL_RANK"])
cards = h100s(int(os.environ["WORLD_SIZE"]), processes={os.getpid(): 2 * 2**30})
for index, card in enumerate(cards):
    card.utilization = 0.3 + 0.4 * index  # 0.3 and 0.7 on two GPUs: the node's mean is 0.5
# Rank 1's GPU has a row remap pending (degraded until a reset), so the cluster's GPU status
# panel has a rank to put first.
cards[1 % len(cards)].remap = (1, 0, 1, 0)
fake = FakeNvml(cards)
nvml.load_pynvml_backend = lambda: fake
# Rank 0's GPU reports one application XID (31, a page fault: no alert), as a cluster of any
# size sees now and then, so the XID panel has data; injected once the GPU is registered for
# events (at the first collection), as the driver delivers none before.
xid_card = cards[local_rank] if local_rank == 0 else None
stats = {"allocated_bytes.all.current": 10, "reserved_bytes.all.current": 20, "allocated_bytes.all.peak": 15}
uuid = cards[local_rank].uuid.removeprefix("GPU-")
gpu.torch_allocator_stats = lambda: [(local_rank, uuid, stats)]
telemetry = setup_telemetry("openlora-cluster-test", hyperparameters={"learning_rate": 1e-4, "lora_r": 8})
training = telemetry.training
training.set_adapter(r=8, alpha=16, dropout=0.05, target_modules=["q_proj", "v_proj"],
                     trainable_params=4096, total_params=1_000_000)
training.attach_guard(DivergenceGuard())
training.set_model_flops(flops_per_token, peak_flops=peak_flops)
print(telemetry.prometheus_url, flush=True)
deadline = time.monotonic() + lifetime_s
step = 0
while time.monotonic() < deadline:
    fetch = time.perf_counter()
    time.sleep(data_s)
    data_time = time.perf_counter() - fetch
    time.sleep(step_s - data_s)
    step += 1
    if xid_card is not None and xid_card.uuid in fake.registered:
        fake.inject_xid(xid_card, 31)
        xid_card = None
    training.record_step(
        loss=3.0 / (1 + step / 100), grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4,
        data_time_s=data_time,
    )
    if step % 10 == 0:
        accuracy = float("nan") if local_rank == 1 and step == 10 else 0.5
        training.record_eval(loss=3.5 / (1 + step / 100), accuracy=accuracy)
        training.record_epoch(step / 1000)
telemetry.shutdown()
"""


# The ranks' model: 1 MFLOP per token on a device of 100 GFLOP/s, so 512 tokens every 20 ms is
# an MFU of about a quarter.
FLOPS_PER_TOKEN, PEAK_FLOPS = 1e6, 1e11


class Ranks:
    """``len(step_seconds)`` rank processes of one run on this host, on base_port + LOCAL_RANK.

    ``data_seconds``: how much of each rank's step is spent waiting for its batch (none by default).
    ``push_env``: push the metrics this way (tests/support/metrics_paths.py) instead of serving them; each rank's
    service.instance.id, its ``instance`` label then, is ``<run_id>-rank<RANK>``, and ``targets`` lists those.
    """

    def __init__(
        self,
        run_id: str,
        step_seconds: list[float],
        *,
        data_seconds: list[float] | None = None,
        lifetime_s: float = 300.0,
        extra_env: dict[str, str] | None = None,
        run_name: str | None = None,
        push_env: dict[str, str] | None = None,
    ) -> None:
        data_seconds = data_seconds or [0.0] * len(step_seconds)
        assert len(data_seconds) == len(step_seconds)
        assert all(0 <= data <= step for data, step in zip(data_seconds, step_seconds, strict=True))
        self.run_id = run_id
        self.run_name = run_name or f"name of {run_id}"
        self.world_size = len(step_seconds)
        self.base_port = free_port_range(self.world_size)
        self.processes: list[subprocess.Popen] = []
        # Output to files, not pipes: a pipe nobody reads would block a chatty rank.
        self.logs = [tempfile.TemporaryFile() for _ in step_seconds]  # noqa: SIM115 (closed in stop())
        self.push = push_env is not None
        if self.push:
            self.targets = [f"{run_id}-rank{rank}" for rank in range(self.world_size)]
        else:
            self.targets = [f"127.0.0.1:{self.base_port + rank}" for rank in range(self.world_size)]
        for rank, step_s in enumerate(step_seconds):
            push = (
                {**push_env, "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={self.targets[rank]}"}
                if push_env is not None
                else {}
            )
            env = child_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.world_size),
                OPENLORA_RUN_ID=run_id,
                OPENLORA_RUN_NAME=self.run_name,
                OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                # The port offset by LOCAL_RANK (the default), as under torchrun.
                OTEL_EXPORTER_PROMETHEUS_PORT=str(self.base_port),
                OPENLORA_GPU_METRICS="on",
                OPENLORA_QUIET="true",
                OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
                PYTHONPATH=str(ROOT),
                **(extra_env or {}),
                **push,
            )
            args = (step_s, data_seconds[rank], lifetime_s, FLOPS_PER_TOKEN, PEAK_FLOPS)
            try:
                process = subprocess.Popen(
                    [sys.executable, "-c", RANK_SCRIPT, *map(str, args)],
                    cwd=ROOT,
                    env=env,
                    stdout=self.logs[rank],
                    stderr=subprocess.STDOUT,
                )
            except BaseException:
                self.stop()
                raise
            self.processes.append(process)

    def wait_serving(self, timeout: float = 60.0) -> None:
        if self.push:
            return  # nothing to serve: a test waits for their series instead
        deadline = time.monotonic() + timeout
        for process, target in zip(self.processes, self.targets, strict=True):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"rank at {target} exited: {self.output(target)}")
                try:
                    with urllib.request.urlopen(f"http://{target}/metrics", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"rank at {target} did not serve in {timeout} s") from None
                    time.sleep(0.2)

    def output(self, target: str) -> str:
        log = self.logs[self.targets.index(target)]
        log.seek(0)
        return log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            reap(process, 20)
        for log in self.logs:
            log.close()


@contextmanager
def ranks(
    run_id: str,
    step_seconds: list[float],
    data_seconds: list[float] | None = None,
    push_env: dict[str, str] | None = None,
) -> Iterator[Ranks]:
    started = Ranks(run_id, step_seconds, data_seconds=data_seconds, push_env=push_env)
    try:
        started.wait_serving()
        yield started
    finally:
        started.stop()


FAST_S, SLOW_S = 0.02, 0.08  # rank 1 is the straggler: ratio about 4 against rank 0, the median without it

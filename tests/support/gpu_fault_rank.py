"""One rank of a training-like run whose GPU is a fake NVML's (tests/support/fake_nvml.py), with a GPU
fault injected: what `openlora-otel diagnose` is proven on when no real GPU can be made to fail.

Run as a script, one process per rank, with the environment torchrun would give it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``) and ``OPENLORA_RUN_ID``, ``OPENLORA_HISTORY_DIR``: the real
``setup_telemetry()``, its GPU collection reading this rank's GPU (by ``LOCAL_RANK``) of a node of
``WORLD_SIZE`` H100s, steps of ``--step-ms`` recorded as a training loop records them. Tests start a
pair with :func:`start` and wait for it with :func:`finish`. From step
``--fault-at`` the ``--fault`` hits LOCAL_RANK 1's GPU:

- ``off-bus``: XID 79 and NVML loses the GPU; the rank stops stepping, goes on reporting for
  ``--linger-s`` and then raises (the CUDA error a real rank would die of).
- ``ecc``: an uncorrected ECC error; the rank goes on.
- ``remap-pending``: a row remap waits for a reset; the rank goes on.
- ``thermal``: the clock held down by heat 60 % of the time, at 1.2 GHz and 88 °C: its steps take twice
  as long.
- ``narrow-link``: the PCIe link trained at x8 of x16 (from the start): its steps take twice as long.
- ``memory-growth``: the torch allocator's allocated (and reserved) memory grows by 400 MiB a step
  from the start (20 GiB of 80 at first, as every rank's).
- ``oom``: the allocator counts an out-of-memory error; the rank lingers and raises (the error a
  real rank dies of).
- ``slowdown``: ``thermal`` on every rank's GPU (not only LOCAL_RANK 1's): the whole run slows.
- ``overfit``: every rank evaluates every 10 steps; the evaluation loss falls to its best at step 30
  and rises from there, while the training loss falls throughout.
- ``busy-host``: each rank on a node of its own (``host.name`` node-0 and node-1, both ``LOCAL_RANK`` 0,
  so each reports its node's CPUs), rank 1's node 92 % busy (the host metrics' CPU times scripted), rank 0's
  15 %: rank 1's steps take twice as long.
- ``none``: a healthy rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from openlora_otel import setup_telemetry  # noqa: E402
from openlora_otel.hardware import gpu, nvml  # noqa: E402
from tests.support.fake_nvml import FakeNvml, h100s  # noqa: E402
from tests.support.host_sources import Recorded  # noqa: E402

FAULTS = ("none", "off-bus", "ecc", "remap-pending", "thermal", "narrow-link", "memory-growth", "oom", "slowdown", "overfit",
          "busy-host")  # fmt: skip
DYING = ("off-bus", "oom")  # faults rank 1 dies of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fault-at", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--linger-s", type=float, default=1.5)
    args = parser.parse_args()
    local_rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    cards = h100s(world, processes={os.getpid(): 2 * 2**30})
    card = cards[local_rank]
    faulty = (local_rank == 1 or args.fault == "slowdown") and args.fault != "none"
    if args.fault == "busy-host":
        faulty = os.environ["RANK"] == "1"
        _busy_cpus(0.92 if faulty else 0.15)
    if faulty and args.fault == "narrow-link":
        card.link = (8, 5)
    fake = FakeNvml(cards)
    nvml.load_pynvml_backend = lambda: fake
    # The torch allocator of this rank's device, as torch.cuda.memory_stats() reports it.
    stats = {"allocated_bytes.all.current": 20 * 2**30, "reserved_bytes.all.current": 22 * 2**30,
             "allocated_bytes.all.peak": 21 * 2**30, "num_ooms": 0, "num_alloc_retries": 0}  # fmt: skip
    gpu.torch_allocator_stats = lambda: [(local_rank, card.uuid.removeprefix("GPU-"), dict(stats))]
    telemetry = setup_telemetry("gpu-fault-run", hyperparameters={"learning_rate": 1e-4})
    training = telemetry.training
    step_s = args.step_ms / 1000.0
    for step in range(1, args.steps + 1):
        slow = 2.0 if faulty and args.fault in ("narrow-link", "busy-host") else 1.0
        if faulty and step >= args.fault_at and args.fault in ("thermal", "slowdown"):
            slow = 2.0
            card.sm_clock_hz = 1.2e9
            card.temperature_c = 88.0
            card.throttle_ns["thermal"] += round(0.6 * slow * step_s * 1e9)
        if faulty and args.fault == "memory-growth":
            stats["allocated_bytes.all.current"] += 400 * 2**20
            stats["reserved_bytes.all.current"] += 400 * 2**20
        if faulty and step == args.fault_at:
            if args.fault == "oom":
                stats["num_ooms"] += 1
                time.sleep(args.linger_s)
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if args.fault == "off-bus":
                _when_watched(fake, card)
                fake.inject_xid(card, 79)
                card.failing = True
                time.sleep(args.linger_s)  # stuck in the step its GPU left under, still reporting
                # The error a real rank dies of; the telemetry's exit hooks write its last line.
                raise RuntimeError("CUDA error: unspecified launch failure")
            if args.fault == "ecc":
                card.ecc_uncorrected += 1
            if args.fault == "remap-pending":
                card.remap = (card.remap[0], card.remap[1] + 1, 1, 0)
        time.sleep(step_s * slow)
        training.record_step(loss=3.0 / (1 + step / 100), grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4)
        if args.fault == "overfit" and step % 10 == 0:
            training.record_eval(loss=2.5 - step / 40 if step <= 30 else 1.75 + (step - 30) / 200)
    telemetry.shutdown()
    return 0


def start(
    directory: Path, fault: str, fault_at: int, ports: int | None = None, *extra: str, push: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 of run ``gpu-<fault>`` side by side, each writing its history every 250 ms under
    ``directory/<fault>``; with ``ports``, serving its metrics for Prometheus on ``ports`` + its rank,
    with a last scrape at its exit; with ``push`` (an OTLP exporter's environment), pushing its metrics
    every 250 ms (as its history is written) instead. ``extra``: more arguments for both."""
    from tests.support.processes import child_env

    processes = []
    for rank in (0, 1):
        # busy-host: a node each, each rank its node's LOCAL_RANK 0 (the one that reports the node's CPUs).
        node = {"LOCAL_RANK": "0", "OTEL_RESOURCE_ATTRIBUTES": f"host.name=node-{rank}", "OPENLORA_HOST_METRICS": "true",
                "OPENLORA_PROMETHEUS_PORT_OFFSET": "rank"}  # fmt: skip
        exporting = {**push, "OTEL_METRIC_EXPORT_INTERVAL": "250"} if push else {"OTEL_METRICS_EXPORTER": "none"} if ports is None else {
            "OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(ports), "OPENLORA_PROMETHEUS_EXPECT_SCRAPE": "true"}  # fmt: skip
        env = child_env(**{
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OPENLORA_RUN_ID": f"gpu-{fault}",
            "OPENLORA_HISTORY_DIR": str(directory / fault), "OPENLORA_HISTORY_INTERVAL": "250",
            "OPENLORA_HOST_METRICS": "false", "OPENLORA_QUIET": "true", **exporting,
            **(node if fault == "busy-host" else {}),
        })  # fmt: skip
        processes.append(subprocess.Popen(
            [sys.executable, __file__, "--fault", fault, "--fault-at", str(fault_at), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    return processes


def finish(processes: list[subprocess.Popen], fault: str, timeout_s: float = 120.0) -> None:
    """Wait for the ranks :func:`start` started (killed after ``timeout_s``); each must have exited 0, but
    rank 1 of a fault in :data:`DYING`, which dies of its CUDA error as a real one would."""
    from tests.support.processes import reap

    for rank, process in enumerate(processes):
        try:
            output, _ = process.communicate(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
            reap(process, 10)
        assert process.returncode == (1 if fault in DYING and rank == 1 else 0), output


def _busy_cpus(busy: float) -> None:
    """The CPU times of a 4-CPU node whose CPUs are ``busy`` (a share) of the time, from now on, as the
    host metrics read them (their source's ``cpu_times``; the rest of the node is read as it is)."""
    from openlora_otel.hardware import host

    real = host._source
    began = time.monotonic()
    fields = ("user", "nice", "system", "idle")

    def cpu_times() -> tuple[tuple[str, ...], dict[int, tuple[float, ...]]]:
        elapsed = 1000.0 + time.monotonic() - began
        return fields, dict.fromkeys(range(4), (elapsed * busy, 0.0, 0.0, elapsed * (1.0 - busy)))

    host._source = lambda: Recorded(real(), cpu_times=cpu_times)


def _when_watched(fake: FakeNvml, card: object, timeout_s: float = 10.0) -> None:
    """The driver delivers XIDs only to a GPU registered for events (at the first collection)."""
    deadline = time.monotonic() + timeout_s
    while card.uuid not in fake.registered and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())

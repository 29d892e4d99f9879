"""One simulated training rank for bench_cluster_sizing.py: telemetry as a real rank has it, no model.

Run by the benchmark, never by hand: the rank's identity (RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_RANK, OPENLORA_RUN_ID) and its port arrive in the environment
as torchrun and the user would set them. The process

- hands openlora-otel a fake NVML with the node's 8 GPUs (tests/support/fake_nvml.py),
  put where ``setup_telemetry()`` looks for the real one, so the GPU series
  are exactly those a rank on an 8-GPU node exports;
- calls ``setup_telemetry()`` (configuration from the environment, as in a job);
- records what a LoRA fine-tune records: the adapter, then every ``--step-s``
  a step with loss, grad norm, learning rate, tokens and samples, the epoch,
  and an evaluation (loss and accuracy) at the first step and every 40 after;
- moves the fake GPUs' readings between steps, so Prometheus stores changing
  values (constant ones would compress better than real ones do).

It stops after ``--max-s`` seconds or as soon as its parent is gone, whichever
comes first: a benchmark that dies never leaves ranks behind.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openlora_otel import setup_telemetry  # noqa: E402
from openlora_otel.hardware import nvml  # noqa: E402
from tests.support.fake_nvml import FakeNvml, h100s  # noqa: E402

GPUS_PER_NODE = 8
EVAL_EVERY = 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--max-s", type=float, default=600.0)
    args = parser.parse_args()
    parent = os.getppid()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", "0"))

    gpus = h100s(GPUS_PER_NODE)
    # This rank's process holds memory on its own GPU, as a CUDA process does.
    gpus[local_rank % GPUS_PER_NODE].processes[os.getpid()] = 20 * 2**30
    fake = FakeNvml(gpus)
    nvml.load_pynvml_backend = lambda: fake  # what tests/hardware/test_gpu.py does with monkeypatch

    telemetry = setup_telemetry()
    training = telemetry.training
    training.set_adapter(r=16, alpha=32, dropout=0.05, target_modules=["q_proj", "v_proj"],
                         trainable_params=4_194_304, total_params=7_000_000_000)  # fmt: skip
    print(f"ready {telemetry.prometheus_url}", flush=True)

    started = time.monotonic()
    step = 0
    try:
        while time.monotonic() - started < args.max_s and os.getppid() == parent:
            time.sleep(args.step_s)
            step += 1
            phase = step / 10.0 + rank
            for gpu in gpus:
                gpu.utilization = 0.8 + 0.15 * math.sin(phase + gpu.index)
                gpu.memory_used = int((40 + 5 * math.sin(phase)) * 2**30)
                gpu.power_w = 550.0 + 100.0 * math.sin(phase + 1.0)
                gpu.energy_j += gpu.power_w * args.step_s
                gpu.temperature_c = 65.0 + 5.0 * math.sin(phase / 3.0)
                gpu.sm_clock_hz = 1.98e9 - 1e8 * (step % 3)
            training.record_step(
                loss=2.0 / math.sqrt(step) + 0.01 * math.sin(phase),
                grad_norm=1.0 + 0.2 * math.sin(phase * 1.7),
                learning_rate=2e-4 * min(1.0, step / 100.0),
                tokens=8 * 2048,
                samples=8,
            )
            training.record_epoch(step / 1000.0)
            if step == 1 or step % EVAL_EVERY == 0:
                training.record_eval(loss=2.1 / math.sqrt(step), accuracy=0.5 + step / 10_000.0)
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()

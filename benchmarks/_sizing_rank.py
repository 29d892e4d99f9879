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
  values (constant ones would compress better than real ones do); both as the
  many ranks of tests/support/rank_group.py do (tests/support/lora_steps.py).

It stops after ``--max-s`` seconds or as soon as its parent is gone, whichever
comes first: a benchmark that dies never leaves ranks behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openlora_otel import setup_telemetry  # noqa: E402
from openlora_otel.hardware import nvml  # noqa: E402
from tests.support.fake_nvml import FakeNvml, h100s  # noqa: E402
from tests.support.lora_steps import move_gpus, record_lora_step  # noqa: E402

GPUS_PER_NODE = 8


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
            move_gpus(gpus, phase, step, args.step_s)
            record_lora_step(training, step, phase)
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()

"""Many simulated training ranks in one process: each a whole Telemetry of its own.

Run as a script by benchmarks/bench_scale_out.py (1,000 ranks) and by the scale-out tests, never by
hand. A real rank is one process with one ``setup_telemetry()``; a thousand processes do not fit a
small machine, so this process builds, for each of its ranks, what
``setup_telemetry()`` builds (the configuration from that rank's environment as torchrun would set
it, ``build_provider``: its Resource with run and rank identity, the views, the real OTLP exporter
pushing every ``OTEL_METRIC_EXPORT_INTERVAL``) and a ``Telemetry`` on it with a fake NVML of the
node's 8 GPUs (tests/support/fake_nvml.py). Only the global provider and the SIGTERM handler are left
out (one per process). Host metrics are off: they would be this process's, not a rank's. Each rank's
Resource gets ``service.instance.id=rank-<RANK>`` and ``host.name=node-<GROUP_RANK>``; with
``--pod-resource`` (the ranks of one Kubernetes pod, tests/deploy/test_kubernetes_cluster.py) the
group's own ``OTEL_RESOURCE_ATTRIBUTES`` (the pod's k8s.* attributes) are kept and only the instance id
is added.

Every ``--step-s`` each rank records what a LoRA fine-tune records (tests/support/lora_steps.py, as
bench_cluster_sizing's _sizing_rank.py does for one rank): a step with loss, grad norm, learning rate, tokens and
samples, the epoch, an evaluation every 40 steps; its GPUs' readings move. With
``--nonfinite-loss-from N``, the group's first rank's loss is NaN from its N-th step on (a run gone
bad, for the alerting tests). With ``--export-log PATH`` every push of every rank appends a line
``<instance> <time of its steps counter's point, ms> ok|failed`` to PATH: what each rank really sent,
so a test can tell a sample lost on the way from one never made (a push that came late). It stops
after ``--max-s`` or when its parent is gone.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from openlora_otel.config import TelemetryConfig  # noqa: E402
from openlora_otel.provider import build_provider  # noqa: E402
from openlora_otel.telemetry import Telemetry  # noqa: E402
from tests.support.fake_nvml import FakeNvml, h100s  # noqa: E402
from tests.support.lora_steps import move_gpus, record_lora_step  # noqa: E402

GPUS_PER_NODE = 8
STEPS_INSTRUMENT = "openlora.training.steps"


class ExportLog:
    """One line per push of every rank: its instance, the time of its steps counter's point and
    whether the exporter reported success (see the module's docstring)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def watch(self, instance: str, readers: list) -> None:
        for reader in readers:
            exporter = getattr(reader, "_exporter", None)
            if exporter is None:
                continue
            export = exporter.export

            def logged(metrics_data, *args, _export=export, **kwargs):
                result = _export(metrics_data, *args, **kwargs)
                stamp = steps_time_ms(metrics_data)
                if stamp is not None:
                    outcome = "ok" if getattr(result, "name", "") == "SUCCESS" else "failed"
                    with self._lock:
                        self._file.write(f"{instance} {stamp} {outcome}\n")
                return result

            exporter.export = logged

    def close(self) -> None:
        with self._lock:
            self._file.close()


def steps_time_ms(metrics_data) -> int | None:
    """The time, in whole ms as a remote write carries it, of the steps counter's point in one push."""
    for resource_metrics in metrics_data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == STEPS_INSTRUMENT and metric.data.data_points:
                    return metric.data.data_points[0].time_unix_nano // 1_000_000
    return None


def read_export_log(path: Path) -> dict[str, dict[int, str]]:
    """``--export-log``'s file: for each instance, each push's time (ms) and outcome."""
    pushes: dict[str, dict[int, str]] = {}
    # Read while the ranks write: a last line without its newline is still being written, left out.
    for line in path.read_text().splitlines(keepends=True):
        parts = line.split()
        if line.endswith("\n") and len(parts) == 3:
            pushes.setdefault(parts[0], {})[int(parts[1])] = parts[2]
    return pushes


def start_rank(
    rank: int,
    world_size: int,
    base_env: dict[str, str],
    *,
    host_metrics: bool = False,
    pod_resource: bool = False,
    export_log: ExportLog | None = None,
) -> tuple[Telemetry, FakeNvml]:
    """One rank's Telemetry and its fake NVML; ``host_metrics``: this process's and host's too (a
    stand-in for a rank's, where one rank is all a process holds); ``pod_resource``: keep
    ``base_env``'s resource attributes, adding only the rank's instance id; ``export_log``: log each
    of its pushes there."""
    resource = f"service.instance.id=rank-{rank},host.name=node-{rank // GPUS_PER_NODE}"
    if pod_resource:
        resource = f"{base_env['OTEL_RESOURCE_ATTRIBUTES']},service.instance.id=rank-{rank}"
    env = {
        **base_env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % GPUS_PER_NODE),
        "GROUP_RANK": str(rank // GPUS_PER_NODE),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(GPUS_PER_NODE),
        "OTEL_RESOURCE_ATTRIBUTES": resource,
        "OPENLORA_HOST_METRICS": "true" if host_metrics else "false",
        "OPENLORA_GPU_METRICS": "on",
        "OPENLORA_QUIET": "true",
    }
    config = TelemetryConfig.from_env(env)
    gpus = h100s(GPUS_PER_NODE)
    gpus[rank % GPUS_PER_NODE].processes[os.getpid()] = 20 * 2**30
    fake = FakeNvml(gpus)
    fake.init()
    provider, prometheus, readers = build_provider(config, None, [])
    if export_log is not None:
        export_log.watch(f"rank-{rank}", readers)
    telemetry = Telemetry(
        config=config,
        meter_provider=provider,
        resource=provider._sdk_config.resource,
        owns_provider=True,
        prometheus=prometheus,
        readers=readers,
        nvml=fake,
    )
    telemetry.set_run_info(hyperparameters={"learning_rate": 2e-4, "lora_r": 16})
    telemetry.training.set_adapter(r=16, alpha=32, dropout=0.05, target_modules=["q_proj", "v_proj"],
                                   trainable_params=4_194_304, total_params=7_000_000_000)  # fmt: skip
    return telemetry, fake


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-rank", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--max-s", type=float, default=900.0)
    parser.add_argument("--nonfinite-loss-from", type=int, default=0, help="step of the first NaN loss (0: none)")
    parser.add_argument("--pod-resource", action="store_true", help="keep OTEL_RESOURCE_ATTRIBUTES (a pod's)")
    parser.add_argument("--export-log", help="append a line per push of every rank to this file")
    args = parser.parse_args()
    parent = os.getppid()
    base_env = {k: v for k, v in os.environ.items() if k.startswith(("OTEL_", "OPENLORA_"))}
    export_log = ExportLog(args.export_log) if args.export_log else None
    ranks = [
        start_rank(rank, args.world_size, base_env, pod_resource=args.pod_resource, export_log=export_log)
        for rank in range(args.first_rank, args.first_rank + args.count)
    ]
    print(f"ready {args.count}", flush=True)
    started = time.monotonic()
    step = 0
    try:
        while time.monotonic() - started < args.max_s and os.getppid() == parent:
            time.sleep(args.step_s)
            step += 1
            for offset, (telemetry, fake) in enumerate(ranks):
                phase = step / 10.0 + args.first_rank + offset
                move_gpus(fake.gpus, phase, step, args.step_s)
                nonfinite = offset == 0 and 0 < args.nonfinite_loss_from <= step
                record_lora_step(telemetry.training, step, phase, step_time_s=args.step_s, nonfinite_loss=nonfinite)
    finally:
        for telemetry, _ in ranks:
            telemetry.shutdown()
        if export_log is not None:
            export_log.close()


if __name__ == "__main__":
    main()

"""Explicit against exponential (native) histograms on a recorded run: quantile error, series and bytes.

The run: the demo's own step times (``--steps`` of the tiny model on this machine's CPU, each
``step_time_s`` that ``record_step`` got, kept), or ``--synthetic`` log-normal ones. The same values
then go, through openlora-otel's step-duration histogram (its window and views), into two providers
that push OTLP to one Prometheus 3 (build/bin/prometheus, ``--web.enable-otlp-receiver``): one with
explicit buckets (the default), one exponential
(``OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram``), which
Prometheus stores as a native histogram. Printed side by side:

- p50, p90, p99 exact (from the values) and as ``histogram_quantile`` answers in Prometheus for each,
  with the relative error;
- the series each form is stored as, and the samples one export writes;
- the bytes of one OTLP export of the histogram (protobuf, uncompressed and gzip) and of its lines in
  the Prometheus text format (explicit only: the pull endpoint has no exponential form).

    python benchmarks/bench_native_histograms.py [--steps 400] [--synthetic]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAME = "openlora_training_step_duration_seconds"


def recorded_step_times(steps: int) -> list[float]:
    """The step times of a real demo run (tiny model, CPU), as record_step got them."""
    from openlora_otel import TelemetryConfig, setup_telemetry
    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.demo.train import run_demo

    config = TelemetryConfig(exporters=("none",), quiet=True, gpu_metrics="off", host_metrics=False, handle_sigterm=False)
    telemetry = setup_telemetry(config=config)
    times: list[float] = []
    record = telemetry.training.record_step

    def keep(*args, **kwargs):
        if kwargs.get("step_time_s") is not None:
            times.append(kwargs["step_time_s"])
        return record(*args, **kwargs)

    telemetry.training.record_step = keep  # type: ignore[method-assign]
    try:
        run_demo(DemoOptions(steps=steps, eval_every=0, quiet=True), telemetry, where="cpu")
    finally:
        telemetry.shutdown()
    return times


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def query(base: str, expr: str) -> list[dict]:
    return get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]


def start_prometheus(work: Path) -> tuple[subprocess.Popen, str]:
    binary = ROOT / "build" / "bin" / "prometheus"
    if not binary.exists():
        raise SystemExit("needs build/bin/prometheus (Prometheus 3): tools/build.sh prometheus")
    config = work / "prometheus.yml"
    config.write_text("global: {}\nscrape_configs: []\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen([str(binary), f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}", "--web.enable-otlp-receiver"],
                               stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return process, base
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit(f"Prometheus did not start; see {work / 'prometheus.log'}")


def push(values: list[float], base: str, exponential: bool) -> tuple[bytes, str]:
    """Record ``values`` as step times on a provider of our views and push one OTLP export of it to
    Prometheus; the export's protobuf, and the histogram's text-format lines (explicit only)."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from openlora_otel.config import OTLPConfig
    from openlora_otel.exporters.exposition import Exposition
    from openlora_otel.exporters.otlp import build_otlp_exporter
    from openlora_otel.training.metrics import TrainingMetrics, step_duration_view

    aggregation = "base2_exponential_bucket_histogram" if exponential else "explicit_bucket_histogram"
    reader = InMemoryMetricReader()
    resource = Resource({"service.name": "bench", "service.instance.id": aggregation})
    provider = MeterProvider(metric_readers=[reader], resource=resource, views=[step_duration_view(exponential=exponential)])
    training = TrainingMetrics(provider.get_meter("openlora_otel"), window_histogram=True, exponential_histograms=exponential)
    for value in values:
        training.record_step(loss=1.0, step_time_s=value)
    data = reader.get_metrics_data()
    only = [
        metric for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics
        if metric.name == "openlora.training.step.duration"
    ]  # fmt: skip
    data.resource_metrics[0].scope_metrics[0].metrics[:] = only
    del data.resource_metrics[0].scope_metrics[1:]
    exporter = build_otlp_exporter(
        OTLPConfig(endpoint=f"{base}/api/v1/otlp/v1/metrics", histogram_aggregation=aggregation)  # type: ignore[arg-type]
    )
    exporter.export(data)
    exporter.shutdown()
    text = "" if exponential else Exposition().render(data).decode()
    provider.shutdown()
    return encode_metrics(data).SerializeToString(), "".join(
        line + "\n" for line in text.splitlines() if line.startswith(NAME)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="demo steps to record (default 400)")
    parser.add_argument("--synthetic", action="store_true", help="log-normal step times instead of a demo run")
    args = parser.parse_args()
    if args.synthetic:
        rng = random.Random(1)
        values = [rng.lognormvariate(-2.5, 0.5) for _ in range(args.steps)]
        source = f"{args.steps} log-normal step times"
    else:
        values = recorded_step_times(args.steps)
        source = f"the demo's {len(values)} step times on this CPU"
    ordered = sorted(values)
    with tempfile.TemporaryDirectory() as work:
        process, base = start_prometheus(Path(work))
        try:
            sizes = {}
            for exponential in (False, True):
                sizes[exponential] = push(values, base, exponential)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(query(base, f'{{__name__=~"{NAME}.*"}}')) < 2:
                time.sleep(0.5)
            series = {
                exponential: len(query(base, f'{{__name__=~"{NAME}.*", instance="{instance}"}}'))
                for exponential, instance in ((False, "explicit_bucket_histogram"), (True, "base2_exponential_bucket_histogram"))
            }
            native = query(base, f'{NAME}{{instance="base2_exponential_bucket_histogram"}}')
            buckets = len(native[0]["histogram"][1]["buckets"]) if native and "histogram" in native[0] else 0
            print(f"{source}: min {ordered[0] * 1e3:.1f} ms, max {ordered[-1] * 1e3:.1f} ms")
            print(f"{'quantile':<9} {'exact ms':>9} {'explicit ms':>12} {'error':>7} {'native ms':>10} {'error':>7}")
            for q in (0.5, 0.9, 0.99):
                exact = ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
                explicit = float(query(base, f'histogram_quantile({q}, sum by (le) ({NAME}_bucket{{instance="explicit_bucket_histogram"}}))')[0]["value"][1])
                nat = float(query(base, f'histogram_quantile({q}, {NAME}{{instance="base2_exponential_bucket_histogram"}})')[0]["value"][1])
                print(f"p{int(q * 100):<8} {exact * 1e3:>9.2f} {explicit * 1e3:>12.2f} {explicit / exact - 1:>+7.1%} "
                      f"{nat * 1e3:>10.2f} {nat / exact - 1:>+7.1%}")  # fmt: skip
            for exponential, label in ((False, "explicit"), (True, "exponential")):
                protobuf, text = sizes[exponential]
                print(
                    f"{label:<12} series {series[exponential]:>3}, OTLP export {len(protobuf):>5} B "
                    f"({len(gzip.compress(protobuf)):>4} B gzip)"
                    + (f", text format {len(text.encode()):>5} B" if text else f", {buckets} buckets in Prometheus")
                )
        finally:
            process.terminate()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()

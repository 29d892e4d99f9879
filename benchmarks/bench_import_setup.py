"""Import and setup cost of openlora-otel vs the plain OpenTelemetry SDK, side by side in one run.

Each sample is a fresh interpreter (imports are cached after the first), so the
figures include what a training script pays once at start-up:

- ``python -c pass``                         : interpreter baseline
- plain SDK: import opentelemetry.sdk.metrics + the Prometheus exporter, build a
  MeterProvider with a PrometheusMetricReader and start prometheus_client's server
- openlora-otel: ``import openlora_otel`` alone, then ``setup_telemetry()`` (pull endpoint)

    python benchmarks/bench_import_setup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PLAIN = """
import time, json
t0 = time.perf_counter()
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import start_http_server, CollectorRegistry
t1 = time.perf_counter()
registry = CollectorRegistry()
server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "setup": t2 - t1}))
"""

OURS = """
import time, json
t0 = time.perf_counter()
import openlora_otel
t1 = time.perf_counter()
telemetry = openlora_otel.setup_telemetry()
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "setup": t2 - t1}))
telemetry.shutdown()
"""


def sample(code: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENLORA_"))}
    env.update({"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": "0"})
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    plain, ours = [], []
    for _ in range(args.repeat):  # interleaved, so machine noise hits both alike
        plain.append(sample(PLAIN))
        ours.append(sample(OURS))

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows) * 1000

    print(f"median of {args.repeat} fresh interpreters, milliseconds")
    print(f"{'':<28}{'import':>10}{'setup':>10}{'total':>10}")
    for label, rows in (("plain SDK + prometheus", plain), ("openlora-otel", ours)):
        print(
            f"{label:<28}{med(rows, 'import'):>10.1f}{med(rows, 'setup'):>10.1f}{med(rows, 'import') + med(rows, 'setup'):>10.1f}"
        )
    ratio = (med(ours, "import") + med(ours, "setup")) / (med(plain, "import") + med(plain, "setup"))
    print(f"ratio openlora-otel / plain: {ratio:.2f}")


if __name__ == "__main__":
    main()

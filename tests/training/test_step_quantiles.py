"""Step-time quantiles from a real Prometheus are within 10 % of the true ones, from 10 ms to 10 s.

Each distribution is recorded by its own process (one run each, as in real
life), served on its own pull endpoint and scraped by Debian's Prometheus;
``histogram_quantile`` over the scraped buckets is compared with the exact
quantile of the recorded sample.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
import time

import pytest

from openlora_otel.names import STEP_DURATION_BUCKETS
from tests.support.processes import child_env, free_port, reap
from tests.support.prometheus_server import Prometheus

SAMPLES = 3000
QUANTILES = (0.5, 0.9, 0.99)


def _constant(value: float) -> list[float]:
    return [value] * SAMPLES


def _distributions() -> dict[str, list[float]]:
    rng = random.Random(7)
    lower = [b for b in STEP_DURATION_BUCKETS if 0.01 <= b < 10.0]
    return {
        # The example: 0.102 s steps read as a p50 of 0.175 s with the old buckets.
        "constant_102ms": _constant(0.102),
        # Just above a bound: the worst case for the upper quantiles.
        "just_above_bound": _constant(lower[len(lower) // 2] * 1.0001),
        "just_below_bound": _constant(lower[len(lower) // 4] * 0.9999),
        "constant_10ms": _constant(0.01),  # exactly the range's lower end, a bound itself
        "constant_9s": _constant(9.5),
        "normal_5pct": [rng.gauss(0.35, 0.35 * 0.05) for _ in range(SAMPLES)],
        "lognormal": [rng.lognormvariate(math.log(0.8), 0.4) for _ in range(SAMPLES)],
        # Most steps fast, every tenth one pays for evaluation or a checkpoint.
        "bimodal": [2.5 if i % 10 == 0 else rng.uniform(0.04, 0.05) for i in range(SAMPLES)],
        "log_uniform_wide": [math.exp(rng.uniform(math.log(0.01), math.log(10.0))) for _ in range(SAMPLES)],
    }


_CHILD = """
import sys
from openlora_otel import setup_telemetry
telemetry = setup_telemetry("quantiles")
training = telemetry.training
for line in open(sys.argv[1]):
    training.record_step(step_time_s=float(line))
print("ready", flush=True)
sys.stdin.readline()
telemetry.shutdown()
"""


def _true_quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@pytest.mark.e2e
def test_histogram_quantile_is_within_10_percent_for_known_distributions(tmp_path) -> None:
    distributions = _distributions()
    ports = {name: free_port() for name in distributions}
    children: list[subprocess.Popen] = []
    prometheus = None
    try:
        for name, values in distributions.items():
            sample = tmp_path / f"{name}.txt"
            sample.write_text("\n".join(repr(v) for v in values))
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(sample)],
                env=child_env(
                    OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
                    OTEL_EXPORTER_PROMETHEUS_PORT=str(ports[name]),
                    OPENLORA_QUIET="true",
                    OPENLORA_GPU_METRICS="off",
                    OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT="0",
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(child)
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        (tmp_path / "prom").mkdir()
        prometheus = Prometheus(tmp_path / "prom", [f"127.0.0.1:{port}" for port in ports.values()])
        instances = {f"127.0.0.1:{port}": name for name, port in ports.items()}
        deadline = time.monotonic() + 60
        counts: dict[str, float] = {}
        while time.monotonic() < deadline:
            counts = {
                instances[r["metric"]["instance"]]: float(r["value"][1])
                for r in prometheus.query("openlora_training_step_duration_seconds_count")
            }
            if len(counts) == len(distributions) and all(c == SAMPLES for c in counts.values()):
                break
            time.sleep(0.5)
        assert counts == {name: SAMPLES for name in distributions}

        failures = []
        for q in QUANTILES:
            result = prometheus.query(
                f"histogram_quantile({q}, sum by (instance, le) (openlora_training_step_duration_seconds_bucket))"
            )
            estimates = {instances[r["metric"]["instance"]]: float(r["value"][1]) for r in result}
            for name, values in distributions.items():
                truth = _true_quantile(values, q)
                error = abs(estimates[name] - truth) / truth
                if error > 0.10:
                    failures.append(f"{name} p{q * 100:g}: {estimates[name]:.4g} vs {truth:.4g} ({error:.1%})")
        assert not failures, failures
    finally:
        for child in children:
            if child.poll() is None and child.stdin is not None:
                child.stdin.write("\n")
                child.stdin.flush()
        for child in children:
            reap(child, 15)
        if prometheus is not None:
            prometheus.stop()


def test_bucket_bounds_keep_neighbours_within_10_percent() -> None:
    inside = [b for b in STEP_DURATION_BUCKETS if 0.01 <= b <= 10.0]
    assert inside[0] == 0.01 and inside[-1] == 10.0
    # 10 ms itself: the bucket that holds it, (below, 0.01], is as narrow as the others.
    below = max(b for b in STEP_DURATION_BUCKETS if b < 0.01)
    assert 0.01 / below < 1.1
    assert max(high / low for low, high in itertools.pairwise(inside)) < 1.1
    assert list(STEP_DURATION_BUCKETS) == sorted(set(STEP_DURATION_BUCKETS))

"""The order the suite runs its files in: the files whose tests take minutes (real servers on many
paths, the default-length demo, AIPerf), slowest first (the fresh-clone .ci/run's durations), before
the rest. Under pytest-xdist's --dist loadfile (a file per worker at a time, in collection order)
they start first, and the run does not end with two workers idle and one still in them."""

from __future__ import annotations

SLOW_FILES_FIRST = (
    "deploy/test_self_monitoring.py",
    "deploy/test_deployment.py",
    "serving/test_inference_dashboard.py",
    "deploy/test_cluster_dashboard.py",
    "serving/test_aiperf.py",
    "demo/test_demo.py",
    "report/test_diagnose_runs.py",
    "deploy/test_thanos_faults.py",
    "hardware/test_gpu_check.py",
    "report/test_report_adapter.py",
    "deploy/test_scaleout.py",
    "deploy/test_bench_scale_out.py",
    "deploy/test_kubernetes_cluster.py",
)


def slow_first_rank(nodeid: str) -> int:
    """Where a test's file comes: its place in SLOW_FILES_FIRST, the others after them all."""
    path = nodeid.split("::", 1)[0].removeprefix("tests/")
    return SLOW_FILES_FIRST.index(path) if path in SLOW_FILES_FIRST else len(SLOW_FILES_FIRST)

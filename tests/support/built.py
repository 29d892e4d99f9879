"""The servers tools/build.sh builds from the Go module proxy (build/bin, or $OPENLORA_BIN_DIR).

A test that needs one skips when it is not built, except under CI (``CI`` set), where .ci/run builds
them all (tools/setup-real-parts.sh) and a missing one is a failure, as for the Debian binaries
(tests/support/real_parts.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.real_parts import missing

ROOT = Path(__file__).resolve().parent.parent.parent
# binary -> the tools/build.sh target that builds it
TARGETS = {
    "otelcol-openlora": "collector",
    "otelcol-openlora-lb": "collector-lb",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "alertmanager": "alertmanager",
    "amtool": "alertmanager",
    "victoria-metrics": "victoriametrics",
    "vmalert": "victoriametrics",
    "thanos": "thanos",
    "cortex": "cortex",
    "etcd": "etcd",
    "kube-apiserver": "kubernetes",
    "kube-controller-manager": "kubernetes",
    "kube-scheduler": "kubernetes",
    "kwok": "kwok",
    "kwok-stages.yaml": "kwok",
    "prometheus-operator": "prometheus-operator",
    "prometheus-operator-crds.yaml": "prometheus-operator",
    "kube-state-metrics": "kube-state-metrics",
}


# Read once, when the tests are loaded: each test runs without any OPENLORA_* variable
# (tests/conftest.py's clean_env, which imports this module first).
_BIN_DIR = os.environ.get("OPENLORA_BIN_DIR")


def bin_dir() -> Path:
    return Path(_BIN_DIR or ROOT / "build" / "bin")


def built(name: str) -> str:
    """The path of built binary ``name`` (or of a file a build puts beside them, ``*.yaml``); skips
    (fails under CI) when it is not there."""
    path = bin_dir() / name
    if path.is_file() and (name.endswith(".yaml") or os.access(path, os.X_OK)):
        return str(path)
    missing("build/bin", f"{path} is not built: run tools/build.sh {TARGETS[name]}")

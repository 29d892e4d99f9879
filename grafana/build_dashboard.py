"""Writes grafana/dashboards/openlora-training.json, openlora-cluster.json and openlora-inference.json; tests check the committed files match.

    python grafana/build_dashboard.py

The dashboards are built in the package beside this file, grafana/dashboard_builder/:

    layout.py             Grid: hands out each row's and panel's gridPos in reading order
    common.py             the panel, target, row and variable helpers, the settings and query pieces
                          the dashboards share
    training.py           the training dashboard; its GPU and host rows in training_hardware.py
    cluster.py            the cluster dashboard: the ranks of one run side by side
    inference.py          the inference dashboard: a server's requests per adapter

This file is the command and what the tests load (by path): render(), render_cluster() and
render_inference() give each file's text, and the inference alerts' thresholds are here as
LATENCY_OBJECTIVE_S, ERROR_RATIO_THRESHOLD and CLIENT_ERRORS (tests compare them with the rules).

Plain dicts on purpose. grafana-foundation-sdk (the 11.6 flavour, the newest with a Grafana
version; none for 12) was tried on a slice in issue 12: the panel, row and variable helpers and
the "Input and compute" row took 182 lines against 186 here, its only saving the automatic grid
layout (which layout.py now does); its JSON was ours but for defaults it adds, no variable
`definition`, and no panel ids or query refIds unless set by hand. Not worth an alpha dependency
whose versions are build stamps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# grafana/ is no package: run as a script its directory is on sys.path already; loaded by path
# (the tests), or imported from elsewhere, it is not.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from dashboard_builder import cluster, inference, training  # noqa: E402
from dashboard_builder.inference import (  # noqa: E402
    CLIENT_ERRORS,
    ERROR_RATIO_THRESHOLD,
    LATENCY_OBJECTIVE_S,
)

__all__ = [
    "CLIENT_ERRORS",
    "ERROR_RATIO_THRESHOLD",
    "LATENCY_OBJECTIVE_S",
    "render",
    "render_cluster",
    "render_inference",
]

DASHBOARDS = HERE / "dashboards"
OUT = DASHBOARDS / "openlora-training.json"
CLUSTER_OUT = DASHBOARDS / "openlora-cluster.json"
INFERENCE_OUT = DASHBOARDS / "openlora-inference.json"


def render() -> str:
    """The training dashboard's JSON, as committed in OUT."""
    return json.dumps(training.build(), indent=2) + "\n"


def render_cluster() -> str:
    """The cluster dashboard's JSON, as committed in CLUSTER_OUT."""
    return json.dumps(cluster.build(), indent=2) + "\n"


def render_inference() -> str:
    """The inference dashboard's JSON, as committed in INFERENCE_OUT."""
    return json.dumps(inference.build(), indent=2) + "\n"


if __name__ == "__main__":
    for path, text in ((OUT, render()), (CLUSTER_OUT, render_cluster()), (INFERENCE_OUT, render_inference())):
        path.write_text(text)
        print(f"wrote {path}")

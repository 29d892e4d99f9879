#!/usr/bin/env bash
# Set up the real parts the tests start, so that the README's test command skips none of them:
#
#   Debian's packages   prometheus (and promtool), victoria-metrics, prometheus-alertmanager (and amtool),
#                       chromium and fonts-liberation; installed with apt-get when one is missing
#                       (through sudo when not run as root)
#   build/bin           tools/build.sh: our Collector, Prometheus 3, Alertmanager 0.35, VictoriaMetrics
#                       1.151 and vmalert, Thanos 0.40.1, Cortex 1.21.1, and a Kubernetes control plane
#                       (etcd 3.6, Kubernetes 1.36, kwok, the Prometheus Operator, kube-state-metrics),
#                       from the Go module proxy (needs Go)
#   .venv-aiperf        AIPerf, pinned, from PyPI, in a virtual environment of its own
#
# Usage: tools/setup-real-parts.sh   (from anywhere; no arguments). .ci/run runs it first. Each part is
# reused when it is already there: a second run takes seconds once Go's caches are warm.
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
    "") ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "tools/setup-real-parts.sh: no arguments accepted (got '$1')" >&2; exit 2 ;;
esac

export DEBIAN_FRONTEND=noninteractive
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    sudo=(sudo env DEBIAN_FRONTEND=noninteractive)
fi

# prometheus (also agent mode and the remote-write receiver) and promtool; victoria-metrics as the
# remote-write store of the scale-out tests; prometheus-alertmanager (and amtool) for the alerting
# tests; chromium (headless) opens the report's HTML page in tests/report/test_report.py, with
# fonts-liberation for its text (a recommendation, not a dependency).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1 \
    || ! command -v victoria-metrics >/dev/null 2>&1 || ! command -v amtool >/dev/null 2>&1 \
    || [ ! -x /usr/bin/chromium ]; then
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends prometheus victoria-metrics prometheus-alertmanager \
        chromium fonts-liberation >/dev/null
fi
prometheus --version 2>&1 | head -n 1
dpkg-query -W victoria-metrics 2>/dev/null || true
dpkg-query -W chromium 2>/dev/null || true

# From the Go module proxy, pinned (tools/build.sh): our Collector distribution, Prometheus 3 and its
# promtool, Alertmanager 0.35 and amtool, VictoriaMetrics 1.151, Thanos and Cortex, the control plane of
# tests/deploy/test_kubernetes_cluster.py, into build/bin. Go's module and build
# caches are reused when the machine has them (a rebuild then takes seconds per binary).
go version
started=$SECONDS
tools/build.sh
echo "Go builds took $((SECONDS - started)) s"

# AIPerf, the LLM benchmark client tests/serving/test_aiperf.py drives `serve` with, from PyPI, pinned, in a
# virtual environment of its own (.venv-aiperf, gitignored; tests/support/aiperf.py finds it there): it
# brings transformers and tokenizers but not torch, and pins versions of its own. About 55 s and 1.2 GB
# the first time; reused when the pinned version is there. The test
# itself adds about a minute (two AIPerf runs against one `serve`, nothing downloaded at run time).
aiperf_version=0.13.0
if ! .venv-aiperf/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('aiperf') != '$aiperf_version')" \
    2>/dev/null; then
    started=$SECONDS
    rm -rf .venv-aiperf
    python3 -m venv .venv-aiperf
    .venv-aiperf/bin/pip install -q "aiperf==$aiperf_version"
    echo "AIPerf $aiperf_version installed in $((SECONDS - started)) s"
fi

#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a CUDA machine that has torch, transformers, peft and
# nvidia-ml-py but none of our OpenTelemetry packages and no network.
#
#   bash benchmarks/gpu_check.sh --download-wheels    # here, with network: the wheels into .whl/
#   bash benchmarks/gpu_check.sh OUT [options]        # there: install .whl/*.whl, run the check
#
# The wheels are the versions this checkout is tested with, for CPython 3.12 on x86-64 Linux
# (PYTHON_VERSION=3.11 ... to fetch for another); they go to a folder of their own on PYTHONPATH,
# never into the machine's site-packages. Options after OUT go to gpu_check.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
    opentelemetry-exporter-prometheus==0.66b2 opentelemetry-instrumentation==0.66b2
    opentelemetry-instrumentation-fastapi==0.66b2
    opentelemetry-instrumentation-asgi==0.66b2 opentelemetry-util-http==0.66b2 asgiref==3.13.0
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
    annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0
)

if [ "${1:-}" = "--download-wheels" ]; then
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
    ls .whl
    exit 0
fi

out=${1:?usage: bash benchmarks/gpu_check.sh OUT [gpu_check.py options] | --download-wheels}
shift
site=${OPENLORA_CHECK_SITE:-/tmp/openlora-check-site}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
exec python3 benchmarks/gpu_check.py "$out" "$@"

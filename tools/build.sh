#!/usr/bin/env bash
# Build, from the Go module proxy, the servers the end-to-end tests run next to Debian's packages:
#
#   collector        build/bin/otelcol-openlora   our OpenTelemetry Collector distribution
#                                                 (collector/otelcol-openlora: core v0.165.0, contrib v0.165.1)
#   collector-lb     build/bin/otelcol-openlora-lb   the agent tier that load-balances over gateways
#                                                 (collector/otelcol-openlora-lb: core and contrib v0.161.0,
#                                                 the newest release whose loadbalancing exporter is served)
#   prometheus       build/bin/prometheus, promtool   Prometheus 3 (module v0.316.0 = Prometheus 3.16.0)
#   alertmanager     build/bin/alertmanager, amtool   Alertmanager v0.35.0
#   victoriametrics  build/bin/victoria-metrics, vmalert   VictoriaMetrics v1.151.0 (single node) and its
#                                                 rule evaluator
#   thanos           build/bin/thanos             Thanos v0.40.1 (sidecar, store, query, receive, rule,
#                                                 compact, tools: one binary)
#   cortex           build/bin/cortex             Cortex v1.21.1 (single binary, -target=all)
#   etcd             build/bin/etcd               etcd v3.6.16 (the API server's store)
#   kubernetes       build/bin/kube-apiserver, kube-controller-manager, kube-scheduler   Kubernetes v1.36.3
#   kwok             build/bin/kwok, kwok-stages.yaml   kwok v0.8.0 (fake nodes: pods Running without a kubelet)
#   prometheus-operator  build/bin/prometheus-operator, prometheus-operator-crds.yaml   Prometheus Operator v0.85.0
#   kube-state-metrics   build/bin/kube-state-metrics    kube-state-metrics v2.15.0
#   (the last five: the control plane of tests/deploy/test_kubernetes_cluster.py)
#
# Usage: tools/build.sh [--regenerate] [collector|collector-lb|prometheus|alertmanager|victoriametrics|thanos|cortex
#                        |etcd|kubernetes|kwok|prometheus-operator|kube-state-metrics ...]
#   With no name, all twelve. The versions are pinned in each module's go.mod and go.sum (tools/*/ and
#   collector/otelcol-openlora*/); --regenerate first reruns the Collector Builder (ocb of the
#   distribution's release) on its manifest.yaml, after a change of components or release.
#   OPENLORA_BIN_DIR: where the binaries go (default build/bin). Go's module and build caches
#   ($GOMODCACHE, $GOCACHE) are reused between runs: a second build takes seconds per binary.
#
# The builds are reproducible: CGO off, -trimpath, no VCS stamp; each binary's version says what it is
# (`build/bin/prometheus --version`, `build/bin/otelcol-openlora --version`).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OPENLORA_BIN_DIR:-build/bin}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=local

names="collector collector-lb prometheus alertmanager victoriametrics thanos cortex etcd kubernetes kwok prometheus-operator kube-state-metrics"
regenerate=0
targets=()
for arg in "$@"; do
    case $arg in
        --regenerate) regenerate=1 ;;
        collector | collector-lb | prometheus | alertmanager | victoriametrics | thanos | cortex | etcd | kubernetes | kwok \
            | prometheus-operator | kube-state-metrics) targets+=("$arg") ;;
        -h | --help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "tools/build.sh: unknown argument '$arg' (accepted: --regenerate, ${names// /, })" >&2; exit 2 ;;
    esac
done
[ ${#targets[@]} -gt 0 ] || targets=($names)

# The version of module $2 in the go.mod of directory $1, and the directory Go unpacked it into.
module_version() { (cd "$1" && go list -m -f '{{.Version}}' "$2"); }
module_dir() { (cd "$1" && go mod download -json "$2" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'); }

# ldflags for github.com/prometheus/common/version, which Prometheus and Alertmanager print.
common_version_flags() {
    local p=github.com/prometheus/common/version
    echo "-s -w -X $p.Version=$1 -X $p.Revision=$2 -X $p.Branch=module -X $p.BuildUser=openlora-otel/tools/build.sh"
}

timed() {
    local name=$1
    shift
    local started=$SECONDS
    "$@"
    echo "built $name in $((SECONDS - started)) s"
}

# A Collector distribution of collector/$1 (the sources ocb generated from its manifest.yaml, with ocb $2),
# built with plain go build; $3, $4: a module@version to require above what ocb chose, and why.
build_distribution() {
    local name=$1 ocb=$2 bump=${3:-}
    local dir=$root/collector/$name
    if [ "$regenerate" = 1 ]; then
        if [ -z "$bump" ]; then
            (cd "$dir" && go run "go.opentelemetry.io/collector/cmd/builder@$ocb" --config manifest.yaml --skip-compilation)
        else
            # ocb writes the sources and go.mod, then its `go mod tidy` fails on the refused version; the
            # bump and a second tidy finish the job (and fail if anything else is missing).
            rm -f "$dir/go.mod"
            (cd "$dir" && go run "go.opentelemetry.io/collector/cmd/builder@$ocb" --config manifest.yaml --skip-compilation) \
                || echo "(ocb's go mod tidy failed as expected without $bump)"
            [ -f "$dir/go.mod" ] || { echo "tools/build.sh: ocb wrote no $dir/go.mod" >&2; exit 1; }
            (cd "$dir" && go mod edit -require="$bump" && go mod tidy)
        fi
    fi
    (cd "$dir" && go build -ldflags "-s -w" -o "$out/$name" .)
}

build_collector() { build_distribution otelcol-openlora v0.165.0; }

# The loadbalancing exporter v0.161.0 asks for github.com/aws/aws-sdk-go-v2/service/servicediscovery
# v1.48.0 (its AWS Cloud Map resolver), which the module proxy refuses; v1.49.0, which it serves, is
# required instead (same major version, a compatible API: the build checks it).
build_collector-lb() {
    build_distribution otelcol-openlora-lb v0.161.0 github.com/aws/aws-sdk-go-v2/service/servicediscovery@v1.49.0
}

build_prometheus() {
    local dir=$root/tools/prometheus3 module=github.com/prometheus/prometheus
    local version release
    version=$(module_version "$dir" "$module")
    release=$(cat "$(module_dir "$dir" "$module")/VERSION")
    local flags
    flags=$(common_version_flags "$release" "$module@$version")
    (cd "$dir" && go build -ldflags "$flags" -o "$out/prometheus" "$module/cmd/prometheus" \
        && go build -ldflags "$flags" -o "$out/promtool" "$module/cmd/promtool")
}

build_alertmanager() {
    # The module has the source of the web UI but not what npm and Elm build from it (ui/app/dist, which
    # ui/web.go embeds), and neither can be fetched here: the build uses a copy of the module with a
    # one-page ui/app/dist saying so. The API (/api/v2), which Prometheus and amtool use, is whole.
    local dir=$root/tools/alertmanager module=github.com/prometheus/alertmanager
    local version flags
    version=$(module_version "$dir" "$module")
    flags=$(common_version_flags "${version#v}" "$module@$version")
    local src=$root/build/src/alertmanager-$version
    if [ ! -f "$src/.openlora-ui-placeholder" ]; then
        rm -rf "$src"
        mkdir -p "$(dirname "$src")"
        cp -R "$(module_dir "$dir" "$module")" "$src"
        chmod -R u+w "$src"
        local page='<!doctype html><title>Alertmanager</title><p>This Alertmanager was built by openlora-otel tools/build.sh without its web UI (npm and Elm build it, and neither is reachable there). The API at /api/v2 and amtool work.</p>'
        for ui in elm mantine; do
            mkdir -p "$src/ui/app/dist/$ui"
            echo "$page" >"$src/ui/app/dist/$ui/index.html"
        done
        touch "$src/.openlora-ui-placeholder"
    fi
    # The pinned go.mod and go.sum, with the module replaced by that copy.
    cp "$dir/go.mod" "$src.mod"
    cp "$dir/go.sum" "$src.sum"
    echo "replace $module => $src" >>"$src.mod"
    (cd "$dir" && go build -modfile="$src.mod" -ldflags "$flags" -o "$out/alertmanager" "$module/cmd/alertmanager" \
        && go build -modfile="$src.mod" -ldflags "$flags" -o "$out/amtool" "$module/cmd/amtool")
}

build_victoriametrics() {
    local dir=$root/tools/victoriametrics module=github.com/VictoriaMetrics/VictoriaMetrics
    local version
    version=$(module_version "$dir" "$module")
    local app
    for app in victoria-metrics vmalert; do
        (cd "$dir" && go build -ldflags "-s -w -X $module/lib/buildinfo.Version=$app-$version" \
            -o "$out/$app" "$module/app/$app")
    done
}

# Build command $3 of module $2, pinned in tools/$1/go.mod, inside a copy of the module's download (its
# own go.mod and go.sum pin every dependency): its go.mod has replace directives, which hold only in the
# main module, so neither `go install module@version` nor a requiring module builds it as released.
# The copy is build/src/<name>-<version>; $4 the ldflags, $5 the build tags its release uses.
build_in_module_copy() {
    local dir=$root/tools/$1 module=$2 command=$3 flags=$4 tags=$5
    local version
    version=$(module_version "$dir" "$module")
    local src=$root/build/src/$1-$version
    if [ ! -f "$src/.openlora-copy" ]; then
        rm -rf "$src"
        mkdir -p "$(dirname "$src")"
        cp -R "$(module_dir "$dir" "$module")" "$src"
        chmod -R u+w "$src"
        touch "$src/.openlora-copy"
    fi
    (cd "$src" && go build -tags "$tags" -ldflags "$flags" -o "$out/$(basename "$command")" "./$command")
}

# Thanos and Cortex releases are built with the tags netgo and slicelabels (their .promu.yml and Makefile):
# without slicelabels, Prometheus' labels package is its string form, which Thanos Query's endpoint code
# does not expect (it panics reading a ruler's label sets).
build_thanos() {
    local module=github.com/thanos-io/thanos version
    version=$(module_version "$root/tools/thanos" "$module")
    build_in_module_copy thanos "$module" cmd/thanos "$(common_version_flags "${version#v}" "$module@$version")" \
        "netgo,slicelabels"
}

build_cortex() {
    # Cortex sets github.com/prometheus/common/version from variables of its main package.
    local module=github.com/cortexproject/cortex version
    version=$(module_version "$root/tools/cortex" "$module")
    build_in_module_copy cortex "$module" cmd/cortex \
        "-s -w -X main.Version=${version#v} -X main.Revision=$module@$version -X main.Branch=module" "netgo,slicelabels"
}

# Command $2 (a package path) of the module pinned in tools/$1/go.mod (a wrapper that requires it: its own
# go.mod has no replace directive that matters, or tools/$1/go.mod restates what they did), into
# build/bin/$3 with ldflags $4.
build_from_wrapper() {
    (cd "$root/tools/$1" && go build -ldflags "$4" -o "$out/$3" "$2")
}

build_etcd() {
    local module=go.etcd.io/etcd/server/v3 version
    version=$(module_version "$root/tools/etcd" "$module")
    (cd "$root/tools/etcd" && go build -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$version" \
        -o "$out/etcd" .)
}

# The version variables Kubernetes' own build sets (hack/lib/version.sh): the API server reports them,
# and clients (kwok, the operator) read them.
build_kubernetes() {
    local version flags="-s -w" p
    version=$(module_version "$root/tools/kubernetes" k8s.io/kubernetes)
    local minor=${version#v1.}
    minor=${minor%%.*}
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags+=" -X $p.gitVersion=$version -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitCommit=module"
        flags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    build_from_wrapper kubernetes k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver "$flags"
    build_from_wrapper kubernetes k8s.io/kubernetes/cmd/kube-controller-manager kube-controller-manager "$flags"
    build_from_wrapper kubernetes k8s.io/kubernetes/cmd/kube-scheduler kube-scheduler "$flags"
}

# kwok plays no stage of its own without a configuration: build/bin/kwok-stages.yaml holds those of its
# release (kustomize/stage) it plays in the tests: a node initialised and kept Ready (node/fast,
# node/heartbeat), a pod made Running with an IP from its node's podCIDR and deleted when asked
# (pod/fast pod-ready and pod-delete). Not pod-complete: it ends a Job's pods a moment after they run,
# where a training pod runs until the test ends it.
build_kwok() {
    local module=sigs.k8s.io/kwok version dir stage
    version=$(module_version "$root/tools/kwok" "$module")
    build_from_wrapper kwok "$module/cmd/kwok" kwok "-s -w -X $module/pkg/consts.Version=$version"
    dir=$(module_dir "$root/tools/kwok" "$module")/kustomize/stage
    for stage in node/fast/node-initialize node/heartbeat/node-heartbeat pod/fast/pod-ready pod/fast/pod-delete; do
        echo "# kwok $version kustomize/stage/$stage.yaml"
        cat "$dir/$stage.yaml"
        echo "---"
    done >"$out/kwok-stages.yaml"
}

# With its CRDs of the same release (example/prometheus-operator-crd), in build/bin/prometheus-operator-crds.yaml.
build_prometheus-operator() {
    local module=github.com/prometheus-operator/prometheus-operator version crd
    version=$(module_version "$root/tools/prometheus-operator" "$module")
    build_from_wrapper prometheus-operator "$module/cmd/operator" prometheus-operator \
        "$(common_version_flags "${version#v}" "$module@$version")"
    for crd in "$(module_dir "$root/tools/prometheus-operator" "$module")"/example/prometheus-operator-crd/*.yaml; do
        echo "# prometheus-operator $version example/prometheus-operator-crd/$(basename "$crd")"
        cat "$crd"
        echo "---"
    done >"$out/prometheus-operator-crds.yaml"
}

build_kube-state-metrics() {
    local module=k8s.io/kube-state-metrics/v2 version
    version=$(module_version "$root/tools/kube-state-metrics" "$module")
    build_from_wrapper kube-state-metrics "$module" kube-state-metrics \
        "$(common_version_flags "$version" "$module@$version")"
}

for target in "${targets[@]}"; do
    timed "$target" "build_$target"
done

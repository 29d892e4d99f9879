"""deploy/kubernetes/ on a real control plane: applied, discovered, scraped, and a failed Job paged.

A control plane without nodes runs as plain processes (tests/support/kubernetes_cluster.py: etcd,
kube-apiserver, the Job controller, the scheduler, kwok playing the kubelet of four fake GPU nodes).
On it: the operator's CRDs and every manifest, applied server-side with strict field validation,
twice; the real Job controller makes the Indexed Job's pods, the real scheduler binds them (GPUs
counted), kwok runs them with IPs from their node's podCIDR, which are loopback addresses here. Each
pod's ranks are then real processes (tests/support/rank_group.py: a whole Telemetry per rank) started
with the environment the kubelet would give the pod's container (the downward API resolved from the
pod object, $(VAR) expanded), listening on the pod's IP. The real Prometheus Operator renders the
PodMonitors into a Prometheus configuration; a real Prometheus 3 runs with it, finds every rank
through kubernetes_sd_configs against the API server, and scrapes it. kube-state-metrics reads the
same API server; a second training Job whose pod fails (as the kubelet reports an OOM kill) is failed
by the real Job controller, and the shipped rule pages it by its run.

What is not real here: no container runs (no kubelet, no image is pulled), so the ranks are started by
the test, and the pod network is loopback; the Deployment and DaemonSet are accepted but make no pods
(their controllers do not run). docs/how-to/kubernetes.md says what was run and with which versions.
"""

from __future__ import annotations

import base64
import copy
import gzip
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.built import built
from tests.support.dashboards import (
    CLUSTER_DASHBOARD,
    TRAINING_DASHBOARD,
    http_variable_options,
    run_every_query,
)
from tests.support.downward_api import container_env, pod_fields
from tests.support.kubernetes_cluster import FIELD_MANAGER, ApiError, ControlPlane, Kube, manifests
from tests.support.polling import wait_until
from tests.support.processes import child_env, free_port, reap
from tests.support.prometheus_server import ServerProcess

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
RANK_GROUP = ROOT / "tests" / "support" / "rank_group.py"
NAMESPACE = "openlora"
JOB = "openlora-train"
FAILING_JOB = "openlora-train-oom"
GPUS_PER_NODE = 8
# Four fake nodes of 8 GPUs: the training Job's two pods (8 GPUs each) take two, the failing Job's the
# other two. Pods on node i get IPs from 127.0.(10+i).0/24: loopback, so a process here can be them.
NODES = {f"gpu-node-{i}": f"127.0.{10 + i}.0/24" for i in range(4)}
# Panels the simulated ranks (tests/support/rank_group.py) feed nothing: host and process metrics are off
# (they would be the one process's, not a rank's); no torch allocator, data loader, FLOP count, guard,
# non-finite evaluation or XID. Every other panel of both dashboards must answer with data.
SIMULATED_RANKS_LACK = {
    # the cluster dashboard
    "Data-wait fraction per rank, highest first",
    "MFU per rank, lowest first",
    "XID errors per rank, most first",
    # the training dashboard
    "Adapter and model",
    "Data-wait fraction",
    "Data wait per step",
    "Model FLOP/s: achieved and peak",
    "MFU (model FLOPs utilization)",
    "Non-finite evaluations",
    "Divergence guard trips",
    "torch allocator",
    "XID errors",
    "Process CPU",
    "Process memory (RSS)",
    "Process disk I/O",
    "Node CPU busy",
    "Node memory",
    "Node disk I/O",
    "Node network I/O",
}
# Scrape and evaluate faster than the shipped 5 s / 15 s, so that the test takes seconds.
INTERVAL = "1s"


def objects() -> list[dict]:
    return [obj for path in sorted(K8S.glob("*.yaml")) for obj in manifests(path)]


def applied_state(kube: Kube, applied: list[dict]) -> dict[str, tuple]:
    """Per object: its generation (a change of spec bumps it) and when this field manager last applied
    a change to it (a server-side apply that changes nothing leaves both). Not the resource version:
    the controllers write status (the Job's, the nodes') whenever they like."""
    state = {}
    for obj in applied:
        meta = kube.request("GET", kube.object_path(obj))["metadata"]
        ours = [m for m in meta["managedFields"] if m["manager"] == FIELD_MANAGER and m["operation"] == "Apply"]
        state[kube.object_path(obj)] = (meta.get("generation"), [(m.get("subresource"), m["time"]) for m in ours])
    return state


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The control plane, for this module's tests (the one module that uses it): stopped when they end,
    so that its 0.8 GB (kube-apiserver's 0.5 with the operator's CRDs) are not held through the rest
    of a worker's run."""
    with ControlPlane(tmp_path_factory.mktemp("kubernetes")) as plane:
        yield plane


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The control plane with the operator's CRDs and the four nodes."""
    plane = control_plane
    kube = plane.kube
    for crd in manifests(Path(built("prometheus-operator-crds.yaml"))):
        kube.apply(crd)
    for crd in manifests(Path(built("prometheus-operator-crds.yaml"))):
        name = crd["metadata"]["name"]
        wait_until(
            lambda name=name: any(
                c["type"] == "Established" and c["status"] == "True"
                for c in kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, name)
                .get("status", {})
                .get("conditions", [])
            ),
            30,
            f"CRD {name} established",
        )
    for name, cidr in NODES.items():
        plane.add_node(name, cidr, GPUS_PER_NODE)
    yield plane


@pytest.fixture(scope="module")
def applied(cluster: ControlPlane) -> dict:
    """Every object of deploy/kubernetes/ applied once, in file order, then a second time; the
    resource versions after each."""
    kube = cluster.kube
    first = [kube.apply(obj) for obj in objects()]
    after_first = applied_state(kube, first)
    time.sleep(1.1)  # managedFields times have seconds: a change now would show a later one
    second = [kube.apply(obj) for obj in objects()]
    return {"objects": first, "after_first": after_first, "after_second": applied_state(kube, second)}


def test_the_control_plane_is_the_pinned_kubernetes_and_its_fake_nodes_are_ready(cluster: ControlPlane) -> None:
    kube = cluster.kube
    assert kube.request("GET", "/version")["gitVersion"] == "v1.36.3"
    nodes = {n["metadata"]["name"]: n for n in kube.list("v1", "Node")}
    assert set(nodes) == set(NODES)
    for name, node in nodes.items():
        ready = wait_until(
            lambda name=name: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in kube.get("v1", "Node", None, name)["status"].get("conditions", [])
            ),
            30,
        )
        assert ready, node
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS_PER_NODE)
    rss = cluster.rss_bytes()
    print(f"control plane ready in {cluster.started_s:.1f} s; RSS MB: " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in rss.items()))
    assert cluster.started_s < 120


def test_every_manifest_is_accepted_with_strict_validation_and_a_second_apply_changes_nothing(applied: dict) -> None:
    kinds = sorted({(o["kind"], o["metadata"]["name"]) for o in applied["objects"]})
    assert kinds == sorted((o["kind"], o["metadata"]["name"]) for o in objects())
    assert {kind for kind, _ in kinds} == {
        "Namespace", "ConfigMap", "Service", "Deployment", "DaemonSet", "Job", "PodMonitor"
    }  # fmt: skip
    assert applied["after_second"] == applied["after_first"], "the second apply changed an object"


def test_the_configmaps_on_the_server_hold_what_render_configmaps_renders(cluster: ControlPlane, applied: dict) -> None:
    spec = importlib.util.spec_from_file_location("render_configmaps", K8S / "render_configmaps.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    assert (K8S / "10-collector-config.yaml").read_text() == render.render()
    for name, (_, paths) in render.CONFIGS.items():
        data = cluster.kube.get("v1", "ConfigMap", NAMESPACE, name)["data"]
        assert data == {path.name: path.read_text() for path in paths}, name


@pytest.mark.parametrize(
    ("kind", "path", "field"),
    [
        ("Job", ("spec", "template", "spec", "containers", 0), "imagePullPolicyy"),
        ("PodMonitor", ("spec", "podMetricsEndpoints", 0), "scrapeIntervall"),
        ("Deployment", ("spec", "template", "spec"), "terminationGracePeriod"),
    ],
)
def test_an_unknown_field_is_refused_not_dropped(applied: dict, cluster: ControlPlane, kind: str, path: tuple, field: str) -> None:
    """The control: no unknown field passes, for built-in kinds and for the CRD's schema alike. (A
    server-side apply refuses one of a built-in kind while typing the patch, with a 500 and "field not
    declared in schema", as upstream does; a custom resource's is refused by strict field validation,
    where it would otherwise be pruned.)"""
    obj = copy.deepcopy(next(o for o in objects() if o["kind"] == kind))
    node = obj
    for key in path:
        node = node[key]
    node[field] = "1"
    with pytest.raises(ApiError) as refused:
        cluster.kube.apply(obj)
    message = str(refused.value)
    assert refused.value.status in (400, 422, 500) and field in message, message
    assert "unknown field" in message or "field not declared in schema" in message, message


# -- discovery and scraping through the operator's configuration ----------------------------------------


def running_pods(kube: Kube, job: str, count: int, timeout: float = 60) -> list[dict]:
    """The Job's ``count`` pods once each is Running with an IP, in completion-index order."""

    def ready() -> list[dict]:
        pods = kube.list("v1", "Pod", NAMESPACE, labelSelector=f"batch.kubernetes.io/job-name={job}")
        live = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return live if len(live) == count else []

    pods = wait_until(ready, timeout, f"{count} Running pods of Job {job}")
    return sorted(pods, key=lambda p: int(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]))


def start_pod_ranks(pod: dict, world_size: int) -> subprocess.Popen:
    """The ranks of one pod as real processes: the trainer container's environment as the kubelet makes
    it (downward API from the pod object, $(VAR) expanded), the pull endpoint on the pod's IP (the pod's
    own network namespace, where the manifest's 0.0.0.0 is that IP)."""
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    env = container_env(container, pod_fields(pod))
    env["OTEL_EXPORTER_PROMETHEUS_HOST"] = pod["status"]["podIP"]
    own = {k: v for k, v in env.items() if k.startswith(("OTEL_", "OPENLORA_"))}
    index = int(pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])
    process = subprocess.Popen(
        [sys.executable, str(RANK_GROUP), "--first-rank", str(index * GPUS_PER_NODE), "--count", str(GPUS_PER_NODE),
         "--world-size", str(world_size), "--step-s", "0.5", "--max-s", "600", "--pod-resource"],
        env=child_env(**own, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().startswith("ready"), "the ranks did not start"
    return process


def operator_config(kube: Kube, name: str, timeout: float = 60) -> dict:
    """The Prometheus configuration the operator rendered for Prometheus ``name`` (its Secret)."""

    def rendered() -> bytes:
        try:
            secret = kube.get("v1", "Secret", NAMESPACE, f"prometheus-{name}")
        except ApiError:
            return b""
        return base64.b64decode(secret.get("data", {}).get("prometheus.yaml.gz", ""))

    data = wait_until(rendered, timeout, f"the operator's configuration for Prometheus {name}")
    return yaml.safe_load(gzip.decompress(data))


@pytest.fixture(scope="module")
def scraped(cluster: ControlPlane, applied: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The training Job's ranks running, kube-state-metrics and the operator against the API server, and
    a Prometheus 3 with the operator's configuration (plus the shipped rules)."""
    kube = cluster.kube
    workdir = tmp_path_factory.mktemp("operated")
    job = kube.get("batch/v1", "Job", NAMESPACE, JOB)
    world_size = job["spec"]["completions"] * GPUS_PER_NODE
    pods = running_pods(kube, JOB, job["spec"]["completions"])
    processes: list[subprocess.Popen] = []
    servers: list[ServerProcess] = []
    try:
        for pod in pods:
            processes.append(start_pod_ranks(pod, world_size))
        ksm_port, ksm_telemetry = free_port(), free_port()
        servers.append(
            ServerProcess(
                "kube-state-metrics",
                [built("kube-state-metrics"), f"--kubeconfig={cluster.kubeconfig_file}", "--host=127.0.0.1",
                 f"--port={ksm_port}", "--telemetry-host=127.0.0.1", f"--telemetry-port={ksm_telemetry}",
                 "--resources=jobs,pods",
                 # What docs/how-to/kubernetes.md asks of a cluster's kube-state-metrics.
                 "--metric-labels-allowlist=jobs=[app.kubernetes.io/part-of],"
                 "pods=[batch.kubernetes.io/job-name,batch.kubernetes.io/controller-uid]"],
                ksm_port, workdir, "/metrics",
            )
        )  # fmt: skip
        operator_port = free_port()
        servers.append(
            ServerProcess(
                "prometheus-operator",
                [built("prometheus-operator"), f"--web.listen-address=127.0.0.1:{operator_port}",
                 f"--namespaces={NAMESPACE}", "--log-level=warn"],
                operator_port, workdir, "/healthz", env={"KUBECONFIG": str(cluster.kubeconfig_file)},
            )
        )  # fmt: skip
        # A static scrape of kube-state-metrics, as a cluster's Prometheus has one (kube-prometheus-stack's
        # ServiceMonitor); given to the operator as additionalScrapeConfigs, which it renders in.
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "openlora-extra-scrape", "namespace": NAMESPACE},
                "stringData": {
                    "kube-state-metrics.yaml": yaml.safe_dump(
                        [
                            {
                                "job_name": "kube-state-metrics",
                                "honor_labels": True,
                                "static_configs": [{"targets": [f"127.0.0.1:{ksm_port}"]}],
                            }
                        ]
                    )
                },
            }
        )
        prometheus_name = "openlora"
        kube.apply(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "Prometheus",
                "metadata": {"name": prometheus_name, "namespace": NAMESPACE},
                "spec": {
                    "version": "v3.16.0",
                    "scrapeInterval": INTERVAL,
                    "evaluationInterval": INTERVAL,
                    "podMonitorSelector": {"matchLabels": {"app.kubernetes.io/part-of": "openlora-otel"}},
                    "podMonitorNamespaceSelector": {},
                    "additionalScrapeConfigs": {"name": "openlora-extra-scrape", "key": "kube-state-metrics.yaml"},
                    # Prometheus runs outside the cluster here: the operator writes this API server,
                    # its CA and the token file into every kubernetes_sd_config.
                    "apiserverConfig": {
                        "host": cluster.server,
                        "tlsConfig": {"caFile": str(cluster.ca_file)},
                        "authorization": {"type": "Bearer", "credentialsFile": str(cluster.token_file)},
                    },
                },
            }
        )
        config = operator_config(kube, prometheus_name)
        # What the operator's config-reloader does in the pod before Prometheus reads the file: expand
        # $(POD_NAME) and $(SHARD) (pod 0 of shard 0). The rules: what a PrometheusRule would mount,
        # here the shipped file itself.
        text = yaml.safe_dump({**config, "rule_files": [str(RULES)]})
        text = text.replace("$(POD_NAME)", f"prometheus-{prometheus_name}-0").replace("$(SHARD)", "0")
        assert "$(" not in text, text
        (workdir / "prometheus.yml").write_text(text)
        port = free_port()
        prometheus = ServerProcess(
            "prometheus",
            [built("prometheus"), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            port, workdir, "/-/ready",
        )  # fmt: skip
        servers.append(prometheus)
        yield {"prometheus": prometheus, "config": config, "job": job, "pods": pods, "world_size": world_size}
    finally:
        for server in reversed(servers):
            server.stop()
        for process in processes:
            process.terminate()
            reap(process, 30)


def test_the_operator_renders_pod_discovery_against_the_api_server(scraped: dict, cluster: ControlPlane) -> None:
    jobs = [c for c in scraped["config"]["scrape_configs"] if c["job_name"].startswith("podMonitor/openlora/openlora-training/")]
    assert len(jobs) == GPUS_PER_NODE, [c["job_name"] for c in scraped["config"]["scrape_configs"]]
    for job in jobs:
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod" and sd["api_server"] == cluster.server, sd
        assert sd["namespaces"]["names"] == [NAMESPACE], sd
        assert job["scrape_interval"] == "5s" and job["scrape_timeout"] == "5s", job


def test_each_rank_is_a_target_with_the_labels_the_rules_and_dashboards_join_on(scraped: dict) -> None:
    prometheus, pods, job = scraped["prometheus"], scraped["pods"], scraped["job"]
    expected = {
        f"{pod['status']['podIP']}:{9464 + local}": (pod, local) for pod in pods for local in range(GPUS_PER_NODE)
    }

    seen: list[dict] = []

    def training_targets() -> list[dict]:
        targets = prometheus.get("/api/v1/targets", state="active")["data"]["activeTargets"]
        seen[:] = targets
        ours = [t for t in targets if t["labels"].get("job") == "openlora"]
        return ours if len(ours) == len(expected) and all(t["health"] == "up" for t in ours) else []

    targets = wait_until(training_targets, 90)
    assert targets, (
        [(t["labels"], t["health"], t["lastError"]) for t in seen],
        [t for t in prometheus.get("/api/v1/targets", state="dropped")["data"]["droppedTargets"] if "training" in t["scrapePool"]][:1],
        prometheus.log.read_text()[-3000:],
    )
    for target in targets:
        labels = target["labels"]
        pod, local = expected[labels["instance"]]
        assert labels == {
            "job": "openlora",
            "instance": labels["instance"],
            "namespace": NAMESPACE,
            "pod": pod["metadata"]["name"],
            "container": "trainer",
            "endpoint": f"rank-{local}",
        }, labels
    # The run's identity, from target_info joined on (job, instance): the run id is the Job's uid on
    # every rank, each rank on its pod's node, with its local rank.
    uid = job["metadata"]["uid"]

    def identities() -> list[dict]:
        series = prometheus.query('target_info{job="openlora"}')
        return series if len(series) == len(expected) else []

    for series in wait_until(identities, 60, "target_info of every rank"):
        labels = series["metric"]
        pod, local = expected[labels["instance"]]
        assert labels["openlora_run_id"] == uid and labels["k8s_job_uid"] == uid, labels
        assert labels["k8s_job_name"] == JOB and labels["openlora_run_name"] == JOB, labels
        assert labels["k8s_node_name"] == pod["spec"]["nodeName"] and labels["k8s_pod_name"] == pod["metadata"]["name"], labels
        assert labels["openlora_local_rank"] == str(local), labels
        index = int(pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])
        assert labels["openlora_rank"] == str(index * GPUS_PER_NODE + local), labels
    assert len({p["spec"]["nodeName"] for p in pods}) == len(pods), "the scheduler put two 8-GPU pods on one 8-GPU node"


def test_the_training_and_cluster_dashboards_answer_per_rank_through_this_path(scraped: dict) -> None:
    prometheus, uid = scraped["prometheus"], scraped["job"]["metadata"]["uid"]
    per_rank = (
        "count(openlora_training_steps_total * on (job, instance) group_left (openlora_run_id)"
        f' target_info{{openlora_run_id="{uid}"}})'
    )
    assert wait_until(
        lambda: (r := prometheus.query(per_rank)) and float(r[0]["value"][1]) == scraped["world_size"], 90
    ), prometheus.query(per_rank)
    assert prometheus.wait_for_scrapes(3, timeout=60)  # the PodMonitor scrapes every 5 s
    options = http_variable_options(prometheus.url)
    problems = run_every_query(
        CLUSTER_DASHBOARD, prometheus.query, options, uid, run_names={uid: JOB}, without_data=SIMULATED_RANKS_LACK
    )
    problems += run_every_query(
        TRAINING_DASHBOARD, prometheus.query, options, uid, run_names={uid: JOB}, hparam="learning_rate",
        without_data=SIMULATED_RANKS_LACK,
    )  # fmt: skip
    assert not problems, "\n".join(problems)


def test_a_training_job_that_fails_before_reporting_pages_by_its_run(scraped: dict, cluster: ControlPlane) -> None:
    """A second training Job whose container never reports (its pod is OOM-killed before the first
    step): the kubelet's report of the failed pod is the only thing the test writes; the real Job
    controller fails the Job (backoffLimit 0), kube-state-metrics says so, and the shipped rule pages
    with the run's id (the Job's uid) and name (the Job's name)."""
    kube, prometheus = cluster.kube, scraped["prometheus"]
    manifest = next(o for o in objects() if o["kind"] == "Job")
    failing = copy.deepcopy(manifest)
    failing["metadata"]["name"] = FAILING_JOB
    try:
        uid = kube.apply(failing)["metadata"]["uid"]
        pods = running_pods(kube, FAILING_JOB, failing["spec"]["completions"])
        victim = pods[0]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        kube.patch_status(
            "v1", "Pod", NAMESPACE, victim["metadata"]["name"],
            {"status": {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                        "containerStatuses": [{
                            "name": "trainer", "image": victim["spec"]["containers"][0]["image"], "imageID": "",
                            "ready": False, "restartCount": 0, "started": False,
                            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": now, "finishedAt": now}},
                        }]}},
        )  # fmt: skip

        def job_failed() -> bool:
            status = kube.get("batch/v1", "Job", NAMESPACE, FAILING_JOB)["status"]
            return any(c["type"] == "Failed" and c["status"] == "True" for c in status.get("conditions", []))

        assert wait_until(job_failed, 60), kube.get("batch/v1", "Job", NAMESPACE, FAILING_JOB)["status"]

        def page() -> list[dict]:
            return prometheus.query('ALERTS{alertname="OpenloraKubernetesJobFailed", alertstate="firing"}')

        alerts = wait_until(page, 60)
        assert alerts, prometheus.query('{__name__=~"kube_job_status_failed|kube_job_failed|kube_job_labels"}')
        (alert,) = alerts
        labels = alert["metric"]
        assert labels["severity"] == "critical" and labels["namespace"] == NAMESPACE, labels
        assert labels["job_name"] == FAILING_JOB and labels["openlora_run_name"] == FAILING_JOB, labels
        assert labels["openlora_run_id"] == uid and labels["reason"] == "BackoffLimitExceeded", labels
        # The training Job that reports through its own metrics is running: not paged.
        assert all(a["metric"]["job_name"] != JOB for a in page())
    finally:
        kube.delete("batch/v1", "Job", NAMESPACE, FAILING_JOB)

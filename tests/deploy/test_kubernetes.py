"""deploy/kubernetes/: schema validation and consistency of the manifests, offline (a real control plane
applies and runs them in tests/deploy/test_kubernetes_cluster.py).

The core kinds are validated against the Kubernetes JSON schemas that the PyPI package
kubernetes-validate ships (offline, strict: unknown fields fail). The PodMonitor is a custom
resource with no schema there; it is checked structurally. Everything else is consistency: label
selectors against pod labels, Service ports against container ports, $(VAR) references against
the env list, the PodMonitor's ports against what each local rank binds (computed by
TelemetryConfig.from_env, not restated), the downward API against the semantic-convention k8s.*
names, the ConfigMaps against deploy/collector/, and the collector endpoints against the Services.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from openlora_otel.config import TelemetryConfig
from tests.support import collector_checks as checks
from tests.support.downward_api import container_env, expand

K8S = checks.ROOT / "deploy" / "kubernetes"
COLLECTOR_CONFIGS = checks.ROOT / "deploy" / "collector"
PROMETHEUS_YML = checks.ROOT / "collector" / "prometheus.yml"
COMPOSE = checks.ROOT / "collector" / "docker-compose.yml"

KNOWN_KINDS = {
    ("v1", "Namespace"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "DaemonSet"),
    ("batch/v1", "Job"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}
# Resource attributes of the OpenTelemetry semantic conventions' k8s registry (opentelemetry.io,
# "Kubernetes Attributes"): the names a backend or the collector's k8s components also use.
SEMCONV_K8S = frozenset(
    f"k8s.{entity}.{field}"
    for entity in ("cluster", "node", "pod", "replicaset", "deployment", "statefulset", "daemonset", "job", "cronjob")
    for field in ("name", "uid")
) | {"k8s.namespace.name", "k8s.container.name", "k8s.container.restart_count"}
# The Job pods' identity, each from the downward API field that holds it.
K8S_ATTRIBUTE_SOURCES = {
    "k8s.pod.name": "metadata.name",
    "k8s.pod.uid": "metadata.uid",
    "k8s.namespace.name": "metadata.namespace",
    "k8s.node.name": "spec.nodeName",
    "k8s.job.name": "metadata.labels['batch.kubernetes.io/job-name']",
    "k8s.job.uid": "metadata.labels['batch.kubernetes.io/controller-uid']",
}
# fieldRef paths the downward API accepts for environment variables.
ENV_FIELD_PATHS = re.compile(
    r"metadata\.(name|namespace|uid)|metadata\.(labels|annotations)\['[^']+'\]"
    r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs)"
)
# Labels the Job controller puts on its pods (the batch.kubernetes.io/ ones since Kubernetes 1.27).
JOB_POD_LABELS = {
    "batch.kubernetes.io/job-name",
    "batch.kubernetes.io/controller-uid",
    "batch.kubernetes.io/job-completion-index",
    "job-name",
    "controller-uid",
}
_REFERENCE = re.compile(r"\$\((\w+)\)")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PORT_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?!-))*[a-z0-9]|[a-z]")


# -- reading the manifests ----------------------------------------------------------------------


def manifest_files() -> list[Path]:
    # `kubectl apply -f deploy/kubernetes/` reads these, in this order.
    return sorted(p for p in K8S.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


@functools.cache
def _parsed() -> tuple[dict, ...]:
    return tuple(doc for path in manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc)


def documents() -> list[dict]:
    """Every object, parsed once per session: tests that change one work on a deep copy."""
    return list(_parsed())


def objects(kind: str) -> list[dict]:
    return [doc for doc in documents() if doc["kind"] == kind]


def one(kind: str, name: str) -> dict:
    (found,) = [doc for doc in objects(kind) if doc["metadata"]["name"] == name]
    return found


def workloads() -> list[dict]:
    return [doc for doc in documents() if doc["kind"] in ("Deployment", "DaemonSet", "Job")]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def selected_workloads(selector: Mapping[str, str]) -> list[dict]:
    return [w for w in workloads() if selects(selector, pod_labels(w))]


def container_ports(workload: dict) -> list[dict]:
    return [port for container in containers(workload) for port in container.get("ports", [])]


def training_job() -> dict:
    (job,) = objects("Job")
    return job


def trainer(job: dict | None = None) -> dict:
    (container,) = containers(job or training_job())
    return container


def collector_container(kind: str) -> dict:
    (workload,) = objects(kind)
    (container,) = containers(workload)
    return container


def flag(args: list[str], *names: str) -> str:
    """The value of ``--name=value`` (torchrun accepts - and _ spellings) among ``args``."""
    for arg in args:
        key, _, value = arg.partition("=")
        if key.lstrip("-").replace("_", "-") in {n.replace("_", "-") for n in names}:
            return value
    raise AssertionError(f"no {names} in {args}")


# -- the downward API and $(VAR) expansion, as the kubelet does them ---------------------------------


def fake_pod(job: dict, *, index: int = 0, node: str = "gpu-node-7", job_uid: str = "6b1f0c2e-job") -> dict[str, str]:
    """Downward API values of one pod of ``job``: distinct per field, so a swapped source shows."""
    name = job["metadata"]["name"]
    return {
        "metadata.name": f"{name}-{index}-x7k2p",
        "metadata.uid": f"pod-uid-{index}",
        "metadata.namespace": job["metadata"]["namespace"],
        "spec.nodeName": node,
        "status.hostIP": f"10.0.3.{7 + index}",
        "status.podIP": f"10.244.{index}.5",
        "metadata.labels['batch.kubernetes.io/job-name']": name,
        "metadata.labels['batch.kubernetes.io/controller-uid']": job_uid,
        "metadata.labels['batch.kubernetes.io/job-completion-index']": str(index),
    }


def rank_env(container: dict, pod: Mapping[str, str], local_rank: int, node_rank: int = 0) -> dict[str, str]:
    """What one rank under torchrun sees: the container's env plus the variables torchrun sets."""
    env = container_env(container, pod)
    args = [expand(a, env) for a in container["args"]]
    per_node = int(flag(args, "nproc-per-node"))
    env.update(
        LOCAL_RANK=str(local_rank),
        RANK=str(node_rank * per_node + local_rank),
        GROUP_RANK=str(node_rank),
        WORLD_SIZE=str(int(flag(args, "nnodes")) * per_node),
        TORCHELASTIC_RUN_ID=flag(args, "rdzv-id"),
    )
    return env


# -- schemas --------------------------------------------------------------------------------------


def kubernetes_validate():
    try:
        import kubernetes_validate.utils as utils
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed (PyPI, in the `dev` extra); .ci/run must install it")
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    return utils


def schema_versions(utils) -> list[str]:
    """The oldest Kubernetes the manifests claim (1.27: the Job pod labels they read) and the newest schema."""
    versions = [tuple(int(p) for p in v.split(".")[:2]) for v in utils.all_versions()]
    oldest = min(v for v in versions if v >= (1, 27))
    return sorted({f"{oldest[0]}.{oldest[1]}", f"{max(versions)[0]}.{max(versions)[1]}"})


def test_core_objects_validate_against_the_kubernetes_schemas() -> None:
    utils = kubernetes_validate()
    versions = schema_versions(utils)
    for doc in documents():
        for version in versions:
            if doc["apiVersion"] == "monitoring.coreos.com/v1":
                # A custom resource: no schema in the package (checked structurally below).
                with pytest.raises(utils.SchemaNotFoundError):
                    utils.validate(doc, version, strict=True)
                continue
            utils.validate(doc, version, strict=True)
    # The validator is strict: a misspelt field or a wrong type fails (so passing means something).
    job = copy.deepcopy(training_job())
    trainer(job)["env"][0]["valueFrom"]["fieldRef"]["fieldpath"] = "metadata.name"
    with pytest.raises(utils.ValidationError):
        utils.validate(job, versions[-1], strict=True)
    job = copy.deepcopy(training_job())
    trainer(job)["ports"][0]["containerPort"] = "9464"
    with pytest.raises(utils.ValidationError):
        utils.validate(job, versions[-1], strict=True)


def test_podmonitors_have_the_crd_fields_they_need() -> None:
    """monitoring.coreos.com/v1 PodMonitor: spec.selector is required; only fields of the CRD are used."""
    spec_fields = {"jobLabel", "selector", "namespaceSelector", "podMetricsEndpoints", "podTargetLabels"}
    endpoint_fields = {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "relabelings"}
    duration = re.compile(r"(\d+(ms|s|m|h))+")
    monitors = objects("PodMonitor")
    assert monitors
    for monitor in monitors:
        spec = monitor["spec"]
        assert set(spec) <= spec_fields, set(spec) - spec_fields
        assert spec["selector"]["matchLabels"], "an empty selector would scrape every pod"
        assert spec["podMetricsEndpoints"]
        for endpoint in spec["podMetricsEndpoints"]:
            assert set(endpoint) <= endpoint_fields, set(endpoint) - endpoint_fields
            assert isinstance(endpoint["port"], str)  # a named container port
            for key in ("interval", "scrapeTimeout"):
                assert duration.fullmatch(endpoint[key]), endpoint[key]


# -- structure ------------------------------------------------------------------------------------


def test_kinds_names_and_namespaces() -> None:
    docs = documents()
    (namespace,) = objects("Namespace")
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) in KNOWN_KINDS, (doc["apiVersion"], doc["kind"])
        name = doc["metadata"]["name"]
        assert _DNS_LABEL.fullmatch(name) and len(name) <= 63, name
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace["metadata"]["name"], name
    keys = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
    assert len(keys) == len(set(keys))
    # `kubectl apply -f` goes file by file: the Namespace first, ConfigMaps before what mounts them.
    order = [doc["kind"] for path in manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert order[0] == "Namespace"
    assert max(i for i, k in enumerate(order) if k == "ConfigMap") < min(
        i for i, k in enumerate(order) if k in ("Deployment", "DaemonSet", "Job")
    )


def test_selectors_match_the_pods_and_service_ports_match_container_ports() -> None:
    for workload in workloads():
        if workload["kind"] != "Job":  # a Job's selector is generated
            assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload))
        names = [p["name"] for p in container_ports(workload)]
        assert len(names) == len(set(names))
        for name in names:
            assert len(name) <= 15 and _PORT_NAME.fullmatch(name), f"{name} is not a valid port name"
    for service in objects("Service"):
        (target,) = selected_workloads(service["spec"]["selector"])
        ports = container_ports(target)
        for port in service["spec"]["ports"]:
            matched = [p for p in ports if port["targetPort"] in (p["name"], p["containerPort"])]
            assert len(matched) == 1, f"{service['metadata']['name']}: targetPort {port['targetPort']}"
            assert matched[0]["protocol"] == port["protocol"]
    for monitor in objects("PodMonitor"):
        targets = selected_workloads(monitor["spec"]["selector"]["matchLabels"])
        assert targets, f"PodMonitor {monitor['metadata']['name']} selects no pods"
        for workload in targets:
            names = {p["name"] for p in container_ports(workload)}
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["port"] in names, f"{workload['metadata']['name']} has no port {endpoint['port']}"


def test_every_env_reference_resolves() -> None:
    for workload in workloads():
        template_labels = pod_labels(workload)
        for container in containers(workload):
            names: list[str] = []
            for entry in container.get("env", []):
                for referenced in _REFERENCE.findall(str(entry.get("value", ""))):
                    # $(VAR) expands only when VAR comes earlier in the same list; otherwise the
                    # process gets the literal text "$(VAR)".
                    assert referenced in names, f"{entry['name']} uses $({referenced}) before it is defined"
                field = entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                if field:
                    assert ENV_FIELD_PATHS.fullmatch(field), field
                    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field)
                    if label:
                        known = set(template_labels) | (JOB_POD_LABELS if workload["kind"] == "Job" else set())
                        assert label.group(1) in known, f"no pod has the label {label.group(1)}"
                names.append(entry["name"])
            assert len(names) == len(set(names))
            for arg in container.get("command", []) + container.get("args", []):
                for referenced in _REFERENCE.findall(arg):
                    assert referenced in names, f"{arg} uses $({referenced}), which is not in env"
    # The expansion helper reproduces the kubelet's rules that the check above relies on.
    assert expand("a=$(X),b=$(Y),c=$$(X)", {"X": "1"}) == "a=1,b=$(Y),c=$(X)"


# -- the training Job ---------------------------------------------------------------------------------


def test_downward_api_puts_the_pod_namespace_and_node_into_the_resource() -> None:
    job = training_job()
    pod = fake_pod(job)
    config = TelemetryConfig.from_env(rank_env(trainer(), pod, local_rank=3))
    attributes = config.resource_attributes
    declared = {
        pair.split("=", 1)[0]
        for pair in next(e["value"] for e in trainer()["env"] if e["name"] == "OTEL_RESOURCE_ATTRIBUTES").split(",")
    }
    assert declared <= SEMCONV_K8S, declared - SEMCONV_K8S
    assert {"k8s.pod.name", "k8s.namespace.name", "k8s.node.name"} <= declared
    for key in declared & set(K8S_ATTRIBUTE_SOURCES):
        assert attributes[key] == pod[K8S_ATTRIBUTE_SOURCES[key]], key
    assert attributes["k8s.container.name"] == trainer()["name"]
    # The ranks that torchrun sets land next to them.
    world_size = int(flag(trainer()["args"], "nnodes")) * int(flag(trainer()["args"], "nproc-per-node"))
    assert attributes["openlora.local_rank"] == 3 and attributes["openlora.world_size"] == world_size
    assert config.service_name == next(e["value"] for e in trainer()["env"] if e["name"] == "OTEL_SERVICE_NAME")


def test_run_id_is_the_jobs_on_every_rank_of_every_node() -> None:
    job = training_job()
    nodes = int(flag(trainer()["args"], "nnodes"))
    per_node = int(flag(trainer()["args"], "nproc-per-node"))
    run_ids = set()
    for index in range(nodes):
        pod = fake_pod(job, index=index, node=f"gpu-node-{index}")
        for local_rank in range(per_node):
            env = rank_env(trainer(), pod, local_rank, node_rank=index)
            run_ids.add(TelemetryConfig.from_env(env).run_id)
            assert env["TORCHELASTIC_RUN_ID"] == env["OPENLORA_RUN_ID"]  # the rendezvous id is the same one
    assert run_ids == {"6b1f0c2e-job"}
    # Another Job (a re-created one, same name) gets another id.
    other = TelemetryConfig.from_env(rank_env(trainer(), fake_pod(job, job_uid="0d9e-other-job"), 0))
    assert other.run_id == "0d9e-other-job"


def test_one_scrape_endpoint_per_local_rank() -> None:
    job, container = training_job(), trainer()
    pod = fake_pod(job)
    per_node = int(flag(container["args"], "nproc-per-node"))
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == per_node  # one rank per GPU
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {}
    for local_rank in range(per_node):
        config = TelemetryConfig.from_env(rank_env(container, pod, local_rank))
        assert "prometheus" in config.enabled_exporters
        # Bound beyond loopback, or Prometheus (another pod) cannot scrape it.
        assert config.prometheus_host == "0.0.0.0"
        expected[f"rank-{local_rank}"] = config.prometheus_port
    assert {name: port for name, port in ports.items() if name.startswith("rank-")} == expected
    assert sorted(expected.values()) == list(range(9464, 9464 + per_node))
    monitor = one("PodMonitor", "openlora-training")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == list(expected)
    assert selected_workloads(monitor["spec"]["selector"]["matchLabels"]) == [job]


def test_podmonitors_scrape_as_the_shipped_prometheus_config_does() -> None:
    """Job names, interval and timeout of collector/prometheus.yml, which the alert rules assume."""
    prometheus = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    expected_job = {"openlora-training": "openlora", "openlora-collector-self": "openlora-collector-self"}
    for monitor in objects("PodMonitor"):
        spec = monitor["spec"]
        for workload in selected_workloads(spec["selector"]["matchLabels"]):
            job = pod_labels(workload)[spec["jobLabel"]]
            assert job == expected_job[monitor["metadata"]["name"]] and job in jobs
        for endpoint in spec["podMetricsEndpoints"]:
            assert endpoint["interval"] == prometheus["global"]["scrape_interval"]
            assert endpoint["scrapeTimeout"] == prometheus["global"]["scrape_timeout"]
    # The self PodMonitor covers both tiers.
    selected = selected_workloads(one("PodMonitor", "openlora-collector-self")["spec"]["selector"]["matchLabels"])
    assert sorted(w["kind"] for w in selected) == ["DaemonSet", "Deployment"]


def test_grace_period_covers_the_final_export_and_scrape() -> None:
    job = training_job()
    config = TelemetryConfig.from_env(rank_env(trainer(), fake_pod(job), 0))
    assert config.handle_sigterm
    needed = config.final_scrape_timeout_s + config.shutdown_timeout_s
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed


def test_rendezvous_reaches_pod_zero_through_the_headless_service() -> None:
    job, container = training_job(), trainer()
    spec = job["spec"]
    nodes = int(flag(container["args"], "nnodes"))
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    service = one("Service", spec["template"]["spec"]["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert selected_workloads(service["spec"]["selector"]) == [job]
    host, port = flag(container["args"], "rdzv-endpoint").rsplit(":", 1)
    # An Indexed Job's pod i is named <job>-i; with the subdomain it resolves as <job>-i.<service>.
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    assert flag(container["args"], "rdzv-backend") == "c10d"


def test_otlp_path_reaches_the_agent_on_the_node() -> None:
    job = training_job()
    pod = fake_pod(job)
    env = rank_env(trainer(), pod, 0) | {"OTEL_METRICS_EXPORTER": "otlp"}
    otlp = TelemetryConfig.from_env(env).otlp
    agent_config = checks.load(COLLECTOR_CONFIGS / "agent.yaml")
    agent_ports = {p["name"]: p for p in collector_container("DaemonSet")["ports"]}
    http = checks.receiver_ports(agent_config)["http"]
    assert otlp.protocol == "http/protobuf"
    assert otlp.endpoint == f"http://{pod['status.hostIP']}:{http}/v1/metrics"
    # Prometheus remote write drops delta sums: the ranks must push cumulative.
    assert otlp.temporality == "cumulative"
    for protocol, port in checks.receiver_ports(agent_config).items():
        (published,) = [p for p in agent_ports.values() if p["containerPort"] == port]
        assert published["hostPort"] == port, f"the agent's {protocol} receiver is not on the node's port"


# -- the collector tiers ----------------------------------------------------------------------------


def _render_module():
    spec = importlib.util.spec_from_file_location("render_configmaps", K8S / "render_configmaps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configmaps_hold_exactly_the_collector_configs() -> None:
    module = _render_module()
    assert (K8S / "10-collector-config.yaml").read_text() == module.render(), (
        "run: python deploy/kubernetes/render_configmaps.py"
    )
    expected = {"DaemonSet": "agent.yaml", "Deployment": "gateway.yaml"}
    for kind, file_name in expected.items():
        (workload,) = objects(kind)
        (container,) = containers(workload)
        config_path = Path(flag(container["args"], "config"))
        assert config_path.name == file_name
        (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
        (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        config_map = one("ConfigMap", volume["configMap"]["name"])
        extra = ["agent-loadbalancing.yaml"] if kind == "DaemonSet" else []  # the overlay, used when named
        assert config_map["data"] == {name: (COLLECTOR_CONFIGS / name).read_text() for name in [file_name, *extra]}


def test_the_generator_refuses_text_yaml_would_change() -> None:
    module = _render_module()
    assert yaml.safe_load("k: " + module._literal_block("a:\n\n  b: 1\n", "  "))["k"] == "a:\n\n  b: 1\n"
    for bad in ("trailing: space \n", "no newline", "two:\n\n"):
        with pytest.raises(ValueError):
            module._literal_block(bad, "  ")


def test_agents_send_to_the_gateway_service() -> None:
    agent_config = checks.load(COLLECTOR_CONFIGS / "agent.yaml")
    gateway_config = checks.load(COLLECTOR_CONFIGS / "gateway.yaml")
    endpoint = agent_config["exporters"]["otlp_grpc"]["endpoint"]
    service = one("Service", checks.endpoint_host(endpoint))  # short name: same namespace as the agents
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == checks.endpoint_port(endpoint)]
    (gateway,) = selected_workloads(service["spec"]["selector"])
    assert gateway["kind"] == "Deployment"
    (target,) = [p for p in container_ports(gateway) if port["targetPort"] in (p["name"], p["containerPort"])]
    assert target["containerPort"] == checks.receiver_ports(gateway_config)["grpc"]


@pytest.mark.parametrize(("kind", "file_name"), [("DaemonSet", "agent.yaml"), ("Deployment", "gateway.yaml")])
def test_collector_pods_match_their_config(kind: str, file_name: str) -> None:
    config = checks.load(COLLECTOR_CONFIGS / file_name)
    container = collector_container(kind)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    receivers = checks.receiver_ports(config)
    assert ports["otlp-grpc"] == receivers["grpc"] and ports["otlp-http"] == receivers["http"]
    assert ports["metrics"] == checks.self_metrics_port(config)
    assert ports["health"] == checks.endpoint_port(config["extensions"]["health_check"]["endpoint"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "health"
    # memory_limiter's limit_percentage is a share of the container's limit; without one it is the node's.
    assert container["resources"]["limits"]["memory"]
    assert config["processors"]["memory_limiter"]["limit_percentage"] < 100
    # Every ${env:VAR} without a default is provided by the container.
    provided = {entry["name"] for entry in container.get("env", [])}
    for variable, has_default in checks.env_references((COLLECTOR_CONFIGS / file_name).read_text()).items():
        assert has_default or variable in provided, f"{kind} does not set {variable}"


def test_gateway_writes_to_a_remote_write_path_with_credentials_from_a_secret() -> None:
    env = {e["name"]: e for e in collector_container("Deployment")["env"]}
    url = urlsplit(env["OPENLORA_REMOTE_WRITE_URL"]["value"])
    assert url.scheme in ("http", "https") and url.path == "/api/v1/write" and not url.username
    secret = env["OPENLORA_REMOTE_WRITE_AUTHORIZATION"]["valueFrom"]["secretKeyRef"]
    assert secret["optional"] is True  # a store without authentication needs no Secret


def _env_entries() -> Iterator[dict]:
    for workload in workloads():
        for container in containers(workload):
            yield from container.get("env", [])


def test_no_credentials_in_the_manifests() -> None:
    assert not objects("Secret")
    for entry in _env_entries():
        if re.search(r"AUTH|TOKEN|PASSWORD|SECRET|CREDENTIAL|API_KEY", entry["name"]):
            assert "secretKeyRef" in entry.get("valueFrom", {}), f"{entry['name']} must come from a Secret"
        value = str(entry.get("value", ""))
        if "://" in value:
            assert urlsplit(value).password is None, f"{entry['name']} carries a password in its URL"


def test_images_are_pinned_and_the_collector_is_the_composes() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    (collector_image,) = {s["image"] for s in compose.values() if "opentelemetry-collector" in s["image"]}
    for workload in workloads():
        for container in containers(workload):
            image, _, tag = container["image"].rpartition(":")
            assert image and tag and tag != "latest", container["image"]
    assert collector_container("DaemonSet")["image"] == collector_image
    assert collector_container("Deployment")["image"] == collector_image


def test_load_balancing_agents_resolve_the_gateways_headless_service() -> None:
    """deploy/collector/agent-loadbalancing.yaml's DNS name is a headless Service of the gateway pods."""
    overlay = checks.load(COLLECTOR_CONFIGS / "agent-loadbalancing.yaml")
    dns = overlay["exporters"]["load_balancing"]["resolver"]["dns"]
    name, namespace, *suffix = dns["hostname"].split(".")
    assert suffix == ["svc", "cluster", "local"]
    service = one("Service", name)
    assert service["metadata"]["namespace"] == namespace
    # Headless: DNS gives each ready pod's IP (a ClusterIP Service would give one virtual IP: one backend).
    assert service["spec"]["clusterIP"] == "None"
    (gateway,) = selected_workloads(service["spec"]["selector"])
    assert gateway["kind"] == "Deployment" and gateway["spec"]["replicas"] >= 2
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(dns["port"])]
    (target,) = [p for p in container_ports(gateway) if port["targetPort"] in (p["name"], p["containerPort"])]
    gateway_config = checks.load(COLLECTOR_CONFIGS / "gateway.yaml")
    assert target["containerPort"] == checks.receiver_ports(gateway_config)["grpc"]

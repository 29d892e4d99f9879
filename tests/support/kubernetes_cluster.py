"""A Kubernetes control plane without nodes, as plain processes on loopback (the way envtest runs one),
and a small client for its API.

What runs, each built by tools/build.sh from the Go module proxy: etcd, kube-apiserver (its serving
certificate made by itself at start, a P-256 service-account key made here, a static token for the
tests' one user, RBAC on, that user in system:masters), kube-controller-manager with the Job,
service-account and garbage-collector controllers (what turns an Indexed Job into pods and a failed
pod into a failed Job), kube-scheduler (what binds the pods to nodes, GPUs counted), and kwok, which
plays the kubelet of the fake nodes the tests create: it moves their pods to Running and gives each
an IP from its node's podCIDR. No container runs: the tests start the processes a pod would run
themselves, on the pod's IP (a loopback address: every 127.x.y.z is this machine's).

The client speaks the API with the standard library: discovery, server-side apply with strict field
validation, get, list, status patches, delete.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from tests.support.built import built
from tests.support.pem_files import ec_private_key
from tests.support.polling import wait_until
from tests.support.processes import child_env, free_port, reap

FIELD_MANAGER = "openlora-tests"
# The annotation kwok manages nodes by (its --manage-nodes-with-annotation-selector).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
SERVICE_CIDR = "10.96.0.0/16"


class ApiError(Exception):
    """An API request answered with an error status: ``status`` and the server's Status object."""

    def __init__(self, method: str, path: str, status: int, body: dict | str) -> None:
        message = body.get("message", body) if isinstance(body, dict) else body
        super().__init__(f"{method} {path}: {status}: {message}")
        self.status = status
        self.body = body


class Kube:
    """A client of one API server: the tests' token, its serving certificate as the CA."""

    def __init__(self, server: str, token: str, ca_file: Path) -> None:
        self.server = server
        self._token = token
        self._context = ssl.create_default_context(cafile=str(ca_file))
        self._resources: dict[tuple[str, str], tuple[str, bool]] = {}

    def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json", timeout: float = 30
    ) -> dict:
        """``method`` on ``path``, ``body`` sent as JSON (or as given, if bytes); the answer parsed."""
        text = self.raw(method, path, body, content_type=content_type, timeout=timeout)
        return json.loads(text) if text else {}

    def raw(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json", timeout: float = 30
    ) -> bytes:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, context=self._context, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            raw = error.read().decode(errors="replace")
            try:
                parsed: dict | str = json.loads(raw)
            except ValueError:
                parsed = raw
            raise ApiError(method, path, error.code, parsed) from None
        return text

    # -- discovery ---------------------------------------------------------------------------------

    def resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        """The plural resource name of ``kind`` in ``api_version`` and whether it is namespaced, from
        the server's discovery (read again once when the kind is new: a CRD installed since)."""
        key = (api_version, kind)
        if key not in self._resources:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            for item in self.request("GET", base)["resources"]:
                if "/" not in item["name"]:
                    self._resources[(api_version, item["kind"])] = (item["name"], item["namespaced"])
        if key not in self._resources:
            raise KeyError(f"the API server does not serve {kind} in {api_version}")
        return self._resources[key]

    def path(self, api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
        plural, namespaced = self.resource(api_version, kind)
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        if namespaced:
            base += f"/namespaces/{namespace or 'default'}"
        return f"{base}/{plural}" + (f"/{name}" if name else "")

    def object_path(self, obj: dict) -> str:
        meta = obj["metadata"]
        return self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])

    # -- reading and writing -----------------------------------------------------------------------

    def apply(self, obj: dict, *, strict: bool = True) -> dict:
        """Server-side apply of ``obj`` (field manager openlora-tests, conflicts forced), with strict
        field validation: an unknown or duplicate field is refused, not dropped."""
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        if strict:
            query["fieldValidation"] = "Strict"
        return self.request(
            "PATCH",
            self.object_path(obj) + "?" + urllib.parse.urlencode(query),
            json.dumps(obj).encode(),
            content_type="application/apply-patch+yaml",
        )

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict:
        return self.request("GET", self.path(api_version, kind, namespace, name))

    def list(self, api_version: str, kind: str, namespace: str | None = None, **query: str) -> list[dict]:
        path = self.path(api_version, kind, namespace)
        return self.request("GET", path + ("?" + urllib.parse.urlencode(query) if query else ""))["items"]

    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return self.request("POST", self.path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj)

    def patch_status(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict) -> dict:
        return self.request(
            "PATCH",
            self.path(api_version, kind, namespace, name) + "/status",
            patch,
            content_type="application/merge-patch+json",
        )

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", self.path(api_version, kind, namespace, name), body)
        except ApiError as error:
            if error.status != 404:
                raise


class _Loader(yaml.SafeLoader):
    """YAML as Kubernetes reads it (YAML 1.2 through sigs.k8s.io/yaml): a bare ``=`` is a string, not
    PyYAML's 1.1 "value" tag (the operator's CRDs list it among a field's enum values)."""


_Loader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:value"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def manifests(path: Path) -> Iterator[dict]:
    """The objects of a YAML file (``---`` separated), empty documents left out."""
    for document in yaml.load_all(path.read_text(), Loader=_Loader):
        if document:
            yield document


def kubeconfig(server: str, ca_file: Path, token: str) -> dict:
    """A kubeconfig for the tests' user: what the controllers, kwok, the operator and
    kube-state-metrics connect with."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": "test", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok under ``directory``;
    a context manager. ``kube`` is the client, ``kubeconfig_file`` what other processes connect with,
    ``ca_file`` and ``token_file`` the same for a Prometheus. ``started_s`` the seconds from the first
    process to a ready API server with its controllers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stack = ExitStack()
        self._processes: list[tuple[str, subprocess.Popen]] = []
        self.started_s = 0.0

    # -- processes ---------------------------------------------------------------------------------

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self._stack.callback(log.close)
        process = subprocess.Popen(
            [built(name), *args], stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=self.directory
        )
        self._processes.append((name, process))
        return process

    def log(self, name: str) -> str:
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _check_alive(self) -> None:
        for name, process in self._processes:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)}")

    def _wait(self, what: str, ready: Callable[[], object], timeout: float = 60.0) -> None:
        def check() -> bool:
            self._check_alive()
            try:
                return bool(ready())
            except (OSError, ApiError, KeyError):
                return False

        if not wait_until(check, timeout=timeout, interval=0.2):
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s")

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each process now (from /proc)."""
        sizes = {}
        for name, process in self._processes:
            try:
                for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        sizes[name] = int(line.split()[1]) * 1024
            except OSError:
                pass
        return sizes

    def __enter__(self) -> ControlPlane:
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for _, process in reversed(self._processes):
            if process.poll() is None:
                process.terminate()
        # Their state is thrown away with the directory: a few seconds to stop, then killed.
        for _, process in reversed(self._processes):
            reap(process, timeout=3)
        self._processes.clear()
        self._stack.close()

    def _start_all(self) -> None:
        started = time.monotonic()
        d = self.directory
        (d / "pki").mkdir(parents=True, exist_ok=True)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self._start(
            "etcd",
            [
                "--name=test",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        key = d / "pki" / "service-account.key"
        key.write_text(ec_private_key())
        self._token = os.urandom(16).hex()
        self.token_file = d / "pki" / "token"
        self.token_file.write_text(self._token)
        (d / "pki" / "tokens.csv").write_text(f'{self._token},openlora-tests,openlora-tests,"system:masters"\n')
        self._start(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                # No --tls-cert-file: it makes a CA and a serving certificate for 127.0.0.1 and
                # localhost here, apiserver.crt holding both.
                f"--cert-dir={d / 'pki'}",
                f"--token-auth-file={d / 'pki' / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={key}",
                f"--service-account-signing-key-file={key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--profiling=false",
            ],
        )
        self.server = f"https://127.0.0.1:{api_port}"
        self.ca_file = d / "pki" / "apiserver.crt"
        self._wait("the API server's certificate", self.ca_file.exists, timeout=60)
        self.kube = Kube(self.server, self._token, self.ca_file)
        self._wait("kube-apiserver /readyz", lambda: self.kube.raw("GET", "/readyz") == b"ok", 90)
        self.kubeconfig_file = d / "kubeconfig.yaml"
        self.kubeconfig_file.write_text(yaml.safe_dump(kubeconfig(self.server, self.ca_file, self._token)))
        common = [f"--kubeconfig={self.kubeconfig_file}", "--leader-elect=false", "--secure-port=0"]
        self._start(
            "kube-controller-manager",
            [*common, "--controllers=job,serviceaccount,garbagecollector,nodelifecycle", "--use-service-account-credentials=false"],
        )
        self._start("kube-scheduler", common)
        self._start(
            "kwok",
            [
                f"--kubeconfig={self.kubeconfig_file}",
                # The stages it plays (tools/build.sh build_kwok): no pod-complete, so a Job's pods run
                # until the test ends them.
                f"--config={built('kwok-stages.yaml')}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{free_port()}",
            ],
        )
        # Ready: the service-account controller has made the default namespace's account (pods need
        # their namespace's; the ServiceAccount admission refuses them without it).
        self._wait(
            "the service-account controller",
            lambda: self.kube.get("v1", "ServiceAccount", "default", "default"),
            timeout=60,
        )
        self.started_s = time.monotonic() - started

    # -- the cluster's objects ---------------------------------------------------------------------

    def add_node(self, name: str, pod_cidr: str, gpus: int) -> dict:
        """A fake node that kwok keeps Ready, with ``gpus`` nvidia.com/gpu allocatable and pods given
        IPs from ``pod_cidr``."""
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        node = self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                    "labels": {"kubernetes.io/hostname": name, "type": "kwok"},
                },
                "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
            }
        )
        self.kube.patch_status("v1", "Node", None, name, {"status": {"capacity": capacity, "allocatable": capacity}})
        return node

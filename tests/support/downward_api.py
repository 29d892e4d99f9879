"""A container's environment as the kubelet makes it: the downward API's fields of its pod, and
Kubernetes' ``$(VAR)`` expansion over the variables defined before, in list order."""

from __future__ import annotations

import re
from collections.abc import Mapping


def expand(text: str, defined: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, the rest stays literal."""

    def replace(match: re.Match) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return defined.get(match.group(1), match.group(0))

    return re.sub(r"\$?\$\((\w+)\)", replace, text)


def container_env(container: dict, pod: Mapping[str, str]) -> dict[str, str]:
    """The environment the container starts with: values in list order, each expanded over the earlier
    ones; ``pod`` maps each downward-API field path to its value (:func:`pod_fields` for a real pod)."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = pod[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def pod_fields(pod: dict) -> dict[str, str]:
    """The downward API's environment fields of a pod object as the API server returns it."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    fields = {
        "metadata.name": meta["name"],
        "metadata.uid": meta["uid"],
        "metadata.namespace": meta["namespace"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIP": status.get("podIP", ""),
    }
    for key, value in meta.get("labels", {}).items():
        fields[f"metadata.labels['{key}']"] = value
    for key, value in meta.get("annotations", {}).items():
        fields[f"metadata.annotations['{key}']"] = value
    return fields

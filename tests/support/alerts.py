"""The shipped rule groups with a short ``for``, and the alerts a Prometheus says are firing: for the
tests that make the self-monitoring alerts' faults happen on real servers."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.prometheus_server import PrometheusApi

ROOT = Path(__file__).resolve().parent.parent.parent
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"


def shortened_rules(groups: tuple[str, ...], short_for: str = "2s") -> dict:
    """The shipped ``groups`` with every ``for`` at ``short_for`` (the shipped ones are minutes), and
    nothing else changed: the expressions, windows and thresholds are the shipped ones."""
    shipped = [g for g in yaml.safe_load(RULES.read_text())["groups"] if g["name"] in groups]
    copy = yaml.safe_load(yaml.safe_dump(shipped))
    for group in copy:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = short_for
    for original, short in zip(shipped, copy, strict=True):
        for a, b in zip(original["rules"], short["rules"], strict=True):
            assert {k: v for k, v in a.items() if k != "for"} == {k: v for k, v in b.items() if k != "for"}
    return {"groups": copy}


def firing(prometheus: PrometheusApi) -> dict[str, list[dict]]:
    """The firing alerts of /api/v1/alerts, by name."""
    body = prometheus.get("/api/v1/alerts")
    assert body["status"] == "success", body
    alerts: dict[str, list[dict]] = {}
    for alert in body["data"]["alerts"]:
        if alert["state"] == "firing":
            alerts.setdefault(alert["labels"]["alertname"], []).append(alert)
    return alerts

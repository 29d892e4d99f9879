"""The shipped Thanos and Cortex configurations (deploy/thanos/, deploy/cortex/) agree with each other;
tests/support/long_term_stores.py runs them (tests/deploy/test_deployment.py and the other paths of
tests/support/metrics_paths.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.support.shipped import shipped_args

ROOT = Path(__file__).resolve().parent.parent.parent
THANOS = ROOT / "deploy" / "thanos"


def flags(component: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for arg in shipped_args(THANOS / f"{component}.default"):
        flag, _, value = arg.partition("=")
        values.setdefault(flag, []).append(value)
    return values


def test_query_deduplicates_every_replica_label_the_components_set() -> None:
    replica_labels = set(flags("query")["--query.replica-label"])
    for component in ("receive", "rule"):
        (label,) = flags(component)["--label"]
        name, _, value = label.partition("=")
        assert re.fullmatch(r'"\d+"', value), label
        assert name in replica_labels, (component, name, replica_labels)


def test_the_hashring_names_the_receivers_query_reads_with_replication_two() -> None:
    (ring,) = json.loads((THANOS / "hashring.json").read_text())
    receive = flags("receive")
    assert receive["--receive.replication-factor"] == ["2"] and len(ring["endpoints"]) >= 2
    assert receive["--receive.local-endpoint"][0] in ring["endpoints"]
    assert set(ring["endpoints"]) <= set(flags("query")["--endpoint"])
    # The Cap'n Proto port is in the shipped line, and its comment says to give each receiver of a host
    # its own (Thanos always listens on it; tests/support/long_term_stores.py gives each its own).
    assert "--receive.capnproto-address" in receive
    assert "receivers that share a host need one each" in (THANOS / "receive.default").read_text()


def test_every_component_shares_one_bucket_and_no_file_holds_a_credential() -> None:
    for component in ("receive", "rule", "sidecar", "store", "compact"):
        assert flags(component)["--objstore.config-file"] == ["/etc/thanos/bucket.yml"], component
    for path in THANOS.glob("bucket*.yml"):
        config = yaml.safe_load(path.read_text())
        assert config["type"] in ("FILESYSTEM", "S3", "GCS"), path
        assert not {"access_key", "secret_key", "service_account"} & set(config["config"]), path


def test_the_compactor_keeps_raw_samples_30_days_and_downsamples() -> None:
    compact = flags("compact")
    assert compact["--retention.resolution-raw"] == ["30d"] and "--wait" in compact
    assert "--downsampling.disable" not in compact


def test_cortex_runs_everything_in_one_process_with_ruler_and_alertmanager() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "cortex" / "cortex.yaml").read_text())
    assert config["target"] == "all" and config["auth_enabled"] is False
    assert config["ruler"]["enable_api"] and config["ruler"]["alertmanager_url"].endswith("/alertmanager")
    assert config["ruler_storage"]["backend"] == "local" and config["blocks_storage"]["backend"] == "filesystem"

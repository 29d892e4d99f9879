"""deploy/prometheus/: the per-node agent, the central stores and federation, run for real.

Two training-like rank processes are discovered by a real Prometheus in agent mode
through a file_sd directory; the agent remote-writes to (a) a central Prometheus with
the remote-write receiver on and (b) VictoriaMetrics (vmalert evaluating the rules
there). Series and target_info must arrive with the run id, and every query of both
dashboards must return data against each store. A global Prometheus federates from the
central one, and the cluster dashboard must work there too.

Every process is started from the shipped files: the configs are deploy/prometheus/*.yml
with only addresses, paths and intervals rewritten, and the command lines are the ARGS of
the shipped *.default files with the same kind of rewrites, so what ships is what runs.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from openlora_otel.exporters.discovery import _host_label
from tests.support.dashboards import (
    CLUSTER_DASHBOARD,
    TRAINING_DASHBOARD,
    http_variable_options,
    run_every_query,
)
from tests.support.polling import wait_until
from tests.support.processes import free_port
from tests.support.prometheus_server import ServerProcess as Server
from tests.support.ranks import FAST_S, SLOW_S, Ranks, write_rules
from tests.support.real_parts import debian, missing
from tests.support.shipped import rewrite_args, shipped_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "prometheus"
VM_DIR = DEPLOY / "victoria-metrics"
RUN_ID = "scaleout-run"


def binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(debian(package), f"{name} is not installed (Debian package `{package}`)")
    return path


# -- the shipped files, rewritten for loopback and temp dirs ------------------------------------


def loopback(url: str, port: int) -> str:
    """``url`` with its host and port replaced: the shipped path stays."""
    return urllib.parse.urlsplit(url)._replace(netloc=f"127.0.0.1:{port}").geturl()


def agent_config(sd_dir: Path, store_ports: list[int]) -> dict:
    config = yaml.safe_load((DEPLOY / "agent.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    # The ranks' job; the agent's self-scrape (127.0.0.1:9090, the shipped port) is left out here:
    # tests/deploy/test_self_monitoring.py has Prometheus scrape itself.
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"openlora", "prometheus-agent"}
    job = jobs["openlora"]
    config["scrape_configs"] = [job]
    (sd,) = job["file_sd_configs"]
    sd["files"] = [str(sd_dir / Path(pattern).name) for pattern in sd["files"]]
    (shipped,) = config["remote_write"]
    config["remote_write"] = []
    for port in store_ports:  # the shipped entry once per store, only the address changed
        entry = copy.deepcopy(shipped)
        entry["url"] = loopback(shipped["url"], port)
        config["remote_write"].append(entry)
    return config


def central_config(rules: Path) -> dict:
    config = yaml.safe_load((DEPLOY / "central.yml").read_text())
    config["global"]["evaluation_interval"] = "1s"
    assert config["rule_files"], "the central store must load the rules"
    config["rule_files"] = [str(rules)]
    # Its self-scrape jobs name the shipped ports (127.0.0.1:9090 and :9093), not this test's servers:
    # left out here (tests/deploy/test_self_monitoring.py has Prometheus scrape itself).
    assert {job["job_name"] for job in config["scrape_configs"]} == {"prometheus", "alertmanager"}
    config["scrape_configs"] = []
    # Nothing listens there: alerts are not under test here (and no Alertmanager of this machine gets them).
    assert config["alerting"]["alertmanagers"], "the central store must send its alerts"
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [f"127.0.0.1:{free_port()}"]}]}]
    return config


def global_config(central_port: int) -> dict:
    config = yaml.safe_load((DEPLOY / "global.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{central_port}"]}]
    return config


# -- processes ---------------------------------------------------------------------------------------


@dataclass
class Stack:
    ranks: Ranks
    agent: Server
    central: Server
    federated: Server
    vm: Server | None
    vm_missing: str


def expected_instances(ranks: Ranks) -> list[str]:
    """The agent names each rank after its registration file: <host>:<port>, unique across nodes."""
    return sorted(f"{_host_label()}:{target.rsplit(':', 1)[1]}" for target in ranks.targets)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = binary("prometheus", "prometheus")
    workdir = tmp_path_factory.mktemp("scaleout")
    rules = write_rules(workdir / "rules")
    sd_dir = workdir / "file_sd"
    sd_dir.mkdir()
    started: list[Server] = []
    ranks = None
    try:
        central_port = free_port()
        (workdir / "central.yml").write_text(yaml.safe_dump(central_config(rules)))
        central = Server(
            "central",
            [
                prometheus,
                *rewrite_args(
                    shipped_args(DEPLOY / "central.default"),
                    {
                        "--config.file": str(workdir / "central.yml"),
                        "--storage.tsdb.path": str(workdir / "central-data"),
                    },
                ),
                f"--web.listen-address=127.0.0.1:{central_port}",
                "--log.level=warn",
            ],
            central_port,
            workdir,
            "/-/ready",
        )
        started.append(central)

        vm, vm_missing = None, ""
        store_ports = [central_port]
        vm_binary, vmalert_binary = shutil.which("victoria-metrics"), shutil.which("vmalert")
        if vm_binary and vmalert_binary:
            vm_port, vmalert_port = free_port(), free_port()
            vm = Server(
                "victoria-metrics",
                [
                    vm_binary,
                    *rewrite_args(
                        shipped_args(VM_DIR / "victoria-metrics.default"),
                        {
                            "-storageDataPath": str(workdir / "vm-data"),
                            "-httpListenAddr": f"127.0.0.1:{vm_port}",
                            # Fresh samples visible at once; the shipped 15 s would only slow the test.
                            "-search.latencyOffset": "0s",
                        },
                    ),
                    "-loggerLevel=WARN",
                ],
                vm_port,
                workdir,
                "/health",
            )
            started.append(vm)
            vm_url = f"http://127.0.0.1:{vm_port}"
            started.append(
                Server(
                    "vmalert",
                    [
                        vmalert_binary,
                        *rewrite_args(
                            shipped_args(VM_DIR / "vmalert.default"),
                            {
                                "-rule": str(rules),
                                "-datasource.url": vm_url,
                                "-remoteWrite.url": vm_url,
                                "-remoteRead.url": vm_url,
                                # Nothing listens there: alerts are not under test here.
                                "-notifier.url": f"http://127.0.0.1:{free_port()}",
                                "-evaluationInterval": "1s",
                                "-httpListenAddr": f"127.0.0.1:{vmalert_port}",
                            },
                        ),
                        "-remoteWrite.flushInterval=1s",
                        "-loggerLevel=WARN",
                    ],
                    vmalert_port,
                    workdir,
                    "/health",
                )
            )
            store_ports.append(vm_port)
        else:
            vm_missing = "victoria-metrics / vmalert are not installed (Debian package `victoria-metrics`)"

        agent_port = free_port()
        (workdir / "agent.yml").write_text(yaml.safe_dump(agent_config(sd_dir, store_ports)))
        agent = Server(
            "agent",
            [
                prometheus,
                *rewrite_args(
                    shipped_args(DEPLOY / "agent.default"),
                    {
                        "--config.file": str(workdir / "agent.yml"),
                        "--storage.agent.path": str(workdir / "agent-wal"),
                        "--web.listen-address": f"127.0.0.1:{agent_port}",
                    },
                ),
                "--log.level=warn",
            ],
            agent_port,
            workdir,
            "/-/ready",
        )
        started.append(agent)

        federated_port = free_port()
        (workdir / "global.yml").write_text(yaml.safe_dump(global_config(central_port)))
        federated = Server(
            "global",
            [
                prometheus,
                f"--config.file={workdir / 'global.yml'}",
                f"--storage.tsdb.path={workdir / 'global-data'}",
                f"--web.listen-address=127.0.0.1:{federated_port}",
                "--log.level=warn",
            ],
            federated_port,
            workdir,
            "/-/ready",
        )
        started.append(federated)

        # Each rank registers itself in the agent's file_sd directory.
        ranks = Ranks(RUN_ID, [FAST_S, SLOW_S], extra_env={"OPENLORA_PROMETHEUS_FILE_SD_DIR": str(sd_dir)})
        ranks.wait_serving()
        yield Stack(ranks, agent, central, federated, vm, vm_missing)
    finally:
        if ranks is not None:
            ranks.stop()
        for server in reversed(started):
            server.stop()


def wait_for_records(store: Server, timeout: float = 90.0) -> None:
    """Until the last record of the chain (the straggler ratio) has both ranks, and the
    training series have a few samples more for the rates."""
    done = wait_until(lambda: len(store.query("rank:openlora_training_straggler_ratio:2m")) == 2, timeout)
    assert done, f"no straggler ratio for both ranks; up: {store.query('up')}"
    # And the last records of the energy chain (through vmalert, one link an evaluation or two behind
    # the one before).
    done = wait_until(
        lambda: store.query("run:openlora_training_energy_per_step_joules:2m")
        and store.query("rank:openlora_training_energy_per_token_joules:2m"),
        timeout,
    )
    assert done, f"no energy records; GPU power: {store.query('gpu:hw_energy_joules:rate2m')}"
    time.sleep(3)


def check_store(store: Server, ranks: Ranks) -> None:
    # The ranks' series and their identity arrived through the agent.
    info = store.query(f'target_info{{openlora_run_id="{RUN_ID}"}}')
    assert sorted(s["metric"]["openlora_rank"] for s in info) == ["0", "1"], info
    assert {s["metric"]["openlora_world_size"] for s in info} == {"2"}
    assert {s["metric"]["job"] for s in info} == {"openlora"}
    assert sorted(s["metric"]["instance"] for s in info) == expected_instances(ranks)
    steps = store.query(
        "openlora_training_steps_total * on (job, instance) group_left (openlora_rank) "
        f'target_info{{openlora_run_id="{RUN_ID}"}}'
    )
    assert sorted(s["metric"]["openlora_rank"] for s in steps) == ["0", "1"], steps
    by_rank = {s["metric"]["openlora_rank"]: float(s["value"][1]) for s in steps}
    assert by_rank["0"] > by_rank["1"] > 0, by_rank  # the fast rank took more steps
    # Every query of both dashboards.
    for path in (TRAINING_DASHBOARD, CLUSTER_DASHBOARD):
        problems = run_every_query(
            path,
            store.query,
            http_variable_options(store.url),
            RUN_ID,
            run_names={RUN_ID: ranks.run_name},
            hparam="learning_rate",
        )
        assert not problems, f"{path.name} on {store.name}:\n" + "\n".join(problems)
    ratio = {
        s["metric"]["openlora_rank"]: float(s["value"][1])
        for s in store.query("rank:openlora_training_straggler_ratio:2m")
    }
    # The baseline leaves the slowest rank out: with two ranks it is rank 0's own step time, so
    # rank 0 is at 1 (exactly in Prometheus, whose group reads this evaluation's records; vmalert
    # reads each record back from the store, where the mean and the baseline may be an
    # evaluation apart).
    assert ratio["1"] > 1.5 and ratio["0"] == pytest.approx(1.0, abs=0.25), ratio
    # The records that name an alert's run (its id from target_info, its name from
    # openlora_run_info) for each rank, and for the run (the ranks' alerts).
    names = {
        s["metric"]["openlora_run_name"]
        for s in store.query(
            f'openlora_run_info * on (job, instance) group_left () target_info{{openlora_run_id="{RUN_ID}"}}'
        )
    }
    assert len(names) == 1, names
    current = store.query(f'instance:openlora_run:current{{openlora_run_id="{RUN_ID}"}}')
    assert sorted(s["metric"]["instance"] for s in current) == expected_instances(ranks)
    assert {s["metric"]["openlora_run_name"] for s in current} == names
    (run,) = store.query(f'run:openlora_run:name{{openlora_run_id="{RUN_ID}"}}')
    assert {run["metric"]["openlora_run_name"]} == names


# -- the shipped files -------------------------------------------------------------------------------


@pytest.mark.process
def test_shipped_prometheus_configs_pass_promtool() -> None:
    promtool = binary("promtool", "prometheus")
    for args in (
        ["--agent", "deploy/prometheus/agent.yml"],
        ["deploy/prometheus/central.yml"],
        ["deploy/prometheus/global.yml"],
    ):
        result = subprocess.run(
            [promtool, "check", "config", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_shipped_command_lines_give_each_role_its_mode() -> None:
    # The agent: agent mode, loopback, no rules (agent mode refuses them), remote write. The
    # central store: the receiver. Neither turns on what the other role needs.
    agent = shipped_args(DEPLOY / "agent.default")
    central = shipped_args(DEPLOY / "central.default")
    assert "--enable-feature=agent" in agent and "--web.enable-remote-write-receiver" not in agent
    assert "--web.enable-remote-write-receiver" in central and "--enable-feature=agent" not in central
    assert any(a.startswith("--web.listen-address=127.0.0.1:") for a in agent), (
        "the agent listens on loopback"
    )
    config = yaml.safe_load((DEPLOY / "agent.yml").read_text())
    assert "rule_files" not in config and config["remote_write"]
    # The job the rules read, and the agent itself (its remote write, watched by the central store's rules).
    assert {job["job_name"] for job in config["scrape_configs"]} == {"openlora", "prometheus-agent"}


def test_vmalert_unit_runs_the_installed_binary_with_the_shipped_flags() -> None:
    # No systemd here: the unit is checked against the files and the package, not started.
    unit = (VM_DIR / "vmalert.service").read_text()
    default = (VM_DIR / "vmalert.default").read_text()
    environment = re.search(r"^EnvironmentFile=(\S+)$", unit, re.M).group(1)
    assert f"# {environment} " in default, "vmalert.default does not say where it goes"
    executable = re.search(r"^ExecStart=(\S+) \$ARGS$", unit, re.M).group(1)
    assert executable == binary("vmalert", "victoria-metrics")
    user = re.search(r"^User=(\S+)$", unit, re.M).group(1)
    import pwd

    pwd.getpwnam(user)  # the user the package creates for victoria-metrics
    assert "-rule=/etc/prometheus/rules/*.yml" in shipped_args(VM_DIR / "vmalert.default")


@pytest.mark.e2e
def test_rules_load_in_vmalert() -> None:
    vmalert = binary("vmalert", "victoria-metrics")
    result = subprocess.run(
        [vmalert, "-dryRun", "-rule=openlora_otel/rules/openlora.yml", "-loggerLevel=ERROR"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- real processes -----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_agent_discovers_the_ranks_through_file_sd(stack: Stack) -> None:
    assert wait_until(lambda: len(stack.agent.get("/api/v1/targets")["data"]["activeTargets"]) == 2, 30)
    targets = stack.agent.get("/api/v1/targets")["data"]["activeTargets"]
    assert sorted(t["scrapeUrl"] for t in targets) == sorted(
        f"http://{t}/metrics" for t in stack.ranks.targets
    )
    assert {t["labels"]["job"] for t in targets} == {"openlora"}
    assert sorted(t["labels"]["instance"] for t in targets) == expected_instances(stack.ranks)


@pytest.mark.e2e
def test_central_prometheus_receives_the_ranks_and_the_dashboards_work(stack: Stack) -> None:
    wait_for_records(stack.central)
    check_store(stack.central, stack.ranks)


@pytest.mark.e2e
def test_victoriametrics_receives_the_ranks_and_the_dashboards_work(stack: Stack) -> None:
    if stack.vm is None:
        missing(debian("victoria-metrics"), stack.vm_missing)
    wait_for_records(stack.vm)
    check_store(stack.vm, stack.ranks)


@pytest.mark.e2e
def test_global_prometheus_federates_the_cluster_view(stack: Stack) -> None:
    wait_for_records(stack.central)
    wait_for_records(stack.federated)
    # No openlora_run_info is federated: the run is offered by its id there.
    problems = run_every_query(
        CLUSTER_DASHBOARD,
        stack.federated.query,
        http_variable_options(stack.federated.url),
        RUN_ID,
        run_names={RUN_ID: RUN_ID},
    )
    assert not problems, "\n".join(problems)
    # The central store's external label tells the clusters apart; the raw training series stay home.
    info = stack.federated.query(f'target_info{{openlora_run_id="{RUN_ID}"}}')
    cluster = yaml.safe_load((DEPLOY / "central.yml").read_text())["global"]["external_labels"]["cluster"]
    assert {s["metric"]["cluster"] for s in info} == {cluster}
    assert not stack.federated.query("openlora_training_steps_total")
    if stack.vm is not None:  # VictoriaMetrics answers the same /federate request
        params = yaml.safe_load((DEPLOY / "global.yml").read_text())["scrape_configs"][0]["params"]
        url = f"{stack.vm.url}/federate?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=10) as response:
            names = {line.split("{")[0] for line in response.read().decode().splitlines() if line[:1] != "#"}
        assert {"target_info", "rank:openlora_training_straggler_ratio:2m", "hw_gpu_utilization"} <= names

"""``openlora-otel diagnose`` on real runs with faults injected the way the demo injects them, from
their history files: a healthy run, a loss gone NaN at step 20, a learning rate far too high, a slow
data loader, a run SIGKILLed after its checkpoint and resumed, and under torchrun a rank slowed on
purpose and a rank hung (its peer blocked in the all-reduce, the run terminated after more than a
minute). For each faulty run the injected cause is the top finding, with its step or rank; the
healthy run has none; the JSON form validates against its schema. Where a Prometheus 3 is built, the
runs also push over OTLP to it, and each is diagnosed from there alike.

GPU faults, with no GPU to make fail: two-rank runs (tests/support/gpu_fault_rank.py) whose real
telemetry reads a fake NVML (tests/support/fake_nvml.py), the fault on rank 1's GPU: it fell off the bus
(and the rank died), an uncorrected ECC error, a row remap pending, its clock held down by heat (a
straggler), its PCIe link trained narrow (a straggler), its node's CPUs busy elsewhere (a straggler), its allocated memory growing every step, an
out-of-memory error (and the rank died); both ranks' GPUs held down by heat from step 40 (the run
slowed); an evaluation loss rising from step 30 while the training loss falls (overfitting); and a
healthy pair; also pushed to the Prometheus 3, where there is one, and diagnosed from there alike."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from openlora_otel.cli import main
from openlora_otel.report.diagnosis import JSON_SCHEMA, diagnose
from openlora_otel.report.history_source import read_runs
from openlora_otel.report.model import ReportError
from tests.support import gpu_fault_rank
from tests.support.demo import needs_the_demo
from tests.support.metrics_paths import push_env
from tests.support.polling import wait_until
from tests.support.processes import child_env, reap
from tests.support.prometheus_server import Prometheus, prometheus_binary

# e2e: the corpus's runs also push to a real Prometheus 3, when one is built (the store fixture).
pytestmark = [pytest.mark.process, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]

STEPS = "40"
RUNS = {
    "healthy": [],
    "nan": ["--nan-at-step", "20"],
    "lr-too-high": ["--lr", "10"],
    # Long against a step's compute even on a loaded machine: 60 ms (half the time on an idle one) fell
    # under the 20 % threshold in a CI run beside two other test workers.
    "slow-data": ["--data-delay-ms", "250"],
}


# Where the corpus's runs also push their metrics over OTLP, when the store fixture has a Prometheus 3
# (build/bin): each run is then diagnosed from both sources.
_PUSH: dict[str, str] = {}

HANG_AT = 20  # rank 1 of the hung run stops before this step's batch
KILL_AFTER = 45  # the killed run (80 steps) is SIGKILLed once it reached this step, its checkpoint at step 40


def start_demo(
    directory: Path, name: str, args: list[str], *, ranks: int = 1, history: str | None = None, **env: str
) -> subprocess.Popen:
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "openlora_otel"] if ranks > 1 else [
        "-m", "openlora_otel"]  # fmt: skip
    env = child_env(**{
        "OMP_NUM_THREADS": "1", "OPENLORA_HISTORY_DIR": str(directory / (history or name)),
        "OPENLORA_HOST_METRICS": "false", "OTEL_METRICS_EXPORTER": "none", "OPENLORA_QUIET": "true", **_PUSH, **env,
    })  # fmt: skip
    return subprocess.Popen(
        [sys.executable, *launcher, "demo", "--steps", STEPS, "--run-name", name, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def end_demo(process: subprocess.Popen, codes: tuple[int, ...] = (0, 3), timeout: float = 240) -> None:
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        reap(process, 10)
    # 3: the divergence guard stopped the NaN run, as the demo documents.
    assert process.returncode in codes, output


def run_demo(directory: Path, name: str, args: list[str], *, ranks: int = 1) -> None:
    end_demo(start_demo(directory, name, args, ranks=ranks))


def killed_and_resumed(directory: Path) -> None:
    """Run ``resumed`` (80 steps): SIGKILLed once past step KILL_AFTER (its checkpoint of step 40 saved), then
    ``--resume``d to the end; each attempt's history in a directory of its own (resumed-1, resumed-2)."""
    checkpoints = directory / "checkpoints"
    # Checkpoints at steps 40 and 80 (the end): the kill lands between, however late a loaded machine makes it.
    args = ["--steps", "80", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "40"]
    # The progress file is written at each collection, every second: the kill lands up to a second's steps
    # after KILL_AFTER, before the next checkpoint (step 80, the end). A line every 100 ms gave the
    # throughput detector enough readings to find a real slowdown when a CI machine got busier mid-run.
    process = start_demo(directory, "resumed", args, history="resumed-1")
    progress = checkpoints / "openlora-progress.json"

    def reached() -> int:
        try:
            return int(json.loads(progress.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    try:
        wait_until(lambda: reached() >= KILL_AFTER or process.poll() is not None, 240, f"step {KILL_AFTER}", interval=0.02)
        assert process.poll() is None, "the run ended before it could be killed"
    finally:  # killed whatever happened above: a failure there is not hidden behind a wait
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        end_demo(process, (-signal.SIGKILL,), 30)
    end_demo(start_demo(directory, "resumed", [*args, "--resume"], history="resumed-2"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus | None]:
    """A Prometheus 3 (build/bin's: tools/build.sh builds it in CI) taking the corpus's runs over OTLP, as
    deploy/prometheus/otlp.yml has it; None where it was not built (the runs then only write history)."""
    try:
        prometheus_binary(3)
    except pytest.skip.Exception:
        yield None
        return
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "otlp.yml").read_text())
    prometheus = Prometheus(tmp_path_factory.mktemp("corpus-store"), [], major=3, extra_args=("--web.enable-otlp-receiver",),
                            blocks={"otlp": shipped["otlp"], "storage": shipped["storage"]})  # fmt: skip
    try:
        _PUSH.update(push_env(f"{prometheus.url}/api/v1/otlp"))
        yield prometheus
    finally:
        _PUSH.clear()
        prometheus.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, store: Prometheus | None) -> Path:
    needs_the_demo()
    directory = tmp_path_factory.mktemp("corpus")
    # The hung run first: it must stay stuck for over a minute (HANG_MIN_S) while the others run.
    hung = start_demo(directory, "hung-rank", ["--hang-rank", "1", "--hang-at-step", str(HANG_AT)], ranks=2)
    try:
        for name, args in RUNS.items():
            run_demo(directory, name, args)
        # 300 ms more a step: twice a loaded machine's step (80 ms, 1.9 times an idle one's, came near the
        # 1.25 threshold when the steps themselves took longer).
        run_demo(directory, "straggler", ["--straggle-rank", "1", "--straggle-ms", "300"], ranks=2)
        killed_and_resumed(directory)

        def found_hung() -> bool:
            try:
                return any(f.kind == "hang" for run in read_runs([str(directory / "hung-rank")]) for f in diagnose(run))
            except ReportError:  # no line written yet
                return False

        wait_until(lambda: found_hung() or hung.poll() is not None, 240, "the hung run found hung", interval=1.0)
        assert hung.poll() is None, "the hung run ended by itself"
    finally:
        # As a person or a scheduler's time limit would (and whatever failed above): torchrun passes the
        # SIGTERM on to the ranks; the hung rank leaves on it, its peer's all-reduce then fails.
        if hung.poll() is None:
            hung.send_signal(signal.SIGTERM)
        end_demo(hung, tuple(range(-64, 256)), 120)
    return directory


def diagnosis(corpus: Path, directory: str, capsys: pytest.CaptureFixture, *, name: str | None = None) -> dict:
    """The one run diagnosed in ``corpus/directory``, its JSON validated (``name``: its run name, the directory's by default)."""
    capsys.readouterr()
    assert main(["diagnose", str(corpus / directory), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, JSON_SCHEMA)
    (run,) = document["runs"]
    assert run["name"] == (name or directory)
    return run


def test_a_healthy_run_has_no_finding(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    assert diagnosis(corpus, "healthy", capsys)["findings"] == []


def test_a_loss_gone_nan_is_the_top_finding_at_its_step(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    top = diagnosis(corpus, "nan", capsys)["findings"][0]
    assert (top["kind"], top["severity"], top["step"]) == ("divergence", "critical", 20)
    # The demo makes the loss NaN outright: nothing grew before it.
    assert "without warning" in top["cause"]


def test_a_learning_rate_far_too_high_is_named_as_the_cause(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    top = diagnosis(corpus, "lr-too-high", capsys)["findings"][0]
    assert (top["kind"], top["severity"]) == ("divergence", "critical")
    assert "learning rate too high" in top["cause"] and "far above what fine-tunes use" in top["cause"], top["cause"]
    assert "gradient_norm.max" in {e["series"].rsplit("training.", 1)[-1] for e in top["evidence"]}


def test_a_slow_data_loader_is_the_top_finding(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    (top, *_) = diagnosis(corpus, "slow-data", capsys)["findings"]
    assert top["kind"] == "input_bound" and top["severity"] in ("warning", "critical")


def test_a_slowed_rank_is_the_top_finding_by_its_rank(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    run = diagnosis(corpus, "straggler", capsys)
    assert run["ranks"] == 2
    top = run["findings"][0]
    assert (top["kind"], top["rank"]) == ("straggler", 1), run["findings"]
    assert [f for f in run["findings"] if f["kind"] == "straggler"] == [top]  # rank 0 is not one


def test_a_hung_rank_stops_the_run_at_its_step(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    """Under DDP the hung rank's peer waits for it in the all-reduce of the same step: no rank steps
    after step HANG_AT - 1, and their last steps cannot tell which one hung (the finding says where
    to look: the ranks' stacks)."""
    run = diagnosis(corpus, "hung-rank", capsys)
    top = run["findings"][0]
    assert (top["kind"], top["severity"], top["step"], top["rank"]) == ("hang", "critical", HANG_AT - 1, None), run
    assert top["title"].startswith(f"no rank stepped after step {HANG_AT - 1} "), top["title"]
    assert "py-spy dump" in top["try"][0]


def test_a_run_killed_and_resumed_says_it_restarted_and_what_it_did_again(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["diagnose", str(corpus / "resumed-1"), str(corpus / "resumed-2"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, JSON_SCHEMA)
    (run,) = document["runs"]  # one run, two attempts
    assert run["name"] == "resumed" and run["outcome"] == "finished"
    (top,) = run["findings"]  # a few seconds lost: worth knowing, no warning
    assert (top["kind"], top["severity"]) == ("goodput", "info"), top
    # Killed past step KILL_AFTER (a collection later at most), resumed from the checkpoint of step 40.
    lost = int(top["title"].split(": ", 1)[1].split(" step")[0])
    assert top["title"].startswith("the run restarted 1 time(s): ") and KILL_AFTER - 40 <= lost < 40, top["title"]


def test_every_run_of_the_corpus_is_diagnosed_alike_from_prometheus(corpus: Path, store: Prometheus | None) -> None:
    """The same runs, pushed over OTLP to a Prometheus 3 as they ran and read back from it (every rank):
    the same top finding (kind, severity, rank) as from their history files, nothing above info for
    the healthy run; the steps within the push's second of the files'."""
    from openlora_otel.report.prometheus import read_prometheus

    if store is None:
        pytest.skip("no Prometheus 3 built (tools/build.sh): the corpus was diagnosed from its files only")
    directories = {name: [name] for name in (*RUNS, "straggler", "hung-rank")} | {"resumed": ["resumed-1", "resumed-2"]}
    for name, where in directories.items():
        (from_files,) = read_runs([str(corpus / d) for d in where])
        (from_prometheus,) = read_prometheus(store.url, [name], every_rank=True)
        files, pulled = diagnose(from_files), diagnose(from_prometheus)
        shown = f"{name}: files {[(f.kind, f.severity, f.rank, f.step) for f in files]}, prometheus {pulled}"
        assert from_prometheus.ranks == from_files.ranks and bool(files) == bool(pulled), shown
        if name == "healthy":
            assert all(f.severity == "info" for f in pulled), shown
            continue
        assert (pulled[0].kind, pulled[0].severity, pulled[0].rank) == (files[0].kind, files[0].severity, files[0].rank), shown


def test_the_text_form_and_a_run_by_name(corpus: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    every = sorted(str(corpus / name) for name in RUNS)  # the four runs' directories
    assert main(["diagnose", *every, "--run", "nan"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("run ") and "(nan)" in text and "[critical] the loss went non-finite at step 20" in text
    assert "runbook: https://openlora.github.io/openlora-otel/runbooks/#openloralossnonfinite" in text
    assert main(["diagnose", *every, "--run", "nope"]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


# -- GPU faults ---------------------------------------------------------------------------------
FAULT_AT = 20


SLOWDOWN_AT = 40  # the run slows from here: 8 readings (250 ms) of 50 ms steps before, 24 of 100 ms after


def run_ranks(directory: Path, fault: str, ports: int | None = None, push: dict[str, str] | None = None) -> None:
    if fault == "slowdown":
        processes = gpu_fault_rank.start(directory, fault, SLOWDOWN_AT, ports, "--steps", "100", push=push)
    elif fault == "memory-growth":  # 20 readings: growth is judged on at least 12 after the warm-up
        processes = gpu_fault_rank.start(directory, fault, FAULT_AT, ports, "--steps", "100", push=push)
    else:
        processes = gpu_fault_rank.start(directory, fault, FAULT_AT, ports, push=push)
    gpu_fault_rank.finish(processes, fault)


@pytest.fixture(scope="module")
def gpu_corpus(tmp_path_factory: pytest.TempPathFactory, store: Prometheus | None) -> Path:
    """The GPU-fault runs; each also pushed every 250 ms to the store's Prometheus 3, where there is one."""
    directory = tmp_path_factory.mktemp("gpu-corpus")
    for fault in gpu_fault_rank.FAULTS:
        run_ranks(directory, fault, push=dict(_PUSH) or None)
    return directory


def test_every_gpu_fault_run_is_diagnosed_alike_from_prometheus(gpu_corpus: Path, store: Prometheus | None) -> None:
    """The GPU corpus from both sources: the same top finding (kind, severity, rank) from the Prometheus
    3 the runs pushed to as from their history files; nothing above info for the healthy pair."""
    from openlora_otel.report.prometheus import read_prometheus

    if store is None:
        pytest.skip("no Prometheus 3 built (tools/build.sh): the corpus was diagnosed from its files only")
    for fault in gpu_fault_rank.FAULTS:
        (from_files,) = read_runs([str(gpu_corpus / fault)])
        (from_prometheus,) = read_prometheus(store.url, [f"gpu-{fault}"], every_rank=True)
        files, pulled = diagnose(from_files), diagnose(from_prometheus)
        shown = f"{fault}: files {[(f.kind, f.severity, f.rank, f.step) for f in files]}, prometheus {pulled}"
        assert from_prometheus.ranks == from_files.ranks == 2 and bool(files) == bool(pulled), shown
        if fault == "none":
            assert all(f.severity == "info" for f in pulled), shown
            continue
        assert (pulled[0].kind, pulled[0].severity, pulled[0].rank) == (files[0].kind, files[0].severity, files[0].rank), shown


def test_a_healthy_pair_of_ranks_on_fake_gpus_has_no_finding(gpu_corpus: Path, capsys: pytest.CaptureFixture) -> None:
    assert diagnosis(gpu_corpus, "none", capsys, name="gpu-none")["findings"] == []


@pytest.mark.parametrize(
    ("fault", "severity", "runbook"),
    [
        ("off-bus", "critical", "openloragpufelloffthebus"),
        ("ecc", "critical", "openloragpuuncorrectedeccerrors"),
        ("remap-pending", "warning", "openloragpurowremappending"),
    ],
)
def test_a_gpu_fault_is_the_top_finding_with_its_rank_and_step(
    gpu_corpus: Path, capsys: pytest.CaptureFixture, fault: str, severity: str, runbook: str
) -> None:
    run = diagnosis(gpu_corpus, fault, capsys, name=f"gpu-{fault}")
    top = run["findings"][0]
    assert (top["kind"], top["severity"], top["rank"]) == ("gpu_fault", severity, 1), run["findings"]
    assert top["runbook"].endswith(f"#{runbook}")
    # Seen by the first collection after the fault (every 250 ms, five 50 ms steps; more on a loaded
    # machine): the rank that died stopped at the step before it.
    assert FAULT_AT - 1 <= top["step"] <= FAULT_AT + 15, top
    assert [f for f in run["findings"] if f["kind"] == "gpu_fault"] == [top]  # rank 0's GPU is fine


@pytest.mark.parametrize(
    ("fault", "severity", "title"),
    [("oom", "critical", "rank 1 ran out of GPU memory by step"), ("memory-growth", "warning", "rank 1's allocated GPU memory grows steadily")],
)
def test_a_memory_fault_is_the_top_finding(gpu_corpus: Path, capsys: pytest.CaptureFixture, fault: str, severity: str, title: str) -> None:
    run = diagnosis(gpu_corpus, fault, capsys, name=f"gpu-{fault}")
    (top,) = run["findings"]
    assert (top["kind"], top["severity"], top["rank"]) == ("memory", severity, 1), run["findings"]
    assert top["title"].startswith(title), top["title"]
    if fault == "oom":
        assert FAULT_AT - 1 <= top["step"] <= FAULT_AT + 15, top


@pytest.mark.parametrize(
    ("fault", "cause"),
    [("thermal", "its GPU's clock was held down by heat (thermal)"), ("narrow-link", "its GPU's PCIe link ran on 8 of the 16 lanes"),
     ("busy-host", "its host was busy elsewhere: its node node-1's CPUs were 92% busy, the other ranks' nodes 15%")],
)
def test_a_straggler_is_explained_by_its_gpu_or_its_host(gpu_corpus: Path, capsys: pytest.CaptureFixture, fault: str, cause: str) -> None:
    run = diagnosis(gpu_corpus, fault, capsys, name=f"gpu-{fault}")
    (top,) = run["findings"]
    assert (top["kind"], top["rank"]) == ("straggler", 1)
    assert top["cause"].startswith(cause), top["cause"]
    if fault == "thermal":
        hot = {e["series"]: e["value"] for e in top["evidence"]}
        assert hot["hw.temperature"] == 88 and hot["openlora.gpu.clock.sm"] < 1.98e9, hot


def test_gpu_faults_found_from_prometheus(tmp_path: Path) -> None:
    """The same from a real Prometheus (3.16) scraping the ranks: the GPU series' PromQL names are right,
    and the rank that died keeps its fault (its last scrape, at its exit)."""
    from openlora_otel.report.diagnosis import diagnose
    from openlora_otel.report.prometheus import read_prometheus
    from tests.support.processes import free_port_range
    from tests.support.prometheus_server import Prometheus

    ports = {fault: free_port_range(2) for fault in ("off-bus", "thermal", "busy-host")}
    targets = [f"127.0.0.1:{port + rank}" for port in ports.values() for rank in (0, 1)]
    prometheus = Prometheus(tmp_path, targets, major=3)
    try:
        # Its scrape loops running (its first targets come up to 5 s after its start) before the ranks.
        assert prometheus.wait_for_scrapes(1)
        for fault, port in ports.items():
            run_ranks(tmp_path, fault, port)
        time.sleep(2)  # the last scrapes stored
        (dead,) = read_prometheus(prometheus.url, ["gpu-off-bus"], every_rank=True)
        top = diagnose(dead)[0]
        assert (top.kind, top.severity, top.rank) == ("gpu_fault", "critical", 1), diagnose(dead)
        assert top.runbook.endswith("#openloragpufelloffthebus") and FAULT_AT - 1 <= top.step <= FAULT_AT + 15, top
        (hot,) = read_prometheus(prometheus.url, ["gpu-thermal"], every_rank=True)
        (top,) = diagnose(hot)
        assert (top.kind, top.rank) == ("straggler", 1) and top.cause.startswith(
            "its GPU's clock was held down by heat (thermal)"
        ), top
        # Each rank's node from its target_info's host_name, its CPUs from system_cpu_utilization.
        (busy,) = read_prometheus(prometheus.url, ["gpu-busy-host"], every_rank=True)
        assert [p.host for p in busy.processes] == ["node-0", "node-1"]
        (top,) = diagnose(busy)
        assert (top.kind, top.rank) == ("straggler", 1) and top.cause.startswith(
            "its host was busy elsewhere: its node node-1's CPUs were 9"), top
    finally:
        prometheus.stop()


def test_a_slowdown_of_every_rank_is_found_at_its_step_with_what_changed(gpu_corpus: Path, capsys: pytest.CaptureFixture) -> None:
    run = diagnosis(gpu_corpus, "slowdown", capsys, name="gpu-slowdown")
    (top,) = run["findings"]  # both ranks slowed alike: no straggler
    assert (top["kind"], top["rank"]) == ("throughput", None), run["findings"]
    assert top["title"].startswith("every rank became") and SLOWDOWN_AT <= top["step"] <= SLOWDOWN_AT + 15, top
    assert "the GPU's clock held down (thermal)" in top["cause"], top["cause"]


def test_overfitting_is_found_from_the_evaluations(gpu_corpus: Path, capsys: pytest.CaptureFixture) -> None:
    run = diagnosis(gpu_corpus, "overfit", capsys, name="gpu-overfit")
    (top,) = run["findings"]
    assert (top["kind"], top["severity"]) == ("evaluation", "warning"), run["findings"]
    # The evaluation of step 30, at the step of the first history line that held it (lines every 250 ms).
    assert 30 <= top["step"] <= 40, top
    assert "overfitting" in top["title"], top["title"]

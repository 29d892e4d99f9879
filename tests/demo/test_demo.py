"""`openlora-otel demo`: a real fine-tune, scraped by a real Prometheus; signals; options; the loss falls."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, _deps, setup_telemetry
from openlora_otel.cli import main
from openlora_otel.commands.demo import _summary
from openlora_otel.demo.options import DemoOptions
from openlora_otel.demo.train import run_demo
from tests.support.demo import demo_process, wait_for_line
from tests.support.otlp_receiver import HttpReceiver
from tests.support.processes import child_env, free_port
from tests.support.prometheus_server import Prometheus, prometheus_binary
from tests.support.readings import value


@pytest.mark.e2e
def test_demo_metrics_scraped_by_prometheus_then_sigterm(tmp_path) -> None:
    prometheus_binary()
    port = free_port()
    env = {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
    demo = demo_process("--steps", "40", "--batch-size", "4", "--eval-every", "20", "--linger", "60", env=env)
    prometheus = None
    try:
        wait_for_line(demo.stderr, "keeping the final values", timeout=120)
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
        assert prometheus.wait_for("openlora_training_steps_total == 40", timeout=30)
        assert float(prometheus.wait_for("openlora_adapter_rank")[0]["value"][1]) == 8
        assert float(prometheus.wait_for("openlora_training_tokens_total")[0]["value"][1]) == 40 * 4 * 64
        assert prometheus.wait_for("openlora_training_eval_loss")
        assert prometheus.wait_for('openlora_training_eval_value{openlora_eval_metric="perplexity"}')
        assert prometheus.wait_for("openlora_training_step_duration_seconds_count == 40")
        assert prometheus.wait_for('target_info{service_name="openlora-demo"}')
        demo.send_signal(signal.SIGTERM)
        stdout, stderr = demo.communicate(timeout=20)
    finally:
        if prometheus:
            prometheus.stop()
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
    assert demo.returncode == 143, stderr
    assert "stopped by SIGTERM after 40 steps" in stdout
    assert "Traceback" not in stderr


@pytest.mark.process
def test_sigint_mid_training_stops_at_the_next_step_and_flushes() -> None:
    receiver = HttpReceiver()
    env = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",  # only the flush at shutdown can deliver
    }
    demo = demo_process("--steps", "1000", "--batch-size", "2", "--eval-every", "0", env=env)
    try:
        wait_for_line(demo.stderr, "step 100/1000", timeout=240)  # mid-training, whatever the load
        demo.send_signal(signal.SIGINT)
        stdout, stderr = demo.communicate(timeout=30)
        assert demo.returncode == 130, stderr
        assert "stopped by SIGINT" in stdout and "telemetry flushed" in stdout
        assert "Traceback" not in stderr
        assert receiver.wait_for(lambda r: "openlora.training.steps" in r.metrics(), timeout=5)
        steps = receiver.metrics()["openlora.training.steps"][-1][1].as_int
        assert 100 <= steps < 1000
        assert f"after {steps} steps" in stdout
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
        receiver.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-3"], "argument --steps: must be > 0"),
        (["--steps", "ten"], "argument --steps: expected an integer > 0"),
        (["--lr", "0"], "argument --lr: must be > 0"),
        (["--batch-size", "0"], "argument --batch-size: must be > 0"),
        (["--eval-every", "-1"], "argument --eval-every: must be >= 0"),
        (["--linger", "-5"], "argument --linger: must be >= 0"),
        (["--exporter", "zipkin"], "argument --exporter: 'zipkin' is not valid"),
    ],
)
def test_bad_options_are_usage_errors(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_environment_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "abc")
    assert main(["demo", "--steps", "1"]) == 2
    assert "OTEL_EXPORTER_PROMETHEUS_PORT='abc' is not valid" in capsys.readouterr().err


def test_missing_peft_names_the_extra(monkeypatch, capsys) -> None:
    real = _deps.is_installed
    monkeypatch.setattr(_deps, "is_installed", lambda name: False if name == "peft" else real(name))
    assert main(["demo", "--steps", "1", "--exporter", "none"]) == 2
    assert "openlora-otel[demo]" in capsys.readouterr().err


@pytest.mark.parametrize("hf_trainer", [False, True])
def test_a_short_run_records_every_training_metric(
    hf_trainer: bool, memory_reader: InMemoryMetricReader
) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    options = DemoOptions(steps=12, eval_every=6, quiet=True, hf_trainer=hf_trainer)
    result = run_demo(options, telemetry, where="memory")
    data = memory_reader.get_metrics_data()
    assert result.steps == 12 and result.exit_code == 0
    assert value(data, "openlora.training.steps") == 12
    assert value(data, "openlora.training.tokens") == 12 * 16 * 64
    assert value(data, "openlora.training.samples") == 12 * 16
    assert value(data, "openlora.training.loss") is not None
    assert value(data, "openlora.training.gradient_norm") is not None
    assert value(data, "openlora.training.learning_rate") is not None
    assert value(data, "openlora.training.eval.loss") == pytest.approx(result.final_eval_loss)
    assert value(data, "openlora.adapter.rank") == 8
    assert value(data, "openlora.adapter.target_modules") == 7
    assert 0 < value(data, "openlora.adapter.trainable.ratio") < 1
    telemetry.shutdown()


def test_default_length_run_learns(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    result = run_demo(DemoOptions(quiet=True, seed=0), telemetry, where="memory")
    telemetry.shutdown()
    assert result.steps == DemoOptions().steps
    # About 3.5 (close to ln of the 32-character alphabet) down to about 1.4 with seed 0.
    assert result.first_eval_loss > 3.0
    assert result.final_eval_loss < result.first_eval_loss - 1.5
    assert math.isfinite(result.final_eval_loss)


# -- under torchrun (the full run with Prometheus is in tests/demo/test_torchrun_demo.py) -------------


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--straggle-rank", "1"], {}, "--straggle-rank and --straggle-ms go together"),
        (["--straggle-ms", "50"], {}, "--straggle-rank and --straggle-ms go together"),
        (["--straggle-rank", "1", "--straggle-ms", "50"], {}, "needs two or more ranks, and WORLD_SIZE is 1"),
        (
            ["--straggle-rank", "0", "--straggle-ms", "50"],
            {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
            "needs two or more ranks, and WORLD_SIZE is 1",
        ),
        (
            ["--straggle-rank", "2", "--straggle-ms", "50"],
            {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
            "2 is not a rank of this launch (WORLD_SIZE=2: ranks 0 to 1)",
        ),
        (["--straggle-rank", "-1", "--straggle-ms", "5"], {}, "argument --straggle-rank: must be >= 0"),
        (["--straggle-rank", "1", "--straggle-ms", "0"], {}, "argument --straggle-ms: must be > 0"),
        (["--hf-trainer"], {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "--hf-trainer runs one process"),
        (["--hf-trainer", "--nan-at-step", "5"], {}, "work with the demo's own loop; drop --hf-trainer"),
        (["--hf-trainer", "--data-delay-ms", "5"], {}, "work with the demo's own loop; drop --hf-trainer"),
        (["--nan-at-step", "0"], {}, "argument --nan-at-step: must be > 0"),
        (["--hang-rank", "1"], {}, "--hang-rank needs --hang-at-step"),
        (
            ["--hang-rank", "2", "--hang-at-step", "5"],
            {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
            "--hang-rank: 2 is not a rank of this launch (WORLD_SIZE=2: ranks 0 to 1)",
        ),
        (["--hf-trainer", "--hang-at-step", "5"], {}, "work with the demo's own loop; drop --hf-trainer"),
        (["--hang-at-step", "0"], {}, "argument --hang-at-step: must be > 0"),
    ],
)
def test_distributed_options_that_make_no_sense_are_usage_errors(
    args, env, message, monkeypatch, capsys
) -> None:
    for name, setting in env.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises(SystemExit) as info:
        main(["demo", "--exporter", "none", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_hung_process_stays_at_its_step_until_stopped() -> None:
    """--hang-at-step in one process: it stops before the step's batch and stays there (its telemetry
    going on) until stopped, here by SIGTERM; the run then ends as a stopped one, at the step before,
    its outcome terminated (found by review: the demo's own signal handler left it finished)."""
    import os
    import threading

    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[reader])
    # Sent while the demo's handlers are in place: it is stuck until a signal comes.
    threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    began = time.monotonic()
    result = run_demo(DemoOptions(steps=10, batch_size=2, eval_every=0, quiet=True, hang_at_step=3), telemetry,
                      where="memory")  # fmt: skip
    stuck = time.monotonic() - began
    data = reader.get_metrics_data()
    telemetry.shutdown()
    assert (result.steps, result.interrupted) == (2, "SIGTERM")
    assert value(data, "openlora.training.steps") == 2 and stuck >= 1.5
    assert telemetry.outcome == "terminated"


def test_a_rank_outside_the_world_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    assert main(["demo", "--exporter", "none"]) == 2
    assert "RANK=2 with WORLD_SIZE=2" in capsys.readouterr().err


def test_ranks_without_a_rendezvous_address_are_told_to_use_torchrun(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert main(["demo", "--exporter", "none"]) == 2
    err = capsys.readouterr().err
    assert "MASTER_ADDR and MASTER_PORT are not both set" in err
    assert "torchrun --standalone --nproc_per_node=2 -m openlora_otel demo" in err and "Traceback" not in err


def test_a_step_without_ranks_counts_no_wait_and_agrees_on_nothing() -> None:
    from openlora_otel.demo.ddp import StepSync

    sync = StepSync()
    sync.start(offer="SIGTERM")
    assert sync.waited_since_grads_ready(sync.started + 1.0) == 0.0  # no hook ran: one process
    sync.grads_ready = sync.started + 0.25
    assert sync.waited_since_grads_ready(sync.started + 1.0) == pytest.approx(0.75)
    sync.agreed = "SIGTERM"
    sync.start()
    assert (sync.grads_ready, sync.offer, sync.agreed) == (None, None, None)


# Two gloo ranks through the demo's DDP wrapper: gradients still the mean over ranks, the stop
# reasons riding on them, and what the hook measures. A small Linear model, no demo.
_GROUP_SCRIPT = """
import time, torch
from openlora_otel.demo.ddp import StepSync, TrainingGroup
group = TrainingGroup(torch)
rank, world = group.rank, group.world_size
torch.manual_seed(0)
reference = torch.nn.Linear(64, 64)
model = torch.nn.Linear(64, 64)
model.load_state_dict(reference.state_dict())
sync = StepSync()
ddp = group.wrap(model, sync)

def batch(step, of_rank):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + of_rank))

def mean_gradient(step):
    grads = []
    for other in range(world):
        reference.zero_grad()
        reference(batch(step, other)).pow(2).sum().backward()
        grads.append(reference.weight.grad.clone())
    return sum(grads) / world

def offer(step):
    # 1-4: nobody; 5: rank 1 only; from 8: both, with different reasons.
    if step >= 8:
        return "requested" if rank == 0 else "SIGINT"
    return "SIGTERM" if rank == 1 and step == 5 else None

for step in range(1, 12):
    sync.start(offer=offer(step))
    if rank == 1 and step in (3, 4):
        time.sleep(0.3)  # rank 1 works 300 ms longer before its backward: rank 0 waits for it
    ddp(batch(step, rank)).pow(2).sum().backward()
    done = time.perf_counter()
    waited = sync.waited_since_grads_ready(done)
    same = torch.allclose(model.weight.grad, mean_gradient(step), rtol=1e-5, atol=1e-6)
    model.zero_grad()
    print(f"RANK {rank} STEP {step} MEAN {same} AGREED {sync.agreed} "
          f"WALL {done - sync.started:.3f} OWN {done - sync.started - waited:.3f}", flush=True)
group.close()
"""


@pytest.mark.process
def test_two_ranks_stop_together_and_time_their_own_work(tmp_path) -> None:
    script = tmp_path / "group.py"
    script.write_text(_GROUP_SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env=child_env(PYTHONPATH=root, OMP_NUM_THREADS="1"),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout
    # Seen once on a loaded machine: a rank aborted *after* its last step and destroy_process_group(),
    # in torch's teardown of gloo's worker threads ("terminate called without an active exception",
    # exit -6; pytorch/pytorch#190489 and #179291 discuss it). That is torch's exit, not the step
    # logic this test checks, so it is tolerated only with every step's line printed.
    torch_teardown_abort = (
        result.returncode != 0
        and "terminate called without an active exception" in result.stderr
        and len(re.findall(r"RANK \d STEP 11 ", out)) == 2
    )
    assert result.returncode == 0 or torch_teardown_abort, result.stderr[-3000:]
    rows = {
        (int(m[0]), int(m[1])): (m[2] == "True", None if m[3] == "None" else m[3], float(m[4]), float(m[5]))
        for m in re.findall(r"RANK (\d) STEP (\d+) MEAN (\w+) AGREED (\w+) WALL ([\d.]+) OWN ([\d.]+)", out)
    }
    assert len(rows) == 22, out
    for rank in (0, 1):
        assert all(rows[rank, step][0] for step in range(1, 12)), out  # DDP's mean, unchanged
        # Every rank learns the same answer in the same step: the strongest reason any rank had.
        agreed = [rows[rank, step][1] for step in range(1, 12)]
        assert agreed == [None] * 4 + ["SIGTERM"] + [None] * 2 + ["SIGINT"] * 4, (rank, agreed)
    # Steps 3 and 4 (after step 2, whose forward rebuilt DDP's buckets: a collective, once).
    for step in (3, 4):
        (_, _, wall0, own0), (_, _, wall1, own1) = rows[0, step], rows[1, step]
        assert wall0 > 0.25 and wall1 > 0.25, out  # the wall time: the same slow step on both ranks
        assert own1 > 0.25 > own0, out  # own work: only rank 1's has the 300 ms


def test_a_loss_gone_nan_trips_the_guard_and_the_demo_stops_with_status_3(
    memory_reader: InMemoryMetricReader, capsys
) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    options = DemoOptions(steps=2000, nan_at_step=10, quiet=True)
    result = run_demo(options, telemetry, where="memory")
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    assert result.interrupted == "diverged" and result.exit_code == 3
    # Tripped on the 3rd NaN at the earliest; the guard's own check (every 0.5 s) bounds the lag.
    assert 12 <= result.steps < 2000
    assert "non-finite losses in a row" in result.stop_detail
    assert value(data, "openlora.training.loss.nonfinite") == result.steps - 9
    assert value(data, "openlora.training.guard.trips", **{"openlora.guard.reason": "nonfinite_loss"}) == 1
    # The summary says why, and no "-> inf" for the evaluation that never came.
    _summary(result, "memory", True, run_id="r")
    out = capsys.readouterr().out
    assert f"stopped by the divergence guard after {result.steps} steps (" in out
    assert "no evaluation after it" in out and "inf" not in out


def test_a_nan_evaluation_is_the_final_one_in_the_summary(
    memory_reader: InMemoryMetricReader, capsys
) -> None:
    """Evaluations every 10 steps, the loss NaN from step 20: the evaluation after step 20 is NaN
    and is the run's last; the summary shows it (not the best one as the final) and the best
    finite one as the best."""
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    result = run_demo(DemoOptions(steps=400, eval_every=10, nan_at_step=20, quiet=True), telemetry, where="memory")
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    assert result.interrupted == "diverged" and result.steps > 20
    assert math.isnan(result.final_eval_loss) and math.isfinite(result.best_eval_loss)
    assert value(data, "openlora.training.eval.nonfinite", **{"openlora.eval.metric": "loss"}) >= 1
    _summary(result, "memory", True, run_id="r")
    out = capsys.readouterr().out
    assert f"-> nan (best {result.best_eval_loss:.3f})" in out, out


def test_a_slow_input_pipeline_shows_as_data_wait(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    run_demo(DemoOptions(steps=8, eval_every=0, quiet=True, data_delay_ms=60), telemetry, where="memory")
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    assert 0.06 <= value(data, "openlora.training.data_wait.duration") < 1.0
    assert 0.0 < value(data, "openlora.training.data_wait.fraction") <= 1.0


def test_the_demo_reports_model_flops_and_mfu_with_a_configured_peak(
    memory_reader: InMemoryMetricReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENLORA_PEAK_FLOPS", "1e12")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry(metric_readers=[memory_reader])
    run_demo(DemoOptions(steps=6, eval_every=0, quiet=True), telemetry, where="memory")
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    # The hand count of tests/training/test_flops.py for the demo's model at seq_len 64.
    assert value(data, "openlora.model.flops_per_token") == 3_448_832
    achieved = value(data, "openlora.training.throughput.flops")
    assert achieved == pytest.approx(value(data, "openlora.training.throughput.tokens") * 3_448_832)
    assert value(data, "openlora.training.model_flops.utilization") == pytest.approx(achieved / 1e12)


@pytest.mark.parametrize(
    ("environ", "hint"),
    [
        ({"OTEL_METRICS_EXPORTER": "none"}, False),
        ({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "0"}, True),
        ({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_the_docker_compose_hint_only_where_a_stack_could_see_the_metrics(monkeypatch, capsys, environ, hint) -> None:
    for name, setting in environ.items():
        monkeypatch.setenv(name, setting)
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    assert main(["demo", "--steps", "1", "--batch-size", "2", "--eval-every", "0", "--device", "cpu"]) == 0
    assert ("docker compose up" in capsys.readouterr().err) is hint


def test_a_signal_before_the_first_step_stops_the_run_cleanly(monkeypatch) -> None:
    """SIGINT while the model is first evaluated (a loaded machine takes seconds there) used to raise
    KeyboardInterrupt out of the demo, with a traceback and no final export; now it stops the run
    before its first step, as a signal during training stops it at the next one."""
    import os

    from openlora_otel.demo import train

    real = train.evaluate
    calls = []

    def evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # delivered while the evaluation runs
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", evaluate)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), handle_sigterm=False))
    try:
        result = run_demo(DemoOptions(steps=50, batch_size=2, eval_every=0, quiet=True), telemetry, where="memory")
    finally:
        telemetry.shutdown()
    assert result.interrupted == "SIGINT" and result.exit_code == 130
    assert result.steps == 0 and len(calls) == 1  # no final evaluation after a stop


# -- checkpoints, resume and goodput (issue 23) ---------------------------------------------------


def _spent(data, phase: str) -> float:
    return value(data, "openlora.training.time", **{"openlora.training.phase": phase}) or 0.0


def test_a_run_stopped_after_its_checkpoint_resumes_and_counts_the_steps_done_again(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    options = DemoOptions(
        steps=12, batch_size=2, eval_every=4, quiet=True, checkpoint_dir=directory, checkpoint_every=5
    )
    first = InMemoryMetricReader()
    config = TelemetryConfig(exporters=("none",), run_id="demo-run")
    telemetry = setup_telemetry(config=config, metric_readers=[first])
    result = run_demo(DemoOptions(**{**options.__dict__, "stop_at_step": 8}), telemetry, where="memory")
    data = first.get_metrics_data()
    telemetry.shutdown()
    assert result.steps == 8 and result.interrupted == "--stop-at-step" and result.exit_code == 0
    assert _spent(data, "evaluation") > 0 and _spent(data, "checkpoint_save") > 0
    assert (tmp_path / "ckpt" / "checkpoint.pt").is_file()

    second = InMemoryMetricReader()
    telemetry = setup_telemetry(config=config.replace(run_attempt=2), metric_readers=[second])
    result = run_demo(DemoOptions(**{**options.__dict__, "resume": True}), telemetry, where="memory")
    data = second.get_metrics_data()
    telemetry.shutdown()
    assert result.steps == 12 and result.interrupted is None
    assert value(data, "openlora.training.steps") == 12 - 5  # resumed at the checkpoint of step 5
    assert value(data, "openlora.training.steps.lost") == 8 - 5
    assert _spent(data, "lost_progress") > 0 and _spent(data, "checkpoint_load") > 0
    assert _spent(data, "productive") > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--checkpoint-dir", "{tmp}", "--hf-trainer"], "drop --hf-trainer"),
        (["--checkpoint-dir", "{tmp}", "--resume"], "--resume: no checkpoint in"),
    ],
)
def test_checkpoint_options_that_make_no_sense_are_usage_errors(args, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.process
def test_the_demo_resumed_from_its_checkpoint_reports_the_lost_steps(tmp_path) -> None:
    """Two attempts of one run, as a user would: stopped after step 8 with a checkpoint at step 5,
    then --resume. The second attempt keeps the run id, counts attempt 2 and 3 steps lost."""
    from openlora_otel.report.history_reader import read_history

    directory = tmp_path / "ckpt"
    common = ["--steps", "12", "--batch-size", "2", "--eval-every", "4", "--checkpoint-dir", str(directory)]
    runs = []
    for attempt, extra in ((1, ["--checkpoint-every", "5", "--stop-at-step", "8"]), (2, ["--resume"])):
        history = tmp_path / f"history-{attempt}"
        env = {"OPENLORA_HISTORY_DIR": str(history), "OTEL_METRICS_EXPORTER": "none", "OPENLORA_GPU_METRICS": "off"}
        demo = demo_process(*common, *extra, "--quiet", "--device", "cpu", env=env)
        stdout, stderr = demo.communicate(timeout=600)
        assert demo.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr
        [path] = history.iterdir()
        runs.append((stdout, list(read_history(path))))
    (first_out, first), (second_out, second) = runs
    assert "stopped by --stop-at-step after 8 steps" in first_out and "--resume" in first_out
    assert "12 steps" in second_out
    assert first[-1].resource["openlora.run.id"] == second[-1].resource["openlora.run.id"]
    assert (first[-1].resource["openlora.run.attempt"], second[-1].resource["openlora.run.attempt"]) == (1, 2)
    final = second[-1]
    assert final.value("openlora.training.steps.lost") == 8 - 5
    assert final.value("openlora.training.time", **{"openlora.training.phase": "lost_progress"}) > 0
    assert final.value("openlora.training.time", **{"openlora.training.phase": "checkpoint_load"}) > 0
    assert first[-1].value("openlora.training.time", **{"openlora.training.phase": "checkpoint_save"}) > 0

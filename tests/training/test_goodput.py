"""Where a training process's time goes: the phase clock, the progress file, and openlora.training.time."""

from __future__ import annotations

import json
import threading
import time

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.names import TRAINING_PHASES
from openlora_otel.training.goodput import STALL_S, PhaseClock, ProgressFile, process_start_time
from tests.support.clock import FakeClock
from tests.support.readings import points, value


@pytest.fixture
def fake(clock: FakeClock) -> FakeClock:
    """The shared fake clock (tests/conftest.py), by a name that leaves ``clock`` to the PhaseClocks here."""
    return clock


def spent(data, phase: str) -> float:
    return value(data, "openlora.training.time", **{"openlora.training.phase": phase}) or 0.0


def test_process_start_is_read_from_proc_and_lies_in_the_past() -> None:
    started = process_start_time()
    assert started is not None  # Linux
    assert time.time() - 7 * 86400 < started <= time.time()


def test_every_second_lands_in_one_phase(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now - 5.0)  # the process started 5 s ago
    fake.sleep(1.0)
    with clock.phase("checkpoint_load"):
        fake.sleep(2.0)
    clock.first_step(fake.now)  # start-up: 5 + 1 s, the load apart
    fake.sleep(10.0)
    with clock.phase("evaluation"):
        fake.sleep(3.0)
    fake.sleep(1.0)
    with clock.phase("checkpoint_save"):
        fake.sleep(4.0)
    last = fake.now
    taken = clock.take(fake.now, steps=10, data_wait=2.5, last_step=last)
    assert taken == pytest.approx(
        {"startup": 6.0, "checkpoint_load": 2.0, "evaluation": 3.0, "checkpoint_save": 4.0,
         "data_wait": 2.5, "productive": 8.5}
    )  # fmt: skip
    assert sum(taken.values()) == pytest.approx(26.0)  # 5 s before the clock was built, 21 s since
    assert clock.take(fake.now) == {}  # nothing twice
    fake.sleep(7.0)
    clock.close(fake.now)  # the end: idle from the last step on
    fake.sleep(0.5)
    assert clock.take(fake.now) == pytest.approx({"idle": 7.5})


def test_marks_nest_and_unwind_in_any_order(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    clock.first_step(fake.now)
    outer, inner = clock.phase("evaluation"), clock.phase("checkpoint_save")
    outer.__enter__()
    fake.sleep(1.0)
    inner.__enter__()
    fake.sleep(2.0)
    outer.__exit__(None, None, None)  # the outer one left first: the inner one now returns to steps
    fake.sleep(3.0)
    inner.__exit__(None, None, None)
    fake.sleep(4.0)
    assert clock.take(fake.now) == pytest.approx({"evaluation": 1.0, "checkpoint_save": 5.0, "productive": 4.0})


def test_a_mark_left_by_an_exception_still_ends(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    clock.first_step(fake.now)
    with pytest.raises(RuntimeError), clock.phase("evaluation"):
        fake.sleep(2.0)
        raise RuntimeError("eval failed")
    fake.sleep(1.0)
    assert clock.take(fake.now) == pytest.approx({"evaluation": 2.0, "productive": 1.0})


def test_an_unknown_phase_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"evaluation, checkpoint_save, checkpoint_load.*'training'"):
        PhaseClock(started=0.0).phase("training")


def test_a_stall_turns_idle_and_the_next_step_ends_it(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    clock.first_step(fake.now)
    fake.sleep(1.0)
    clock.take(fake.now, steps=1, last_step=fake.now)
    fake.sleep(1.0)
    clock.take(fake.now, steps=1, last_step=fake.now)  # steps every second
    fake.sleep(STALL_S + 30.0)  # then nothing for 90 s
    assert clock.take(fake.now) == pytest.approx({"productive": STALL_S, "idle": 30.0})
    assert clock.stalled
    fake.sleep(5.0)
    clock.unstall(fake.now)  # what record_step does when a step arrives
    fake.sleep(1.0)
    assert clock.take(fake.now, steps=1, last_step=fake.now) == pytest.approx({"idle": 5.0, "productive": 1.0})


def test_steps_done_again_after_a_restart_are_lost_progress(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    assert clock.resumed(100, reached=130) == 30  # checkpoint at 100, the last attempt got to 130
    clock.first_step(fake.now)
    fake.sleep(20.0)
    # 20 steps, all done before: all lost.
    assert clock.take(fake.now, steps=20, last_step=fake.now) == pytest.approx({"lost_progress": 20.0})
    fake.sleep(20.0)
    # 20 more: 10 redone (to 130), 10 new.
    assert clock.take(fake.now, steps=20, last_step=fake.now) == pytest.approx(
        {"lost_progress": 10.0, "productive": 10.0}
    )
    assert clock.global_step == 140
    assert clock.take_lost_steps() == 30 and clock.take_lost_steps() == 0


def test_resuming_past_what_was_reached_loses_nothing() -> None:
    clock = PhaseClock(started=0.0)
    assert clock.resumed(200, reached=150) == 0
    assert clock.resumed(200) == 0


def test_the_progress_file_keeps_the_highest_step(tmp_path) -> None:
    progress = ProgressFile(tmp_path)
    assert progress.path == tmp_path / "openlora-progress.json"
    assert progress.reached() is None
    progress.write(10, run_id="r", attempt=1)
    progress.write(5, run_id="r", attempt=1)  # lower: kept at 10
    assert json.loads(progress.path.read_text())["step"] == 10
    # A later attempt that has not yet passed the earlier one's step does not lower it.
    again = ProgressFile(tmp_path / "openlora-progress.json")
    again.write(7, run_id="r", attempt=2)
    assert again.reached() == 10
    again.write(12, run_id="r", attempt=2)
    assert json.loads(again.path.read_text()) == {"run_id": "r", "step": 12, "attempt": 2, "time": pytest.approx(time.time(), abs=60)}


def test_a_progress_file_of_another_run_is_replaced(tmp_path) -> None:
    ProgressFile(tmp_path).write(500, run_id="old-run", attempt=1)
    ProgressFile(tmp_path).write(3, run_id="new-run", attempt=1)
    assert json.loads((tmp_path / "openlora-progress.json").read_text())["step"] == 3


@pytest.mark.parametrize("content", ["not json", '{"step": "ten"}', '{"step": -1}', "[1]", '{"step": true}'])
def test_a_bad_progress_file_is_ignored_with_one_warning(tmp_path, caplog, content: str) -> None:
    (tmp_path / "openlora-progress.json").write_text(content)
    progress = ProgressFile(tmp_path)
    assert progress.reached() is None
    assert progress.reached() is None
    assert len([r for r in caplog.records if "openlora-progress.json" in r.getMessage()]) == 1


def test_an_unwritable_progress_file_never_raises(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    ProgressFile(blocker / "sub" / "p.json").write(3, run_id="r", attempt=1)  # a file where a directory must be
    assert "could not" in caplog.text and "p.json" in caplog.text


# -- through TrainingMetrics and an SDK reader ----------------------------------------------------


@pytest.fixture
def training(fake: FakeClock):
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), run_id="r1"), metric_readers=[reader])
    yield telemetry, reader
    telemetry.shutdown()


def test_time_is_exported_by_phase_and_adds_up_to_the_wall_time(fake: FakeClock, training) -> None:
    telemetry, reader = training
    metrics = telemetry.training
    first = reader.get_metrics_data()
    # Every phase exists from the first collection (increase() would miss a series born later).
    phases = {dict(p.attributes)["openlora.training.phase"] for p in points(first, "openlora.training.time")}
    assert phases == set(TRAINING_PHASES)
    assert value(first, "openlora.training.steps.lost") == 0
    before = sum(spent(first, phase) for phase in TRAINING_PHASES)
    start = fake.now
    fake.sleep(2.0)
    metrics.record_step(loss=1.0)  # start-up ends
    for _ in range(10):
        fake.sleep(0.5)
        metrics.record_step(loss=1.0, data_time_s=0.1)
    with metrics.phase("evaluation"):
        fake.sleep(3.0)
    data = reader.get_metrics_data()
    total = sum(spent(data, phase) for phase in TRAINING_PHASES)
    assert total - before == pytest.approx(fake.now - start)
    assert spent(data, "evaluation") == pytest.approx(3.0)
    assert spent(data, "data_wait") == pytest.approx(1.0)
    assert spent(data, "productive") == pytest.approx(4.0)
    assert spent(data, "startup") - spent(first, "startup") == pytest.approx(2.0)


def test_a_resumed_run_counts_its_lost_steps_and_writes_its_progress(fake: FakeClock, training, tmp_path) -> None:
    (tmp_path / "openlora-progress.json").write_text(json.dumps({"run_id": "r1", "step": 8, "attempt": 1}))
    telemetry, reader = training
    metrics = telemetry.training
    metrics.track_progress(tmp_path)
    assert metrics.resumed(5) == 3  # from the file: the first attempt reached step 8
    metrics.record_step()
    for _ in range(6):
        fake.sleep(1.0)
        metrics.record_step()
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.steps.lost") == 3
    # 7 steps, the first three done again: 3/7 of the 6 s between steps.
    assert spent(data, "lost_progress") == pytest.approx(6.0 * 3 / 7)
    assert metrics.global_step == 12
    saved = json.loads((tmp_path / "openlora-progress.json").read_text())
    assert saved["step"] == 12 and saved["run_id"] == "r1" and saved["attempt"] == 1


def test_resumed_checks_its_arguments(training) -> None:
    telemetry, _ = training
    with pytest.raises(TypeError):
        telemetry.training.resumed("10")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        telemetry.training.resumed(-1)


def test_the_attempt_is_in_the_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = InMemoryMetricReader()
    config = TelemetryConfig.from_env({"TORCHELASTIC_RESTART_COUNT": "2", "OTEL_METRICS_EXPORTER": "none"})
    telemetry = setup_telemetry(config=config, metric_readers=[reader])
    try:
        telemetry.training.record_step()
        data = reader.get_metrics_data()
        assert data.resource_metrics[0].resource.attributes["openlora.run.attempt"] == 3
    finally:
        telemetry.shutdown()


def test_marking_is_cheap_and_thread_safe(training) -> None:
    telemetry, reader = training
    mark = telemetry.training.phase("evaluation")

    def work() -> None:
        for _ in range(2000):
            with mark:
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    data = reader.get_metrics_data()
    assert spent(data, "evaluation") >= 0.0
    assert all(p.value >= 0 for p in points(data, "openlora.training.time"))


def test_steps_after_the_last_collection_are_not_idle_at_shutdown(fake: FakeClock, training) -> None:
    """The steps since the last collection are still steps when the process ends, the time after them idle."""
    telemetry, reader = training
    metrics = telemetry.training
    first = reader.get_metrics_data()
    metrics.record_step()
    for _ in range(4):
        fake.sleep(1.0)
        metrics.record_step()
    fake.sleep(3.0)
    metrics.close()  # no collection since the steps: the shutdown's final one follows
    data = reader.get_metrics_data()
    assert spent(data, "productive") - spent(first, "productive") == pytest.approx(4.0)
    assert spent(data, "idle") - spent(first, "idle") == pytest.approx(3.0)


# -- what a review found ----------------------------------------------------------------------------


def test_track_progress_on_a_directory_not_made_yet_writes_inside_it(fake: FakeClock, training, tmp_path) -> None:
    telemetry, reader = training
    checkpoints = tmp_path / "ckpt"  # the script makes it later, with its first checkpoint
    telemetry.training.track_progress(checkpoints)
    telemetry.training.record_step()
    reader.get_metrics_data()
    assert (checkpoints / "openlora-progress.json").is_file()
    checkpoints.mkdir(exist_ok=True)  # the script's own makedirs still works


def test_a_step_count_past_int64_in_the_file_is_ignored(tmp_path, caplog) -> None:
    (tmp_path / "openlora-progress.json").write_text('{"run_id": "r", "step": 18446744073709551616}')
    assert ProgressFile(tmp_path).reached() is None
    (tmp_path / "openlora-progress.json").write_text("[" * 100_000 + "]" * 100_000)  # deeper than json allows
    assert ProgressFile(tmp_path).reached() is None


def test_a_later_clock_in_the_process_starts_when_it_is_built() -> None:
    PhaseClock()  # the process's first clock (here or earlier in this test process) took its start
    later = PhaseClock()
    assert later.take(time.perf_counter())["startup"] < 5.0


def test_a_step_inside_a_mark_after_a_stall_returns_to_steps(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    clock.first_step(fake.now)
    clock.take(fake.now, steps=1, last_step=fake.now)
    fake.sleep(STALL_S + 40.0)
    clock.take(fake.now)  # stalled: idle
    with clock.phase("checkpoint_save"):
        fake.sleep(10.0)
        clock.unstall(fake.now)  # a step arrives while a background save is marked
        fake.sleep(5.0)
    fake.sleep(3.0)
    assert clock.take(fake.now, steps=1, last_step=fake.now) == pytest.approx(
        {"checkpoint_save": 15.0, "productive": 3.0}
    )
    assert not clock.stalled


def test_after_close_a_late_step_does_not_turn_idle_time_productive(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    clock.first_step(fake.now)
    clock.take(fake.now, steps=1, last_step=fake.now)
    fake.sleep(STALL_S + 10.0)
    clock.take(fake.now)
    clock.close(fake.now)
    clock.unstall(fake.now)  # the training thread still stepping after a SIGTERM shutdown
    fake.sleep(50.0)
    assert clock.take(fake.now) == pytest.approx({"idle": 50.0})


def test_a_long_evaluation_is_no_stall(fake: FakeClock) -> None:
    clock = PhaseClock(started=fake.now)
    clock.first_step(fake.now)
    clock.take(fake.now, steps=1, last_step=fake.now)
    with clock.phase("evaluation"):
        fake.sleep(600.0)
    fake.sleep(2.0)
    assert clock.take(fake.now) == pytest.approx({"evaluation": 600.0, "productive": 2.0})


def test_the_first_steps_data_wait_is_start_up_not_taken_from_the_steps(fake: FakeClock, training) -> None:
    telemetry, reader = training
    metrics = telemetry.training
    first = reader.get_metrics_data()
    fake.sleep(20.0)
    metrics.record_step(data_time_s=20.0)  # the first batch took 20 s: start-up
    for _ in range(10):
        fake.sleep(1.0)
        metrics.record_step(data_time_s=0.1)
    data = reader.get_metrics_data()
    assert spent(data, "productive") - spent(first, "productive") == pytest.approx(9.0)
    assert spent(data, "data_wait") - spent(first, "data_wait") == pytest.approx(1.0)


def test_a_new_run_at_step_0_ignores_another_runs_progress_file(training, tmp_path) -> None:
    (tmp_path / "openlora-progress.json").write_text(json.dumps({"run_id": "other-run", "step": 500}))
    telemetry, _ = training
    telemetry.training.track_progress(tmp_path)
    assert telemetry.training.resumed(0) == 0
    # Resuming from a checkpoint in that directory is this run's: its file counts.
    assert telemetry.training.resumed(400) == 100

"""`openlora-otel report`'s "Where the time went": goodput by phase, summed over the ranks and
attempts of a run, from history files two real attempts of one run id append to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from openlora_otel import setup_telemetry
from openlora_otel.commands import report as report_command
from openlora_otel.names import TRAINING_PHASES
from openlora_otel.report.goodput import TimeSample, time_breakdown
from openlora_otel.report.history_reader import read_history
from openlora_otel.report.history_source import read_runs
from openlora_otel.report.summary import TIME_HEADING, time_lines
from tests.support.clock import FakeClock
from tests.support.history_files import history_config

pytest.importorskip("opentelemetry.exporter.otlp.proto.common")  # the history file's encoder

RUN_ID = "goodput-run-1"
# What the two attempts below book (see _two_attempts).
LOST_SHARE = 6 / 11  # attempt 2: 11 steps, the first 6 done again, 10 s between them
EXPECTED = {
    "startup": 2.0 + 1.0,
    "productive": 20.0 + 10.0 * (1 - LOST_SHARE),
    "data_wait": 0.0,
    "evaluation": 3.0,
    "checkpoint_save": 0.0,
    "checkpoint_load": 2.0,
    "lost_progress": 10.0 * LOST_SHARE,
    "idle": 1.0 + 4.0,
}


def _attempt(directory: Path, attempt: int) -> object:
    config = history_config(directory, quiet=True, run_id=RUN_ID, run_name="restarted", run_attempt=attempt)
    return setup_telemetry(config=config)


def _two_attempts(directory: Path, checkpoints: Path, clock: FakeClock) -> Path:
    """Attempt 1 reaches step 21 and ends; attempt 2 resumes from step 15: 6 steps lost."""
    telemetry = _attempt(directory, 1)
    try:
        training = telemetry.training
        training.track_progress(checkpoints)
        clock.sleep(2.0)  # start-up
        training.record_step(loss=1.0)
        for _ in range(10):
            clock.sleep(1.0)
            training.record_step(loss=1.0)
        telemetry.force_flush()  # a line in the middle: cumulative, not to be added to the last one
        for _ in range(10):
            clock.sleep(1.0)
            training.record_step(loss=1.0)
        with training.phase("evaluation"):
            clock.sleep(3.0)
        clock.sleep(1.0)  # after the last step: idle
    finally:
        telemetry.shutdown()
    telemetry = _attempt(directory, 2)
    try:
        training = telemetry.training
        training.track_progress(checkpoints)
        with training.phase("checkpoint_load"):
            clock.sleep(2.0)
        assert training.resumed(15) == 6  # the progress file says attempt 1 reached 21
        clock.sleep(1.0)
        training.record_step(loss=1.0)
        for _ in range(10):
            clock.sleep(1.0)
            training.record_step(loss=1.0)
        # A line after the last step: PhaseClock.close() learns the last step's time at collections
        # only, so steps after the last one would be booked idle at the shutdown.
        telemetry.force_flush()
        clock.sleep(4.0)
    finally:
        telemetry.shutdown()
    files = list(directory.glob("*.jsonl"))
    assert [f.name for f in files] == [f"{RUN_ID}.jsonl"]  # both attempts append to the run id's file
    return files[0]


@pytest.fixture
def history(tmp_path: Path, clock: FakeClock) -> Path:
    directory = tmp_path / "history"
    _two_attempts(directory, tmp_path / "checkpoints", clock)
    return directory


def _check(time: object, labels: list[str]) -> None:
    assert time is not None
    assert time.phases == pytest.approx(EXPECTED)
    assert list(time.phases) == list(TRAINING_PHASES)
    assert time.total == pytest.approx(43.0)
    assert time.goodput == pytest.approx(EXPECTED["productive"] / 43.0)
    assert [a.label for a in time.attempts] == labels
    assert [a.steps_lost for a in time.attempts] == [0, 6]
    assert [a.lost_progress_s for a in time.attempts] == pytest.approx([0.0, 10.0 * LOST_SHARE])
    assert [a.seconds for a in time.attempts] == pytest.approx([26.0, 17.0])
    assert time.steps_lost == 6


def test_two_attempts_in_one_file_are_summed_by_their_last_values(history: Path) -> None:
    path = history / f"{RUN_ID}.jsonl"
    snapshots = list(read_history(path))
    assert [s.resource["openlora.run.attempt"] for s in snapshots] == [1, 1, 2, 2]
    assert len({s.resource["service.instance.id"] for s in snapshots}) == 2
    (run,) = read_runs([str(history)])
    _check(run.time, ["1", "2"])
    assert run.time.processes == 2


def test_lines_without_the_attempt_or_instance_are_split_where_the_counters_start_over(
    history: Path, tmp_path: Path
) -> None:
    """A foreign writer's lines (no openlora.run.attempt, no service.instance.id): the counters'
    reset says where the second process began."""
    out = tmp_path / "stripped"
    out.mkdir()
    lines = []
    for raw in (history / f"{RUN_ID}.jsonl").read_text().splitlines():
        body = json.loads(raw)
        for resource_metrics in body["resourceMetrics"]:
            attributes = resource_metrics["resource"]["attributes"]
            attributes[:] = [
                a for a in attributes if a["key"] not in ("openlora.run.attempt", "service.instance.id")
            ]
        lines.append(json.dumps(body))
    (out / f"{RUN_ID}.jsonl").write_text("".join(line + "\n" for line in lines))
    (run,) = read_runs([str(out)])
    _check(run.time, ["?", "? (again)"])


def test_ranks_of_one_attempt_add_their_seconds_and_count_the_steps_lost_once() -> None:
    def sample(rank: int, attempt: int, seconds: float, lost: float) -> TimeSample:
        phases = {"productive": seconds, "lost_progress": lost}
        return TimeSample(
            0.0, phases, steps_lost=5 if lost else 0, attempt=attempt, rank=rank, process=f"{attempt}.{rank}"
        )

    time = time_breakdown(
        [sample(0, 1, 10.0, 0.0), sample(1, 1, 11.0, 0.0), sample(0, 2, 4.0, 2.0), sample(1, 2, 4.0, 3.0)]
    )
    assert time is not None and time.processes == 4
    assert time.phases["productive"] == 29.0 and time.phases["lost_progress"] == 5.0
    assert [(a.label, a.processes, a.steps_lost, a.lost_progress_s) for a in time.attempts] == [
        ("1", 2, 0, 0.0),
        ("2", 2, 5, 5.0),
    ]
    assert time_breakdown([TimeSample(0.0, {})]) is None


def test_the_text_and_the_page_show_the_section(
    history: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    (run,) = read_runs([str(history)])
    text = "\n".join(time_lines(run))
    assert f"{TIME_HEADING} (2 attempts, 2 processes" in text
    rows = {line.split()[0]: line.split()[1:] for line in time_lines(run)[1:]}
    assert rows["productive"] == ["24.5", "s", "57.1", "%"]
    assert rows["lost_progress"] == ["5.5", "s", "12.7", "%"]
    assert rows["total"] == ["43.0", "s", "goodput", "57.1", "%"]
    assert "attempt 1: 0 steps lost, 0.0 s lost_progress, 26.0 s in all (1 process)" in text
    assert "attempt 2: 6 steps lost, 5.5 s lost_progress, 17.0 s in all (1 process)" in text

    parser = argparse.ArgumentParser(prog="openlora-otel")
    report_command.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out" / "r.html"
    out.parent.mkdir()
    assert (
        report_command.run(parser.parse_args(["report", str(history), "--out", str(out), "--format", "html"]))
        == 0
    )
    printed = capsys.readouterr().out
    assert "goodput 57.1 %" in printed and "attempt 2: 6 steps lost" in printed
    page = out.read_text()
    section = page[page.index('<section id="time">') :]
    assert f"<h2>{TIME_HEADING}</h2>" in section
    assert "goodput 57.1 %" in section and "<strong>57.1 %</strong>" in section
    assert 'title="lost_progress: 5.5 s (12.7 %)"' in section
    assert '>6</td><td class="num">5.5 s</td>' in section  # attempt 2's steps lost and seconds


def test_a_run_without_the_time_counter_says_so() -> None:
    from openlora_otel.report.model import Run

    assert time_lines(Run("r", "r", {}, "x")) == [
        f"{TIME_HEADING}: not in the data read (openlora.training.time in a run's history files; "
        "not read from Prometheus)"
    ]

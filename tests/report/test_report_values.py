"""`openlora-otel report` on history files whose values are odd (issue 29, section 3): a NaN last-step
timestamp, lone surrogates in names and ids, a megabyte of eval metric name. Shown escaped or
shortened; the report still draws, exit 0, no traceback. And the history reader, fuzzed."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from openlora_otel import setup_telemetry
from openlora_otel.commands import report as report_command
from openlora_otel.report.history_reader import read_history
from openlora_otel.report.history_source import read_runs
from openlora_otel.report.model import ReportError, shown
from tests.support.fuzz import fuzz
from tests.support.history_files import history_config

pytest.importorskip("opentelemetry.exporter.otlp.proto.common")  # the history file's encoder
pytest.importorskip("matplotlib")

_TIMESTAMP = "openlora.training.last_step.timestamp"


@pytest.fixture(scope="module")
def lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A 12-step run's history lines: one every 4 steps (and the shutdown's), with an evaluation."""
    directory = tmp_path_factory.mktemp("history")
    config = history_config(directory, quiet=True, run_id="odd1", run_name="odd", handle_sigterm=False)
    telemetry = setup_telemetry(config=config, hyperparameters={"lora_r": 8})
    try:
        for step in range(1, 13):
            telemetry.training.record_step(loss=2.0 - step / 10, tokens=100)
            if step % 4 == 0:
                telemetry.training.record_eval(loss=2.0, accuracy=0.5)
                telemetry.force_flush()
    finally:
        telemetry.shutdown()
    [path] = directory.iterdir()
    return path.read_text().splitlines()


def _metrics(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for scope in body["resourceMetrics"][0]["scopeMetrics"] for m in scope["metrics"]]


def _attribute(pairs: list[dict[str, Any]], key: str, text: str) -> None:
    for pair in pairs:
        if pair["key"] == key:
            pair["value"] = {"stringValue": text}


def _resource(key: str, text: str) -> Callable[[dict[str, Any]], None]:
    return lambda body: _attribute(body["resourceMetrics"][0]["resource"]["attributes"], key, text)


def _info(key: str, text: str) -> Callable[[dict[str, Any]], None]:
    def change(body: dict[str, Any]) -> None:
        for metric in _metrics(body):
            if metric["name"] == "openlora.run.info":
                for point in metric["gauge"]["dataPoints"]:
                    _attribute(point["attributes"], key, text)

    return change


def _eval_metric(text: str) -> Callable[[dict[str, Any]], None]:
    def change(body: dict[str, Any]) -> None:
        for metric in _metrics(body):
            if metric["name"] == "openlora.training.eval.value":
                for point in metric["gauge"]["dataPoints"]:
                    _attribute(point["attributes"], "openlora.eval.metric", text)

    return change


def _nan_timestamp(body: dict[str, Any]) -> None:
    for metric in _metrics(body):
        if metric["name"] == _TIMESTAMP:
            for point in metric["gauge"]["dataPoints"]:
                point.pop("asInt", None)
                point["asDouble"] = "NaN"


def _write(directory: Path, lines: list[str], change: Callable[[dict[str, Any]], None]) -> Path:
    path = directory / "odd1.jsonl"
    out = []
    for line in lines:
        body = json.loads(line)
        change(body)
        out.append(json.dumps(body))  # ensure_ascii: a lone surrogate is written as the escape \ud800
    path.write_text("".join(line + "\n" for line in out))
    return path


def _report(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="openlora-otel")
    report_command.add_parser(parser.add_subparsers(dest="command"))
    return report_command.run(parser.parse_args(["report", *argv]))


LONE = "\ud800"
CASES = {
    "nan-timestamp": (_nan_timestamp, None),
    "run-name": (_info("openlora.run.name", f"x{LONE}y"), "x\\ud800y"),
    "resource-run-name": (_resource("openlora.run.name", LONE), None),
    "hyperparameter": (_info("openlora.hparam.lora_r", LONE), "\\ud800"),
    "run-id": (_resource("openlora.run.id", f"id{LONE}"), "id\\ud800"),
    "eval-metric": (_eval_metric(f"acc{LONE}"), "acc\\ud800"),
    "eval-metric-1mb": (_eval_metric("m" * 1_000_000), "m" * 63 + "…"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", ["png", "html"])
def test_odd_values_are_shown_escaped_or_shortened(
    case: str, fmt: str, lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, expected = CASES[case]
    path = _write(tmp_path, lines, change)
    assert _report(str(path), "--out", f"{tmp_path}/", "--format", fmt) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "12 steps" in out
    written = (tmp_path / f"openlora-report.{fmt}").read_bytes()
    assert written
    if expected is not None and fmt == "html":
        assert expected.encode() in written
        assert len(written) < 4_000_000  # the megabyte name is not there whole (nor its escapes)


def test_a_nan_timestamp_is_no_time_in_the_summary(lines: list[str], tmp_path: Path) -> None:
    from openlora_otel.report.summary import summarize

    (run,) = read_runs([str(_write(tmp_path, lines, _nan_timestamp))])
    assert summarize(run).seconds is None  # not NaN: nothing to measure the run's length by


def test_shown_escapes_what_is_not_printable_and_shortens() -> None:
    assert shown("plain name") == "plain name"
    assert shown(f"a{LONE}b\n\x00") == "a\\ud800b\\n\\x00"
    assert shown("x" * 10, 5) == "xxxx…"
    assert shown(f"{LONE}" * 10, 8) == "\\ud800\\…"
    "".join(
        shown(chr(c)) for c in range(0xE000)
    ).encode()  # controls and surrogates: UTF-8 carries the result


# -- property-based: the history reader and the report over any line ---------------------------------


@st.composite
def _mutated_line(draw: st.DrawFn, lines: list[str]) -> str:
    """A real line with one value replaced by anything JSON can hold (or a random line)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(st.characters(blacklist_characters="\n"), max_size=80))
    body = json.loads(draw(st.sampled_from(lines)))
    spots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            spots.append((node, key))
            walk(value)

    walk(body)
    for _ in range(draw(st.integers(1, 3))):
        node, key = draw(st.sampled_from(spots))
        node[key] = draw(
            st.one_of(
                st.none(),
                st.booleans(),
                st.integers(min_value=-(2**70), max_value=2**70),
                st.floats(),
                st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", LONE, "x" * 5000, "-1", "007"]),
                st.text(max_size=20),
                st.lists(st.integers(), max_size=3),
                st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
            )
        )
    return json.dumps(body)


@fuzz
@given(data=st.data())
@example(data=None)
@example(data="resourceMetrics-string")
@example(data="bounds-string")
def test_fuzz_history_reader_and_report(
    lines: list[str], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject | str | None
) -> None:
    """Whatever a line holds: the reader yields snapshots or skips it, counted; the runs it makes are
    reported or refused with a ReportError; the texts they carry encode as UTF-8."""
    directory = tmp_path_factory.mktemp("fuzz")
    if data is None:  # the issue's: a NaN timestamp and a lone surrogate in the run name
        body = json.loads(lines[1])
        _nan_timestamp(body)
        _info("openlora.run.name", LONE)(body)
        bad = json.dumps(body)
    elif data == "resourceMetrics-string":  # found: taken as no data, the line neither read nor counted
        bad = '{"resourceMetrics": ""}'
    elif data == "bounds-string":  # found: a string of digits read as bucket bounds, one per digit
        body = json.loads(lines[1])
        for metric in _metrics(body):
            if "histogram" in metric:
                metric["histogram"]["dataPoints"][0]["explicitBounds"] = "12"
        bad = json.dumps(body)
    else:
        bad = data.draw(_mutated_line(lines))
    path = directory / "odd1.jsonl"
    path.write_text("".join(line + "\n" for line in [lines[0], bad, *lines[2:]]))
    reader = read_history(path)
    snapshots = list(reader)
    # The other lines are read; the changed one is skipped and counted, or read (an empty one, or one of
    # no resources, `"resourceMetrics": []`, gives no snapshot).
    assert len(lines) - 1 <= len(snapshots) + reader.skipped <= len(lines)
    if isinstance(data, str):
        assert reader.skipped == 1
    try:
        runs = read_runs([str(path)])
    except ReportError:
        return
    from openlora_otel.report.summary import summarize

    for run in runs:
        for text in (run.run_id, run.name, run.source, *run.hyperparameters, *run.hyperparameters.values()):
            text.encode()
        for row in run.rows:
            for key in row.values:
                assert len(key) < 100
                key.encode()
        summary = summarize(run)
        assert summary.seconds is None or math.isfinite(summary.seconds)

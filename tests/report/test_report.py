"""`openlora-otel report`: runs read from history files and from a real Prometheus, drawn as PNG and HTML.

History files here are written the way the OTLP exporters encode a collection (a
real MeterProvider read in memory, ``encode_metrics``, the protobuf JSON mapping),
one ``ExportMetricsServiceRequest`` per line. The Prometheus test scrapes real demo
runs with Debian's Prometheus. The page is opened in headless Chromium.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToJson
from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.commands import report as report_command
from openlora_otel.hardware import nvml
from openlora_otel.report.drawing import prepare
from openlora_otel.report.history_reader import WARNED_LINES, read_history
from openlora_otel.report.history_source import read_runs
from openlora_otel.report.model import QUANTITIES, Row, Run, curves, legend_labels
from openlora_otel.report.png import png_figure
from openlora_otel.report.prometheus import PrometheusSource, read_prometheus
from tests.support.chromium import chromium, headless
from tests.support.demo import demo_process, needs_the_demo, wait_for_line
from tests.support.fake_nvml import FakeNvml, h100s
from tests.support.processes import child_env, free_port, reap
from tests.support.prometheus_server import Prometheus, prometheus_binary

CPU_PANELS = ["Loss", "Gradient norm", "Learning rate", "Throughput", "Step time"]
HPARAMS = {"learning_rate": 3e-3, "batch_size": 16, "lora_r": 8, "lora_alpha": 16, "base_model": "tiny-llama"}


# -- writing history files -------------------------------------------------------------------
def write_history(
    directory: Path,
    *,
    run_id: str,
    run_name: str | None,
    hyperparameters: Mapping[str, object],
    steps: int = 60,
    lr: float = 1e-3,
    collect_every: int = 5,
    eval_every: int = 20,
    config: TelemetryConfig | None = None,
    file_name: str | None = None,
    resource_attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Path:
    """A pretend run whose loss falls faster with a larger ``lr``, one line per ``collect_every`` steps
    and a final line after the last step (as at shutdown)."""
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(
        run_id=run_id,
        run_name=run_name,
        hyperparameters=hyperparameters,
        config=config or TelemetryConfig(exporters=("none",), host_metrics=False, quiet=True),
        metric_readers=[reader],
        resource_attributes=resource_attributes,
    )
    lines = []
    try:
        for step in range(1, steps + 1):
            telemetry.training.record_step(
                loss=expected_loss(step, lr),
                grad_norm=1.0 + 0.5 * math.exp(-step / 10),
                learning_rate=lr * min(1.0, step / 10),
                tokens=1024,
                step_time_s=0.05 + 0.01 * (step % 2),
            )
            if eval_every and step % eval_every == 0:
                telemetry.training.record_eval(loss=expected_loss(step, lr) + 0.1)
            if step % collect_every == 0:
                lines.append(otlp_json_line(reader))
        lines.append(otlp_json_line(reader))
    finally:
        telemetry.shutdown()
    path = directory / (file_name or f"{run_id}.jsonl")
    path.write_text("".join(line + "\n" for line in lines))
    return path


def expected_loss(step: int, lr: float) -> float:
    return 0.5 + 3.0 * math.exp(-step * lr * 30)


def otlp_json_line(reader: InMemoryMetricReader) -> str:
    """One collection as the OTLP/JSON file format writes it: an ExportMetricsServiceRequest on one line."""
    request = encode_metrics(reader.get_metrics_data())
    line = MessageToJson(request, indent=None, use_integers_for_enums=True)
    assert "\n" not in line
    return line


def run_report(*argv: str) -> int:
    """``openlora-otel report ARGV`` through the command's own parser (SystemExit on a usage error)."""
    parser = argparse.ArgumentParser(prog="openlora-otel")
    report_command.add_parser(parser.add_subparsers(dest="command"))
    return report_command.run(parser.parse_args(["report", *argv]))


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    directory = tmp_path / "history"
    directory.mkdir()
    write_history(directory, run_id="aaaa1111", run_name="a", hyperparameters=HPARAMS, lr=3e-3)
    write_history(
        directory,
        run_id="bbbb2222",
        run_name="b",
        hyperparameters={**HPARAMS, "learning_rate": 1e-3},
        lr=1e-3,
    )
    return directory


# -- history files -----------------------------------------------------------------------------
def test_history_file_curves_are_the_recorded_values_against_the_step(two_runs: Path) -> None:
    runs = read_runs([str(two_runs / "aaaa1111.jsonl")])
    (run,) = runs
    assert (run.run_id, run.name) == ("aaaa1111", "a")
    assert run.hyperparameters == {
        "learning_rate": "0.003",
        "batch_size": "16",
        "lora_r": "8",
        "lora_alpha": "16",
        "base_model": "tiny-llama",
    }
    c = curves(run.rows)
    # One point per collection, at the step count of that collection; the final line repeats step 60.
    assert [x for x, _ in c["loss"]] == list(range(5, 61, 5))
    # The loss gauge is the mean over the steps of each interval.
    mean_56_60 = sum(expected_loss(s, 3e-3) for s in range(56, 61)) / 5
    assert c["loss"][-1] == (60, pytest.approx(mean_56_60))
    assert c["loss_max"][-1] == (60, pytest.approx(expected_loss(56, 3e-3)))
    assert c["eval_loss"] == [(s, pytest.approx(expected_loss(s, 3e-3) + 0.1)) for s in (20, 40, 60)]
    assert c["learning_rate"][-1] == (60, pytest.approx(3e-3))
    assert c["grad_norm_max"][0] == (5, pytest.approx(1.0 + 0.5 * math.exp(-0.1)))
    # Step time from the histogram: (sum delta) / (count delta) between collections.
    steps_56_60 = [0.05 + 0.01 * (s % 2) for s in range(56, 61)]
    assert c["step_time"][-1] == (60, pytest.approx(sum(steps_56_60) / 5))
    assert all(v > 0 for _, v in c["tokens_per_s"])
    drawing = prepare(runs)
    assert [p.title for p in drawing.panels] == CPU_PANELS  # no GPU: those panels are left out
    assert drawing.summaries[0].steps == 60
    assert drawing.summaries[0].final_eval_loss == pytest.approx(expected_loss(60, 3e-3) + 0.1)


def test_two_runs_overlaid_legend_names_them_with_the_learning_rate_that_differs(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert run_report(str(two_runs), "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'openlora-report.png'}" in printed
    assert f"wrote {out / 'openlora-report.html'}" in printed
    png = (out / "openlora-report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 50_000

    runs = read_runs([str(two_runs)])
    assert [run.name for run in runs] == ["a", "b"]
    assert legend_labels(runs) == ["a (lr=0.003)", "b (lr=0.001)"]
    figure = png_figure(prepare(runs))
    texts = {t.get_text() for t in figure.findobj(lambda a: hasattr(a, "get_text"))}
    assert {"a (lr=0.003)", "b (lr=0.001)"} <= texts  # the run legend
    assert set(CPU_PANELS) <= texts  # panel titles
    assert {"step", "tokens / s", "loss", "learning rate"} <= texts  # axis labels with units
    # Each run's loss curve is drawn, in its own colour, with its own values.
    from matplotlib.axes import Axes

    (loss_ax,) = [ax for ax in figure.findobj(Axes) if ax.get_title(loc="left") == "Loss"]
    solid = [line for line in loss_ax.get_lines() if line.get_linestyle() == "-"]
    assert len(solid) == 2 and solid[0].get_color() != solid[1].get_color()
    assert solid[0].get_ydata()[-1] < solid[1].get_ydata()[-1]  # the larger lr fell further

    page = (out / "openlora-report.html").read_text()
    assert page.count('<div class="chart"') == len(CPU_PANELS)
    # Nothing loaded from anywhere: every script and style inline, no reference out, and a policy that forbids any.
    assert not re.search(r"src=|<link|@import|url\(|href=", page)
    assert "default-src 'none'" in page
    for heading in ["Runs", *CPU_PANELS]:
        assert f"<h2>{heading}</h2>" in page
    assert 'aria-label="Loss: a (lr=0.003); b (lr=0.001)"' in page
    assert "learning_rate=0.003" in page and "learning_rate=0.001" in page


def test_gpu_panels_appear_when_the_run_had_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = h100s(2)
    gpus[0].utilization, gpus[1].utilization = 0.25, 0.75
    gpus[1].memory_used = 30 * 2**30
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: FakeNvml(gpus))
    config = TelemetryConfig(
        exporters=("none",), host_metrics=False, quiet=True, gpu_metrics="on", gpu_devices="all"
    )
    write_history(tmp_path, run_id="gpu1", run_name="on-gpu", hyperparameters=HPARAMS, config=config)
    (run,) = read_runs([str(tmp_path)])
    c = curves(run.rows)
    assert [v for _, v in c["gpu_utilization"]] == [0.5] * 12  # mean of the two GPUs, every collection
    assert [v for _, v in c["gpu_memory"]] == [30 * 2**30] * 12  # the fuller GPU
    drawing = prepare([run])
    assert [p.title for p in drawing.panels] == [*CPU_PANELS, "GPU utilization", "GPU memory in use"]
    figure = png_figure(drawing)
    texts = {t.get_text() for t in figure.findobj(lambda a: hasattr(a, "get_text"))}
    assert {"busy (%)", "GiB"} <= texts


def test_ranks_lowest_drawn_and_lines_that_are_not_otlp_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for rank, lr in ((1, 1e-3), (0, 3e-3)):
        write_history(
            tmp_path,
            run_id="ddp1",
            run_name="ddp",
            hyperparameters=HPARAMS,
            lr=lr,
            file_name=f"ddp1.rank{rank}.jsonl",
            resource_attributes={"openlora.rank": rank},
        )
    with (tmp_path / "ddp1.rank0.jsonl").open("a") as handle:
        handle.write("not json at all\n")
        handle.write('{"resourceMetrics": [{"resource": {"attri')  # killed mid-write
    (run,) = read_runs([str(tmp_path)])
    assert (run.rank, run.ranks) == (0, 2)
    assert len(run.rows) == 13  # 12 collections and the final line
    assert curves(run.rows)["learning_rate"][-1][1] == pytest.approx(3e-3)  # rank 0's values
    assert "ddp1.rank0.jsonl line 14 is not OTLP/JSON metrics" in caplog.text


# -- corrupt lines: valid JSON, absurd values ------------------------------------------------
_LOSS, _DURATION, _STEPS = "openlora.training.loss", "openlora.training.step.duration", "openlora.training.steps"
_RAW = "@raw@"  # a placeholder replaced by JSON text json.dumps would not write (1e400, 400 digits)
_HUGE = "1" + "0" * 400  # an integer no float holds


def _first_point(body: dict[str, Any], name: str) -> dict[str, Any]:
    for scope in body["resourceMetrics"][0]["scopeMetrics"]:
        for metric in scope["metrics"]:
            if metric["name"] == name:
                return next(v for v in metric.values() if isinstance(v, dict) and "dataPoints" in v)["dataPoints"][0]
    raise AssertionError(name)


def _set(name: str, field: str, value: object, raw: str | None = None) -> Callable[[str], str]:
    """A good line with one field of the first point of ``name`` replaced (by ``raw`` JSON text if given)."""

    def make(line: str) -> str:
        body = json.loads(line)
        _first_point(body, name)[field] = _RAW if raw is not None else value
        return json.dumps(body).replace(f'"{_RAW}"', raw or "")

    return make


def _edit(change: Callable[[dict[str, Any]], object], raw: str | None = None) -> Callable[[str], str]:
    def make(line: str) -> str:
        body = json.loads(line)
        change(body)
        return json.dumps(body).replace(f'"{_RAW}"', raw or "")

    return make


def _resource_attribute(key: object, value: dict[str, object]) -> Callable[[dict[str, Any]], object]:
    return lambda body: body["resourceMetrics"][0]["resource"]["attributes"].append({"key": key, "value": value})


def _metric_named(name: object) -> Callable[[dict[str, Any]], object]:
    def change(body: dict[str, Any]) -> None:
        body["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["name"] = name

    return change


def _points_of_the_first_metric(points: object) -> Callable[[dict[str, Any]], object]:
    def change(body: dict[str, Any]) -> None:
        metric = body["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]
        next(v for v in metric.values() if isinstance(v, dict) and "dataPoints" in v)["dataPoints"] = points

    return change


# Each makes a bad line out of a good one; the reader skips and counts it (the report, for the ranks).
CORRUPT_LINES: dict[str, Callable[[str], str]] = {
    "time 1e400 (inf)": _set(_STEPS, "timeUnixNano", None, "1e400"),
    "time NaN": _set(_STEPS, "timeUnixNano", None, "NaN"),
    "time -Infinity": _set(_STEPS, "timeUnixNano", None, "-Infinity"),
    "time negative": _set(_STEPS, "timeUnixNano", -5),
    "time fractional": _set(_STEPS, "timeUnixNano", 1.5e9 + 0.5),
    "time past 2**64": _set(_STEPS, "timeUnixNano", str(2**64)),
    "time of 400 digits": _set(_STEPS, "timeUnixNano", None, _HUGE),
    "time a list": _set(_STEPS, "timeUnixNano", [1]),
    "time abc": _set(_STEPS, "timeUnixNano", "abc"),
    "time with an underscore": _set(_STEPS, "timeUnixNano", "1_000"),
    "time true": _set(_STEPS, "timeUnixNano", True),
    "count 1e999": _set(_DURATION, "count", None, "1e999"),
    "count negative": _set(_DURATION, "count", -1),
    "count fractional": _set(_DURATION, "count", 1.5),
    "bucket count 1e999": _set(_DURATION, "bucketCounts", None, "[1e999]"),
    "sum of 400 digits": _set(_DURATION, "sum", None, _HUGE),
    "asDouble a list": _set(_LOSS, "asDouble", [1.0, 2.0]),
    "asDouble abc": _set(_LOSS, "asDouble", "abc"),
    "asDouble an object": _set(_LOSS, "asDouble", {"v": 1}),
    "asDouble of 400 digits": _set(_LOSS, "asDouble", None, _HUGE),
    "asDouble true": _set(_LOSS, "asDouble", True),
    "asInt 1e400": _set(_STEPS, "asInt", None, "1e400"),
    "asInt past int64": _set(_STEPS, "asInt", str(2**63)),
    "asInt of 400 digits": _set(_STEPS, "asInt", None, _HUGE),
    "asInt a string of 5000 digits": _set(_STEPS, "asInt", "9" * 5000),
    "asDouble nested 100000 deep": _set(_LOSS, "asDouble", None, "[" * 100_000 + "]" * 100_000),
    "a line nested 100000 deep": lambda line: "[" * 100_000 + "]" * 100_000,
    "a line that is a number": lambda line: "42",
    "a line that is a string": lambda line: '"resourceMetrics"',
    "a line that is null": lambda line: "null",
    "resourceMetrics a number": lambda line: '{"resourceMetrics": 5}',
    "resourceMetrics null": lambda line: '{"resourceMetrics": null}',
    "dataPoints an object": _edit(_points_of_the_first_metric({"a": 1})),
    "metric name a list": _edit(_metric_named([1])),
    "metric name a number": _edit(_metric_named(5)),
    "attribute key a number": _edit(_resource_attribute(5, {"stringValue": "x"})),
    "stringValue a list": _edit(_resource_attribute("x", {"stringValue": ["a"]})),
    "boolValue a string": _edit(_resource_attribute("x", {"boolValue": "false"})),
    "intValue of 400 digits": _edit(_resource_attribute("x", {"intValue": _RAW}), _HUGE),
    "doubleValue of 400 digits": _edit(_resource_attribute("x", {"doubleValue": _RAW}), _HUGE),
    "rank past int64": _edit(_resource_attribute("openlora.rank", {"intValue": str(2**64)})),
    # Read as attributes (any value is an attribute), refused by the report: not a rank.
    "rank abc": _edit(_resource_attribute("openlora.rank", {"stringValue": "abc"})),
    "rank NaN": _edit(_resource_attribute("openlora.rank", {"doubleValue": "NaN"})),
    "rank 1e400": _edit(_resource_attribute("openlora.rank", {"doubleValue": _RAW}), "1e400"),
    "rank negative": _edit(_resource_attribute("openlora.rank", {"intValue": "-1"})),
}
_RANKS_THE_READER_KEEPS = {"rank abc", "rank NaN", "rank 1e400", "rank negative"}


@pytest.fixture(scope="module")
def good_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The lines of a 20-step run: a collection every 5 steps and the final one (5 lines)."""
    directory = tmp_path_factory.mktemp("good")
    path = write_history(directory, run_id="good1", run_name="good", hyperparameters=HPARAMS, steps=20)
    return path.read_text().splitlines()


@pytest.mark.parametrize("case", list(CORRUPT_LINES))
def test_corrupt_but_parseable_lines_are_skipped_counted_and_said(
    case: str,
    good_lines: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = CORRUPT_LINES[case](good_lines[1])
    if "deep" not in case:  # valid JSON, and for these Python's parser too: what is wrong is the values
        json.loads(bad)
    lines = [good_lines[0], bad, *good_lines[1:3], bad, *good_lines[3:]]
    path = tmp_path / "good1.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    caplog.set_level(logging.WARNING)

    reader = read_history(path)
    snapshots = list(reader)
    if case in _RANKS_THE_READER_KEEPS:
        assert (len(snapshots), reader.skipped) == (7, 0)
    else:
        assert [s.line for s in snapshots] == [1, 3, 4, 6, 7]  # the good ones, in order
        assert reader.skipped == 2
        assert "good1.jsonl line 2 is not OTLP/JSON metrics" in caplog.text

    skipped: dict[str, int] = {}
    (run,) = read_runs([str(path)], skipped=skipped)
    assert skipped == {str(path): 2}
    assert [step for step, _ in curves(run.rows)["loss"]] == [5, 10, 15, 20]

    capsys.readouterr()
    assert run_report(str(path), "--out", str(tmp_path) + "/", "--format", "png") == 0
    out, err = capsys.readouterr()
    assert (tmp_path / "openlora-report.png").stat().st_size > 0
    assert "run good1 (good): 20 steps" in out
    assert f"openlora-otel report: skipped 2 lines of {path} (not OTLP/JSON metrics" in err
    assert "Traceback" not in out + err


def test_a_file_of_bad_lines_names_the_first_few_and_counts_all(
    good_lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "good1.jsonl"
    bad = ['{"resourceMetrics": 5}'] * 1000
    path.write_text("".join(line + "\n" for line in [*bad, *good_lines, *bad]))
    caplog.set_level(logging.WARNING)
    reader = read_history(path)
    assert len(list(reader)) == 5 and reader.skipped == 2000
    assert len(caplog.records) == WARNED_LINES  # not 2,000 warnings
    assert "without a warning each" in caplog.records[-1].getMessage()
    assert run_report(str(path), "--out", str(tmp_path) + "/", "--format", "png") == 0
    assert f"skipped 2,000 lines of {path}" in capsys.readouterr().err

    # Lines the report refuses (an openlora.rank that is no rank) are named as sparingly.
    no_rank = CORRUPT_LINES["rank abc"](good_lines[1])
    path.write_text("".join(line + "\n" for line in [*[no_rank] * 100, *good_lines]))
    caplog.clear()
    skipped: dict[str, int] = {}
    read_runs([str(path)], skipped=skipped)
    assert skipped == {str(path): 100}
    assert len(caplog.records) == WARNED_LINES


def _with_nan(line: str, names: set[str] | None = None) -> str:
    """``line`` with every double (or those of the metrics ``names``) NaN, as a diverged or foreign writer writes."""
    body = json.loads(line)
    for scope in body["resourceMetrics"][0]["scopeMetrics"]:
        for metric in scope["metrics"]:
            if names is not None and metric["name"] not in names:
                continue
            for data in metric.values():
                for point in data.get("dataPoints", ()) if isinstance(data, dict) else ():
                    for key in ("asDouble", "sum", "min", "max"):
                        if key in point:
                            point[key] = "NaN"
                    if "asInt" in point:
                        point["asDouble"] = "NaN"
                        del point["asInt"]
    return json.dumps(body)


def test_nan_values_are_data_the_report_draws_a_diverged_run_and_skips_nan_step_counts(
    good_lines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A diverged loss from the third line on: kept by the reader, drawn (the line stops there), nothing skipped.
    path = tmp_path / "good1.jsonl"
    lines = [*good_lines[:2], *(_with_nan(line, {_LOSS, "openlora.training.loss.max"}) for line in good_lines[2:])]
    path.write_text("".join(line + "\n" for line in lines))
    reader = read_history(path)
    snapshots = list(reader)
    assert reader.skipped == 0 and len(snapshots) == 5
    assert math.isnan(snapshots[-1].value(_LOSS) or 0.0) and snapshots[-1].value(_STEPS) == 20
    (run,) = read_runs([str(path)])
    loss = curves(run.rows)["loss"]
    assert [s for s, _ in loss] == [5, 10, 15, 20] and [math.isnan(v) for _, v in loss] == [False] * 2 + [True] * 2
    assert run_report(str(path), "--out", str(tmp_path) + "/") == 0
    out, err = capsys.readouterr()
    assert "20 steps" in out and "skipped" not in err
    assert "Loss" in out and (tmp_path / "openlora-report.html").read_text().count('<div class="chart"') >= 1

    # Every double NaN, the step count too, in one line among good ones: kept, but no step to draw it at.
    lines = [good_lines[0], _with_nan(good_lines[1]), *good_lines[2:]]
    path.write_text("".join(line + "\n" for line in lines))
    assert len(list(read_history(path))) == 5
    assert run_report(str(path), "--out", str(tmp_path) + "/") == 0
    assert "run good1 (good): 20 steps" in capsys.readouterr().out

    # Only NaN step counts: nothing to draw against, said as for a run without steps (exit 2, no traceback).
    path.write_text("".join(_with_nan(line) + "\n" for line in good_lines))
    assert run_report(str(path), "--out", str(tmp_path) + "/") == 2
    assert "no training steps in" in capsys.readouterr().err


def test_run_selection_output_paths_and_usage_errors(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_report(str(two_runs), "--run", "b", "--format", "html") == 0
    assert (tmp_path / "openlora-report.html").exists() and not (tmp_path / "openlora-report.png").exists()
    assert "a (lr" not in (tmp_path / "openlora-report.html").read_text()
    assert run_report(str(two_runs), "--out", str(tmp_path / "cmp.png")) == 0
    assert (tmp_path / "cmp.png").exists() and (tmp_path / "cmp.html").exists()
    capsys.readouterr()

    assert run_report(str(two_runs), "--run", "nope") == 2
    err = capsys.readouterr().err
    assert "no run 'nope' in" in err and "aaaa1111 (a), bbbb2222 (b)" in err
    assert run_report(str(tmp_path / "missing")) == 2
    assert "missing: no such file or directory" in capsys.readouterr().err
    assert run_report(str(two_runs), "--out", str(tmp_path / "no" / "such" / "dir" / "x.png")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert run_report(str(two_runs), "--out", f"{tmp_path / 'new' / 'dir'}/", "--format", "png") == 0
    assert (tmp_path / "new" / "dir" / "openlora-report.png").exists()
    for argv, message in (
        ([str(two_runs), "--format", "pdf"], "argument --format: 'pdf' is not valid: expected png, html"),
        ([], "nothing to draw"),
        (["--prometheus", "http://127.0.0.1:9"], "--prometheus needs --run"),
    ):
        with pytest.raises(SystemExit) as info:
            run_report(*argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_without_matplotlib_the_error_names_the_extra(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run_report(str(two_runs), "--out", str(tmp_path)) == 2
    assert "pip install 'openlora-otel[report]'" in capsys.readouterr().err


def test_legend_shows_only_what_differs_and_tells_same_names_apart() -> None:
    def run(run_id: str, name: str, **hparams: str) -> Run:
        return Run(run_id, name, hparams, "test", [Row(0.0, {"steps": 1.0, "loss": 1.0})])

    runs = [
        run("1111aaaa2222", "sweep", learning_rate="0.001", lora_r="8", seed="0"),
        run("3333bbbb4444", "sweep", learning_rate="0.001", lora_r="16", seed="0"),
        run("5555cccc6666", "other", learning_rate="0.002", lora_r="16", seed="0"),
    ]
    assert legend_labels(runs) == [
        "sweep [1111aaaa] (lr=0.001, r=8)",
        "sweep [3333bbbb] (lr=0.001, r=16)",
        "other (lr=0.002, r=16)",
    ]
    assert legend_labels(runs[:1]) == ["sweep (lr=0.001, r=8)"]  # one run: what it was


def test_a_diverged_run_is_marked_in_the_table_and_on_the_loss_panel() -> None:
    """A run gone NaN: its mean loss stays finite (the NaN steps are left out of it), so the last loss
    alone looked healthy. The non-finite counter says by which step it went, in the table and as a
    line on the loss panel; a healthy run beside it has neither."""
    pytest.importorskip("matplotlib")
    from openlora_otel.report.page import html_page
    from openlora_otel.report.summary import LAST_LOSS

    diverged = Run("a1", "lr-too-high", {"learning_rate": "0.3"}, "a.jsonl")
    healthy = Run("b2", "lr-ok", {"learning_rate": "0.001"}, "b.jsonl")
    for step in (10, 20, 30):
        diverged.rows.append(
            Row(float(step), {"steps": float(step), "loss": 2.0, "loss_nonfinite": 0.0 if step < 30 else 4.0})
        )
        healthy.rows.append(Row(float(step), {"steps": float(step), "loss": 1.5, "loss_nonfinite": 0.0}))
    drawing = prepare([diverged, healthy])
    assert [s.nonfinite_from for s in drawing.summaries] == [30.0, None]
    assert drawing.summaries[0].last_loss_text == "2 (non-finite by step 30)"
    assert drawing.summaries[1].last_loss_text == "1.5"
    page = html_page(drawing)
    assert f"<th>{LAST_LOSS}</th>" in page and "2 (non-finite by step 30)" in page
    # The diagnosis section: the diverged run's finding, nothing for the healthy one.
    section = page[page.index('<section id="diagnosis">') : page.index("</section>", page.index('<section id="diagnosis">'))]
    assert "lr-too-high" in section and "[critical]</strong> the loss went non-finite at step 27" in section
    assert "lr-ok" not in section and "runbooks/#openloralossnonfinite" in section
    assert '<section id="diagnosis">' not in html_page(prepare([healthy]))
    figure = png_figure(drawing)
    loss_axes = [ax for ax in figure.axes if ax.get_title(loc="left") == "Loss"]
    marks = [line for ax in loss_axes for line in ax.get_lines() if line.get_gid() == "nonfinite"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [30.0, 30.0]
    assert any("non-finite loss by step 30" in text.get_text() for ax in loss_axes for text in ax.texts)


def test_curves_keep_an_evaluation_that_ends_after_the_last_step() -> None:
    rows = [
        Row(1.0, {"steps": 10.0, "loss": 2.0, "eval_loss": 2.5}),
        Row(2.0, {"steps": 20.0, "loss": 1.5, "eval_loss": 2.5}),
        Row(3.0, {"steps": 20.0, "loss": 1.5, "eval_loss": 1.9}),  # final evaluation, no new step
        Row(4.0, {"steps": 20.0, "loss": 1.5, "eval_loss": 1.9}),  # lingering: repeats
    ]
    c = curves(rows)
    assert c["loss"] == [(10.0, 2.0), (20.0, 1.5)]
    assert c["eval_loss"] == [(10.0, 2.5), (20.0, 1.9)]


def test_throughput_is_tokens_over_the_time_between_points_when_a_step_outlasts_a_collection() -> None:
    # Lines every 0.2 s, a step every 8 s of 1,024 tokens: the first line after a step has 1,024 tokens
    # in its 0.2 s (a per-interval gauge says 5,120 tokens/s); the run made 128 tokens/s.
    rows = []
    for step in range(1, 4):
        for tick in range(40):
            rows.append(Row(step * 8.0 + tick * 0.2, {"steps": float(step), "tokens": 1024.0 * step}))
    c = curves(rows)
    assert c["tokens_per_s"] == [(2.0, pytest.approx(128.0)), (3.0, pytest.approx(128.0))]


def test_throughput_is_steady_when_the_lines_and_the_steps_do_not_line_up() -> None:
    # A step every 0.15 s of 100 tokens (667 tokens/s, steady), a line every 0.2 s (the docs'
    # OPENLORA_HISTORY_INTERVAL=200): lines see one or two new steps in turn. Over the lines' own
    # times that reads 500 and 1,000 tokens/s in turn; over the steps' times it is the real rate.
    rows = []
    for tick in range(1, 60):
        now = tick * 0.2
        steps = math.floor(now / 0.15 + 1e-9)
        rows.append(
            Row(now, {"steps": float(steps), "tokens": 100.0 * steps, "last_step_time": 1e9 + steps * 0.15})
        )
    rates = [rate for _, rate in curves(rows)["tokens_per_s"]]
    assert len(rates) > 40
    assert min(rates) == pytest.approx(100 / 0.15) and max(rates) == pytest.approx(100 / 0.15)


# -- headless Chromium ---------------------------------------------------------------------------
@pytest.mark.e2e
def test_html_page_in_headless_chromium(two_runs: Path, tmp_path: Path) -> None:
    chromium()
    out = tmp_path / "page"
    out.mkdir()
    assert run_report(str(two_runs), "--out", str(out), "--format", "html") == 0
    url = (out / "openlora-report.html").as_uri()

    dom = headless(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for heading in ["Runs", *CPU_PANELS]:
        assert f"<h2>{heading}</h2>" in dom.stdout
    assert dom.stdout.count("<canvas") == len(CPU_PANELS)  # the script drew a uPlot chart per panel
    assert "<strong>a</strong>" in dom.stdout and "<strong>b</strong>" in dom.stdout
    assert "Loss: a (lr=0.003); b (lr=0.001)" in dom.stdout

    shot = tmp_path / "shot.png"
    result = headless(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", url)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(shot)[:, :, :3]
    assert pixels.shape[:2] == (2000, 1400)
    ink = (pixels < 0.9).any(axis=2).mean()
    assert ink > 0.02, f"the screenshot is almost blank ({ink:.1%} of pixels not white)"
    # Both runs' colours are on screen (the swatches in the table and the curves).
    for color in ((0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28)):
        near = (abs(pixels * 255 - color) < 12).all(axis=2).sum()
        assert near > 200, f"colour {color} hardly on screen ({near} pixels)"


# -- a real Prometheus scraping real demo runs ---------------------------------------------------
@pytest.mark.process
def test_report_from_the_history_files_of_two_real_demo_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/how-to/run-history.md's commands: two demo runs with another learning rate each, no server, then the report."""
    needs_the_demo()
    history = tmp_path / "runs"
    env = {
        "OPENLORA_HISTORY_DIR": str(history),
        "OPENLORA_HISTORY_INTERVAL": "200",
        "OTEL_METRICS_EXPORTER": "none",
    }
    common = ("--steps", "60", "--eval-every", "20", "--quiet")
    demos = {
        name: demo_process(*common, "--run-name", name, "--lr", lr, env=env)
        for name, lr in (("a", "3e-3"), ("b", "1e-3"))
    }
    printed = {}
    try:
        for name, demo in demos.items():
            stdout, stderr = demo.communicate(timeout=600)
            assert demo.returncode == 0, stderr[-3000:]
            printed[name] = stdout
    finally:
        for demo in demos.values():
            if demo.poll() is None:
                demo.kill()
            reap(demo, 10)
    runs = {run.name: run for run in read_runs([str(history)])}
    assert set(runs) == {"a", "b"}
    for name, stdout in printed.items():
        run = runs[name]
        assert f"run {run.run_id} ({name}): 60 steps" in stdout
        # "eval loss 3.495 -> 2.718 (best ...)": the report's last eval point is that final evaluation.
        final_eval = float(re.search(r"eval loss [\d.]+ -> ([\d.]+)", stdout).group(1))
        c = curves(run.rows)
        assert c["eval_loss"][-1] == (60, pytest.approx(final_eval, abs=5e-4))
        # An evaluation shows at the step count of the first collection after it (a step or two late).
        first, second = (x for x, _ in c["eval_loss"][1:3])
        assert 20 <= first < 40 <= second < 60
        assert c["loss"][-1][0] == 60 and len(c["loss"]) >= 10  # a line a fifth of a second
        assert c["step_time"] and c["tokens_per_s"] and c["grad_norm"] and c["learning_rate"]
        assert run.hyperparameters["base_model"] == "tiny-llama"
    assert (runs["a"].hyperparameters["learning_rate"], runs["b"].hyperparameters["learning_rate"]) == (
        "0.003",
        "0.001",
    )
    assert sorted(legend_labels(list(runs.values()))) == ["a (lr=0.003)", "b (lr=0.001)"]

    out = tmp_path / "out"
    out.mkdir()
    assert run_report(str(history), "--out", str(out)) == 0
    # The demo records the perplexity of each evaluation too: its own panel, after the loss.
    assert "panels: Loss, Eval perplexity, Gradient norm, Learning rate, Throughput, Step time" in (
        capsys.readouterr().out
    )
    page = (out / "openlora-report.html").read_text()
    assert "<strong>learning_rate=0.003</strong>" in page and "<strong>learning_rate=0.001</strong>" in page
    assert (out / "openlora-report.png").stat().st_size > 50_000


@pytest.mark.e2e
def test_report_from_prometheus_that_scraped_two_real_demo_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prometheus_binary()
    needs_the_demo()
    ports = free_port(), free_port()
    # Small steps, each at least 50 ms long (the data delay): a few seconds of training on any machine,
    # so Prometheus takes a dozen scrapes or more of each run.
    common = (
        "--steps",
        "60",
        "--batch-size",
        "2",
        "--eval-every",
        "20",
        "--data-delay-ms",
        "50",
        "--linger",
        "300",
    )
    history = tmp_path / "runs"
    demos = [
        demo_process(
            *common,
            "--run-name",
            name,
            "--lr",
            lr,
            env={
                "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
                "OPENLORA_HISTORY_DIR": str(history),  # the same runs in files too
            },
        )
        for port, name, lr in ((ports[0], "a", "3e-3"), (ports[1], "b", "1e-3"))
    ]
    prometheus = None
    try:
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{p}" for p in ports], scrape_interval="250ms")
        for demo in demos:
            wait_for_line(demo.stderr, "keeping the final values", timeout=300)
        done = time.time()
        for port in ports:
            # Scrapes a second after the final evaluation: the last values are in Prometheus.
            assert prometheus.wait_for(
                f'timestamp(openlora_training_eval_loss{{instance="127.0.0.1:{port}"}}) > {done + 1}',
                timeout=30,
            )
        (target_b,) = prometheus.query(f'target_info{{instance="127.0.0.1:{ports[1]}"}}')
        run_id_b = target_b["metric"]["openlora_run_id"]

        # By name for one, by id for the other.
        runs = read_prometheus(prometheus.url, ["a", run_id_b])
        assert [run.name for run in runs] == ["a", "b"]
        assert runs[1].run_id == run_id_b
        assert legend_labels(runs) == ["a (lr=0.003)", "b (lr=0.001)"]
        for run in runs:
            c = curves(run.rows)
            assert max(x for x, _ in c["loss"]) == 60
            assert [x for x, _ in c["eval_loss"]][-1] == 60
            assert len(c["loss"]) >= 5, c["loss"]  # a curve, not a point
            assert c["loss"][-1][1] < c["loss"][0][1]
            assert c["learning_rate"] and c["tokens_per_s"] and c["step_time"] and c["grad_norm_max"]
        # The last eval loss is the demo's own final evaluation.
        final_b = prometheus.query(f'openlora_training_eval_loss{{instance="127.0.0.1:{ports[1]}"}}')
        assert curves(runs[1].rows)["eval_loss"][-1][1] == pytest.approx(float(final_b[0]["value"][1]))
        # The same runs read from their history files say the same.
        from_files = {run.run_id: run for run in read_runs([str(history)])}
        assert set(from_files) == {run.run_id for run in runs}
        for run in runs:
            twin = from_files[run.run_id]
            assert (twin.name, twin.hyperparameters) == (run.name, run.hyperparameters)
            here, there = curves(run.rows), curves(twin.rows)
            assert here["eval_loss"][-1] == pytest.approx(there["eval_loss"][-1])
            assert here["loss"][-1][0] == there["loss"][-1][0] == 60

        out = tmp_path / "out"
        out.mkdir()
        assert (
            run_report("--prometheus", prometheus.url, "--run", "a", "--run", run_id_b, "--out", str(out))
            == 0
        )
        printed = capsys.readouterr().out
        assert "panels: Loss, Gradient norm, Learning rate, Throughput, Step time" in printed
        assert (out / "openlora-report.png").stat().st_size > 50_000
        assert 'aria-label="Loss: a (lr=0.003); b (lr=0.001)"' in (out / "openlora-report.html").read_text()

        # A run that is not there: a clear error naming it and the server, exit status 2.
        assert run_report("--prometheus", prometheus.url, "--run", "no-such-run", "--out", str(out)) == 2
        err = capsys.readouterr().err
        assert f"no run 'no-such-run' on Prometheus at {prometheus.url}" in err
    finally:
        if prometheus:
            prometheus.stop()
        for demo in demos:
            demo.terminate()
            reap(demo, 20)
            demo.stdout.close()
            demo.stderr.close()


def test_unreachable_prometheus_is_a_clear_error_without_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://reader:s3cret-pass@127.0.0.1:{free_port()}"
    assert run_report("--prometheus", url, "--run", "x", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "cannot reach Prometheus at http://<redacted>@127.0.0.1:" in err
    assert "s3cret" not in err


def test_promql_reads_one_process_on_both_paths() -> None:
    by_key = {q.key: q for q in QUANTITIES}
    selector = 'job="j", instance="i"'
    assert by_key["loss"].promql(selector) == 'max(openlora_training_loss{job="j", instance="i"})'
    assert by_key["step_time_count"].promql(selector) == (
        'max(openlora_training_step_duration_seconds_count{job="j", instance="i"})'
    )
    # Unit-1 gauges of the semantic conventions get _ratio through the Collector: both names match.
    assert by_key["gpu_utilization"].promql(selector) == (
        'avg({__name__=~"hw_gpu_utilization|hw_gpu_utilization_ratio", job="j", instance="i", '
        'hw_gpu_task="general"})'
    )
    assert PrometheusSource("127.0.0.1:9090").shown == "127.0.0.1:9090"


@pytest.mark.process
def test_the_command_line_writes_both_files_next_to_each_other(two_runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "report", str(two_runs)],
        cwd=out,
        env=child_env(PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["openlora-report.html", "openlora-report.png"]
    assert "run aaaa1111 (a): 60 steps" in result.stdout
    help_text = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "report", "--help"],
        env=child_env(PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "openlora-report.png and openlora-report.html in the current directory" in " ".join(
        help_text.split()
    )

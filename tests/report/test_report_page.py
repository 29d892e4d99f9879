"""The report's interactive page and its options: uPlot charts from the curves as JSON, the eval metrics'
panels, a diverged run marked, ``--x`` and ``--smooth``; the page in headless Chromium with no request
leaving it."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from openlora_otel import setup_telemetry
from openlora_otel.commands import report as report_command
from openlora_otel.report.history_source import read_runs
from openlora_otel.report.model import Row, Run, curves, divergence, smooth, step_times
from tests.support.chromium import chromium, headless, page_requests
from tests.support.history_files import history_config


def write_run(directory: Path, run_id: str, lr: float, *, nan_from: int | None = None, steps: int = 40) -> None:
    """A run through the real history writer: a line every 5 steps, an evaluation (loss, accuracy,
    perplexity) every 10, the loss NaN from ``nan_from`` on."""
    config = history_config(directory, quiet=True)
    telemetry = setup_telemetry(
        run_id=run_id, run_name=run_id, hyperparameters={"learning_rate": lr}, config=config
    )
    try:
        for step in range(1, steps + 1):
            loss = 0.5 + 3.0 * math.exp(-step * lr * 30)
            telemetry.training.record_step(
                loss=math.nan if nan_from is not None and step >= nan_from else loss,
                grad_norm=1.0,
                learning_rate=lr,
                tokens=1024,
                step_time_s=0.05,
            )
            if step % 10 == 0:
                telemetry.training.record_eval(loss=loss + 0.1, accuracy=step / 50, perplexity=math.exp(loss))
            if step % 5 == 0:
                telemetry.force_flush()
    finally:
        telemetry.shutdown()


def run_report(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="openlora-otel")
    report_command.add_parser(parser.add_subparsers(dest="command"))
    return report_command.run(parser.parse_args(["report", *argv]))


def page_json(page: str) -> dict[str, Any]:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.DOTALL)
    assert match, "no data in the page"
    return json.loads(match.group(1))


@pytest.fixture
def history(tmp_path: Path) -> Path:
    directory = tmp_path / "history"
    directory.mkdir()
    write_run(directory, "healthy", 3e-3)
    write_run(directory, "diverged", 1e-3, nan_from=23)
    return directory


# -- smoothing ---------------------------------------------------------------------------------
def test_smoothing_is_tensorboards_debiased_ema_and_leaves_non_finite_values_alone() -> None:
    points = [(1.0, 1.0), (2.0, 2.0), (3.0, math.nan), (4.0, 4.0)]
    w = 0.5
    # s1 = 0.5; s2 = 0.25 + 1 = 1.25; s3 = 0.625 + 2 = 2.625, debiased by 1 - w**k (k finite values so far).
    out = smooth(points, w)
    assert [x for x, _ in out] == [1.0, 2.0, 3.0, 4.0]
    assert out[0][1] == pytest.approx(1.0)  # debiased: starts at the first value
    assert out[1][1] == pytest.approx(1.25 / 0.75)
    assert math.isnan(out[2][1])
    assert out[3][1] == pytest.approx(2.625 / 0.875)
    assert smooth(points[:2], 0.0) == points[:2]
    assert [y for _, y in smooth([(i, 3.0) for i in range(5)], 0.9)] == pytest.approx([3.0] * 5)
    with pytest.raises(ValueError):
        smooth(points, 1.0)


def test_smooth_and_x_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--smooth", "1"], ["--smooth", "-0.1"], ["--smooth", "x"], ["--x", "wall"]):
        with pytest.raises(SystemExit):
            run_report(str(tmp_path), *bad)
        assert "--" in capsys.readouterr().err


# -- divergence ---------------------------------------------------------------------------------
def test_divergence_names_each_event_by_its_first_step_and_what_stopped_the_run() -> None:
    rows = [
        Row(float(step), {
            "steps": float(step),
            "loss_nonfinite": 0.0 if step < 30 else 2.0,
            "grad_norm_nonfinite": 0.0 if step < 40 else 1.0,
            "guard_trips_nonfinite_loss": 0.0 if step < 40 else 1.0,
        })
        for step in (10, 20, 30, 40)
    ]
    found = divergence(rows, "stopped_by_guard")
    assert found is not None and found.step == 30.0
    assert found.text == (
        "non-finite loss by step 30; non-finite gradient norm by step 40; "
        "guard tripped (nonfinite_loss) by step 40; stopped by the divergence guard"
    )
    assert divergence(rows[:2], "finished") is None
    only = divergence([], "stopped_by_guard")
    assert only is not None and only.step is None and only.text == "stopped by the divergence guard"


# -- the page's data ------------------------------------------------------------------------------
def test_page_data_round_trips_eval_panels_and_the_diverged_mark(history: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from openlora_otel.report.drawing import prepare
    from openlora_otel.report.page import page_data

    runs = read_runs([str(history)])
    assert [run.name for run in runs] == ["healthy", "diverged"]
    assert [run.outcome for run in runs] == ["finished", "finished"]
    out = tmp_path / "r.html"
    assert run_report(str(history), "--out", str(out), "--format", "html") == 0
    page = out.read_text()
    data = page_json(page)
    assert data == json.loads(json.dumps(page_data(prepare(runs)), allow_nan=False))
    titles = [panel["title"] for panel in data["panels"]]
    assert titles[:3] == ["Loss", "Eval accuracy", "Eval perplexity"]
    assert page.count('<div class="chart"') == len(titles)
    accuracy = data["panels"][1]["lines"][0]["runs"][0]
    assert accuracy[0] == [10.0, 20.0, 30.0, 40.0] and accuracy[2] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    # The data is the curves: steps, the times they were reached, values; NaN as null.
    loss = data["panels"][0]["lines"][0]["runs"]
    for run, points in zip(runs, loss, strict=True):
        expected = curves(run.rows)["loss"]
        times = step_times(run.rows)
        assert points[0] == [s for s, _ in expected]
        assert points[1] == [round(times[s], 3) for s, _ in expected]
        assert points[2] == [None if math.isnan(v) else pytest.approx(v) for _, v in expected]
    # The mean loss leaves the NaN steps out (and has no value once every step of a line is NaN): the
    # mark, not the line, says where it went.
    healthy, diverged = data["runs"]
    assert healthy["mark"] is None
    assert diverged["mark"]["step"] == 25.0  # the first line after step 23
    assert diverged["mark"]["text"] == "diverged: non-finite loss by step 25; run finished"
    assert "<strong>diverged</strong> diverged: non-finite loss by step 25; run finished" in page


def test_names_cannot_break_out_of_the_script(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from openlora_otel.report.drawing import prepare
    from openlora_otel.report.page import html_page

    name = "</script><script>alert(1)</script> & \u2028"
    rows = [Row(float(s), {"steps": float(s), "loss": v}) for s, v in ((1, 1.0), (2, math.nan), (3, math.inf))]
    page = html_page(prepare([Run("r1", name, {}, "x.jsonl", rows=rows)]))
    assert page.count("</script>") == 3 and "alert(1)</script>" not in page
    data = page_json(page)
    assert data["runs"][0]["name"] == name
    assert data["panels"][0]["lines"][0]["runs"][0][2] == [1.0, None, None]  # not finite: null, a gap


def test_x_by_time_uses_the_step_timestamps_on_the_png_and_the_page(history: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.dates import ConciseDateFormatter, num2date

    from openlora_otel.report.drawing import prepare
    from openlora_otel.report.png import png_figure

    runs = read_runs([str(history)])
    drawing = prepare(runs, x="time", smoothing=0.6)
    times = step_times(runs[0].rows)
    assert times and all(abs(t - runs[0].rows[0].time_s) < 600 for t in times.values())
    figure = png_figure(drawing)
    (ax,) = [ax for ax in figure.axes if ax.get_title(loc="left") == "Loss"]
    assert isinstance(ax.xaxis.get_major_formatter(), ConciseDateFormatter)
    assert ax.get_xlabel() == "wall time (UTC)"
    raw = [line for line in ax.get_lines() if line.get_gid() == "raw"]
    assert len(raw) == 4  # mean and max loss of both runs, faint behind their smoothed lines
    first = num2date(raw[0].get_xdata(orig=False)[0]).timestamp()
    assert first == pytest.approx(times[min(times)], abs=1e-3)
    out = tmp_path / "t.html"
    assert run_report(str(history), "--out", str(out), "--format", "html", "--x", "time", "--smooth", "0.6") == 0
    data = page_json(out.read_text())
    assert data["x"] == "time" and data["smooth"] == 0.6
    elapsed = prepare(runs, x="elapsed").x_of(0)
    assert elapsed(min(times)) == 0.0


# -- headless Chromium ----------------------------------------------------------------------------
@pytest.mark.e2e
def test_the_page_draws_its_charts_in_headless_chromium_and_asks_for_nothing(history: Path, tmp_path: Path) -> None:
    chromium()
    pytest.importorskip("matplotlib")
    out = tmp_path / "page"
    out.mkdir()
    assert run_report(str(history), "--out", str(out), "--format", "html", "--smooth", "0.5") == 0
    page = (out / "openlora-report.html").read_text()
    panels = page_json(page)["panels"]
    netlog = tmp_path / "netlog.json"
    result = headless(
        tmp_path,
        f"--log-net-log={netlog}",
        "--window-size=1200,900",
        "--dump-dom",
        (out / "openlora-report.html").as_uri(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    # The script ran: one uPlot chart (a canvas) per panel, in its panel's box.
    assert f'data-charts="{len(panels)}"' in dom
    assert dom.count("<canvas") == len(panels)
    for panel in panels:
        box = dom[dom.index(f'id="chart-{panel["key"]}"') :]
        assert box.index("<canvas") < box.index("</figure>"), panel["key"]
    # Hover values: uPlot's legend, a row per series (raw and smoothed loss of both runs among them).
    assert "healthy (lr=0.003): train (mean per interval) (smoothed)" in dom
    assert "diverged (lr=0.001): train (mean per interval) (raw)" in dom
    # The diverged run's mark: on every panel, its text on the loss panel.
    assert dom.count('class="mark"') == len(panels)
    assert dom.count("diverged: non-finite loss by step 25; run finished</span>") == 1
    assert page_requests(netlog) == []


def test_the_netlog_check_sees_a_page_that_asks_for_something(tmp_path: Path) -> None:
    """The check above is not vacuous: a request a page makes has an initiator in the log."""
    netlog = tmp_path / "netlog.json"
    events = [
        {"type": 7, "params": {"url": "https://update.example/x", "initiator": "not an origin"}},
        {"type": 7, "params": {"url": "http://127.0.0.1:9/x.png", "initiator": "null"}},
        {"type": 8, "params": {"url": "http://127.0.0.1:9/y"}},
    ]
    netlog.write_text(json.dumps({"constants": {"logEventTypes": {"URL_REQUEST_START_JOB": 7}}, "events": events}))
    assert page_requests(netlog) == ["http://127.0.0.1:9/x.png"]


def test_the_vendored_chart_library_is_package_data_with_its_licence() -> None:
    from importlib import resources

    from openlora_otel.report.page import UPLOT_VERSION

    folder = resources.files("openlora_otel.report").joinpath("vendor", "uplot")
    assert folder.joinpath("uPlot.iife.min.js").read_text().startswith(f"/*! https://github.com/leeoniya/uPlot (v{UPLOT_VERSION})")
    assert "MIT License" in folder.joinpath("LICENSE").read_text()
    assert UPLOT_VERSION in folder.joinpath("README.md").read_text()


def test_the_pages_own_style_and_script_are_package_data_inlined_unchanged() -> None:
    pytest.importorskip("matplotlib")
    from importlib import resources

    from openlora_otel.report.drawing import prepare
    from openlora_otel.report.page import html_page

    folder = resources.files("openlora_otel.report").joinpath("assets")
    css, script = folder.joinpath("page.css").read_text(), folder.joinpath("page.js").read_text()
    page = html_page(prepare([Run("r1", "one", {}, "x.jsonl", rows=[Row(1.0, {"steps": 1.0, "loss": 1.0})])]))
    assert f"<style>\n{css}</style>" in page
    assert f"<script>\n{script}</script>" in page
    assert 'document.getElementById("report-data")' in script

def test_a_run_the_guard_stopped_says_so_from_its_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real guard trips on the NaN losses; the history's counters and outcome make the mark's text."""
    import time

    from openlora_otel.training.guard import DivergenceGuard

    config = history_config(tmp_path, quiet=True)
    telemetry = setup_telemetry(run_id="g1", run_name="guarded", config=config)
    try:
        guard = telemetry.training.attach_guard(DivergenceGuard(nonfinite_losses=1, check_interval_s=0.05))
        for step in range(1, 11):
            telemetry.training.record_step(loss=math.nan if step >= 6 else 1.0, grad_norm=1.0, tokens=10)
            if step % 5 == 0:
                telemetry.force_flush()
        deadline = time.monotonic() + 30
        while not guard.tripped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.tripped
    finally:
        telemetry.shutdown()
    (run,) = read_runs([str(tmp_path)])
    assert run.outcome == "stopped_by_guard"
    assert run_report(str(tmp_path), "--out", str(tmp_path) + "/", "--format", "html") == 0
    expected = "non-finite loss by step 10; guard tripped (nonfinite_loss) by step 10; stopped by the divergence guard"
    assert f"  diverged: {expected}" in capsys.readouterr().out
    assert page_json((tmp_path / "openlora-report.html").read_text())["runs"][0]["mark"]["text"] == f"guarded: {expected}"

"""`openlora-otel report --adapter NAME`: a served adapter's training run next to its serving latency,
tokens/s and energy per token. The queries and the summary here; one end-to-end test trains and saves a
demo adapter, serves it, lets a real Prometheus (with the shipped rules) scrape it and reports on it."""

from __future__ import annotations

import io
import json
import re
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from openlora_otel.cli import main as cli_main
from openlora_otel.report.model import ReportError, Row, Run
from openlora_otel.report.serving import (
    INFO,
    NO_ENERGY,
    POWER,
    AdapterServing,
    ServedAdapter,
    curve_queries,
    find_adapter,
    parse_duration,
    rate_window,
    summarize_serving,
    summary_lines,
    summary_queries,
)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "openlora_otel" / "rules" / "openlora.yml"
ADAPTER = ServedAdapter(
    "support-v2",
    run_id="5f0c1234",
    run_name="support",
    base_model="tiny-llama",
    base_fingerprint="1f6863a30e0c1f84",
    final_eval_loss="3.14979",
    servers=("127.0.0.1:9464",),
)


def report(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli_main(["report", *argv])
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


# -- queries -------------------------------------------------------------------------------------
def test_the_queries_are_the_dashboards_scoped_to_the_adapter_of_its_training_run() -> None:
    queries = curve_queries(ADAPTER, "60s")
    scope = (
        " * on (job, instance, openlora_adapter_name) group_left () group by (job, instance, openlora_adapter_name) "
        f'(last_over_time({INFO}{{openlora_adapter_name="support-v2", openlora_training_run_id="5f0c1234"}}[60s]))'
    )
    # Classic buckets or (exponential histograms in Prometheus 3) native ones.
    assert queries["latency_p95"] == (
        "histogram_quantile(0.95, sum by (le) (rate(gen_ai_server_request_duration_seconds_bucket"
        f'{{openlora_adapter_name="support-v2", error_type=""}}[60s]){scope}) or sum (rate(gen_ai_server_request_duration_seconds'
        f'{{openlora_adapter_name="support-v2", error_type=""}}[60s]){scope}))'
    )
    assert queries["ttft_p50"].startswith(
        'histogram_quantile(0.5, sum by (le) (rate(gen_ai_server_time_to_first_token_seconds_bucket{openlora_adapter_name="support-v2"}[60s])'
    )
    assert queries["tokens_per_s"] == (
        'sum(rate(openlora_inference_token_usage_sum{openlora_adapter_name="support-v2", '
        f'gen_ai_token_type="output"}}[60s]){scope})'
    )
    # Joules per output token: the adapter's power from the energy rules over its tokens/s, both over 2 m.
    assert queries["joules_per_token"] == f"{queries['power_w']} / ({queries['tokens_per_s_2m']} > 0)"
    assert queries["power_w"].startswith(f'sum({POWER}{{openlora_adapter_name="support-v2"}}')
    recorded = {r.get("record") for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert POWER in recorded
    # The same series the inference dashboard reads.
    dashboard = (ROOT / "grafana" / "dashboards" / "openlora-inference.json").read_text()
    for series in re.findall(r"\b([a-z_:]+)(?:\{|\[)", " ".join(queries.values())):
        if series not in ("last_over_time", "rate", "sum", "group", "histogram_quantile", "by", "le"):
            assert series in dashboard, series
    # An adapter without a training run: its info series without one.
    assert 'openlora_training_run_id=""' in curve_queries(ServedAdapter("x"), "60s")["tokens_per_s"]
    # The range's figures: over the whole range, evaluated at its end.
    totals = summary_queries(ADAPTER, 3599.5)
    assert totals["requests"].startswith(
        'sum(increase(gen_ai_server_request_duration_seconds_count{openlora_adapter_name="support-v2"}[3600s])'
    )
    assert 'error_type!=""' in totals["failed"] and "increase(" in totals["latency_p50"]
    assert "[3600s]))" in totals["output_tokens"]


def test_the_rate_window_spans_two_points_and_at_least_a_minute() -> None:
    assert rate_window(1.0) == "60s"
    assert rate_window(172.8) == "346s"


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90s", "30m", "2h", "1d", "1w", "1.5h")] == [
        90, 1800, 7200, 86400, 604800, 5400,
    ]  # fmt: skip
    for bad in ("", "1", "h", "-1h", "0m", "1y", "nanh"):
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(bad)


# -- the summary -----------------------------------------------------------------------------------
def test_the_summary_over_the_range() -> None:
    curves = {
        "tokens_per_s": [(0.0, 0.0), (10.0, 20.0), (20.0, 40.0), (30.0, float("nan"))],
        "power_w": [(10.0, 100.0), (20.0, 300.0)],
        "tokens_per_s_2m": [(10.0, 10.0), (20.0, 30.0), (30.0, 5.0)],
    }
    totals = {"requests": 12.0, "failed": 2.0, "latency_p50": 0.25, "latency_p95": 1.5, "ttft_p50": 0.03,
              "ttft_p95": float("nan"), "output_tokens": 96.0}  # fmt: skip
    summary = summarize_serving(curves, totals)
    assert (summary.tokens_per_s, summary.tokens_per_s_peak) == (30.0, 40.0)  # points with traffic
    assert summary.joules_per_token == pytest.approx(400 / 40)  # energy over tokens at the same times
    assert summary.ttft_p95 is None  # NaN: no data
    serving = AdapterServing(ADAPTER, start=0.0, end=3600.0, curves=curves, summary=summary)
    lines = summary_lines(serving)
    assert lines[0] == (
        "adapter support-v2: trained by run 5f0c1234 (support), base model tiny-llama (fingerprint "
        "1f6863a30e0c1f84), final eval loss 3.14979, served by 127.0.0.1:9464"
    )
    text = "\n".join(lines)
    assert "from 1970-01-01 00:00:00 UTC to 1970-01-01 01:00:00 UTC: 12 requests (2 failed)" in text
    assert "request latency p50 250 ms, p95 1.50 s; time to first token p50 30 ms, p95 n/a" in text
    assert "output tokens 96, 30.0 tokens/s while serving (peak 40.0)" in text
    assert "energy per output token: 10 J" in text
    # No GPU energy: said, not a zero.
    bare = summarize_serving({"tokens_per_s": curves["tokens_per_s"]}, totals)
    assert bare.joules_per_token is None
    text = "\n".join(summary_lines(AdapterServing(ServedAdapter("other"), 0.0, 60.0, summary=bare, notes=["n1"])))
    assert "adapter other: no training run recorded, final eval loss n/a" in text
    assert f"energy per output token: {NO_ENERGY}" in text and "  note: n1" in text


class _Source:
    """Answers find_adapter's three questions from canned label sets."""

    shown = "http://prom"

    def __init__(self, in_range: list[dict[str, Any]], stored: list[dict[str, str]], names: list[str]) -> None:
        self.in_range, self.stored, self.names = in_range, stored, names

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.in_range

    def series(self, match: str) -> list[dict[str, str]]:
        return self.stored

    def get(self, path: str, params: list[tuple[str, str]]) -> Any:
        assert path == "/api/v1/label/openlora_adapter_name/values" and params == [("match[]", INFO)]
        return self.names


def _info(run_id: str, instance: str, last: float) -> dict[str, Any]:
    labels = {"__name__": INFO, "job": "serve", "instance": instance, "openlora_adapter_name": "a1",
              "openlora_training_run_id": run_id, "openlora_training_run_name": "a1",
              "openlora_adapter_base_model": "tiny-llama", "openlora_training_final_eval_loss": "3.15"}  # fmt: skip
    return {"metric": labels, "values": [[last - 10, "1"], [last, "1"]]}


def test_the_adapter_is_found_by_its_info_series_the_latest_run_first() -> None:
    source = _Source([_info("old", "h1:1", 100.0), _info("new", "h2:1", 200.0), _info("new", "h3:1", 150.0)], [], [])
    found = find_adapter(source, "a1", 0.0, 300.0, 1.0)  # type: ignore[arg-type]
    assert (found.run_id, found.run_name, found.base_model, found.final_eval_loss) == ("new", "a1", "tiny-llama", "3.15")
    assert found.servers == ("h2:1", "h3:1") and found.others == ("old",)
    # Not served in the range: what the store holds.
    source = _Source([], [_info("r", "h1:1", 0.0)["metric"]], [])
    assert find_adapter(source, "a1", 0.0, 300.0, 1.0).run_id == "r"  # type: ignore[arg-type]
    # Not there at all: named, with the adapters that are.
    source = _Source([], [], ["b1", "b2"])
    with pytest.raises(ReportError, match=r"no adapter 'a1' on Prometheus at http://prom: .* the adapters there are: b1, b2"):
        find_adapter(source, "a1", 0.0, 300.0, 1.0)  # type: ignore[arg-type]


def test_usage_errors() -> None:
    code, _, err = report("--adapter", "a1")
    assert code == 2 and "--adapter needs --prometheus URL" in err
    code, _, err = report("--prometheus", "http://127.0.0.1:1", "--adapter", "a1", "--since", "soon")
    assert code == 2 and "'soon' is not a duration" in err


# -- drawn -----------------------------------------------------------------------------------------
def _training_run(run_id: str = "5f0c1234") -> Run:
    rows = [
        Row(1000.0 + step, {"steps": float(step), "loss": 3.0 - step / 100, "tokens": 100.0 * step,
                            "last_step_time": 1000.0 + step})
        for step in range(1, 40)
    ]  # fmt: skip
    return Run(run_id=run_id, name="support", hyperparameters={"learning_rate": "0.001"}, source="test", rows=rows)


def test_png_and_page_put_the_serving_panels_beside_the_training_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from openlora_otel.report.page import page_data
    from openlora_otel.report.render import render

    now = time.time()
    curves = {
        "latency_p50": [(now - 60 + i, 0.2) for i in range(30)],
        "latency_p95": [(now - 60 + i, 0.4) for i in range(30)],
        "ttft_p50": [(now - 60 + i, 0.02) for i in range(30)],
        "ttft_p95": [(now - 60 + i, float("nan")) for i in range(30)],
        "tokens_per_s": [(now - 60 + i, 30.0) for i in range(30)],
    }
    serving = AdapterServing(ADAPTER, now - 60, now, curves=curves, summary=summarize_serving(curves, {}))
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    drawing = render([_training_run()], png=png, html_path=page, serving=[serving])
    assert png.stat().st_size > 30_000
    assert [p.title for p in drawing.serving_panels] == [
        "Serving: request latency", "Serving: time to first token", "Serving: output tokens/s",
        "Serving: energy per output token",
    ]  # fmt: skip
    assert drawing.serving_colors == [drawing.colors[0]]  # the adapter in its training run's colour
    text = page.read_text()
    assert "<title>Adapter report: support-v2</title>" in text
    training, serving_column = text.split('<div class="col" id="training-panels">')[1].split(
        '<div class="col" id="serving-panels">'
    )
    assert 'id="chart-loss"' in training and 'id="chart-serving-latency"' not in training
    for key in ("serving-latency", "serving-ttft", "serving-tokens"):
        assert f'id="chart-{key}"' in serving_column
    # No energy: no chart, the reason instead.
    assert 'id="chart-serving-energy"' not in text and NO_ENERGY in serving_column
    assert "<td><code>5f0c1234</code> (support)</td>" in text and "1f6863a30e0c1f84" in text
    data = page_data(drawing)["serving"]
    assert [p["key"] for p in data["panels"]] == ["serving-latency", "serving-ttft", "serving-tokens"]
    (p95,) = [line for line in data["panels"][1]["lines"]]  # ttft p95 is all NaN: left out
    assert p95["key"] == "ttft_p50" and p95["adapters"][0][1][0] == 0.02
    embedded = json.loads(text.split('id="report-data">')[1].split("</script>")[0])
    assert embedded["serving"] == json.loads(json.dumps(data))
    # Nothing but inline content: the page still loads nothing.
    assert "http://" not in text.split("<script>")[0].replace("http://127.0.0.1:9464", "")


# -- end to end: trained, saved, served, scraped, reported -----------------------------------------
@pytest.mark.e2e
@pytest.mark.process
def test_report_on_a_served_demo_adapter(tmp_path: Path) -> None:
    """The demo trains and saves ``a1`` (its history in files); serve serves it on the CPU; a real
    Prometheus with the shipped rules scrapes serve; the report names the training run, draws its
    curves from the files, and shows the adapter's latency and tokens/s (energy: none, no GPU)."""
    from tests.support.prometheus_server import Prometheus, prometheus_binary
    from tests.support.serving import ServeProcess, needs_serve, save_demo

    needs_serve()

    prometheus_binary()
    saved, history = tmp_path / "saved", tmp_path / "history"
    printed = save_demo(
        saved, "a1", steps=12, env={"OPENLORA_HISTORY_DIR": str(history), "OPENLORA_HISTORY_INTERVAL": "100"}
    )
    run_id = re.search(r"run (\w+) \(a1\)", printed).group(1)
    serve = ServeProcess(
        saved, workdir=tmp_path, env={"OMP_NUM_THREADS": "1", "OTEL_METRICS_EXPORTER": "prometheus"}
    )
    prometheus = None
    try:
        serve.wait_ready(timeout=120)
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{serve.metrics_port}"], rule_files=[str(RULES)])
        assert prometheus.wait_for(f'{INFO}{{openlora_training_run_id="{run_id}"}}', timeout=30)
        count = 'sum(gen_ai_server_request_duration_seconds_count{openlora_adapter_name="a1"})'
        # Two batches with scrapes between: the series exist before the second, whose rate shows.
        for sent in (3, 6):
            for _ in range(3):
                status, _, body = serve.complete({"model": "a1", "prompt": "the quick brown fox", "max_tokens": 8})
                assert status == 200, body
            assert prometheus.wait_for(f"{count} >= {sent}", timeout=30), serve.log()[-2000:]
            assert prometheus.wait_for_scrapes(2), prometheus.query("up")

        out = tmp_path / "out"
        out.mkdir()
        code, text, err = report(
            str(history), "--prometheus", prometheus.url, "--adapter", "a1", "--since", "10m", "--out", str(out)
        )
        assert code == 0, err
        assert f"adapter a1: trained by run {run_id} (a1), base model tiny-llama (fingerprint " in text
        assert "final eval loss 3." in text
        assert f"run {run_id} (a1): 12 steps, from {history}" in text  # the curves from the files
        latency = re.search(r"request latency p50 (\S+ m?s), p95 (\S+ m?s); time to first token p50 (\S+ m?s)", text)
        assert latency, text
        tokens = re.search(r"output tokens ([\d,]+), ([\d.,]+) tokens/s while serving", text)
        assert tokens and float(tokens.group(2).replace(",", "")) > 0, text
        assert f"energy per output token: {NO_ENERGY}" in text  # serve on the CPU: no GPU energy
        assert "Serving: request latency" in text and "Loss" in text
        page = (out / "openlora-report.html").read_text()
        serving_column = page.split('<div class="col" id="serving-panels">')[1]
        for key in ("serving-latency", "serving-ttft", "serving-tokens"):
            assert f'id="chart-{key}"' in serving_column, key
        assert NO_ENERGY in serving_column and 'id="chart-loss"' in page
        assert (out / "openlora-report.png").stat().st_size > 50_000

        # An adapter not there: exit 2, named, with what is there.
        code, _, err = report("--prometheus", prometheus.url, "--adapter", "nope", "--out", str(out))
        assert code == 2
        assert f"no adapter 'nope' on Prometheus at {prometheus.url}" in err and "the adapters there are: a1" in err
    finally:
        if prometheus is not None:
            prometheus.stop()
        serve.stop(timeout=30)

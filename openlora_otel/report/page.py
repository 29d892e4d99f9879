"""The report as one self-contained HTML page: the table of runs, where the time went, the controls,
and an interactive chart per panel.

The charts are drawn in the browser by uPlot (MIT, vendored under ``vendor/uplot``) from the curves
embedded as JSON: zoom by dragging, values on hover, runs toggled, the x axis and the smoothing chosen
on the page. The page's own style and script are ``assets/page.css`` and ``assets/page.js``, package
data like uPlot. Everything is inline and a Content-Security-Policy forbids any request: it loads
nothing from anywhere.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
from collections.abc import Sequence
from importlib import resources
from typing import Any

from openlora_otel._version import __version__
from openlora_otel.report.drawing import MAX_POINTS, Drawing, panel_scale
from openlora_otel.report.formatting import (
    NOT_AVAILABLE,
    duration,
    integer,
    number,
    percent,
    report_title,
)
from openlora_otel.report.model import ReportError, Run, differing_hyperparameters, thin
from openlora_otel.report.summary import LAST_LOSS, TIME_HEADING

__all__ = ["UPLOT_VERSION", "html_page", "page_data"]

UPLOT_VERSION = "1.6.32"


# The page's own style and script (assets/page.css, assets/page.js), inlined as uPlot is. The script
# builds one uPlot chart per panel from the JSON in #report-data. It writes what it read with
# textContent only (never as HTML); the page's Content-Security-Policy forbids every request, so
# nothing it does can reach the network.

# Nothing leaves the page: no source, style, image, font or connection but what is inline.
_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _inlined(*path: str) -> str:
    """A file of the package's report folder (package data: the vendored uPlot, the page's own style and
    script) as text for the <style> or <script> element it goes in."""
    text = resources.files("openlora_otel.report").joinpath(*path).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():  # would end the element it is inlined in
        raise ReportError(f"the packaged {'/'.join(path)} cannot be inlined: it holds a closing tag")
    return text


def _json_number(value: float, digits: int = 7) -> float | None:
    """A value for the page's JSON: None (null) for NaN and infinities, else ``digits`` significant digits."""
    return float(f"{value:.{digits}g}") if math.isfinite(value) else None


def page_data(drawing: Drawing) -> dict[str, Any]:
    """What the page's charts are drawn from (embedded as JSON): the runs, and per panel and line each
    run's points as ``[steps, times, values]`` (times in Unix seconds, values scaled for the axis,
    null where not finite), thinned to :data:`MAX_POINTS`."""
    runs = []
    for index, (label, color, summary) in enumerate(zip(drawing.labels, drawing.colors, drawing.summaries, strict=True)):
        times = drawing.times[index]
        diverged = summary.divergence
        mark = None
        if diverged is not None:
            step = diverged.step
            mark = {
                "step": step,
                "time": times.get(step) if step is not None else None,
                "text": f"{drawing.runs[index].name}: {diverged.text}",
            }
        runs.append(
            {
                "label": label,
                "name": drawing.runs[index].name,
                "color": color,
                "t0": min(times.values(), default=0.0),
                "mark": mark,
            }
        )
    panels = []
    for panel in drawing.panels:
        scale, ylabel = panel_scale(panel, drawing.curves)
        lines = []
        for line in panel.lines:
            per_run: list[list[list[float | None]] | None] = []
            for index, curve_set in enumerate(drawing.curves):
                times = drawing.times[index]
                points = [
                    (step, times[step], y)
                    for step, y in thin(curve_set.get(line.key, []), MAX_POINTS, line.fold)
                    if step in times
                ]
                per_run.append(
                    [
                        [step for step, _, _ in points],
                        [round(t, 3) for _, t, _ in points],
                        [_json_number(y * scale) for _, _, y in points],
                    ]
                    if points
                    else None
                )
            if any(per_run):
                lines.append(
                    {
                        "key": line.key,
                        "label": line.label,
                        "style": line.style,
                        "width": line.width,
                        "alpha": line.alpha,
                        "marker": line.marker is not None,
                        "smooth": line.smooth,
                        "runs": per_run,
                    }
                )
        panels.append(
            {
                "key": panel.key,
                "title": panel.title,
                "ylabel": ylabel,
                "ylim": list(panel.ylim) if panel.ylim else None,
                "zero": panel.key == "gpu_memory",
                "lines": lines,
            }
        )
    return {
        "x": drawing.x,
        "smooth": drawing.smoothing,
        "runs": runs,
        "panels": panels,
        "serving": serving_data(drawing) if drawing.serving else None,
    }


def serving_data(drawing: Drawing) -> dict[str, Any]:
    """The serving charts' data: the adapters, and per panel with data and line each adapter's
    ``[times, values]`` (Unix seconds; null where not finite), thinned to :data:`MAX_POINTS`."""
    adapters = [
        {"label": item.adapter.name, "color": color}
        for item, color in zip(drawing.serving, drawing.serving_colors, strict=True)
    ]
    panels = []
    for panel in drawing.serving_panels:
        lines = []
        for line in panel.lines:
            per_adapter: list[list[list[float | None]] | None] = []
            for item in drawing.serving:
                points = thin(item.curves.get(line.key, []), MAX_POINTS, "mean")
                per_adapter.append(
                    [[round(t, 3) for t, _ in points], [_json_number(y) for _, y in points]]
                    if any(math.isfinite(y) for _, y in points)
                    else None
                )
            if any(per_adapter):
                lines.append({"key": line.key, "label": line.label, "style": line.style, "width": line.width,
                              "adapters": per_adapter})
        if lines:
            panels.append({"key": panel.key, "title": panel.title, "ylabel": panel.ylabel, "lines": lines})
    return {"adapters": adapters, "panels": panels}


def _serving_sections(drawing: Drawing) -> list[str]:
    """A heading and a chart per serving panel; a panel without data says why instead."""
    from openlora_otel.report.serving import NO_ENERGY

    e = html.escape
    with_data = {panel["key"] for panel in serving_data(drawing)["panels"]}
    sections = []
    for panel in drawing.serving_panels:
        if panel.key in with_data:
            body = (
                f'<div class="chart" id="chart-{panel.key}" role="img" '
                f'aria-label="{e(panel.title, quote=True)}"></div>'
            )
        else:
            note = NO_ENERGY if panel.key == "serving-energy" else "no data: no request to the adapter in the range"
            body = f'<p class="nodata">{e(note)}</p>'
        sections.append(
            f'<section id="{panel.key}"><h2>{e(panel.title)}</h2><figure>{body}'
            f"<figcaption>{e(panel.description)}</figcaption></figure></section>"
        )
    return sections


def _adapters_section(drawing: Drawing) -> str:
    """The page's table of adapters: where each came from and its serving figures over the range."""
    if not drawing.serving:
        return ""
    from openlora_otel.report.serving import NO_ENERGY

    e = html.escape
    rows = []
    for item, color in zip(drawing.serving, drawing.serving_colors, strict=True):
        s = item.summary
        adapter = item.adapter
        run = (
            f"<code>{e(adapter.run_id)}</code>" + (f" ({e(adapter.run_name)})" if adapter.run_name else "")
            if adapter.run_id
            else "not recorded"
        )
        energy = f"{s.joules_per_token:.4g} J" if s.joules_per_token is not None else NO_ENERGY

        def seconds(value: float | None) -> str:
            return NOT_AVAILABLE if value is None else f"{value:.3g} s"

        rows.append(
            "<tr>"
            f'<td class="name"><span class="swatch" style="background:{color}"></span><strong>{e(adapter.name)}</strong></td>'
            f"<td>{run}</td>"
            f"<td>{e(adapter.base_model or NOT_AVAILABLE)}<br><small><code>{e(adapter.base_fingerprint or '')}</code></small></td>"
            f'<td class="num">{e(adapter.final_eval_loss or NOT_AVAILABLE)}</td>'
            f'<td class="num">{NOT_AVAILABLE if s.requests is None else f"{s.requests:,.0f}"}</td>'
            f'<td class="num">{seconds(s.latency_p50)} / {seconds(s.latency_p95)}</td>'
            f'<td class="num">{seconds(s.ttft_p50)} / {seconds(s.ttft_p95)}</td>'
            f'<td class="num">{NOT_AVAILABLE if s.tokens_per_s is None else f"{s.tokens_per_s:,.1f}"}</td>'
            f'<td class="wrap">{e(energy)}</td>'
            "</tr>"
        )
    notes = "".join(
        f"<p class=\"meta\"><strong>{e(item.adapter.name)}</strong>: {e(note)}</p>"
        for item in drawing.serving
        for note in item.notes
    )
    start = min(item.start for item in drawing.serving)
    end = max(item.end for item in drawing.serving)
    stamp = lambda t: _dt.datetime.fromtimestamp(t, _dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")  # noqa: E731
    return (
        '<section id="adapters"><h2>Adapters</h2>\n'
        f'<p class="meta">Each adapter\'s training run (its openlora_inference_adapter_info series) and how it '
        f"served from {e(stamp(start))} to {e(stamp(end))}: successful requests' latency and time to first "
        "token (p50 / p95 over the range), output tokens/s while serving, joules per output token.</p>\n"
        "<table><thead><tr><th>adapter</th><th>training run</th><th>base model</th><th>final eval loss</th>"
        "<th>requests</th><th>latency p50 / p95</th><th>first token p50 / p95</th><th>output tokens/s</th>"
        f"<th>energy per output token</th></tr></thead><tbody>{''.join(rows)}</tbody></table>\n{notes}</section>\n"
    )


def _script_json(value: Any) -> str:
    """``value`` as JSON that is safe inside a <script> element: no ``<``, ``>`` or ``&`` appear as such."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def html_page(drawing: Drawing) -> str:
    """The report as one HTML page: the table of runs, the controls, then a heading and a chart per panel."""
    runs, panels, colors, summaries = drawing.runs, drawing.panels, drawing.colors, drawing.summaries
    e = html.escape
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    differing = differing_hyperparameters(runs) if len(runs) > 1 else []
    rows = []
    for run, color, summary in zip(runs, colors, summaries, strict=True):
        # What tells the runs apart first, in bold; then the rest.
        pairs = [
            f"<strong>{e(k)}={e(run.hyperparameters[k])}</strong>"
            for k in differing
            if k in run.hyperparameters
        ]
        pairs += [f"{e(k)}={e(v)}" for k, v in sorted(run.hyperparameters.items()) if k not in differing]
        hyperparameters = ", ".join(pairs) or "none recorded"
        rank = (
            ""
            if run.rank is None and run.ranks == 1
            else f"rank {run.rank if run.rank is not None else '?'} of {run.ranks} process(es); "
        )
        rows.append(
            "<tr>"
            f'<td class="name"><span class="swatch" style="background:{color}"></span><strong>{e(run.name)}</strong></td>'
            f"<td><code>{e(run.run_id)}</code></td>"
            f'<td class="wrap"><code>{hyperparameters}</code></td>'
            f'<td class="num">{integer(summary.steps)}</td>'
            f'<td class="num">{e(summary.last_loss_text)}</td>'
            f'<td class="num">{number(summary.final_eval_loss)}</td>'
            f'<td class="num">{duration(summary.seconds)}</td>'
            f'<td class="wrap"><small>{e(rank + run.source)}</small></td>'
            "</tr>"
        )
    diverged = [
        f'<p class="diverged"><span class="swatch" style="background:{color}"></span><strong>{e(run.name)}</strong> '
        f"diverged: {e(summary.divergence.text)}</p>"
        for run, color, summary in zip(runs, colors, summaries, strict=True)
        if summary.divergence is not None
    ]
    label_of = dict(zip((id(run) for run in runs), drawing.labels, strict=True))
    toggles = "".join(
        f'<label><input type="checkbox" data-run="{i}" checked> <span class="swatch" style="background:{color}">'
        f"</span>{e(label_of[id(run)])}</label>"
        for i, (run, color) in enumerate(zip(runs, colors, strict=True))
    )
    radios = "".join(
        f'<label><input type="radio" name="x" value="{x}"{" checked" if x == drawing.x else ""}> {e(name)}</label>'
        for x, name in (("step", "step"), ("time", "wall time"), ("elapsed", "time since start"))
    )
    controls = (
        f'<div class="controls" id="controls"><span>Runs: {toggles}</span><span>x axis: {radios}</span>'
        f'<label>smoothing <input type="range" id="smooth" min="0" max="0.99" step="0.01" '
        f'value="{drawing.smoothing}"> <output id="smooth-value">{drawing.smoothing:.2f}</output></label></div>\n'
        "<noscript><p>The charts are drawn by the script in this page: allow JavaScript to see them "
        "(the PNG written beside it has them too).</p></noscript>\n"
    )
    sections = []
    for panel in panels:
        label = e(f"{panel.title}: {'; '.join(drawing.labels)}", quote=True)
        sections.append(
            f'<section id="{panel.key}"><h2>{e(panel.title)}</h2>'
            f'<figure><div class="chart" id="chart-{panel.key}" role="img" aria-label="{label}"></div>'
            f"<figcaption>{e(panel.description)}</figcaption></figure></section>"
        )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(report_title(runs, drawing.serving))}</title>\n<style>{_inlined('vendor', 'uplot', 'uPlot.min.css')}</style>\n<style>\n{_inlined('assets', 'page.css')}</style>"
        "</head>\n"
        + ('<body class="wide">\n' if drawing.serving else "<body>\n")
        + f"<h1>{e(report_title(runs, drawing.serving))}</h1>\n"
        f'<p class="meta">Written by openlora-otel {e(__version__)} on {now}. Curves of each run\'s lowest rank, '
        "against the optimizer step, the wall time or the time since the run's first step. Drag across a chart "
        "to zoom, double-click to zoom back out; hover for the values; the boxes turn runs on and off. "
        f"Charts drawn by uPlot {UPLOT_VERSION} (MIT licence, in this page).</p>\n"
        "<h2>Runs</h2>\n<table><thead><tr><th>run</th><th>id</th><th>hyperparameters</th><th>steps</th>"
        f"<th>{e(LAST_LOSS)}</th><th>final eval loss</th><th>first to last step</th><th>source</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n"
        + "".join(diverged)
        + _diagnosis_section(runs, colors)
        + _adapters_section(drawing)
        + _time_section(runs, colors)
        + controls
        + (
            '<div class="columns"><div class="col" id="training-panels"><h2>Training</h2>'
            + "\n".join(sections)
            + '</div>\n<div class="col" id="serving-panels"><h2>Serving</h2>'
            + "\n".join(_serving_sections(drawing))
            + "</div></div>"
            if drawing.serving
            else "\n".join(sections)
        )
        + f'\n<script type="application/json" id="report-data">{_script_json(page_data(drawing))}</script>\n'
        + f"<script>/* uPlot {UPLOT_VERSION}, MIT licence (c) Leon Sorokin: https://github.com/leeoniya/uPlot */\n"
        + _inlined("vendor", "uplot", "uPlot.iife.min.js")
        + "</script>\n<script>\n"
        + _inlined("assets", "page.js")
        + "</script>\n</body></html>\n"
    )


# -- what went wrong ------------------------------------------------------------------------
def _diagnosis_section(runs: Sequence[Run], colors: Sequence[str]) -> str:
    """``openlora-otel diagnose``'s findings for each run that has some (none: no section)."""
    from openlora_otel.report.diagnosis import diagnose

    e = html.escape
    parts = []
    for run, color in zip(runs, colors, strict=True):
        findings = diagnose(run)
        if not findings:
            continue
        items = "".join(
            f'<li><strong class="{e(f.severity)}">[{e(f.severity)}]</strong> {e(f.title)}<br>'
            f"<small>likely cause: {e(f.cause)}"
            + "".join(f"<br>try: {e(t)}" for t in f.try_next)
            + (f'<br><a href="{e(f.runbook)}">runbook</a>' if f.runbook else "")
            + "</small></li>"
            for f in findings
        )
        parts.append(
            f'<p><span class="swatch" style="background:{color}"></span><strong>{e(run.name)}</strong></p>'
            f"<ol>{items}</ol>"
        )
    if not parts:
        return ""
    return (
        '<section id="diagnosis"><h2>Diagnosis</h2>\n<p class="meta">What <code>openlora-otel diagnose</code> '
        "finds in each run's metrics, most severe first; the command prints the evidence of each.</p>\n"
        + "".join(parts)
        + "</section>\n"
    )


# -- where the time went ----------------------------------------------------------------------
# One colour per phase (names.TRAINING_PHASES): productive green, the badput causes apart.
PHASE_COLORS = {
    "startup": "#9e9e9e",
    "productive": "#2ca02c",
    "data_wait": "#ff7f0e",
    "evaluation": "#1f77b4",
    "checkpoint_save": "#9467bd",
    "checkpoint_load": "#c5b0d5",
    "lost_progress": "#d62728",
    "idle": "#e0e0e0",
}


def _time_section(runs: Sequence[Run], colors: Sequence[str]) -> str:
    """The page's "Where the time went": per run a bar of the phases' shares, then a table of them."""
    timed = [(run, color, run.time) for run, color in zip(runs, colors, strict=True) if run.time is not None]
    if not timed:
        return ""
    e = html.escape
    phases = list(PHASE_COLORS)
    legend = " ".join(
        f'<span class="swatch" style="background:{PHASE_COLORS[p]}"></span>{e(p)}&nbsp;' for p in phases
    )
    bars, rows, attempt_rows = [], [], []
    for run, color, time in timed:
        segments = "".join(
            f'<span style="width:{100 * share:.3f}%;background:{PHASE_COLORS[p]}" '
            f'title="{e(p)}: {time.phases[p]:,.1f} s ({100 * share:.1f} %)"></span>'
            for p in phases
            if (share := time.share(p))
        )
        name = f'<span class="swatch" style="background:{color}"></span><strong>{e(run.name)}</strong>'
        bars.append(
            f"<div>{name} goodput {percent(time.goodput)} of {duration(time.total)}"
            f'<div class="bar" role="img" aria-label="{e(run.name)}: time by phase">{segments}</div></div>'
        )
        cells = "".join(
            f'<td class="num">{time.phases[p]:,.1f} s<br><small>{percent(time.share(p))}</small></td>'
            for p in phases
        )
        rows.append(
            f'<tr><td class="name">{name}</td>{cells}<td class="num">{time.total:,.1f} s</td>'
            f'<td class="num"><strong>{percent(time.goodput)}</strong></td>'
            f'<td class="num">{len(time.attempts)}</td><td class="num">{time.steps_lost:,}</td></tr>'
        )
        for attempt in time.attempts:
            attempt_rows.append(
                f'<tr><td class="name">{name}</td><td class="num">{e(attempt.label)}</td>'
                f'<td class="num">{attempt.processes}</td><td class="num">{attempt.steps_lost:,}</td>'
                f'<td class="num">{attempt.lost_progress_s:,.1f} s</td><td class="num">{attempt.seconds:,.1f} s</td></tr>'
            )
    head = "".join(f"<th>{e(p)}</th>" for p in phases)
    return (
        f'<section id="time"><h2>{TIME_HEADING}</h2>\n'
        '<p class="meta">Wall time of every process of the run (each rank, each attempt) by '
        "<code>openlora.training.phase</code>, from each process's last values of "
        "<code>openlora.training.time</code>; goodput is the productive share.</p>\n"
        f"<p><small>{legend}</small></p>\n" + "".join(bars) + "\n"
        f'<table class="time"><thead><tr><th>run</th>{head}<th>total</th><th>goodput</th><th>attempts</th>'
        f"<th>steps lost</th></tr></thead><tbody>{''.join(rows)}</tbody></table>\n"
        '<table class="time"><thead><tr><th>run</th><th>attempt</th><th>processes</th><th>steps lost</th>'
        "<th>lost_progress</th><th>time in all</th></tr></thead>"
        f"<tbody>{''.join(attempt_rows)}</tbody></table></section>\n"
    )

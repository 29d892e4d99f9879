"""Draw runs: one PNG with every panel, and one self-contained HTML page.

matplotlib is imported here only, and through its object API (``Figure``), so
the report sets no global backend and needs no display. The HTML page holds
each panel as inline SVG (text as paths, so it reads the same without the
fonts it was drawn with) and the table of runs; it loads nothing from anywhere.
"""

from __future__ import annotations

import datetime as _dt
import html
import io
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openlora_otel._version import __version__
from openlora_otel.report.model import (
    PANELS,
    Curve,
    Panel,
    ReportError,
    Run,
    common_hyperparameters,
    curves,
    differing_hyperparameters,
    legend_labels,
    thin,
)

__all__ = [
    "TIME_HEADING",
    "Drawing",
    "Summary",
    "html_page",
    "png_figure",
    "prepare",
    "render",
    "summarize",
    "time_lines",
]

# What the table shows for a value the run does not have.
_NONE = "n/a"
# Points per line: more than a plot's width in pixels shows nothing more, and keeps the page small.
MAX_POINTS = 1000
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_RC = {
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.fonttype": "path",
}


# The last collection interval's mean loss: the demo's "last train loss" is its last step's.
LAST_LOSS = "last loss (interval mean)"


@dataclass(frozen=True)
class Summary:
    """A run's row in the table."""

    steps: int | None
    final_loss: float | None  # the last interval's mean over its finite losses, not the last step's
    final_eval_loss: float | None
    seconds: float | None
    nonfinite_from: float | None = None  # the step by which the first NaN / infinite loss was counted

    @property
    def last_loss_text(self) -> str:
        """The table's cell: the last interval's mean, and where the loss went non-finite if it did."""
        text = _num(self.final_loss)
        if self.nonfinite_from is not None:
            text += f" (non-finite by step {self.nonfinite_from:,.0f})"
        return text


def summarize(run: Run, run_curves: dict[str, Curve] | None = None) -> Summary:
    """Steps, last train and eval loss, and the wall time from the first to the last step seen."""
    run_curves = curves(run.rows) if run_curves is None else run_curves
    # A step count that is NaN or infinite (a corrupt or foreign file) counts no steps, as in curves().
    steps = [v for row in run.rows if (v := row.values.get("steps")) is not None and math.isfinite(v)]
    stamps = [t for _, t in run_curves.get("last_step_time", [])]

    def last(key: str) -> float | None:
        points = run_curves.get(key)
        return points[-1][1] if points else None

    return Summary(
        steps=int(max(steps)) if steps else None,
        final_loss=last("loss"),
        final_eval_loss=last("eval_loss"),
        seconds=max(stamps) - min(stamps) if len(stamps) > 1 else None,
        nonfinite_from=nonfinite_from(run_curves),
    )


def nonfinite_from(run_curves: dict[str, Curve]) -> float | None:
    """The step of the first point whose count of non-finite losses is above 0 (None: none counted)."""
    return next((step for step, count in run_curves.get("loss_nonfinite", []) if count > 0), None)


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401  (checks the part we use imports)
    except ImportError:
        raise ReportError(
            "drawing the report needs the package 'matplotlib', which is not installed: "
            "pip install 'openlora-otel[report]'"
        ) from None
    return matplotlib


@dataclass
class Drawing:
    """Everything a picture of ``runs`` needs, computed once for the PNG and the page."""

    runs: Sequence[Run]
    curves: list[dict[str, Curve]]
    panels: list[Panel]
    labels: list[str]
    colors: list[str]
    summaries: list[Summary]


def prepare(runs: Sequence[Run]) -> Drawing:
    """Curves, the panels that have data in some run (the others are left out, not drawn empty), legends."""
    run_curves = [curves(run.rows) for run in runs]
    return Drawing(
        runs=runs,
        curves=run_curves,
        panels=[
            panel for panel in PANELS if any(c.get(line.key) for c in run_curves for line in panel.lines)
        ],
        labels=legend_labels(runs),
        colors=[_COLORS[i % len(_COLORS)] for i in range(len(runs))],
        summaries=[summarize(run, c) for run, c in zip(runs, run_curves, strict=True)],
    )


def render(runs: Sequence[Run], *, png: Path | None, html_path: Path | None) -> Drawing:
    """Write the PNG and/or the HTML page of ``runs``."""
    matplotlib = _matplotlib()
    drawing = prepare(runs)
    with matplotlib.rc_context(_RC):  # savefig reads some of them (svg.fonttype) when it writes
        if png is not None:
            png_figure(drawing).savefig(png, format="png", dpi=100)
        if html_path is not None:
            html_path.write_text(html_page(drawing), encoding="utf-8")
    return drawing


# -- drawing -------------------------------------------------------------------------------
def _draw(ax: Any, panel: Panel, run_curves: Sequence[dict[str, Curve]], colors: Sequence[str]) -> None:
    """One panel's lines for every run, its title, axis labels and the key to its line styles."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    scale, ylabel = panel.scale, panel.ylabel
    if panel.key == "step_time":  # a CPU demo's step is ~0.1 s, a large model's many seconds
        values = [y for c in run_curves for _, y in c.get("step_time", [])]
        if values and max(values) < 1.0:
            scale, ylabel = 1000.0, "milliseconds per step"
    styles = []
    for curve_set, color in zip(run_curves, colors, strict=True):
        for line in panel.lines:
            points = thin(curve_set.get(line.key, []), MAX_POINTS, line.fold)
            if not points:
                continue
            if line not in styles:
                styles.append(line)
            ax.plot(
                [x for x, _ in points],
                [y * scale for _, y in points],
                line.style,
                color=color,
                linewidth=line.width,
                alpha=line.alpha,
                marker=line.marker,
                markersize=4,
            )
    ax.set_title(panel.title, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    if panel.key == "learning_rate":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _compact(y)))
    elif panel.key in ("throughput", "gpu_memory"):
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}" if y >= 100 else f"{y:,.3g}"))
    if panel.key == "loss":  # where a run went non-finite: its mean line just stops there
        for curve_set, color in zip(run_curves, colors, strict=True):
            step = nonfinite_from(curve_set)
            if step is not None:
                ax.axvline(step, color=color, linestyle=(0, (2, 2)), linewidth=1.4, gid="nonfinite")
                ax.annotate(
                    f"non-finite loss by step {step:,.0f}",
                    xy=(step, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(4, -4),
                    textcoords="offset points",
                    va="top",
                    fontsize=9,
                    color=color,
                )
    if panel.ylim:
        ax.set_ylim(*panel.ylim)
    elif panel.key == "gpu_memory":  # from zero: how full, not how much it wobbled
        ax.set_ylim(bottom=0)
    if len(styles) > 1:  # the run colours are in the run legend; this says which line is which
        ax.legend(
            handles=[
                Line2D(
                    [],
                    [],
                    color="#444444",
                    linestyle=s.style,
                    linewidth=s.width,
                    marker=s.marker,
                    markersize=4,
                )
                for s in styles
            ],
            labels=[s.label for s in styles],
            loc="best",
            framealpha=0.85,
        )


def _run_handles(labels: Sequence[str], colors: Sequence[str]) -> list[Any]:
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], color=color, linewidth=2.5, label=label)
        for label, color in zip(labels, colors, strict=True)
    ]


def png_figure(drawing: Drawing) -> Any:
    """The whole report as one matplotlib Figure: every panel, two per row, then the table of runs."""
    with _matplotlib().rc_context(_RC):
        return _png_figure(drawing)


def _png_figure(drawing: Drawing) -> Any:
    from matplotlib.figure import Figure

    runs, run_curves, panels = drawing.runs, drawing.curves, drawing.panels
    labels, colors, summaries = drawing.labels, drawing.colors, drawing.summaries

    slots = len(panels) + 1  # the last one holds the table of runs
    rows = math.ceil(slots / 2)
    common = common_hyperparameters(runs)
    lead = "Hyperparameters: " if len(runs) == 1 else "Same in every run: "
    subtitle = "\n".join(textwrap.wrap(lead + _pairs(common), 150)) if common else ""
    header_in = 0.8 + 0.3 * math.ceil(len(runs) / 3) + 0.22 * subtitle.count("\n") + (0.3 if subtitle else 0)
    body_in = 3.6 * rows
    figure = Figure(figsize=(14, header_in + body_in), layout="constrained")
    header, body = figure.subfigures(2, 1, height_ratios=[header_in, body_in])
    # The title, the runs' colours and what they share, above every panel: read once, used for all.
    header.suptitle(_title(runs), fontsize=16, fontweight="bold")
    header.legend(
        handles=_run_handles(labels, colors),
        loc="center",
        ncols=min(len(runs), 3),
        fontsize=12,
        frameon=False,
    )
    if subtitle:
        header.text(0.5, 0.02, subtitle, ha="center", va="bottom", fontsize=10, color="#333333")
    grid = body.add_gridspec(rows, 2)
    for i, panel in enumerate(panels):
        _draw(body.add_subplot(grid[i // 2, i % 2]), panel, run_curves, colors)
    index = len(panels)
    table_ax = body.add_subplot(grid[index // 2, :] if index % 2 == 0 else grid[index // 2, 1])
    _table(table_ax, runs, colors, summaries)
    return figure


def _table(ax: Any, runs: Sequence[Run], colors: Sequence[str], summaries: Sequence[Summary]) -> None:
    ax.axis("off")
    ax.set_title("Runs", loc="left")
    cells = [
        [
            _short(run.name, 28),
            run.run_id[:16],
            _int(summary.steps),
            summary.last_loss_text,
            _num(summary.final_eval_loss),
            _duration(summary.seconds),
        ]
        for run, summary in zip(runs, summaries, strict=True)
    ]
    table = ax.table(
        cellText=cells,
        colLabels=["run", "id", "steps", LAST_LOSS, "final eval loss", "first to last step"],
        loc="upper left",
        cellLoc="left",
        colLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(10)
    table.scale(1, 1.5)
    for (row, col), cell in table.get_celld().items():
        cell.set_edgecolor("#cccccc")
        if row == 0:
            cell.set_text_props(fontweight="bold")
        elif col == 0:
            cell.get_text().set_color(colors[row - 1])
            cell.set_text_props(fontweight="bold")
    table.auto_set_column_width(list(range(6)))


def _panel_figure(
    panel: Panel, run_curves: Sequence[dict[str, Curve]], labels: Sequence[str], colors: Sequence[str]
) -> Any:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.2), layout="constrained")
    ax = figure.add_subplot()
    _draw(ax, panel, run_curves, colors)
    ax.set_title("", loc="left")  # the page's heading says it
    figure.legend(
        handles=_run_handles(labels, colors),
        loc="outside upper center",
        ncols=min(len(labels), 3),
        frameon=False,
    )
    return figure


def _svg(matplotlib: Any, figure: Any, panel: Panel, labels: Sequence[str]) -> str:
    buffer = io.StringIO()
    # A salt per panel: clip-path ids are hashes, and two panels inline in one page must not share one.
    with matplotlib.rc_context({"svg.hashsalt": f"openlora-{panel.key}"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, count=1, flags=re.DOTALL)  # RDF: the date, the tool
    # Scale with the page: drop the fixed size, the viewBox keeps the proportions. The label says
    # what the paths draw (text is drawn as paths): the panel and the runs, in their order.
    label = html.escape(f"{panel.title}: {'; '.join(labels)}", quote=True)
    return re.sub(
        r'<svg([^>]*?) width="[^"]*" height="[^"]*"',
        lambda match: f'<svg{match.group(1)} role="img" aria-label="{label}" style="width:100%;height:auto"',
        text,
        count=1,
    )


# -- the page ------------------------------------------------------------------------------
_CSS = """
body { font-family: "DejaVu Sans", "Liberation Sans", Arial, Helvetica, sans-serif; color: #1a1a1a;
       max-width: 1100px; margin: 2rem auto; padding: 0 1rem; line-height: 1.45; }
h1 { font-size: 1.7rem; margin-bottom: .2rem; }
h2 { font-size: 1.3rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
p.meta { color: #555; margin-top: 0; font-size: .9rem; }
table { border-collapse: collapse; width: 100%; font-size: .92rem; }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid #e2e2e2; vertical-align: top; }
th { background: #f4f4f4; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
td.name { white-space: nowrap; }
td.wrap { overflow-wrap: anywhere; }
code { font-family: "DejaVu Sans Mono", "Liberation Mono", monospace; font-size: .85rem; }
.swatch { display: inline-block; width: .9rem; height: .9rem; border-radius: 2px; margin-right: .4rem; vertical-align: -0.1rem; }
figure { margin: .5rem 0 0 0; }
.bar { display: flex; height: 1.3rem; border-radius: 3px; overflow: hidden; margin: .3rem 0 .2rem 0; }
.bar span { display: block; height: 100%; }
table.time { margin-top: .6rem; }
figcaption { color: #555; font-size: .9rem; }
"""


def html_page(drawing: Drawing) -> str:
    """The report as one HTML page: the table of runs, then a heading and an inline SVG per panel."""
    matplotlib = _matplotlib()
    runs, panels, colors, summaries = drawing.runs, drawing.panels, drawing.colors, drawing.summaries
    with matplotlib.rc_context(_RC):
        svgs = [
            _svg(
                matplotlib,
                _panel_figure(panel, drawing.curves, drawing.labels, colors),
                panel,
                drawing.labels,
            )
            for panel in panels
        ]
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
            f'<td class="num">{_int(summary.steps)}</td>'
            f'<td class="num">{e(summary.last_loss_text)}</td>'
            f'<td class="num">{_num(summary.final_eval_loss)}</td>'
            f'<td class="num">{_duration(summary.seconds)}</td>'
            f'<td class="wrap"><small>{e(rank + run.source)}</small></td>'
            "</tr>"
        )
    sections = []
    for panel, svg in zip(panels, svgs, strict=True):
        sections.append(
            f'<section id="{panel.key}"><h2>{e(panel.title)}</h2>'
            f"<figure>{svg}<figcaption>{e(panel.description)} x axis: optimizer step.</figcaption></figure></section>"
        )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(_title(runs))}</title><style>{_CSS}</style></head>\n<body>\n"
        f"<h1>{e(_title(runs))}</h1>\n"
        f'<p class="meta">Written by openlora-otel {e(__version__)} on {now}. Curves of each run\'s lowest rank, '
        "against the optimizer step.</p>\n"
        "<h2>Runs</h2>\n<table><thead><tr><th>run</th><th>id</th><th>hyperparameters</th><th>steps</th>"
        f"<th>{e(LAST_LOSS)}</th><th>final eval loss</th><th>first to last step</th><th>source</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n"
        + _time_section(runs, colors)
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


# -- where the time went ----------------------------------------------------------------------
TIME_HEADING = "Where the time went"
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


def _percent(share: float | None) -> str:
    return _NONE if share is None else f"{100 * share:.1f} %"


def time_lines(run: Run) -> list[str]:
    """The text of the run's "Where the time went": seconds and share per phase, goodput, attempts."""
    time = run.time
    if time is None:
        return [
            f"{TIME_HEADING}: not in the data read (openlora.training.time in a run's history files; "
            "not read from Prometheus)"
        ]
    attempts = len(time.attempts)
    lines = [
        f"{TIME_HEADING} ({attempts} attempt{'s' if attempts != 1 else ''}, {time.processes} "
        f"process{'es' if time.processes != 1 else ''}, summed over ranks and attempts):"
    ]
    width = max(len(phase) for phase in time.phases)
    for phase, seconds in time.phases.items():
        lines.append(f"  {phase:<{width}}  {seconds:12,.1f} s  {_percent(time.share(phase)):>7}")
    lines.append(f"  {'total':<{width}}  {time.total:12,.1f} s  goodput {_percent(time.goodput)}")
    for attempt in time.attempts:
        lines.append(
            f"  attempt {attempt.label}: {attempt.steps_lost:,} step{'s' if attempt.steps_lost != 1 else ''} "
            f"lost, {attempt.lost_progress_s:,.1f} s lost_progress, {attempt.seconds:,.1f} s in all"
            f" ({attempt.processes} process{'es' if attempt.processes != 1 else ''})"
        )
    return lines


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
            f"<div>{name} goodput {_percent(time.goodput)} of {_duration(time.total)}"
            f'<div class="bar" role="img" aria-label="{e(run.name)}: time by phase">{segments}</div></div>'
        )
        cells = "".join(
            f'<td class="num">{time.phases[p]:,.1f} s<br><small>{_percent(time.share(p))}</small></td>'
            for p in phases
        )
        rows.append(
            f'<tr><td class="name">{name}</td>{cells}<td class="num">{time.total:,.1f} s</td>'
            f'<td class="num"><strong>{_percent(time.goodput)}</strong></td>'
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


# -- text ----------------------------------------------------------------------------------
def _title(runs: Sequence[Run]) -> str:
    names = ", ".join(dict.fromkeys(run.name for run in runs))
    return f"Training report: {_short(names, 80)}"


def _pairs(values: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def _compact(value: float) -> str:
    """0.0003 as ``3e-4``, 0.002 as ``0.002``: how learning rates are written."""
    if value == 0:
        return "0"
    text = f"{value:.3g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _int(value: int | None) -> str:
    return _NONE if value is None else f"{value:,}"


def _num(value: float | None) -> str:
    return _NONE if value is None else f"{value:.4g}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return _NONE
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"

"""The report as one PNG: every panel, two per row (training beside serving with --adapter), the table
of runs below, the runs' colours and shared hyperparameters above.

matplotlib is imported here only, and through its object API (``Figure``), so the report sets no
global backend and needs no display; it is imported when a picture is drawn (the ``report`` extra).
"""

from __future__ import annotations

import datetime as _dt
import math
import textwrap
from collections.abc import Sequence
from typing import Any

from openlora_otel.report.drawing import MAX_POINTS, Drawing, panel_scale
from openlora_otel.report.formatting import duration, integer, number, report_title, shortened
from openlora_otel.report.model import Panel, ReportError, Run, common_hyperparameters, smooth, thin
from openlora_otel.report.summary import LAST_LOSS, Summary

__all__ = ["MATPLOTLIB_RC", "import_matplotlib", "png_figure"]

MATPLOTLIB_RC = {
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
_XLABEL = {"step": "step", "time": "wall time (UTC)", "elapsed": "seconds since the run's first step"}


def import_matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401  (checks the part we use imports)
    except ImportError:
        raise ReportError(
            "drawing the report needs the package 'matplotlib', which is not installed: "
            "pip install 'openlora-otel[report]'"
        ) from None
    return matplotlib


def _draw(ax: Any, panel: Panel, drawing: Drawing, *, label_marks: bool = True) -> None:
    """One panel's lines for every run, its title, axis labels and the key to its line styles.

    With smoothing, each smoothed line is drawn over its raw values, faint. A run that diverged
    gets a dashed vertical line where it did; ``label_marks`` says what happened next to it.
    """
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    run_curves, colors = drawing.curves, drawing.colors
    scale, ylabel = panel_scale(panel, run_curves)
    styles = []
    for index, (curve_set, color) in enumerate(zip(run_curves, colors, strict=True)):
        x_of = drawing.x_of(index)
        for line in panel.lines:
            points = [
                (x, y)
                for step, y in thin(curve_set.get(line.key, []), MAX_POINTS, line.fold)
                if (x := x_of(step)) is not None
            ]
            if not points:
                continue
            if line not in styles:
                styles.append(line)
            smoothed = line.smooth and drawing.smoothing > 0
            if smoothed:
                ax.plot(
                    [x for x, _ in points],
                    [y * scale for _, y in points],
                    line.style,
                    color=color,
                    linewidth=1.0,
                    alpha=0.25 * line.alpha,
                    gid="raw",
                )
                points = smooth(points, drawing.smoothing)
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
    ax.set_xlabel(_XLABEL[drawing.x])
    ax.set_ylabel(ylabel)
    if drawing.x == "time":
        from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

        locator = AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    else:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    if panel.key == "learning_rate":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _compact(y)))
    elif panel.key in ("throughput", "gpu_memory"):
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}" if y >= 100 else f"{y:,.3g}"))
    # Where a run diverged (its mean loss line just stops there): a line on every panel, said on the loss's.
    for index, (summary, color) in enumerate(zip(drawing.summaries, colors, strict=True)):
        diverged = summary.divergence
        if diverged is None or diverged.step is None:
            continue
        x = drawing.x_of(index)(diverged.step)
        if x is None:
            continue
        ax.axvline(x, color=color, linestyle=(0, (2, 2)), linewidth=1.4, gid="nonfinite")
        if label_marks and panel.key == "loss":
            ax.annotate(
                diverged.text,
                xy=(x, 1.0),
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
    with import_matplotlib().rc_context(MATPLOTLIB_RC):
        return _png_figure(drawing)


def _png_figure(drawing: Drawing) -> Any:
    from matplotlib.figure import Figure

    runs, panels = drawing.runs, drawing.panels
    labels, colors, summaries = drawing.labels, drawing.colors, drawing.summaries

    slots = len(panels) + 1  # the last one holds the table of runs
    rows = math.ceil(slots / 2)
    if drawing.serving:  # training on the left, serving on the right, the tables below both
        rows = max(len(panels), len(drawing.serving_panels)) + 1
    common = common_hyperparameters(runs)
    lead = "Hyperparameters: " if len(runs) == 1 else "Same in every run: "
    subtitle = "\n".join(textwrap.wrap(lead + _pairs(common), 150)) if common else ""
    header_in = 0.8 + 0.3 * math.ceil(len(runs) / 3) + 0.22 * subtitle.count("\n") + (0.3 if subtitle else 0)
    body_in = 3.6 * rows
    figure = Figure(figsize=(14, header_in + body_in), layout="constrained")
    header, body = figure.subfigures(2, 1, height_ratios=[header_in, body_in])
    # The title, the runs' colours and what they share, above every panel: read once, used for all.
    header.suptitle(report_title(runs, drawing.serving), fontsize=16, fontweight="bold")
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
    if drawing.serving:
        for i, panel in enumerate(panels):
            _draw(body.add_subplot(grid[i, 0]), panel, drawing)
        for i, panel in enumerate(drawing.serving_panels):
            _draw_serving(body.add_subplot(grid[i, 1]), panel, drawing)
        if runs:
            _table(body.add_subplot(grid[rows - 1, 0]), runs, colors, summaries)
        _adapter_text(body.add_subplot(grid[rows - 1, 1] if runs else grid[rows - 1, :]), drawing)
        return figure
    for i, panel in enumerate(panels):
        _draw(body.add_subplot(grid[i // 2, i % 2]), panel, drawing)
    index = len(panels)
    table_ax = body.add_subplot(grid[index // 2, :] if index % 2 == 0 else grid[index // 2, 1])
    _table(table_ax, runs, colors, summaries)
    return figure


def _table(ax: Any, runs: Sequence[Run], colors: Sequence[str], summaries: Sequence[Summary]) -> None:
    ax.axis("off")
    ax.set_title("Runs", loc="left")
    cells = [
        [
            shortened(run.name, 28),
            run.run_id[:16],
            integer(summary.steps),
            summary.last_loss_text,
            number(summary.final_eval_loss),
            duration(summary.seconds),
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


def _draw_serving(ax: Any, panel: Panel, drawing: Drawing) -> None:
    """One serving panel: each adapter's lines in its colour against the wall time; a note when empty."""
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.lines import Line2D

    from openlora_otel.report.serving import NO_ENERGY

    styles = []
    for item, color in zip(drawing.serving, drawing.serving_colors, strict=True):
        for line in panel.lines:
            points = [(t, y) for t, y in thin(item.curves.get(line.key, []), MAX_POINTS, "mean") if math.isfinite(y)]
            if not points:
                continue
            if line not in styles:
                styles.append(line)
            ax.plot(
                [_dt.datetime.fromtimestamp(t, _dt.UTC).replace(tzinfo=None) for t, _ in points],
                [y for _, y in points],
                line.style,
                color=color,
                linewidth=line.width,
                marker="o" if len(points) < 3 else None,
                markersize=3,
            )
    ax.set_title(panel.title, loc="left")
    ax.set_xlabel("wall time (UTC)")
    ax.set_ylabel(panel.ylabel)
    if not styles:
        note = NO_ENERGY if panel.key == "serving-energy" else "no data: no request to the adapter in the range"
        ax.text(0.5, 0.5, "\n".join(textwrap.wrap(note, 48)), ha="center", va="center", transform=ax.transAxes,
                fontsize=9, color="#555555")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    ax.set_ylim(bottom=0)
    if len(styles) > 1:
        ax.legend(
            handles=[Line2D([], [], color="#444444", linestyle=s.style, linewidth=s.width) for s in styles],
            labels=[s.label for s in styles],
            loc="best",
            framealpha=0.85,
        )


def _adapter_text(ax: Any, drawing: Drawing) -> None:
    """The adapters' summaries (report.serving.summary_lines) as text."""
    from openlora_otel.report.serving import summary_lines

    ax.axis("off")
    ax.set_title("Adapters", loc="left")
    y = 0.98
    for item, color in zip(drawing.serving, drawing.serving_colors, strict=True):
        text = "\n".join(
            wrapped for line in summary_lines(item) for wrapped in textwrap.wrap(line, 72, subsequent_indent="    ")
        )
        ax.text(0.0, y, text, transform=ax.transAxes, va="top", ha="left", fontsize=8.5, color=color,
                family="monospace")
        y -= 0.1 * (text.count("\n") + 1) + 0.05


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

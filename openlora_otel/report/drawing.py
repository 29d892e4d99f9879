"""What a picture of runs is drawn from, computed once for the PNG and the page (:class:`Drawing`).

:func:`prepare` turns runs into their curves, the panels that have data, the legends, the colours,
the summaries and the step times, for the chosen x axis and smoothing; the PNG and the page both
draw from the same :class:`Drawing`, so the picture and the page show the same lines.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openlora_otel.report.model import (
    PANELS,
    Curve,
    Panel,
    ReportError,
    Run,
    curves,
    eval_panels,
    legend_labels,
    smooth,
    step_times,
)
from openlora_otel.report.summary import Summary, summarize

__all__ = ["MAX_POINTS", "X_AXES", "Drawing", "panel_scale", "prepare"]

# Points per line: more than a plot's width in pixels shows nothing more, and keeps the page small.
MAX_POINTS = 1000
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")

# What the x axis can be: the optimizer step, the wall time (UTC), the seconds since the run's first step.
X_AXES = ("step", "time", "elapsed")


@dataclass
class Drawing:
    """Everything a picture of ``runs`` needs, computed once for the PNG and the page."""

    runs: Sequence[Run]
    curves: list[dict[str, Curve]]
    panels: list[Panel]
    labels: list[str]
    colors: list[str]
    summaries: list[Summary]
    times: list[dict[float, float]]  # per run: step -> Unix seconds (model.step_times)
    x: str = "step"  # one of X_AXES: the PNG's x axis, the page's first
    smoothing: float = 0.0  # the EMA weight (model.smooth) of the PNG, the page's first
    # --adapter: each adapter's serving (report.serving.AdapterServing), its colour, the serving panels.
    serving: Sequence[Any] = ()
    serving_colors: list[str] = field(default_factory=list)
    serving_panels: list[Panel] = field(default_factory=list)

    def x_of(self, index: int) -> Callable[[float], Any]:
        """Run ``index``'s step -> its x value on the PNG (None where the step has no time)."""
        if self.x == "step":
            return lambda step: step
        times = self.times[index]
        if self.x == "elapsed":
            start = min(times.values(), default=0.0)
            return lambda step: None if step not in times else times[step] - start
        return lambda step: (
            None if step not in times else _dt.datetime.fromtimestamp(times[step], _dt.UTC).replace(tzinfo=None)
        )


def prepare(
    runs: Sequence[Run], *, x: str = "step", smoothing: float = 0.0, serving: Sequence[Any] = ()
) -> Drawing:
    """Curves, the panels that have data in some run (the others are left out, not drawn empty), legends.

    ``serving``: the --adapter adapters (report.serving.AdapterServing); each gets its training run's
    colour, and every serving panel is kept (an empty one says why)."""
    if x not in X_AXES:
        raise ReportError(f"the x axis {x!r} is not one of {', '.join(X_AXES)}")
    smooth([], smoothing)  # checks the weight
    run_curves = [curves(run.rows) for run in runs]
    colors = [_COLORS[i % len(_COLORS)] for i in range(len(runs))]
    serving_colors = []
    for item in serving:
        owner = next((i for i, run in enumerate(runs) if run.run_id == item.adapter.run_id), None)
        serving_colors.append(
            colors[owner] if owner is not None else _COLORS[(len(runs) + len(serving_colors)) % len(_COLORS)]
        )
    if serving:
        from openlora_otel.report.serving import SERVING_PANELS
    # The evaluation metrics other than the loss, each in its panel, right after the loss.
    panels = [*PANELS[:1], *eval_panels(key for c in run_curves for key in c), *PANELS[1:]]
    return Drawing(
        runs=runs,
        curves=run_curves,
        panels=[panel for panel in panels if any(c.get(line.key) for c in run_curves for line in panel.lines)],
        labels=legend_labels(runs),
        colors=colors,
        summaries=[summarize(run, c) for run, c in zip(runs, run_curves, strict=True)],
        times=[step_times(run.rows) for run in runs],
        x=x,
        smoothing=smoothing,
        serving=serving,
        serving_colors=serving_colors,
        serving_panels=list(SERVING_PANELS) if serving else [],
    )


def panel_scale(panel: Panel, run_curves: Sequence[dict[str, Curve]]) -> tuple[float, str]:
    """The factor the panel's values are drawn at and its y label (step time in ms when below 1 s)."""
    if panel.key == "step_time":  # a CPU demo's step is ~0.1 s, a large model's many seconds
        values = [y for c in run_curves for _, y in c.get("step_time", [])]
        if values and max(values) < 1.0:
            return 1000.0, "milliseconds per step"
    return panel.scale, panel.ylabel

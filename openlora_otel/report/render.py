"""Write a report's files: the PNG and the HTML page of runs (``openlora-otel report``).

:func:`render` prepares the runs once (:mod:`.drawing`) and writes the PNG (:mod:`.png`), the page
(:mod:`.page`) or both from the same :class:`~openlora_otel.report.drawing.Drawing`, under the same
matplotlib settings; matplotlib is imported first, so a missing ``report`` extra is said at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openlora_otel.report.drawing import Drawing, prepare
from openlora_otel.report.model import Run
from openlora_otel.report.page import html_page
from openlora_otel.report.png import MATPLOTLIB_RC, import_matplotlib, png_figure

__all__ = ["render"]


def render(
    runs: Sequence[Run],
    *,
    png: Path | None,
    html_path: Path | None,
    x: str = "step",
    smoothing: float = 0.0,
    serving: Sequence[Any] = (),
) -> Drawing:
    """Write the PNG and/or the HTML page of ``runs`` (``x``, ``smoothing``, ``serving``: see :func:`prepare`)."""
    matplotlib = import_matplotlib()
    drawing = prepare(runs, x=x, smoothing=smoothing, serving=serving)
    with matplotlib.rc_context(MATPLOTLIB_RC):  # savefig reads some of them (svg.fonttype) when it writes
        if png is not None:
            png_figure(drawing).savefig(png, format="png", dpi=100)
        if html_path is not None:
            html_path.write_text(html_page(drawing), encoding="utf-8")
    return drawing

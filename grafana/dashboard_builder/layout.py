"""Where the panels of a generated dashboard go: a grid that hands out Grafana gridPos values.

Grafana places a panel by its gridPos: x and w in columns of a 24-column grid, y and h in rows of
about 30 px. Instead of setting them by hand, a dashboard asks a :class:`Grid` for each row
header and each panel in reading order; the grid fills lines left to right and starts a new line
below when the next panel does not fit::

    grid = Grid()
    grid.header()      # {"x": 0, "y": 0, "w": 24, "h": 1}: a row header, always a line of its own
    grid.cell(12, 8)   # {"x": 0, "y": 1, "w": 12, "h": 8}
    grid.cell(12, 8)   # {"x": 12, "y": 1, "w": 12, "h": 8}
    grid.cell(8, 8)    # {"x": 0, "y": 9, "w": 8, "h": 8}: 24 columns were full
    grid.newline()     # a line left part empty: the next cell starts at x 0
"""

from __future__ import annotations

from typing import TypedDict

COLUMNS = 24  # the width of Grafana's grid


class GridPos(TypedDict):
    """A panel's gridPos, its keys in the order Grafana writes them."""

    x: int
    y: int
    w: int
    h: int


class Grid:
    """Hands out positions top to bottom. A line is as tall as its tallest panel; the next line
    starts below it."""

    def __init__(self) -> None:
        self._top = 0  # y of the current line
        self._x = 0  # the first free column of the current line
        self._height = 0  # the tallest panel on the current line so far

    def cell(self, w: int, h: int) -> GridPos:
        """The position of the next panel, ``w`` columns wide and ``h`` high: right of the last one
        when it fits in the line, else at the start of a new line."""
        if not 0 < w <= COLUMNS or h <= 0:
            raise ValueError(f"a panel of {w} x {h} does not fit a {COLUMNS}-column grid")
        if self._x + w > COLUMNS:
            self.newline()
        position = GridPos(x=self._x, y=self._top, w=w, h=h)
        self._x += w
        self._height = max(self._height, h)
        return position

    def header(self) -> GridPos:
        """The position of a row header (a panel of type row): a whole line, one high."""
        self.newline()
        position = GridPos(x=0, y=self._top, w=COLUMNS, h=1)
        self._top += 1
        return position

    def newline(self) -> None:
        """End the current line, full or not: the next panel starts at x 0 below it."""
        self._top += self._height
        self._x = 0
        self._height = 0

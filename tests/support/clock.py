"""A fake clock for the training metrics (tests/conftest.py's ``clock`` fixture puts it in place)."""

from __future__ import annotations

WALL_OFFSET = 1_700_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:  # the wall clock: the same clock, some epoch seconds ahead
        return self.now + WALL_OFFSET

    def sleep(self, seconds: float) -> None:
        self.now += seconds

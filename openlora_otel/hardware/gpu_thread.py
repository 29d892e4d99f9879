"""The helper thread a :class:`~openlora_otel.hardware.gpu_snapshot.GpuCollector` takes its snapshots on.

A collection asks :meth:`SnapshotThread.current`: a snapshot younger than :data:`FRESH_FOR_S` is shared,
else one is taken on a helper thread, at most one at a time, and the collection waits for it at most
the timeout before the last good one is served (up to :data:`MAX_AGE_S` old). Kept apart from what a
snapshot reads: the rules that keep a hung NVML call from stalling a scrape or piling up threads, in one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["FRESH_FOR_S", "MAX_AGE_S", "SnapshotThread"]

FRESH_FOR_S = 0.5  # snapshots younger than this are shared between callbacks and readers
MAX_AGE_S = 60.0  # older than this, a stale snapshot is not served at all


class _Timed(Protocol):
    taken: float  # when it was taken, on time.monotonic()'s clock


S = TypeVar("S", bound=_Timed)


class SnapshotThread(Generic[S]):
    """Serves what ``take()`` returns, taken on a helper thread and bounded in time by ``timeout_s``.

    ``release()`` is called once after :meth:`close`, when no snapshot is in flight any more;
    ``warn(key, message, exc=False)`` reports a problem once per key.
    """

    def __init__(
        self,
        take: Callable[[], S],
        *,
        timeout_s: float,
        release: Callable[[], None],
        warn: Callable[..., None],
    ) -> None:
        self._take_snapshot = take
        self._timeout_s = timeout_s
        self._release = release
        self._warn_once = warn
        self._lock = threading.Lock()
        self._last: S | None = None
        self._inflight: threading.Event | None = None
        self._impatient_until = 0.0
        self._closed = False

    def current(self) -> tuple[S | None, float]:
        """The snapshot to report and its age in seconds; (None, 0) when there is none worth serving."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last.taken < FRESH_FOR_S:
                return self._last, now - self._last.taken
            if self._closed:
                inflight: threading.Event | None = None
            elif self._inflight is None:
                self._inflight = threading.Event()
                threading.Thread(target=self._take, name="openlora-otel-nvml", daemon=True).start()
                inflight = self._inflight
            elif now < self._impatient_until:
                inflight = None  # this collection already waited once for the stuck snapshot
            else:
                inflight = self._inflight
        if inflight is not None and not inflight.wait(self._timeout_s):
            with self._lock:
                self._impatient_until = time.monotonic() + FRESH_FOR_S
            self._warn_once(
                "slow",
                f"an NVML snapshot took longer than {self._timeout_s:g} s; serving the last good one "
                "(see openlora.gpu.snapshot.age)",
            )
        with self._lock:
            snapshot = self._last
        if snapshot is None:
            return None, 0.0
        age = time.monotonic() - snapshot.taken
        if age > MAX_AGE_S:
            return None, age
        return snapshot, age

    def close(self) -> None:
        """Take no more snapshots and call ``release`` now, or when the snapshot in flight is done."""
        with self._lock:
            self._closed = True
            busy = self._inflight is not None
        if not busy:
            self._release()

    def _take(self) -> None:
        try:
            snapshot = self._take_snapshot()
            with self._lock:
                self._last = snapshot
        except Exception:  # pragma: no cover - a snapshot catches per device; belt and braces
            self._warn_once("snapshot", "taking an NVML snapshot failed", exc=True)
        finally:
            with self._lock:
                event, self._inflight = self._inflight, None
                closed = self._closed
            if closed:
                self._release()
            if event is not None:
                event.set()

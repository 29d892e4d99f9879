"""`DivergenceGuard`: notice a diverged run (NaN losses, a loss spike) without adding a sync to the step.

The guard judges only values already on the host: each collection's read-back and its own check
every ``check_interval_s``, so it trips up to that interval plus one device read-back after the bad
step. A trip is latched, counted and handed to ``on_trip`` on a thread of its own.
See docs/getting-started/training-loop.md.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DivergenceGuard", "Trip"]

_logger = logging.getLogger(__name__)

# Weight of the newest window's mean loss in the spike rule's baseline.
_BASELINE_WEIGHT = 0.2


@dataclass(frozen=True)
class Trip:
    """Why a guard tripped: ``reason`` is ``nonfinite_loss`` or ``loss_spike``; ``detail`` says what it saw."""

    reason: str
    detail: str
    steps: int  # optimizer steps recorded when the guard noticed it (the lag is a few)


@dataclass(frozen=True)
class LossWindow:
    """What the guard is shown of one window's losses (all host values)."""

    count: int  # finite losses
    nonfinite: int
    trailing: int  # non-finite losses at the end of the window, in a row
    highest: float  # largest finite loss; -inf when count is 0
    total: float  # sum of the finite losses
    steps: int  # optimizer steps recorded so far, in all


class DivergenceGuard:
    """Trips when the loss goes non-finite N times in a row, or (optionally) spikes.

    ``nonfinite_losses``: N >= 1, or None to turn that rule off.
    ``spike_factor``: F > 1, or None (the default) to turn the spike rule off.
    ``spike_min_steps``: finite losses to see before the spike rule applies.
    ``check_interval_s``: how often the guard reads back the current window
    itself, between collections (0.05 to 3600).
    ``on_trip``: called once per trip with the :class:`Trip`.
    """

    def __init__(
        self,
        *,
        nonfinite_losses: int | None = 3,
        spike_factor: float | None = None,
        spike_min_steps: int = 100,
        check_interval_s: float = 1.0,
        on_trip: Callable[[Trip], Any] | None = None,
    ) -> None:
        if nonfinite_losses is not None and (
            isinstance(nonfinite_losses, bool) or not isinstance(nonfinite_losses, int) or nonfinite_losses < 1
        ):
            raise ValueError(f"nonfinite_losses must be an integer >= 1 or None, got {nonfinite_losses!r}")
        if spike_factor is not None and not (
            isinstance(spike_factor, (int, float)) and math.isfinite(spike_factor) and spike_factor > 1
        ):
            raise ValueError(f"spike_factor must be a finite number > 1 or None, got {spike_factor!r}")
        if isinstance(spike_min_steps, bool) or not isinstance(spike_min_steps, int) or spike_min_steps < 0:
            raise ValueError(f"spike_min_steps must be an integer >= 0, got {spike_min_steps!r}")
        if not (isinstance(check_interval_s, (int, float)) and 0.05 <= check_interval_s <= 3600):
            raise ValueError(f"check_interval_s must be a number from 0.05 to 3600, got {check_interval_s!r}")
        if on_trip is not None and not callable(on_trip):
            raise TypeError(f"on_trip must be callable, got {type(on_trip).__name__}")
        if nonfinite_losses is None and spike_factor is None:
            raise ValueError("both rules are off (nonfinite_losses=None, spike_factor=None): nothing to guard")
        self.nonfinite_losses = nonfinite_losses
        self.spike_factor = None if spike_factor is None else float(spike_factor)
        self.spike_min_steps = spike_min_steps
        self.check_interval_s = float(check_interval_s)
        self._on_trip = on_trip
        self._lock = threading.Lock()
        self._trip: Trip | None = None
        self._count_trip: Callable[[str], None] | None = None
        self._steps_now: Callable[[], int] | None = None
        self._thread: threading.Thread | None = None  # the check thread start() runs
        # Steps recorded when reset() was called: losses from before it never count again
        # (they may still sit in the window the next look reads).
        self._steps_at_reset = 0
        # State from complete windows only; a check of the current window reads it, never changes it.
        self._run = 0  # non-finite losses in a row at the end of the complete windows
        self._baseline: float | None = None
        self._finite_seen = 0

    @property
    def tripped(self) -> bool:
        """True once a rule tripped (cheap: one attribute read; check it after every step)."""
        return self._trip is not None

    @property
    def trip(self) -> Trip | None:
        """The trip, or None."""
        return self._trip

    def reset(self) -> None:
        """Clear the trip and the history (after restoring a checkpoint, say).

        Losses recorded before the reset no longer count, even those a later look
        still finds in the current window: a run of non-finite losses is capped at
        the steps recorded since the reset.
        """
        with self._lock:
            self._trip = None
            self._run = 0
            self._baseline = None
            self._finite_seen = 0
            self._steps_at_reset = self._steps_now() if self._steps_now is not None else 0

    # -- what the training collection calls (openlora_otel.training.collection) ------------
    # Application code need not call these: TrainingMetrics.attach_guard() sets them going.
    def bind(self, count_trip: Callable[[str], None], steps_now: Callable[[], int]) -> None:
        """Count each trip with ``count_trip(reason)``; ``steps_now()`` gives the steps recorded so far."""
        with self._lock:
            self._count_trip = count_trip
            self._steps_now = steps_now

    def start(self, check: Callable[[], None], stop: threading.Event) -> None:
        """Call ``check()`` every ``check_interval_s`` on a thread of the guard's own until ``stop`` is set.

        ``check`` shows the guard the current window (:meth:`observe`, ``complete=False``); it must not
        raise. A daemon thread: it never holds up the interpreter's exit.
        """
        self._thread = threading.Thread(
            target=self._check_every, args=(check, stop), name="openlora-otel-guard", daemon=True
        )
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """After ``stop`` is set, wait (at most ``timeout_s``) for the check thread to end; True when none is
        left running (also when called from that thread, or when none was started)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def observe(self, window: LossWindow, *, complete: bool) -> Trip | None:
        """Judge a window; a ``complete`` window also moves the history on (caller serialises the calls).

        Returns a new trip, which the caller hands to :meth:`fire` once it holds no lock.
        """
        with self._lock:
            run = window.trailing if window.count else self._run + window.nonfinite
            run = min(run, max(window.steps - self._steps_at_reset, 0))
            trip: Trip | None = None
            if self._trip is None:
                if self.nonfinite_losses is not None and run >= self.nonfinite_losses:
                    trip = Trip(
                        "nonfinite_loss",
                        f"{run} non-finite losses in a row (the limit is {self.nonfinite_losses})",
                        window.steps,
                    )
                elif (
                    self.spike_factor is not None
                    and window.count
                    and self._baseline is not None
                    and self._baseline > 0
                    and self._finite_seen >= self.spike_min_steps
                    and window.highest > self.spike_factor * self._baseline
                ):
                    trip = Trip(
                        "loss_spike",
                        f"loss {window.highest:.6g} is over {self.spike_factor:g} x the recent mean "
                        f"{self._baseline:.6g}",
                        window.steps,
                    )
                if trip is not None:
                    self._trip = trip
            if complete:
                self._run = run
                if window.count:
                    mean = window.total / window.count
                    self._baseline = (
                        mean
                        if self._baseline is None
                        else _BASELINE_WEIGHT * mean + (1 - _BASELINE_WEIGHT) * self._baseline
                    )
                    self._finite_seen += window.count
        return trip

    def fire(self, trip: Trip) -> None:
        """Log and count a trip; hand it to ``on_trip`` on a thread of its own.

        Its own thread: the hook may flush the telemetry, post to a chat or take
        seconds, and neither a scrape (whose collection found the trip) nor the
        guard's checks should wait for it or deadlock on it.
        """
        _logger.warning("openlora-otel: divergence guard tripped: %s", trip.detail)
        if self._count_trip is not None:
            self._count_trip(trip.reason)
        if self._on_trip is not None:
            threading.Thread(target=self._call_hook, args=(trip,), name="openlora-otel-on-trip", daemon=True).start()

    def _check_every(self, check: Callable[[], None], stop: threading.Event) -> None:
        while not stop.wait(self.check_interval_s):
            check()

    def _call_hook(self, trip: Trip) -> None:
        try:
            self._on_trip(trip)  # type: ignore[misc]
        except Exception:
            _logger.warning("openlora-otel: the divergence guard's on_trip hook raised", exc_info=True)

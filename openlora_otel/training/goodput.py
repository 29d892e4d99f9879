"""Where a training process's wall time went: goodput and badput by cause.

:class:`PhaseClock` puts every second from the process's start into one phase
(``names.TRAINING_PHASES``), added to ``openlora.training.time`` at each collection. It moves only on
phase changes, the first step and collections, so the step path pays one attribute test.
:class:`ProgressFile` keeps a run's highest step next to its checkpoints, so that the next attempt
knows which steps it does again. See docs/concepts/run-identity.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from openlora_otel.files import NotARegularFile, read_regular_file
from openlora_otel.names import TRAINING_PHASES

__all__ = ["MARKED_PHASES", "STALL_S", "PhaseClock", "ProgressFile", "process_start_time"]

_logger = logging.getLogger(__name__)

# Phases application code (and the callbacks) mark; the others the clock tells itself.
MARKED_PHASES = ("evaluation", "checkpoint_save", "checkpoint_load")
# No step for this long (or ten step intervals, if longer) is a stall: idle from then on.
STALL_S = 60.0
_STALL_INTERVALS = 10
_INT64_MAX = 2**63 - 1  # what OTLP carries: a counter never gets more
# The progress file is one short JSON object (under 200 bytes); a larger one is not ours.
_MAX_FILE_BYTES = 64 * 1024


# Only the first clock of a process starts at the process's start; a later one (a second
# trainer.train() with a fresh Telemetry) starts when it is built, so no second counts the first's time.
_first_clock_lock = threading.Lock()
_first_clock_taken = False


def _claim_process_start() -> bool:
    global _first_clock_taken
    with _first_clock_lock:
        taken, _first_clock_taken = _first_clock_taken, True
        return not taken


def process_start_time() -> float | None:
    """The wall-clock time this process started (Linux ``/proc``), or None where it cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Mark:
    """What ``phase()`` returns: a context manager that enters the phase and leaves it (cheap, reusable)."""

    __slots__ = ("_clock", "_phase")

    def __init__(self, clock: PhaseClock, phase: str) -> None:
        self._clock = clock
        self._phase = phase

    def __enter__(self) -> _Mark:
        self._clock._enter(self._phase)
        return self

    def __exit__(self, *exc: object) -> None:
        self._clock._leave(self._phase)


class PhaseClock:
    """Seconds per phase for one process; :meth:`take` hands over what accrued since its last call.

    ``started``: ``perf_counter()`` reading of the process's start (default: read
    from ``/proc``, else now). Thread-safe; marks are cheap (a lock and a clock read).
    """

    def __init__(self, *, started: float | None = None) -> None:
        now = time.perf_counter()
        if started is None:
            wall = process_start_time() if _claim_process_start() else None
            # The process's start on the perf_counter() clock; never after now, never before a day ago
            # (a container whose /proc reports the host's boot oddly must not book a day of startup).
            started = now - min(max(0.0, time.time() - wall), 86400.0) if wall is not None else now
        self._lock = threading.Lock()
        self._marks = {phase: _Mark(self, phase) for phase in MARKED_PHASES}
        self._spent = dict.fromkeys(TRAINING_PHASES, 0.0)
        # The phase the clock is in now (training between steps is `productive` until the
        # collection splits it), since when, and the marks entered (innermost last).
        self._state = "startup"
        self._since = started
        self._stack: list[tuple[str, str]] = []  # (mark, the phase it interrupted)
        self._first_step: float | None = None
        self._last_step: float | None = None
        self._interval = 0.0  # the latest time between two steps
        # Since when the clock has been waiting for a step while in `productive`: the latest step, or
        # the end of a mark that returned to steps (a long evaluation is no stall).
        self._waiting_since: float | None = None
        self.stalled = False  # read by the step path: a step after a stall ends it
        self._closed = False
        # Global step: where this attempt resumed, steps counted since, and the highest step an
        # earlier attempt reached (steps up to it are done again).
        self._resumed_at = 0
        self._steps = 0
        self._reached = 0
        self._lost_steps_pending = 0

    # -- marks ------------------------------------------------------------------
    def phase(self, name: str) -> _Mark:
        """A context manager for one of :data:`MARKED_PHASES`: its time counts as that phase."""
        try:
            return self._marks[name]
        except (KeyError, TypeError):
            raise ValueError(f"phase must be one of {', '.join(MARKED_PHASES)}, got {name!r}") from None

    def _enter(self, phase: str) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._closed:
                return
            self._book(now)
            self._stack.append((phase, self._state))
            self._state = phase

    def _leave(self, phase: str) -> None:
        now = time.perf_counter()
        with self._lock:
            stack = self._stack
            if self._closed or not stack:
                return
            self._book(now)
            if stack[-1][0] == phase:  # the usual case: the innermost mark ends
                self._state = stack.pop()[1]
                if self._state == "productive" and self._waiting_since is not None:
                    self._waiting_since = now
                return
            # An outer mark left first: the one inside it now returns to what the outer one interrupted.
            for i in range(len(stack) - 2, -1, -1):
                if stack[i][0] == phase:
                    _, before = stack.pop(i)
                    stack[i] = (stack[i][0], before)
                    return

    # -- steps --------------------------------------------------------------------
    def first_step(self, now: float) -> None:
        """The first step was recorded at ``now`` (``perf_counter()``): start-up ends there."""
        with self._lock:
            if self._first_step is not None or self._closed:
                return
            self._first_step = now
            self._waiting_since = now
            if self._state == "startup":
                self._spent["startup"] += max(0.0, now - self._since)
                self._since = now
                self._state = "productive"
            else:  # inside a mark: what it interrupted was start-up, and steps follow it
                self._stack = [(m, "productive" if b == "startup" else b) for m, b in self._stack]

    def unstall(self, now: float) -> None:
        """A step arrived after a stall: idle until now, steps again from here."""
        with self._lock:
            if self._closed:
                return
            if self.stalled:
                self._book(now)
                if self._state == "idle":
                    self._state = "productive"
                # A mark opened during the stall returns to steps, not to the stall.
                self._stack = [(m, "productive" if b == "idle" else b) for m, b in self._stack]
                self._waiting_since = now
            self.stalled = False

    def resumed(self, step: int, reached: int | None = None) -> int:
        """This attempt continues from global step ``step``; an earlier attempt reached ``reached``.

        Returns the steps lost (``reached - step``, at least 0): the next that many
        steps count as ``lost_progress``.
        """
        with self._lock:
            self._resumed_at = step
            self._steps = 0
            lost = min(max(0, (reached or 0) - step), _INT64_MAX)
            self._reached = max(self._reached, reached or 0)
            self._lost_steps_pending += lost
            return lost

    @property
    def global_step(self) -> int:
        """The step this attempt has reached: where it resumed plus the steps counted since."""
        return self._resumed_at + self._steps

    def take_lost_steps(self) -> int:
        with self._lock:
            lost, self._lost_steps_pending = self._lost_steps_pending, 0
            return min(lost, _INT64_MAX)

    # -- collection ---------------------------------------------------------------
    def take(
        self, now: float, *, steps: int = 0, data_wait: float = 0.0, last_step: float | None = None
    ) -> dict[str, float]:
        """Seconds per phase since the previous call, given the window the collection took.

        ``steps``, ``data_wait`` and ``last_step``: the window's step count, its data
        waits and the ``perf_counter()`` of its latest step. Phases with no time are left out.
        """
        with self._lock:
            global_before = self.global_step
            self._steps += steps
            if last_step is not None:
                if self._last_step is not None and steps:
                    self._interval = (last_step - self._last_step) / steps
                self._last_step = last_step
                if self._waiting_since is None or last_step > self._waiting_since:
                    self._waiting_since = last_step
            if self._state == "productive" and not self._closed and self._waiting_since is not None:
                stall_after = max(STALL_S, _STALL_INTERVALS * self._interval)
                if now - self._waiting_since > stall_after:
                    # Booked as steps up to the stall's start, idle from there.
                    self._book(max(self._since, self._waiting_since + stall_after))
                    self._state = "idle"
                    self.stalled = True
            self._book(now)
            spent, self._spent = self._spent, dict.fromkeys(TRAINING_PHASES, 0.0)
            redone = min(steps, self._reached - global_before) if steps and self._reached > global_before else 0
        # Split the time between steps: data waits, steps done again, the rest productive.
        between = spent["productive"]
        waited = min(max(0.0, data_wait), between)
        spent["data_wait"] += waited
        between -= waited
        if redone:
            spent["lost_progress"] += between * redone / steps
            between -= between * redone / steps
        spent["productive"] = between
        return {phase: seconds for phase, seconds in spent.items() if seconds > 0.0}

    def close(self, now: float, *, last_step: float | None = None) -> None:
        """The process is ending: from its last step on (``last_step``, the ``perf_counter()`` of the latest
        step recorded, collected or not), time is idle; before any step, it stays start-up."""
        with self._lock:
            if self._closed:
                return
            if last_step is None or (self._last_step is not None and self._last_step > last_step):
                last_step = self._last_step
            if self._state == "productive":
                # Time after the last step is not a step's: idle from there.
                if last_step is not None and last_step > self._since:
                    self._book(min(last_step, now))
                self._state = "idle"
            self._stack.clear()
            self._closed = True

    def _book(self, now: float) -> None:
        """Add the time since ``_since`` to the current phase (lock held)."""
        elapsed = now - self._since
        if elapsed > 0.0:
            self._spent[self._state] += elapsed
            self._since = now


class ProgressFile:
    """The highest global step a run reached, kept in a small JSON file across its attempts.

    ``{"run_id": ..., "step": ..., "attempt": ..., "time": ...}``, replaced atomically.
    A run resuming from a checkpoint reads it to learn how far the previous attempt got.
    Errors are logged once and never raised: telemetry must not stop training.
    """

    NAME = "openlora-progress.json"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        # A directory (existing or not: the checkpoints may come later) gets the file inside it; a
        # path ending in .json is the file itself.
        self.path = path if path.suffix == ".json" else path / self.NAME
        self._written = -1
        self._warned = False

    def read(self) -> dict[str, Any] | None:
        """What the file holds, or None when it is missing or unreadable (not a regular file, larger than
        64 KiB, not JSON, no step count: warned once)."""
        try:
            data = json.loads(read_regular_file(self.path, max_bytes=_MAX_FILE_BYTES))
        except FileNotFoundError:
            return None
        except NotARegularFile as exc:  # a FIFO would block, /dev/zero never end: refused, unread
            self._warn(f"could not read {exc}; ignored")
            return None
        except (OSError, ValueError, RecursionError) as exc:
            self._warn(f"could not read {self.path}: {exc}")
            return None
        step = data.get("step") if isinstance(data, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= _INT64_MAX:
            self._warn(f"{self.path} holds no step count; ignored")
            return None
        return data

    def reached(self) -> int | None:
        """The highest step recorded, or None."""
        data = self.read()
        return None if data is None else data["step"]

    def earlier_attempt(self, step: int, *, run_id: str) -> int | None:
        """How far an earlier attempt got, for an attempt that starts at ``step``; None when unknown.

        At step 0 only a file of ``run_id`` counts: another run id's file is a different run's (a new
        run in a reused directory). Resuming from a checkpoint (``step`` > 0) in this directory is this
        run's, whatever id the file names (the id may be random per process).
        """
        data = self.read()
        if data is None or (step == 0 and data.get("run_id") != run_id):
            return None
        return data["step"]

    def write(self, step: int, *, run_id: str, attempt: int) -> None:
        """Record ``step`` if it is higher than what this object last wrote and than the file holds for
        ``run_id`` (a file another run id left is replaced)."""
        if step <= self._written:
            return
        if self._written < 0:
            previous = self.read()
            if previous is not None and previous.get("run_id") == run_id and previous["step"] > step:
                self._written = previous["step"]
                return
        # Unique per writer: ranks on several nodes may share the directory (and a PID, in containers).
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"run_id": run_id, "step": step, "attempt": attempt, "time": time.time()}))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._warn(f"could not write {self.path}: {exc}")
            return
        self._written = step

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            _logger.warning("openlora-otel: %s", message)

"""Divergence guard edge cases found in review (each failed on the first version of the guard).

reset() forgets what came before it; on_trip may flush the telemetry; a check of the current
window waits for a collection that is judging the previous one; a device slower than the
collection's 0.2 s poll still lets the guard's own check finish.
"""

from __future__ import annotations

import math
import threading

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.training import readback
from openlora_otel.training.guard import DivergenceGuard
from tests.support.readings import value

torch = pytest.importorskip("torch")


@pytest.fixture
def setup(memory_reader: InMemoryMetricReader):
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    yield telemetry, telemetry.training, memory_reader
    telemetry.shutdown()


# -- R1: reset() does not forget the non-finite losses that caused the trip -----------------
def test_reset_then_a_check_before_the_next_step_trips_again(setup) -> None:
    """A loop that restores a checkpoint and calls guard.reset() is tripped again by the old NaNs.

    The NaNs that tripped the guard are still in the current window (nothing collected yet):
    the guard's own check (every check_interval_s, so certainly during a checkpoint restore)
    or the next collection judges them again against the reset history.
    """
    _, training, _reader = setup
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=3600))
    for _ in range(3):
        training.record_step(loss=math.nan)
    training._collection._check_current_window(guard)  # what the guard thread does every check_interval_s
    assert guard.tripped
    guard.reset()  # "after restoring a checkpoint, say" (guard.py)
    training._collection._check_current_window(guard)  # the restore took longer than check_interval_s
    assert not guard.tripped, f"tripped again on losses recorded before reset(): {guard.trip}"


def test_reset_then_the_collection_trips_again(setup) -> None:
    _, training, reader = setup
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=3600))
    for _ in range(3):
        training.record_step(loss=math.nan)
    training._collection._check_current_window(guard)
    assert guard.tripped
    guard.reset()
    data = reader.get_metrics_data()  # a scrape during the restore
    assert not guard.tripped, f"tripped again on losses recorded before reset(): {guard.trip}"
    assert value(data, "openlora.training.guard.trips", **{"openlora.guard.reason": "nonfinite_loss"}) == 1


# -- R2: on_trip runs with Collection._guard_lock held ------------------------------------
def test_on_trip_can_flush_telemetry(setup) -> None:
    """on_trip=lambda t: telemetry.force_flush() (push the trip out now) can never succeed from the guard's thread.

    _check_current_window calls guard.observe (and so on_trip) with _guard_lock held; the flush's
    collection calls _roll, which waits for _guard_lock until force_flush's own bound gives up.
    Meanwhile that collection holds the SDK's collect lock, so every scrape waits too. With a
    plain provider.force_flush() / reader.collect() (no bound) it is a deadlock for ever.
    """
    telemetry, training, _reader = setup
    flushed: list[bool] = []

    def on_trip(trip: object) -> None:
        flushed.append(telemetry.force_flush(timeout_s=2.0))

    done = threading.Event()

    def on_trip_then_done(trip: object) -> None:
        on_trip(trip)
        done.set()

    guard = training.attach_guard(
        DivergenceGuard(nonfinite_losses=1, check_interval_s=3600, on_trip=on_trip_then_done)
    )
    training.record_step(loss=math.nan)
    training._collection._check_current_window(guard)  # what the guard thread does every check_interval_s
    assert guard.tripped
    assert done.wait(10), "on_trip never finished"
    assert flushed == [True], "force_flush from on_trip timed out waiting for _guard_lock"


# -- R3: the guard's check judges the current window against a history that is not up to date ---
class _SlowFloat:
    """A tensor-like (a 'foreign' value) whose read blocks until released: holds a collection
    between taking the window and judging it, as a CUDA read-back polled for up to 0.2 s does."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.reading = threading.Event()
        self.release = threading.Event()

    def numel(self) -> int:
        return 1

    def __float__(self) -> float:
        self.reading.set()
        assert self.release.wait(10)
        return self.value


def test_no_spurious_trip_while_a_collection_is_between_taking_and_judging(setup) -> None:
    """Losses: NaN NaN | 1.0 | NaN. Never 3 NaNs in a row, yet a limit of 3 trips.

    _roll swaps the window, then reads it back (up to 0.2 s on a GPU) and only then moves the
    guard's history on. A guard check of the NEW window in that gap adds its NaNs to the run of
    the windows before the one being read (2 + 1 = 3), the finite 1.0 not yet seen.
    """
    _, training, reader = setup
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=3600))
    training.record_step(loss=math.nan)
    training.record_step(loss=math.nan)
    reader.collect()  # history: a run of 2
    slow = _SlowFloat(1.0)
    training.record_step(loss=slow)  # a finite loss ends the run
    collector = threading.Thread(target=reader.collect, daemon=True)
    collector.start()
    assert slow.reading.wait(10)  # the collection has taken the window and is reading it back
    training.record_step(loss=math.nan)  # the next window: one NaN
    # The guard thread's check lands in the gap: it must wait for the collection to judge
    # the window it took (the 1.0) before judging the new one.
    checker = threading.Thread(target=training._collection._check_current_window, args=(guard,), daemon=True)
    checker.start()
    checker.join(0.3)
    slow.release.set()
    collector.join(10)
    checker.join(10)
    assert not guard.tripped, f"spurious trip: {guard.trip}"


# -- with no reader and a device more than 0.2 s behind, the guard's own check still sees it --
def test_guard_check_with_a_read_back_slower_than_the_poll(monkeypatch) -> None:
    """Each check starts a new read-back, polls it for 0.2 s (_READBACK_WAIT_S), then drops it and
    returns; the next check starts over. When the device is always more than 0.2 s behind the host
    (a deep kernel queue: the host runs ahead), no check ever completes, and with no reader (exporter
    none, which the docs say the own check covers) the guard never trips. The docs promise a lag of
    check_interval_s plus one device read-back. Simulated on CPU: a read-back takes 0.3 s to land."""
    import time

    real_init = readback._HostRead.__init__

    def init(self, tensor):
        real_init(self, tensor)
        self._landed = time.monotonic() + 0.3

    monkeypatch.setattr(readback._HostRead, "__init__", init)
    monkeypatch.setattr(readback._HostRead, "ready", lambda self: time.monotonic() >= self._landed)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    try:
        tripped = threading.Event()
        telemetry.training.attach_guard(
            DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05, on_trip=lambda trip: tripped.set())
        )
        for _ in range(5):
            telemetry.training.record_step(loss=torch.tensor(math.nan))
        assert tripped.wait(5), "5 NaN losses, check interval 0.05 s, read-back 0.3 s: no trip in 5 s"
    finally:
        telemetry.shutdown()


@pytest.mark.usefixtures("defer_cpu_tensors")  # kept CPU tensors stand in for a device far behind the host
def test_a_guard_check_waiting_on_the_device_is_gone_when_shutdown_returns(monkeypatch) -> None:
    """A check in the middle of a read-back (the device far behind the host) used to go on polling
    for up to 5 s after shutdown, a daemon thread touching the device while the interpreter exits
    (CUDA may be going away then). close() stops its wait; shutdown() joins the thread, bounded."""
    import time

    started = threading.Event()
    monkeypatch.setattr(readback._HostRead, "ready", lambda self: started.set() or False)  # never lands
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    telemetry.training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05))
    telemetry.training.record_step(loss=torch.tensor(1.0))
    assert started.wait(5), "the guard's check never started a read-back"
    began = time.monotonic()
    telemetry.shutdown()
    assert time.monotonic() - began < 1.5
    assert not [t for t in threading.enumerate() if t.name == "openlora-otel-guard" and t.is_alive()]

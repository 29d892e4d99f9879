"""Folding kept tensors: a failed fold is not retried on every step, memory stays bounded, MPS reduces in float32; close() never waits for the lock."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")


from openlora_otel.training import metrics as training_module  # noqa: E402
from openlora_otel.training import readback  # noqa: E402
from tests.support.readings import value  # noqa: E402

# CPU tensors stand in for device tensors here: kept and folded as on a GPU.
pytestmark = pytest.mark.usefixtures("defer_cpu_tensors")

FOLD_EVERY = training_module.FOLD_EVERY


class FailingFold:
    """Stands in for `fold_by_device` (the step path's fold), failing while ``failing`` is set."""

    def __init__(self) -> None:
        self.real = training_module.fold_by_device
        self.calls = 0
        self.failing = True

    def __call__(self, tensors: list[Any], torch: Any) -> list[Any]:
        self.calls += 1
        if self.failing:
            raise RuntimeError("fold failed (injected)")
        return self.real(tensors, torch)


def test_a_failed_fold_is_tried_once_per_window_not_once_per_step(
    setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    training, reader = setup
    fold = FailingFold()
    monkeypatch.setattr(training_module, "fold_by_device", fold)
    steps = 3 * FOLD_EVERY
    with caplog.at_level(logging.WARNING, logger="openlora_otel.training.metrics"):
        for step in range(steps):
            training.record_step(loss=torch.tensor(float(step % 7)))
    # Before the fix: one attempt per step from the 512th on (1025 here).
    assert fold.calls == 1
    assert len(training._recording.window.loss.deferred) == steps
    assert sum("folding kept tensors failed" in r.getMessage() for r in caplog.records) == 1
    # The collection still reads every kept value (its own reduction is not the failing one).
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(sum(s % 7 for s in range(steps)) / steps)
    assert value(data, "openlora.training.window.steps") == steps

    # The next window folds again, normally, once the cause is gone.
    fold.failing = False
    for _ in range(2 * FOLD_EVERY):
        training.record_step(loss=torch.tensor(2.0))
    assert fold.calls == 1 + 2
    assert len(training._recording.window.loss.deferred) == 0
    assert len(training._recording.window.loss.partials) == 2
    assert value(reader.get_metrics_data(), "openlora.training.loss") == pytest.approx(2.0)


def test_a_window_that_failed_again_tries_again_once(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    training, reader = setup
    fold = FailingFold()
    monkeypatch.setattr(training_module, "fold_by_device", fold)
    for window in range(3):
        for _ in range(2 * FOLD_EVERY):
            training.record_step(loss=torch.tensor(1.0))
        assert fold.calls == window + 1
        assert value(reader.get_metrics_data(), "openlora.training.loss") == pytest.approx(1.0)


def test_memory_stays_bounded_after_a_failed_fold_and_drops_are_counted(
    setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    training, reader = setup
    cap = 2 * FOLD_EVERY
    monkeypatch.setattr(training_module, "MAX_UNFOLDED", cap)
    fold = FailingFold()
    monkeypatch.setattr(training_module, "fold_by_device", fold)
    steps = cap + 1000
    for _ in range(steps):
        training.record_step(loss=torch.tensor(3.0), grad_norm=torch.tensor(0.5))
    assert len(training._recording.window.loss.deferred) == cap
    assert len(training._recording.window.grad.deferred) == cap
    assert fold.calls == 2  # one per series
    with caplog.at_level(logging.WARNING, logger="openlora_otel.training.metrics"):
        data = reader.get_metrics_data()
    # What was kept arrives; the rest is counted as dropped, and steps are still all counted.
    assert value(data, "openlora.training.loss") == pytest.approx(3.0)
    assert value(data, "openlora.training.window.steps") == cap
    assert value(data, "openlora.training.steps") == steps
    dropped = [r.getMessage() for r in caplog.records if "tensors dropped" in r.getMessage()]
    assert len(dropped) == 1 and f"{2 * (steps - cap)} loss" in dropped[0]


def test_a_collection_that_cannot_fold_either_drops_with_a_warning_and_no_stale_value(
    setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    training, reader = setup
    training.record_step(loss=1.5)
    assert value(reader.get_metrics_data(), "openlora.training.loss") == pytest.approx(1.5)

    calls = 0

    def broken(tensors: list[Any], torch: Any) -> Any:
        nonlocal calls
        calls += 1
        raise RuntimeError("device lost (injected)")

    monkeypatch.setattr(readback, "_fold", broken)
    for _ in range(3 * FOLD_EVERY):
        training.record_step(loss=torch.tensor(9.0))
    assert calls == 1
    with caplog.at_level(logging.WARNING, logger="openlora_otel.training.metrics"):
        data = reader.get_metrics_data()
    assert calls == 2  # one more attempt, at collection
    # Not frozen at 1.5: a window with nothing readable shows no loss.
    assert value(data, "openlora.training.loss") is None
    assert any("reading loss values failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("device_type", "dtype"),
    [("cpu", torch.float64), ("cuda", torch.float64), ("xpu", torch.float64), ("mps", torch.float32)],
)
def test_reduction_dtype_by_device_type(device_type: str, dtype: Any) -> None:
    assert readback._reduce_dtype(device_type, torch) is dtype


def test_a_device_without_float64_folds_in_float32(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand in for MPS on the CPU: the fold's partials must never be float64 there.
    monkeypatch.setattr(readback, "_NO_FLOAT64", frozenset({"cpu"}))
    training, reader = setup
    steps = 2 * FOLD_EVERY + 10
    for step in range(steps):
        loss = torch.tensor(float(step % 4), dtype=torch.bfloat16)
        training.record_step(loss=loss, grad_norm=torch.tensor(0.25))
    partials = training._recording.window.loss.partials
    assert partials and all(p.dtype == torch.float32 for p in partials)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(sum(s % 4 for s in range(steps)) / steps)
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(0.25)


def test_close_does_not_wait_for_the_lock(setup) -> None:
    training, _ = setup
    # The main thread holding the lock (stuck in a kernel launch inside a fold) must not
    # keep shutdown, or the SIGTERM exit thread, from closing.
    training._recording.lock.acquire()
    try:
        closer = threading.Thread(target=training.close, daemon=True)
        closer.start()
        closer.join(timeout=5.0)
        returned = not closer.is_alive()
    finally:
        training._recording.lock.release()
    closer.join(timeout=5.0)
    assert returned
    assert training._recording.closed
    training.record_step(loss=1.0)
    assert training._recording.window.steps == 0

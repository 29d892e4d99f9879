"""A run's health at a glance: window extremes, data wait, model FLOPs, eval non-finite, the divergence guard."""

from __future__ import annotations

import logging
import math
import random
import threading
import time

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.training import metrics as training_module
from openlora_otel.training import readback
from openlora_otel.training.guard import DivergenceGuard, Trip
from openlora_otel.training.metrics import TrainingMetrics
from tests.support.clock import FakeClock
from tests.support.readings import points, value

torch = pytest.importorskip("torch")


# -- 1. spikes stay visible ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["float", "cpu tensor"])
def test_one_spike_in_500_steps_is_reported_at_its_value(setup, kind: str) -> None:
    training, reader = setup
    wrap = float if kind == "float" else (lambda v: torch.tensor(v))
    for step in range(500):
        grad = 100.0 if step == 321 else 1.0 + 0.001 * (step % 7)
        training.record_step(loss=wrap(2.0 - step / 1000), grad_norm=wrap(grad))
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.gradient_norm.max") == pytest.approx(100.0)
    assert value(data, "openlora.training.gradient_norm") < 1.3  # the mean hides it: why max exists
    assert value(data, "openlora.training.gradient_norm.min") == pytest.approx(1.0)
    assert value(data, "openlora.training.loss.max") == pytest.approx(2.0)
    assert value(data, "openlora.training.loss.min") == pytest.approx(2.0 - 499 / 1000)


def test_extremes_survive_folds_on_the_device_and_ignore_non_finite(setup) -> None:
    training, reader = setup
    steps = 3 * training_module.FOLD_EVERY + 17  # several folds, then a tail of unfolded tensors
    for step in range(steps):
        loss = math.nan if step % 97 == 5 else (50.0 if step == 700 else 1.0)
        low = -3.0 if step == 1100 else 1.0  # a loss can be negative (a reward, a log-likelihood)
        training.record_step(loss=torch.tensor(min(loss, low) if step == 1100 else loss), grad_norm=math.inf)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss.max") == pytest.approx(50.0)
    assert value(data, "openlora.training.loss.min") == pytest.approx(-3.0)
    # No finite gradient norm at all: no extreme to report rather than an infinity.
    assert value(data, "openlora.training.gradient_norm.max") is None
    assert value(data, "openlora.training.gradient_norm.min") is None


def test_extremes_are_per_window_and_repeat_over_an_empty_one(setup) -> None:
    training, reader = setup
    training.record_step(loss=9.0)
    training.record_step(loss=1.0)
    reader.get_metrics_data()
    training.record_step(loss=2.0)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss.max") == 2.0  # the 9.0 belonged to the previous window
    data = reader.get_metrics_data()  # no step: the latest values stay, like the mean
    assert value(data, "openlora.training.loss.max") == 2.0


def _python_fold(values: list[float]) -> tuple[float, int, int, float, float, float, int]:
    finite = [v for v in values if math.isfinite(v)]
    trailing = 0
    for v in reversed(values):
        if math.isfinite(v):
            break
        trailing += 1
    return (
        math.fsum(finite), len(finite), len(values) - len(finite), values[-1],
        max(finite, default=-math.inf), min(finite, default=math.inf), trailing,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_fold_and_combine_match_a_plain_python_reduction(seed: int) -> None:
    rng = random.Random(seed)
    values = [rng.choice([math.nan, math.inf, -math.inf]) if rng.random() < 0.3 else rng.uniform(-5, 5) for _ in range(60)]
    if seed % 2:
        values[-9:] = [math.nan] * 9  # a run at the end that spans partials
    chunks, start = [], 0
    while start < len(values):
        size = rng.randint(1, 12)
        chunks.append(values[start : start + size])
        start += size
    partials = [readback._fold([torch.tensor(v, dtype=torch.float64) for v in chunk], torch) for chunk in chunks]
    got = readback.Folded.from_values(readback._combine(partials, torch).tolist())
    total, count, nonfinite, last, highest, lowest, trailing = _python_fold(values)
    assert got.total == pytest.approx(total)
    assert (got.count, got.nonfinite, got.trailing) == (count, nonfinite, trailing)
    assert (got.highest, got.lowest) == (pytest.approx(highest), pytest.approx(lowest))
    assert got.last == pytest.approx(last, nan_ok=True)


# -- 4. data wait -------------------------------------------------------------------
def test_data_wait_mean_and_fraction_of_wall_time(clock: FakeClock, setup) -> None:
    training, reader = setup
    training.record_step(loss=1.0, data_time_s=0.05)  # first call: a wait but no interval yet
    for _ in range(4):
        clock.sleep(0.2)
        # step_time_s is what the caller says the step took; the fraction uses wall time anyway
        training.record_step(loss=1.0, data_time_s=0.05, step_time_s=0.15)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.data_wait.duration") == pytest.approx(0.05)
    assert value(data, "openlora.training.data_wait.fraction") == pytest.approx(0.25)
    clock.sleep(0.2)
    training.record_step(loss=1.0)  # no data time given: the previous values stay
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.data_wait.fraction") == pytest.approx(0.25)


def test_data_wait_is_absent_until_given_and_validated(setup) -> None:
    training, reader = setup
    training.record_step(loss=1.0)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.data_wait.duration") is None
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="data_time_s must be finite and >= 0"):
            training.record_step(data_time_s=bad)
    with pytest.raises(TypeError, match="data_time_s must be a number"):
        training.record_step(data_time_s="0.1")
    assert training._recording.window.steps == 0  # a refused call records nothing


def test_a_wait_longer_than_the_interval_reads_as_all_waiting(clock: FakeClock, setup) -> None:
    training, reader = setup
    training.record_step()
    clock.sleep(0.1)
    training.record_step(data_time_s=0.3)  # measured by the caller over more than the interval
    assert value(reader.get_metrics_data(), "openlora.training.data_wait.fraction") == 1.0


# -- 5. model FLOPs ----------------------------------------------------------------
def test_achieved_flops_and_utilization(clock: FakeClock, setup) -> None:
    training, reader = setup
    training.set_model_flops(2e9, peak_flops=1e15)
    for _ in range(10):
        clock.sleep(0.1)
        training.record_step(tokens=5000)
    data = reader.get_metrics_data()  # 50 000 tokens in 1 s
    assert value(data, "openlora.model.flops_per_token") == 2e9
    assert value(data, "openlora.training.throughput.flops") == pytest.approx(1e14)
    assert value(data, "openlora.training.peak_flops") == 1e15
    assert value(data, "openlora.training.model_flops.utilization") == pytest.approx(0.1)


def test_no_peak_means_no_utilization(setup) -> None:
    training, reader = setup
    training.set_model_flops(1e6)
    training.record_step(tokens=10)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.throughput.flops") is not None
    assert value(data, "openlora.training.model_flops.utilization") is None
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="must be finite and > 0"):
            training.set_model_flops(bad)


def test_a_configured_peak_wins_over_the_table(memory_reader: InMemoryMetricReader, monkeypatch) -> None:
    monkeypatch.setenv("OPENLORA_PEAK_FLOPS", "2e14")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry(metric_readers=[memory_reader])
    try:
        training = telemetry.training
        training.set_model_flops(1e6, peak_flops=9e15)  # what a callback found in the table
        data = memory_reader.get_metrics_data()
        assert value(data, "openlora.training.peak_flops") == 2e14
    finally:
        telemetry.shutdown()


# -- 8. evaluation ----------------------------------------------------------------
def test_non_finite_evaluations_are_counted_per_metric(setup, caplog) -> None:
    training, reader = setup
    with caplog.at_level(logging.WARNING):
        training.record_eval(loss=math.nan, accuracy=0.5)
        training.record_eval(loss=math.inf, perplexity=math.inf)
        training.record_eval(loss=1.0, perplexity=3.0)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.eval.nonfinite", **{"openlora.eval.metric": "loss"}) == 2
    assert value(data, "openlora.training.eval.nonfinite", **{"openlora.eval.metric": "perplexity"}) == 1
    assert value(data, "openlora.training.eval.loss") == 1.0
    assert sum("eval.nonfinite counts it" in r.getMessage() for r in caplog.records) == 2  # once per name


# -- 2. the divergence guard ------------------------------------------------------
def test_guard_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="nonfinite_losses must be an integer >= 1"):
        DivergenceGuard(nonfinite_losses=0)
    with pytest.raises(ValueError, match="spike_factor must be a finite number > 1"):
        DivergenceGuard(spike_factor=1.0)
    with pytest.raises(ValueError, match="check_interval_s"):
        DivergenceGuard(check_interval_s=0)
    with pytest.raises(ValueError, match="nothing to guard"):
        DivergenceGuard(nonfinite_losses=None)
    with pytest.raises(TypeError, match="on_trip must be callable"):
        DivergenceGuard(on_trip="stop")  # type: ignore[arg-type]


def test_a_plain_loop_sees_the_flag_after_the_collection(setup) -> None:
    training, reader = setup
    trips: list[Trip] = []
    hooked = threading.Event()
    guard = training.attach_guard(
        DivergenceGuard(
            nonfinite_losses=3, check_interval_s=3600, on_trip=lambda trip: (trips.append(trip), hooked.set())
        )
    )
    for step in range(20):
        training.record_step(loss=torch.tensor(math.nan if step >= 10 else 1.0))
        if step in (9, 11):  # a collection: two NaNs in a row are not enough
            reader.get_metrics_data()
            assert not guard.tripped
    data = reader.get_metrics_data()
    assert hooked.wait(10)  # on_trip runs on a thread of its own
    assert guard.tripped and guard.trip is trips[0]
    assert guard.trip.reason == "nonfinite_loss" and "10 non-finite losses in a row" in guard.trip.detail
    assert guard.trip.steps == 20
    assert value(data, "openlora.training.loss.nonfinite") == 10  # the counters still count
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.guard.trips", **{"openlora.guard.reason": "nonfinite_loss"}) == 1
    assert value(data, "openlora.training.guard.trips", **{"openlora.guard.reason": "loss_spike"}) == 0


def test_a_run_of_non_finite_losses_spans_windows(setup) -> None:
    training, reader = setup
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=4, check_interval_s=3600))
    training.record_step(loss=1.0)
    for _ in range(3):  # one NaN per window: the run grows across collections
        training.record_step(loss=math.nan)
        reader.get_metrics_data()
    assert not guard.tripped
    training.record_step(loss=math.nan)
    reader.get_metrics_data()
    assert guard.tripped


def test_finite_loss_in_between_resets_the_run(setup) -> None:
    training, reader = setup
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=3, check_interval_s=3600))
    for loss in [math.nan, math.nan, 1.0, math.nan, math.nan, 2.0] * 20:
        training.record_step(loss=torch.tensor(loss))
    reader.get_metrics_data()
    assert not guard.tripped


def test_the_guard_checks_on_its_own_when_nothing_collects() -> None:
    # Exporter "none": no reader ever collects, and the guard still trips within its interval.
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    try:
        tripped = threading.Event()
        guard = telemetry.training.attach_guard(
            DivergenceGuard(nonfinite_losses=5, check_interval_s=0.05, on_trip=lambda trip: tripped.set())
        )
        for _ in range(5):
            telemetry.training.record_step(loss=torch.tensor(math.inf))
        assert tripped.wait(10), "the guard's own check never ran"
        assert guard.trip is not None and guard.trip.reason == "nonfinite_loss"
        assert telemetry.training._recording.window.steps == 5  # it looked without taking the window
    finally:
        telemetry.shutdown()


def test_the_spike_rule_compares_the_window_maximum_with_the_recent_mean(setup) -> None:
    training, reader = setup
    guard = training.attach_guard(
        DivergenceGuard(nonfinite_losses=None, spike_factor=10.0, spike_min_steps=50, check_interval_s=3600)
    )
    for window in range(5):
        for _ in range(20):
            training.record_step(loss=torch.tensor(2.0))
        if window == 1:
            training.record_step(loss=torch.tensor(30.0))  # too early: 40 losses seen so far
        reader.get_metrics_data()
    assert not guard.tripped
    for step in range(20):
        training.record_step(loss=torch.tensor(25.0 if step == 7 else 2.0))  # one step, 12x the mean
    reader.get_metrics_data()
    assert guard.trip is not None and guard.trip.reason == "loss_spike"
    assert "25 is over 10 x the recent mean" in guard.trip.detail
    guard.reset()
    assert not guard.tripped and guard.trip is None


def test_a_failing_hook_is_logged_and_survived(setup, caplog) -> None:
    training, reader = setup

    called = threading.Event()

    def hook(trip: Trip) -> None:
        called.set()
        raise RuntimeError("the pager is down")

    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=1, check_interval_s=3600, on_trip=hook))
    training.record_step(loss=math.nan)
    with caplog.at_level(logging.WARNING):
        data = reader.get_metrics_data()
        assert called.wait(10)
        hooks = [t for t in threading.enumerate() if t.name == "openlora-otel-on-trip"]
        for thread in hooks:
            thread.join(10)
    assert guard.tripped
    assert value(data, "openlora.training.loss.nonfinite") == 1  # the collection completed
    assert any("on_trip hook raised" in r.getMessage() for r in caplog.records)


def test_one_guard_per_training_metrics(setup) -> None:
    training, _ = setup
    guard = DivergenceGuard()
    assert training.attach_guard(guard) is guard
    assert training.attach_guard(guard) is guard  # the callbacks may attach the user's guard again
    with pytest.raises(ValueError, match="already attached"):
        training.attach_guard(DivergenceGuard())
    with pytest.raises(TypeError, match="takes a DivergenceGuard"):
        training.attach_guard(object())  # type: ignore[arg-type]


def test_the_guard_thread_stops_at_shutdown(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    telemetry.training.attach_guard(DivergenceGuard(check_interval_s=0.05))
    assert any(t.name == "openlora-otel-guard" for t in threading.enumerate())
    telemetry.shutdown()
    deadline = time.monotonic() + 5
    while any(t.name == "openlora-otel-guard" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "openlora-otel-guard" for t in threading.enumerate())


def test_a_guard_on_any_meter(memory_reader: InMemoryMetricReader) -> None:
    from opentelemetry.sdk.metrics import MeterProvider

    provider = MeterProvider(metric_readers=[memory_reader])
    training = TrainingMetrics(provider.get_meter("t"))
    guard = training.attach_guard(DivergenceGuard(nonfinite_losses=2, check_interval_s=3600))
    training.record_step(loss=math.nan)
    training.record_step(loss=math.nan)
    data = memory_reader.get_metrics_data()
    assert guard.tripped
    assert points(data, "openlora.training.guard.trips")
    training.close()
    provider.shutdown()

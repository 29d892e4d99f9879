"""TrainingMetrics read in memory: values after known step sequences, argument rules, threads, no reads on the step path."""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from decimal import Decimal

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.names import ADAPTER_METRICS, TRAINING_METRICS
from openlora_otel.training import collection as collection_module
from openlora_otel.training import metrics as training_module
from openlora_otel.training import readback
from openlora_otel.training.guard import DivergenceGuard
from openlora_otel.training.metrics import TrainingMetrics
from tests.support.clock import WALL_OFFSET, FakeClock
from tests.support.readings import points, value


def test_every_documented_instrument_is_exported(setup) -> None:
    training, reader = setup
    training.record_step(loss=1.0, grad_norm=1.0, learning_rate=0.1, tokens=1, samples=1, step_time_s=0.1)
    training.record_step(
        loss=1.0, grad_norm=1.0, learning_rate=0.1, tokens=1, samples=1, step_time_s=0.1, data_time_s=0.01
    )
    training.record_epoch(1)
    training.record_eval(loss=1.0, accuracy=0.5)
    training.record_eval(perplexity=math.nan)
    training.set_adapter(
        r=8, alpha=16, dropout=0.05, target_modules=["q", "v"], trainable_params=10, total_params=100
    )
    training.set_model_flops(1e6, peak_flops=1e12)
    training.attach_guard(DivergenceGuard())
    data = reader.get_metrics_data()
    exported = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    for spec in (*TRAINING_METRICS, *ADAPTER_METRICS):
        assert spec.name in exported, spec.name
        assert exported[spec.name].unit == spec.unit
        assert exported[spec.name].description == spec.description


def test_known_sequence_of_steps(clock: FakeClock, setup) -> None:
    training, reader = setup
    for loss in (2.0, 3.0, 4.0):
        clock.sleep(0.2)
        training.record_step(
            loss=loss, grad_norm=loss / 2, learning_rate=1e-4, tokens=100, samples=4, step_time_s=0.2
        )
    clock.sleep(0.4)  # window: 1.0 s in all
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(3.0)
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(1.5)
    assert value(data, "openlora.training.learning_rate") == pytest.approx(1e-4)
    assert value(data, "openlora.training.window.steps") == 3
    assert value(data, "openlora.training.steps") == 3
    assert value(data, "openlora.training.tokens") == 300
    assert value(data, "openlora.training.samples") == 12
    assert value(data, "openlora.training.throughput.tokens") == pytest.approx(300.0)
    assert value(data, "openlora.training.throughput.samples") == pytest.approx(12.0)
    [histogram] = points(data, "openlora.training.step.duration")
    assert (histogram.count, histogram.sum) == (3, pytest.approx(0.6))
    bounds = list(histogram.explicit_bounds)
    upper = bisect.bisect_left(bounds, 0.2)
    assert bounds[upper - 1] < 0.2 <= bounds[upper]
    assert histogram.bucket_counts[upper] == 3

    # Next window: two steps with other values; counters accumulate, gauges are per window.
    for loss in (1.0, 0.0):
        training.record_step(loss=loss, tokens=50, step_time_s=2.0)
    clock.sleep(1.0)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(0.5)
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(1.5)  # no new value: repeated
    assert value(data, "openlora.training.steps") == 5
    assert value(data, "openlora.training.tokens") == 400
    assert value(data, "openlora.training.throughput.tokens") == pytest.approx(100.0)
    [histogram] = points(data, "openlora.training.step.duration")
    assert (histogram.count, histogram.sum) == (5, pytest.approx(4.6))


def test_empty_windows_repeat_loss_but_throughput_falls_to_zero(clock: FakeClock, setup) -> None:
    training, reader = setup
    training.record_step(loss=2.0, tokens=100)
    clock.sleep(1.0)
    reader.get_metrics_data()
    clock.sleep(0.01)  # a second reader collecting right after: keep the previous rate
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.throughput.tokens") == pytest.approx(100.0)
    clock.sleep(30.0)  # training stalled
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(2.0)
    assert value(data, "openlora.training.throughput.tokens") == 0.0
    assert value(data, "openlora.training.window.steps") == 0


def test_auto_step_time_from_consecutive_calls(clock: FakeClock, setup) -> None:
    training, reader = setup
    training.record_step(loss=1.0)  # first call: no duration yet
    clock.sleep(0.5)
    training.record_step(loss=1.0)
    clock.sleep(1.0)
    training.record_step(loss=1.0)
    [histogram] = points(reader.get_metrics_data(), "openlora.training.step.duration")
    assert (histogram.count, histogram.sum) == (2, pytest.approx(1.5))


def test_non_finite_values_are_counted_not_averaged(setup) -> None:
    training, reader = setup
    training.record_step(loss=math.nan, grad_norm=math.inf)
    training.record_step(loss=math.inf, grad_norm=2.0)
    training.record_step(loss=1.0, grad_norm=math.nan)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == 1.0
    assert value(data, "openlora.training.gradient_norm") == 2.0
    assert value(data, "openlora.training.loss.nonfinite") == 2
    assert value(data, "openlora.training.gradient_norm.nonfinite") == 2
    # A window of only NaN keeps the last good mean instead of becoming NaN forever.
    training.record_step(loss=math.nan)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == 1.0
    assert value(data, "openlora.training.loss.nonfinite") == 3
    training.record_step(loss=0.5)
    assert value(reader.get_metrics_data(), "openlora.training.loss") == 0.5


def test_epoch_eval_and_adapter(setup) -> None:
    training, reader = setup
    training.record_epoch(1.5)
    training.record_eval(loss=0.75, accuracy=0.9, perplexity=Decimal("2.5"))
    training.set_adapter(
        r=16,
        alpha=32,
        dropout=0.1,
        target_modules=("q_proj", "v_proj"),
        trainable_params=250,
        total_params=1000,
    )
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.epoch") == 1.5
    assert value(data, "openlora.training.eval.loss") == 0.75
    assert value(data, "openlora.training.eval.value", **{"openlora.eval.metric": "accuracy"}) == 0.9
    assert value(data, "openlora.training.eval.value", **{"openlora.eval.metric": "perplexity"}) == 2.5
    assert value(data, "openlora.adapter.rank") == 16
    assert value(data, "openlora.adapter.alpha") == 32
    assert value(data, "openlora.adapter.dropout") == 0.1
    assert value(data, "openlora.adapter.target_modules") == 2
    assert value(data, "openlora.adapter.parameters.trainable") == 250
    assert value(data, "openlora.model.parameters") == 1000
    assert value(data, "openlora.adapter.trainable.ratio") == 0.25


def test_host_numbers_of_other_types_are_accepted(setup) -> None:
    training, reader = setup
    training.record_step(loss=2, grad_norm=Decimal("1.5"), learning_rate=0, tokens=True is False or 3)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == 2.0
    assert value(data, "openlora.training.gradient_norm") == 1.5
    assert value(data, "openlora.training.tokens") == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"loss": "0.5"}, TypeError, "loss must be a number"),
        ({"loss": True}, TypeError, "loss must be a number"),
        ({"loss": [1.0]}, TypeError, "loss must be a number"),
        ({"grad_norm": -1.0}, ValueError, "grad_norm must be >= 0"),
        ({"grad_norm": -2}, ValueError, "grad_norm must be >= 0"),
        ({"learning_rate": -1e-3}, ValueError, "learning_rate must be >= 0"),
        ({"tokens": -5}, ValueError, "tokens must be >= 0"),
        ({"tokens": 5.0}, TypeError, "tokens must be a non-negative integer"),
        ({"samples": "4"}, TypeError, "samples must be a non-negative integer"),
        ({"samples": False}, TypeError, "samples must be a non-negative integer"),
        ({"step_time_s": -0.1}, ValueError, "step_time_s must be finite and >= 0"),
        ({"step_time_s": math.inf}, ValueError, "step_time_s must be finite and >= 0"),
        ({"step_time_s": "fast"}, TypeError, "step_time_s must be a number"),
    ],
)
def test_wrong_types_raise_clear_errors(setup, kwargs, error, text) -> None:
    training, _ = setup
    with pytest.raises(error, match=text):
        training.record_step(**kwargs)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t: t.record_epoch(-1), ValueError),
        (lambda t: t.record_epoch("one"), TypeError),
        (lambda t: t.record_eval(loss="low"), TypeError),
        (lambda t: t.set_adapter(r=0, alpha=16), ValueError),
        (lambda t: t.set_adapter(r=8, alpha=16, dropout=1.5), ValueError),
        (lambda t: t.set_adapter(r=8, alpha=16, trainable_params=10, total_params=5), ValueError),
        (lambda t: t.set_adapter(r=8.5, alpha=16), TypeError),
    ],
)
def test_other_records_validate(setup, call, error) -> None:
    training, _ = setup
    with pytest.raises(error):
        call(training)


def test_many_threads_lose_no_step(setup) -> None:
    training, reader = setup

    def work() -> None:
        for _ in range(5000):
            training.record_step(loss=1.0, tokens=2, samples=1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    collector = threading.Thread(target=lambda: [reader.get_metrics_data() for _ in range(50)])
    for thread in [*threads, collector]:
        thread.start()
    for thread in [*threads, collector]:
        thread.join(timeout=60)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.steps") == 20000
    assert value(data, "openlora.training.tokens") == 40000
    assert value(data, "openlora.training.samples") == 20000


def test_calls_after_shutdown_are_ignored(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    training = telemetry.training
    assert telemetry.training is training  # one per handle
    training.record_step(loss=1.0, tokens=5)
    telemetry.shutdown()
    # What was recorded before shutdown stays for a final collection; nothing after it is taken.
    assert training._recording.window.steps == 1
    training.record_step(loss=9.0, tokens=5)
    training.record_values(loss=9.0)
    training.record_epoch(3)
    assert training._recording.window.steps == 1
    assert training._recording.window.loss.count == 1


class StandIn:
    """A tensor stand-in: any read (item, float, cpu, tolist, numpy) raises unless reading is allowed."""

    allow = False
    reads = 0

    def __init__(self, value: float) -> None:
        self._value = value

    def numel(self) -> int:
        return 1

    def _read(self) -> float:
        if not StandIn.allow:
            raise AssertionError("device read on the step path")
        StandIn.reads += 1
        return self._value

    def item(self) -> float:
        return self._read()

    def __float__(self) -> float:
        return self._read()

    def cpu(self):
        self._read()
        return self

    def tolist(self):
        return self._read()

    def numpy(self):
        return self._read()


def test_tensor_stand_ins_are_only_read_at_collection(setup) -> None:
    training, reader = setup
    StandIn.allow, StandIn.reads = False, 0
    for step in range(10_000):
        training.record_step(
            loss=StandIn(float(step % 4)), grad_norm=StandIn(2.0), learning_rate=StandIn(0.01)
        )
    assert StandIn.reads == 0
    StandIn.allow = True
    try:
        data = reader.get_metrics_data()
    finally:
        StandIn.allow = False
    assert value(data, "openlora.training.loss") == pytest.approx(1.5)
    assert value(data, "openlora.training.gradient_norm") == 2.0
    assert value(data, "openlora.training.learning_rate") == 0.01
    assert value(data, "openlora.training.window.steps") == 10_000


# -- argument types: NumPy values, odd tensors, absurd step times ------------------------------
class _NumelRaises:
    """A tensor-like whose numel() fails (a framework's array in a bad state)."""

    def numel(self) -> int:
        raise RuntimeError("numel is broken")


def _np():
    return pytest.importorskip("numpy")


def _torch():
    return pytest.importorskip("torch")


# (call, the value made lazily so NumPy and torch stay optional, error, text): each refused by that call.
ODD_ARGUMENTS = {
    "loss np.bool_": ("loss", lambda: _np().bool_(True), TypeError, "loss must be a real number, got a NumPy bool"),
    "loss 0-d bool array": ("loss", lambda: _np().array(True), TypeError, "got a NumPy bool"),
    "loss np.complex128": ("loss", lambda: _np().complex128(1 + 2j), TypeError, "got a NumPy complex128"),
    "loss 0-d str array": ("loss", lambda: _np().array("1.5"), TypeError, "got a NumPy <U3"),
    "loss 0-d object array": ("loss", lambda: _np().array(None, dtype=object), TypeError, "got a NumPy object"),
    "loss array (1,)": ("loss", lambda: _np().array([1.5]), ValueError, r"got a NumPy array of shape \(1,\)"),
    "loss array (2, 2)": ("loss", lambda: _np().ones((2, 2)), ValueError, r"NumPy array of shape \(2, 2\)"),
    "grad_norm np.float32 < 0": ("grad_norm", lambda: _np().float32(-1.0), ValueError, "grad_norm must be >= 0"),
    "grad_norm 0-d array < 0": ("grad_norm", lambda: _np().array(-1.0), ValueError, "grad_norm must be >= 0"),
    "loss sparse tensor": (
        "loss", lambda: _torch().tensor([1.5]).to_sparse(), ValueError, "loss is a torch.sparse_coo tensor; pass a dense"
    ),
    "loss numel() raises": ("loss", _NumelRaises, TypeError, r"_NumelRaises.numel\(\) raised RuntimeError: numel is b"),
    "loss meta tensor": ("loss", lambda: _torch().tensor(1.5, device="meta"), ValueError, "loss is a meta tensor"),
    "eval np.bool_": ("eval", lambda: _np().bool_(False), TypeError, "loss must be a real number, got a NumPy bool"),
    "eval array (2,)": ("eval", lambda: _np().array([1.0, 2.0]), ValueError, r"NumPy array of shape \(2,\)"),
    "eval meta tensor": ("eval", lambda: _torch().tensor(1.5, device="meta"), ValueError, "loss is a meta tensor"),
    "eval tensor (2,)": (
        "eval", lambda: _torch().tensor([1.0, 2.0]), ValueError, r"loss must be a one-element tensor, got shape \(2,\)"
    ),
    "eval complex tensor": ("eval", lambda: _torch().tensor(1 + 1j), TypeError, "got a torch.complex64 tensor"),
    "epoch np.bool_": ("epoch", lambda: _np().bool_(True), TypeError, "epoch must be a real number"),
    "step_time_s np.bool_": ("step_time_s", lambda: _np().bool_(True), TypeError, "step_time_s must be a real number"),
    "step_time_s 1e308": ("step_time_s", lambda: 1e308, ValueError, r"finite and >= 0, at most 86400 s \(one day\)"),
    "step_time_s a day and a half second": ("step_time_s", lambda: 86400.5, ValueError, "at most 86400 s"),
    "step_time_s np.float64 1e308": ("step_time_s", lambda: _np().float64(1e308), ValueError, "at most 86400 s"),
    "step_time_s int 10**6": ("step_time_s", lambda: 10**6, ValueError, "at most 86400 s"),
    "data_time_s 1e308": ("data_time_s", lambda: 1e308, ValueError, "data_time_s must be finite and >= 0, at most"),
}


def _record(training: TrainingMetrics, call: str, argument: object) -> None:
    if call == "eval":
        training.record_eval(loss=argument)
    elif call == "epoch":
        training.record_epoch(argument)  # type: ignore[arg-type]
    else:
        training.record_step(**{call: argument})


@pytest.mark.parametrize("case", list(ODD_ARGUMENTS))
def test_odd_argument_types_raise_type_or_value_errors_that_say_what_is_accepted(setup, case: str) -> None:
    training, reader = setup
    call, make, error, text = ODD_ARGUMENTS[case]
    with pytest.raises(error, match=text):
        _record(training, call, make())
    assert training._recording.window.steps == 0  # a refused call records nothing
    assert value(reader.get_metrics_data(), "openlora.training.eval.loss") is None


def test_numpy_scalars_and_0d_arrays_are_read_as_their_value_and_a_day_long_step_is_fine(setup) -> None:
    np = pytest.importorskip("numpy")
    training, reader = setup
    training.record_step(
        loss=np.array(2.5),
        grad_norm=np.array(3, dtype=np.int64),
        learning_rate=np.float32(0.5),
        step_time_s=86400.0,
        data_time_s=np.float64(1.0),
    )
    training.record_step(loss=np.float16(1.5), grad_norm=np.uint8(1), step_time_s=np.array(2.0))
    training.record_eval(loss=np.array(0.75), accuracy=np.float32(0.5))
    training.record_epoch(np.array(1))
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(2.0)
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(2.0)
    assert value(data, "openlora.training.learning_rate") == pytest.approx(0.5)
    assert value(data, "openlora.training.eval.loss") == pytest.approx(0.75)
    assert value(data, "openlora.training.epoch") == 1.0
    (duration,) = points(data, "openlora.training.step.duration")
    assert duration.count == 2 and duration.sum == pytest.approx(86402.0) and math.isfinite(duration.sum)


def test_a_callback_step_that_lasted_days_is_recorded_as_a_day_not_raised_into_the_trainer(
    setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openlora_otel.integrations import common

    training, reader = setup
    clock = FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", clock.perf_counter)
    step = common.StepClock()
    step.idle()
    clock.now += 3 * 86400.0  # the machine slept waiting for the batch, then in the step
    step.batch_started()
    clock.now += 2 * 86400.0
    step_time, data_time = step.step_ended()
    assert (step_time, data_time) == (86400.0, 86400.0)
    training.record_step(loss=1.0, step_time_s=step_time, data_time_s=data_time)
    (duration,) = points(reader.get_metrics_data(), "openlora.training.step.duration")
    assert duration.sum == 86400.0


def test_stand_in_with_several_elements_is_refused(setup) -> None:
    training, _ = setup

    class Vector(StandIn):
        def numel(self) -> int:
            return 3

    with pytest.raises(ValueError, match="exactly one element"):
        training.record_step(loss=Vector(1.0))


def test_gpu_read_back_not_ready_is_carried_to_the_next_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readback, "_READBACK_WAIT_S", 0.0)

    class Slow:
        def __init__(self, polls_until_ready: int, values: list[float]) -> None:
            self.left = polls_until_ready
            self._values = values

        def ready(self) -> bool:
            self.left -= 1
            return self.left < 0

        def values(self) -> list[float]:
            return self._values

    carry: list = []
    slow = Slow(polls_until_ready=3, values=[6.0, 3, 1, 2.0, 3.0, 1.0, 0])
    assert readback.poll_readbacks([("loss", [slow])], carry) == []
    assert carry == [("loss", [slow])]
    later: list = []
    assert readback.poll_readbacks(carry, later) == [
        ("loss", readback.Folded(6.0, 3, 1, 2.0, 3.0, 1.0, 0))
    ]
    assert later == []


def test_constructible_from_any_meter(memory_reader: InMemoryMetricReader) -> None:
    from opentelemetry.sdk.metrics import MeterProvider

    provider = MeterProvider(metric_readers=[memory_reader])
    training = TrainingMetrics(provider.get_meter("mine"))
    training.record_step(loss=4.0, tokens=1)
    assert value(memory_reader.get_metrics_data(), "openlora.training.loss") == 4.0
    provider.shutdown()


def test_a_failing_read_costs_only_its_own_values(setup, caplog: pytest.LogCaptureFixture) -> None:
    training, reader = setup
    StandIn.allow = False  # reads will raise at collection too
    training.record_step(loss=StandIn(1.0), grad_norm=3.0, tokens=7)
    training.record_step(loss=StandIn(1.0), grad_norm=3.0, tokens=7)
    data = reader.get_metrics_data()  # the scrape survives
    assert value(data, "openlora.training.gradient_norm") == 3.0
    assert value(data, "openlora.training.tokens") == 14
    assert value(data, "openlora.training.steps") == 2
    assert value(data, "openlora.training.loss") is None
    assert sum("reading loss values failed" in r.getMessage() for r in caplog.records) == 1
    reader.get_metrics_data()
    training.record_step(loss=StandIn(1.0))
    reader.get_metrics_data()
    assert sum("reading loss values failed" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_record_values_joins_the_window_without_counting_steps(setup) -> None:
    training, reader = setup
    training.record_step(tokens=10)
    training.record_step(tokens=10)
    training.record_values(loss=3.0, grad_norm=1.0, learning_rate=0.5)
    training.record_values(loss=1.0)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.steps") == 2
    assert value(data, "openlora.training.loss") == 2.0
    assert value(data, "openlora.training.learning_rate") == 0.5
    with pytest.raises(ValueError, match="grad_norm must be >= 0"):
        training.record_values(grad_norm=-1.0)
    with pytest.raises(TypeError):
        training.record_values(loss="x")


def test_training_on_a_disabled_telemetry_is_a_cheap_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = setup_telemetry()
    training = telemetry.training
    for _ in range(2000):
        training.record_step(loss=1.0, grad_norm=1.0, learning_rate=0.1, tokens=1, samples=1, step_time_s=0.1)
    training.record_eval(loss=1.0)
    training.set_adapter(r=4, alpha=8)
    # Validation still applies, so a disabled run catches the same mistakes.
    with pytest.raises(TypeError):
        training.record_step(loss="bad")
    assert training._recording.window.steps == 2000  # bounded state: counters, no per-step storage
    telemetry.shutdown()


# -- values that could not be exported, odd arguments ----------------------------------
@pytest.mark.parametrize(
    ("call", "text"),
    [
        (lambda t: t.record_step(tokens=2**63), "tokens must be <= 2\\*\\*63 - 1"),
        (lambda t: t.record_step(samples=2**64 + 1), "samples must be <= 2\\*\\*63 - 1"),
        (lambda t: t.set_adapter(r=8, alpha=16, total_params=2**63), "total_params must be <= 2\\*\\*63 - 1"),
        (lambda t: t.set_adapter(r=8, alpha=16, trainable_params=2**63), "trainable_params must be <="),
        (lambda t: t.set_adapter(r=2**63, alpha=16), "r must be <= 2\\*\\*63 - 1"),
        (lambda t: t.set_adapter(r=8, alpha=16, target_modules=2**63), "target_modules must be <="),
        (lambda t: t.record_step(loss=10**400), "loss is too large for a float"),
        (lambda t: t.record_step(step_time_s=10**400), "step_time_s is too large for a float"),
    ],
)
def test_values_that_cannot_be_exported_are_refused_at_the_call(setup, call, text) -> None:
    training, reader = setup
    with pytest.raises(ValueError, match=text):
        call(training)
    assert training._recording.window.steps == 0  # nothing recorded
    training.record_step(tokens=2**63 - 1)  # the largest count is fine
    assert value(reader.get_metrics_data(), "openlora.training.tokens") == 2**63 - 1


def test_a_cumulative_count_stops_at_int64_max_with_one_warning(
    setup, caplog: pytest.LogCaptureFixture
) -> None:
    training, reader = setup
    for _ in range(3):
        training.record_step(tokens=2**62, samples=1)  # the window's sum passes int64
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.tokens") == 2**63 - 1
    assert value(data, "openlora.training.samples") == 3
    training.record_step(tokens=5, samples=1)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.tokens") == 2**63 - 1
    assert value(data, "openlora.training.samples") == 4  # the others go on counting
    assert sum("2**63 - 1" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("alpha", "error"),
    [(-16, ValueError), (0, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("16", TypeError)],
)
def test_alpha_must_be_finite_and_positive(setup, alpha, error) -> None:
    training, _ = setup
    with pytest.raises(error, match="alpha"):
        training.set_adapter(r=8, alpha=alpha)


@pytest.mark.parametrize(
    ("modules", "count"),
    [
        ("q_proj", 1),
        (".*(q|v)_proj", 1),
        (["q_proj", "v_proj"], 2),
        ({"q_proj", "k_proj", "v_proj"}, 3),
        ((name for name in ("q_proj", "v_proj")), 2),
        (4, 4),
    ],
)
def test_target_modules_counts_names_not_characters(setup, modules, count) -> None:
    training, reader = setup
    training.set_adapter(r=8, alpha=16, target_modules=modules)
    assert value(reader.get_metrics_data(), "openlora.adapter.target_modules") == count


def test_target_modules_as_bytes_is_refused(setup) -> None:
    training, _ = setup
    with pytest.raises(TypeError, match="target_modules"):
        training.set_adapter(r=8, alpha=16, target_modules=b"q_proj")


def test_non_finite_eval_values_are_absent_with_one_warning(setup, caplog: pytest.LogCaptureFixture) -> None:
    training, reader = setup
    training.record_eval(loss=0.5, accuracy=0.9)
    training.record_eval(loss=math.inf, accuracy=math.nan, perplexity=2.0)
    for _ in range(4):
        data = reader.get_metrics_data()
        assert value(data, "openlora.training.eval.loss") is None
        assert value(data, "openlora.training.eval.value", **{"openlora.eval.metric": "accuracy"}) is None
        assert value(data, "openlora.training.eval.value", **{"openlora.eval.metric": "perplexity"}) == 2.0
    training.record_eval(loss=math.inf, accuracy=math.nan)  # the next evaluation is no better
    reader.get_metrics_data()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings  # one per metric name, none from the SDK per collection
    assert any("evaluation accuracy is nan" in w for w in warnings)
    training.record_eval(loss=0.25, accuracy=0.95)  # finite again: reported again
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.eval.loss") == 0.25
    assert value(data, "openlora.training.eval.value", **{"openlora.eval.metric": "accuracy"}) == 0.95


def test_one_unreadable_value_costs_only_itself(setup, caplog: pytest.LogCaptureFixture) -> None:
    training, reader = setup
    StandIn.allow = True
    try:

        class Broken(StandIn):
            def __float__(self) -> float:
                raise RuntimeError("device lost")

        training.record_step(loss=StandIn(2.0))
        training.record_step(loss=Broken(0.0))
        training.record_step(loss=StandIn(4.0))
        data = reader.get_metrics_data()
        assert value(data, "openlora.training.loss") == 3.0
        assert value(data, "openlora.training.window.steps") == 2
        training.record_step(loss=StandIn(5.0))
        assert value(reader.get_metrics_data(), "openlora.training.loss") == 5.0
        # A window where nothing could be read shows no value rather than a stale one...
        training.record_step(loss=Broken(0.0))
        assert value(reader.get_metrics_data(), "openlora.training.loss") is None
        # ...and the next readable window flows again.
        training.record_step(loss=StandIn(6.0))
        assert value(reader.get_metrics_data(), "openlora.training.loss") == 6.0
    finally:
        StandIn.allow = False
    assert sum("reading loss values failed" in r.getMessage() for r in caplog.records) == 1


# -- openlora.training.last_step.timestamp ---------------------------------------------
LAST_STEP = "openlora.training.last_step.timestamp"


def test_absent_until_the_first_step(setup) -> None:
    training, reader = setup
    training.record_epoch(0.5)
    training.record_eval(loss=1.0)
    assert points(reader.get_metrics_data(), LAST_STEP) == []
    training.record_step(loss=1.0)
    assert value(reader.get_metrics_data(), LAST_STEP) is not None


def test_the_latest_step_of_each_window_on_the_wall_clock(clock: FakeClock, setup) -> None:
    training, reader = setup
    clock.sleep(5.0)
    training.record_step(loss=1.0, step_time_s=0.1)
    clock.sleep(2.0)
    training.record_step(loss=1.0, step_time_s=0.1)
    latest = clock.now
    clock.sleep(3.0)  # collected 3 s after the step: the value is still the step's time
    assert value(reader.get_metrics_data(), LAST_STEP) == pytest.approx(latest + WALL_OFFSET)
    # No step since: the same time again, not the collection's.
    clock.sleep(10.0)
    assert value(reader.get_metrics_data(), LAST_STEP) == pytest.approx(latest + WALL_OFFSET)
    clock.sleep(1.0)
    training.record_step()
    assert value(reader.get_metrics_data(), LAST_STEP) == pytest.approx(clock.now + WALL_OFFSET)


def test_only_recorded_steps_move_it(clock: FakeClock, setup) -> None:
    training, reader = setup
    training.record_step(loss=1.0)
    stepped = clock.now
    clock.sleep(1.0)
    with pytest.raises(ValueError):
        training.record_step(loss=1.0, step_time_s=-1.0)  # refused: records nothing
    training.record_values(loss=2.0)  # values without a step
    training.record_eval(loss=1.0)
    assert value(reader.get_metrics_data(), LAST_STEP) == pytest.approx(stepped + WALL_OFFSET)
    training.close()
    clock.sleep(1.0)
    training.record_step(loss=1.0)  # after close(): ignored
    assert value(reader.get_metrics_data(), LAST_STEP) == pytest.approx(stepped + WALL_OFFSET)


def test_the_step_path_reads_no_wall_clock(monkeypatch: pytest.MonkeyPatch, setup) -> None:
    # The timestamp costs the step path one store of the perf_counter() it reads anyway.
    training, reader = setup

    class Counting(FakeClock):
        wall_reads = 0

        def time(self) -> float:
            Counting.wall_reads += 1
            return super().time()

    fake = Counting()
    monkeypatch.setattr(training_module, "time", fake)
    monkeypatch.setattr(collection_module, "time", fake)
    for _ in range(100):
        fake.sleep(0.01)
        training.record_step(loss=1.0, grad_norm=1.0, learning_rate=0.1, tokens=8, samples=1)
    assert Counting.wall_reads == 0
    assert value(reader.get_metrics_data(), LAST_STEP) == pytest.approx(fake.now + WALL_OFFSET)
    assert Counting.wall_reads == 1  # once per collection


def test_real_clocks_give_the_time_of_the_step(setup) -> None:
    training, reader = setup
    before = time.time()
    training.record_step(loss=1.0)
    after = time.time()
    time.sleep(0.05)  # the collection well after the step: stamping its own time would fail the bound
    stamped = value(reader.get_metrics_data(), LAST_STEP)
    # perf_counter() and time() advance together within microseconds over this span.
    assert before - 0.005 <= stamped <= after + 0.005


def test_each_reader_reports_the_steps_since_its_own_collection(clock: FakeClock) -> None:
    """Two readers (Prometheus and the history file, say) each see every step since their own last
    collection: a spike one of them collected is not lost to the other, and each mean and rate
    covers its own span. On a shared window the second reader would see only what came after."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    fast, slow = InMemoryMetricReader(), InMemoryMetricReader()
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[fast, slow])
    try:
        training = telemetry.training
        training.record_step(loss=1.0, grad_norm=1.0, tokens=100)
        training.record_step(loss=50.0, grad_norm=40.0, tokens=100)  # the spike
        clock.sleep(1.0)
        data = fast.get_metrics_data()
        assert value(data, "openlora.training.loss.max") == 50.0
        assert value(data, "openlora.training.throughput.tokens") == pytest.approx(200.0)
        training.record_step(loss=3.0, grad_norm=2.0, tokens=100)
        clock.sleep(1.0)
        data = fast.get_metrics_data()
        assert value(data, "openlora.training.loss.max") == 3.0
        assert value(data, "openlora.training.window.steps") == 1
        assert value(data, "openlora.training.throughput.tokens") == pytest.approx(100.0)

        data = slow.get_metrics_data()  # its first collection: the whole run so far
        assert value(data, "openlora.training.loss.max") == 50.0
        assert value(data, "openlora.training.loss.min") == 1.0
        assert value(data, "openlora.training.loss") == pytest.approx(18.0)
        assert value(data, "openlora.training.gradient_norm.max") == 40.0
        assert value(data, "openlora.training.window.steps") == 3
        assert value(data, "openlora.training.throughput.tokens") == pytest.approx(150.0)
        # Counters and the histogram were always per reader (cumulative in the SDK).
        assert value(data, "openlora.training.steps") == 3
        [histogram] = points(data, "openlora.training.step.duration")
        assert histogram.count == 2  # the first step has no duration

        clock.sleep(1.0)
        data = slow.get_metrics_data()  # nothing new for it: repeats the mean, rate falls to 0
        assert value(data, "openlora.training.loss") == pytest.approx(18.0)
        assert value(data, "openlora.training.throughput.tokens") == 0.0
    finally:
        telemetry.shutdown()


def test_cpu_tensors_are_read_at_once_and_never_folded_on_the_step(setup, monkeypatch) -> None:
    """A CPU tensor's value is ready: it is read as the number it is, nothing is kept, and no fold runs on
    the training thread (folding 512 kept tensors there stalled every 512th step: bench_step_tail.py)."""
    torch = pytest.importorskip("torch")
    from openlora_otel.training import metrics as training_module

    def no_fold(*args, **kwargs):
        raise AssertionError("a fold on the step path")

    monkeypatch.setattr(training_module, "fold_by_device", no_fold)
    training, reader = setup
    weight = torch.tensor(3.0, requires_grad=True)
    for _ in range(1200):
        training.record_step(loss=weight * 0.5, grad_norm=torch.tensor([1.5]), learning_rate=torch.tensor(1e-4))
    window = training._recording.window
    assert not window.loss.deferred and not window.grad.deferred and not window.lr.deferred
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == 1.5
    assert value(data, "openlora.training.gradient_norm") == 1.5
    # What the number path refuses, the tensor path refuses too.
    with pytest.raises(TypeError):
        training.record_step(loss=torch.tensor(True))
    with pytest.raises(TypeError):
        training.record_step(loss=torch.tensor(1 + 2j))
    with pytest.raises(ValueError, match="grad_norm must be >= 0"):
        training.record_step(loss=1.0, grad_norm=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="sparse"):
        training.record_step(loss=torch.tensor([2.0]).to_sparse())

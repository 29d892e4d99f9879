"""TrainingMetrics with real torch tensors: no host read on the step path, folding, forked DataLoader workers."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # noqa: E402

from openlora_otel import TelemetryConfig, setup_telemetry  # noqa: E402
from openlora_otel.exporters.outage import GuardedExporter  # noqa: E402
from tests.support.exporters import PidFileExporter, exporter_pids  # noqa: E402
from tests.support.host_reads import NoHostRead  # noqa: E402
from tests.support.readings import value  # noqa: E402

# CPU tensors stand in for device tensors here: kept and folded as on a GPU.
pytestmark = pytest.mark.usefixtures("defer_cpu_tensors")


def guarded(value: float, requires_grad: bool = False) -> torch.Tensor:
    tensor = torch.tensor(value, requires_grad=requires_grad)
    if requires_grad:
        tensor = tensor * 1.0  # a non-leaf with a grad_fn, like a real loss
    return tensor.as_subclass(NoHostRead)


def test_tensors_are_never_read_on_the_step_path(setup) -> None:
    training, reader = setup
    NoHostRead.allow, NoHostRead.blocked = False, []
    losses = []
    steps = 2000  # several folds of 512 on the step path
    for step in range(steps):
        loss = math.nan if step % 100 == 7 else float(step % 10)
        losses.append(loss)
        training.record_step(
            loss=guarded(loss, requires_grad=True), grad_norm=guarded(0.5), learning_rate=guarded(1e-3)
        )
    assert NoHostRead.blocked == []
    NoHostRead.allow = True
    try:
        data = reader.get_metrics_data()
    finally:
        NoHostRead.allow = False
    finite = [x for x in losses if math.isfinite(x)]
    assert value(data, "openlora.training.loss") == pytest.approx(sum(finite) / len(finite))
    assert value(data, "openlora.training.loss.nonfinite") == steps - len(finite)
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(0.5)
    assert value(data, "openlora.training.learning_rate") == pytest.approx(1e-3)
    assert value(data, "openlora.training.window.steps") == len(finite)


def test_memory_stays_flat_without_any_collection(setup) -> None:
    training, _ = setup
    for _ in range(20_000):
        training.record_step(loss=torch.tensor(1.0))
    series = training._recording.window.loss
    assert len(series.deferred) < 512
    assert len(series.partials) < 512


def test_multi_element_tensor_and_tensor_counts_are_refused(setup) -> None:
    training, _ = setup
    with pytest.raises(ValueError, match="one-element tensor"):
        training.record_step(loss=torch.ones(3))
    with pytest.raises(TypeError, match="would sync the device"):
        training.record_step(tokens=torch.tensor(5))
    # Durations too: float() of a CUDA tensor is a host read.
    for argument in ("step_time_s", "data_time_s"):
        with pytest.raises(TypeError, match=f"{argument} must be a Python number .*would sync the device"):
            training.record_step(**{argument: torch.tensor(0.05)})


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.tensor([float(index), float(os.getpid())])


@pytest.mark.process  # a forked child
def test_forked_dataloader_workers_export_nothing(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    reader = PeriodicExportingMetricReader(GuardedExporter(PidFileExporter(pids), describe="test"), 20)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[reader])
    loader = torch.utils.data.DataLoader(
        SlowDataset(), batch_size=1, num_workers=2, multiprocessing_context="fork", persistent_workers=False
    )
    worker_pids = set()
    for batch in loader:
        # Host floats: a child's collection must not stall on a tensor op after fork,
        # so that the duplicate export (if any) would really happen.
        telemetry.training.record_step(loss=float(batch[0, 0]), tokens=1)
        worker_pids.add(int(batch[0, 1]))
    telemetry.shutdown()
    exported = exporter_pids(pids)
    assert worker_pids and os.getpid() not in worker_pids
    assert exported == {os.getpid()}


def test_meta_tensors_are_refused_and_cpu_values_keep_flowing(setup) -> None:
    training, reader = setup
    meta = torch.tensor(1.0, device="meta")
    for window in range(3):
        losses = [float(window * 10 + i) for i in range(4)]
        for loss in losses:
            training.record_step(loss=torch.tensor(loss), grad_norm=torch.tensor(0.5))
            with pytest.raises(ValueError, match="meta tensor"):
                training.record_step(loss=meta)
            with pytest.raises(ValueError, match="meta tensor"):
                training.record_values(grad_norm=meta)
        data = reader.get_metrics_data()
        assert value(data, "openlora.training.loss") == pytest.approx(sum(losses) / len(losses))
        assert value(data, "openlora.training.steps") == 4 * (window + 1)  # refused calls count nothing


def test_a_device_that_fails_to_read_costs_only_its_values_and_never_freezes_the_gauge(
    setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor that passed validation but cannot be read at collection (its device went away).

    A meta tensor stands in for it: record_step refuses those, so it is put in the window
    directly, as a device failing between the step and the collection would leave it.
    """
    training, reader = setup
    meta = torch.tensor(9.0, device="meta")
    for step in range(600):  # past one fold of 512 on the CPU side
        training.record_step(loss=torch.tensor(float(step % 3)))
    with training._recording.lock:
        training._recording.window.loss.deferred.append(meta)
    data = reader.get_metrics_data()
    assert value(data, "openlora.training.loss") == pytest.approx(1.0)  # the CPU values, not dropped
    assert value(data, "openlora.training.window.steps") == 600

    with training._recording.lock:  # a window with nothing readable...
        training._recording.window.loss.deferred.append(meta)
    assert value(reader.get_metrics_data(), "openlora.training.loss") is None  # ...is no value, not a stale one
    training.record_step(loss=torch.tensor(7.0))
    assert value(reader.get_metrics_data(), "openlora.training.loss") == 7.0
    assert sum("reading loss values failed" in r.getMessage() for r in caplog.records) == 1

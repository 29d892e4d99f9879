"""GPU metrics without a GPU: the fake NVML checks names, units, attributes, exact values, selection and faults."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import ConfigError, MissingDependencyError, TelemetryConfig, setup_telemetry
from openlora_otel.hardware import gpu, gpu_reads, gpu_thread, nvml
from openlora_otel.hardware.gpu import GpuCollector
from openlora_otel.hardware.nvml import GpuError, GpuNotSupported, PynvmlBackend
from openlora_otel.names import GPU_METRICS
from tests.support.fake_nvml import FakeGpu, FakeNvml, fake_pynvml_module, h100s
from tests.support.gpu import SteppedTime, build, series
from tests.support.readings import served_series

# gpu.py's clock is stepped in every test here (tests/conftest.py's stepped_time).
pytestmark = pytest.mark.usefixtures("stepped_time")

# Per GPU and snapshot: the plain queries, one field-values call, and two GPM calls (Hopper).
PER_DEVICE_CALLS = len(gpu_reads.QUERIES) + 1 + 2
# Series present only after a second snapshot (GPM), with CUDA in this process, or after an XID.
LATER = {
    "openlora.gpu.sm.activity",
    "openlora.gpu.sm.occupancy",
    "openlora.gpu.tensor.activity",
    "openlora.gpu.dram.activity",
    "openlora.gpu.xid.errors",
}


def test_every_metric_name_unit_attribute_and_exact_value(collect) -> None:
    [card] = h100s(1, processes={42: 3 * 2**30, 7: 2**30})
    fake = FakeNvml([card], driver="580.82.07")  # a driver that numbers the hw_* throttle fields so
    reader, _ = build(fake)
    collect(reader)  # GPM needs two samples
    fake.inject_xid(card, 79)
    data = collect(reader)
    exported = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    for spec in GPU_METRICS:
        if spec.name.startswith("openlora.torch."):
            continue  # no CUDA in this process
        assert spec.name in exported, spec.name
        assert exported[spec.name].unit == spec.unit, spec.name
    identity = {
        "hw.id": card.uuid,
        "hw.name": "NVIDIA H100 80GB HBM3",
        "hw.vendor": "NVIDIA",
        "hw.model": "NVIDIA H100 80GB HBM3",
        "hw.driver_version": "580.82.07",
        "openlora.gpu.index": 0,
    }
    assert series(data, "hw.gpu.memory.usage") == [(identity, 10 * 2**30)]
    assert series(data, "hw.gpu.memory.limit") == [(identity, 80 * 2**30)]
    assert series(data, "hw.gpu.memory.utilization") == [(identity, 0.125)]
    assert sorted(series(data, "hw.gpu.utilization"), key=lambda s: s[0]["hw.gpu.task"]) == [
        ({**identity, "hw.gpu.task": "decoder"}, 0.0),
        ({**identity, "hw.gpu.task": "encoder"}, 0.0),
        ({**identity, "hw.gpu.task": "general"}, 0.5),
    ]
    gpu_type = {**identity, "hw.type": "gpu"}
    assert series(data, "hw.power") == [(gpu_type, 312.5)]
    assert series(data, "hw.energy") == [(gpu_type, 123456.789)]
    # A temperature sensor's attributes, as the conventions give hw.temperature: no hw.type, vendor, model, driver.
    sensor = {"hw.id": card.uuid, "hw.name": "NVIDIA H100 80GB HBM3", "openlora.gpu.index": 0}
    assert series(data, "hw.temperature") == [(sensor, 61.0)]
    # hw.errors on a GPU: `corrected` and `uncorrected` only (the conventions' GPU refinement).
    assert sorted(series(data, "hw.errors"), key=lambda s: s[0]["error.type"]) == [
        ({**gpu_type, "error.type": "corrected"}, 3),
        ({**gpu_type, "error.type": "uncorrected"}, 0),
    ]
    assert sorted(series(data, "openlora.gpu.pcie.errors"), key=lambda s: s[0]["error.type"]) == [
        ({**identity, "error.type": "correctable"}, 5),
        ({**identity, "error.type": "fatal"}, 0),
        ({**identity, "error.type": "non_fatal"}, 0),
        ({**identity, "error.type": "replay"}, 2),
    ]
    assert series(data, "openlora.gpu.clock.sm") == [(identity, 1.98e9)]
    throttle = {
        attrs["openlora.gpu.throttle.reason"]: value
        for attrs, value in series(data, "openlora.gpu.throttle.time")
    }
    assert throttle == {
        "sw_power_cap": 1.5,
        "thermal": 0.25,
        "sync_boost": 0.0,
        "hw_thermal_slowdown": 1e-6,
        "hw_power_brake_slowdown": 0.0,
    }
    by_direction = lambda name: {a["network.io.direction"]: v for a, v in series(data, name)}  # noqa: E731
    assert by_direction("hw.gpu.io") == {"transmit": 7_000_000_000, "receive": 9_000_000_000}
    assert by_direction("openlora.gpu.nvlink.io") == {
        "transmit": 18_000_000 * 1024,
        "receive": 36_000_000 * 1024,
    }
    assert series(data, "openlora.gpu.xid.errors") == [({**identity, "openlora.gpu.xid.code": "79"}, 1)]
    assert sorted(
        series(data, "openlora.gpu.remap.rows"), key=lambda s: s[0]["openlora.gpu.remap.cause"]
    ) == [
        ({**identity, "openlora.gpu.remap.cause": "correctable"}, 1),
        ({**identity, "openlora.gpu.remap.cause": "uncorrectable"}, 0),
    ]
    assert series(data, "openlora.gpu.remap.pending") == [(identity, 0)]
    assert series(data, "openlora.gpu.remap.failed") == [(identity, 0)]
    assert series(data, "openlora.gpu.pcie.link.width") == [(identity, 16)]
    assert series(data, "openlora.gpu.pcie.link.width.max") == [(identity, 16)]
    assert series(data, "openlora.gpu.pcie.link.generation") == [(identity, 5)]
    assert series(data, "openlora.gpu.pcie.link.generation.max") == [(identity, 5)]
    status = {a["hw.state"]: v for a, v in series(data, "hw.status")}
    assert status == {"ok": 0, "degraded": 0, "failed": 1}  # the XID 79
    assert {a["hw.type"] for a, _ in series(data, "hw.status")} == {"gpu"}
    assert series(data, "openlora.gpu.sm.activity") == [(identity, 0.875)]
    assert series(data, "openlora.gpu.sm.occupancy") == [(identity, 0.4)]
    assert series(data, "openlora.gpu.tensor.activity") == [(identity, 0.625)]
    assert series(data, "openlora.gpu.dram.activity") == [(identity, 0.55)]
    assert series(data, "openlora.process.gpu.memory.usage") == [(identity, 3 * 2**30)]
    [(_, age)] = series(data, "openlora.gpu.snapshot.age")
    assert 0 <= age < 1.0


def test_real_backend_converts_nvml_units_exactly() -> None:
    backend = PynvmlBackend(fake_pynvml_module())
    backend.init()
    handle = backend.handle(0)
    assert backend.uuid(handle) == "GPU-abcdef01-0000-0000-0000-000000000000"
    assert backend.name(handle) == "NVIDIA H100 80GB HBM3"
    assert backend.pci_bus_id(handle) == "00000000:19:00.0"
    assert backend.driver_version() == "550.54.15"
    assert backend.utilization(handle) == 0.37
    assert backend.encoder_utilization(handle) == 0.05
    assert backend.memory(handle) == (1_234_567_890, 85_520_809_984)
    assert backend.power_w(handle) == 312.456  # not truncated to whole watts
    assert backend.energy_j(handle) == 987_654.321
    assert backend.temperature_c(handle) == 61.0
    assert backend.ecc_errors(handle, corrected=True) == 7
    assert backend.ecc_errors(handle, corrected=False) == 1
    assert backend.sm_clock_hz(handle) == 1.98e9
    assert backend.process_memory(handle) == {42: 2_000_000_000}
    assert backend.mig_handles(handle) == []


def test_memory_used_is_nvidia_smis_reading_without_the_drivers_reserve() -> None:
    """On an H200 (driver 580.159.04) the v1 reading said 1626 MiB used where nvidia-smi said 1011:
    v1 counts the memory the driver reserves for itself. v2 leaves it out, as nvidia-smi does."""
    module = fake_pynvml_module()
    backend = PynvmlBackend(module)
    assert backend.memory("handle0") == (1_234_567_890, 85_520_809_984)
    v1_used = module.nvmlDeviceGetMemoryInfo("handle0").used
    assert v1_used - 1_234_567_890 == 620_756_992
    # A driver without the v2 call: the v1 reading, and v2 is not asked again.
    old = fake_pynvml_module(memory_v2=False)
    backend = PynvmlBackend(old)
    assert backend.memory("handle0") == (v1_used, 85_520_809_984)
    assert backend._memory_v2 is None
    # A pynvml release without the v2 structure: v1 straight away.
    older = fake_pynvml_module()
    del older.nvmlMemory_v2
    assert PynvmlBackend(older).memory("handle0") == (v1_used, 85_520_809_984)


def test_real_backend_maps_errors() -> None:
    unsupported = PynvmlBackend(fake_pynvml_module(not_supported={"nvmlDeviceGetPowerUsage"}))
    with pytest.raises(GpuNotSupported):
        unsupported.power_w("handle0")
    lost = PynvmlBackend(fake_pynvml_module(lost=True))
    with pytest.raises(GpuError) as info:
        lost.memory("handle0")
    assert not isinstance(info.value, GpuNotSupported)


def test_eight_gpus_one_snapshot_per_collection_whatever_the_instrument_count(collect) -> None:
    fake = FakeNvml(h100s(8), latency_s=50e-6)
    reader, _ = build(fake)
    collect(reader)  # first collection also discovers the devices
    fake.calls.clear()
    started = time.perf_counter()
    collect(reader)
    took = time.perf_counter() - started
    # 32 instruments, yet a fixed handful of calls per device (plus one XID drain): they do not multiply.
    assert fake.total_calls == 8 * PER_DEVICE_CALLS + 1
    assert len(GPU_METRICS) > 3 * PER_DEVICE_CALLS
    assert took < 1.0  # ~100 calls at 50 µs; generous against a noisy machine


def test_mig_instances_report_memory_without_utilization(collect) -> None:
    parent = FakeGpu(uuid="GPU-aaaa", name="NVIDIA A100-SXM4-80GB")
    parent.mig = [
        FakeGpu(uuid="MIG-1111", memory_used=2**30, memory_total=10 * 2**30, unsupported={"utilization"}),
        FakeGpu(uuid="MIG-2222", memory_used=0, memory_total=10 * 2**30, unsupported={"utilization"}),
    ]
    reader, _ = build(FakeNvml([parent]), devices="process", cuda_visible_devices=None)
    data = collect(reader)
    memory = {
        attrs["hw.id"]: (value, attrs.get("openlora.gpu.parent_id"))
        for attrs, value in series(data, "hw.gpu.memory.usage")
    }
    assert memory == {"MIG-1111": (2**30, "GPU-aaaa"), "MIG-2222": (0, "GPU-aaaa")}
    utilization_ids = {attrs["hw.id"] for attrs, _ in series(data, "hw.gpu.utilization")}
    assert utilization_ids.isdisjoint({"MIG-1111", "MIG-2222"})


def test_hw_temperature_and_hw_errors_carry_what_the_conventions_give_them(collect) -> None:
    """hw.temperature is a temperature sensor's metric (hw.id, hw.name, hw.parent, hw.sensor_location), not a
    GPU metric: no hw.type, vendor, model or driver version. hw.errors' GPU refinement has `error.type`
    `corrected` and `uncorrected` only; the PCIe link errors are openlora.gpu.pcie.errors. openlora.* keys
    are ours (the GPU's index), beside the conventions'."""
    from opentelemetry.semconv._incubating.attributes import hw_attributes
    from opentelemetry.semconv.attributes import error_attributes

    cards = h100s(2)
    reader, _ = build(FakeNvml(cards, driver="580.82.07"))
    data = collect(reader)
    sensor = {hw_attributes.HW_ID, hw_attributes.HW_NAME, hw_attributes.HW_PARENT, hw_attributes.HW_SENSOR_LOCATION}
    temperatures = series(data, "hw.temperature")
    assert len(temperatures) == 2
    for attributes, _ in temperatures:
        assert {key for key in attributes if not key.startswith("openlora.")} <= sensor, attributes
        assert hw_attributes.HW_ID in attributes
    errors = series(data, "hw.errors")
    assert {a[error_attributes.ERROR_TYPE] for a, _ in errors} == {"corrected", "uncorrected"}
    assert {a[hw_attributes.HW_TYPE] for a, _ in errors} == {"gpu"}
    pcie = series(data, "openlora.gpu.pcie.errors")
    assert {a[error_attributes.ERROR_TYPE] for a, _ in pcie} == {"replay", "correctable", "non_fatal", "fatal"}
    assert {a[hw_attributes.HW_ID] for a, _ in pcie} == {card.uuid for card in cards}


def test_unsupported_capability_is_skipped_and_not_asked_again(collect) -> None:
    # Neither the batched fields nor the calls they fall back to answer ECC and power.
    [card] = h100s(1, unsupported={"ecc_errors", "power_w"})
    card.unsupported_fields |= {nvml.FI.ECC_SBE_VOL_TOTAL, nvml.FI.ECC_DBE_VOL_TOTAL, nvml.FI.POWER_AVERAGE}
    fake = FakeNvml([card])
    reader, _ = build(fake)
    data = collect(reader)
    assert {a["error.type"] for a, _ in series(data, "hw.errors")}.isdisjoint({"corrected", "uncorrected"})
    assert series(data, "hw.power") == []
    assert series(data, "hw.temperature")  # the rest is there
    before = fake.calls["ecc_errors"], fake.calls["power_w"]
    asked = len(fake.fields_asked[-1])
    collect(reader)
    assert (fake.calls["ecc_errors"], fake.calls["power_w"]) == before
    assert len(fake.fields_asked[-1]) == asked - 3  # nor are the fields asked again


def test_gpu_failing_mid_run_drops_its_series_warns_once_and_comes_back(
    collect, caplog: pytest.LogCaptureFixture
) -> None:
    cards = h100s(2)
    reader, _ = build(FakeNvml(cards))
    assert len(series(collect(reader), "hw.gpu.memory.usage")) == 2
    cards[1].failing = True
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        data = collect(reader)
        assert [a["hw.id"] for a, _ in series(data, "hw.gpu.memory.usage")] == [cards[0].uuid]
    assert sum("stopped answering NVML" in r.getMessage() for r in caplog.records) == 1
    cards[1].failing = False
    assert len(series(collect(reader), "hw.gpu.memory.usage")) == 2


def test_slow_nvml_serves_the_last_good_snapshot_and_never_piles_up_threads(
    collect, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml(h100s(1))
    reader, _ = build(fake, timeout_s=0.05)
    first = collect(reader)
    assert series(first, "hw.gpu.memory.usage")
    fake.latency_s = 0.5  # NVML now stalls far beyond the bound
    started = time.perf_counter()
    stale = collect(reader)
    assert time.perf_counter() - started < 0.45  # bounded by the timeout, not by NVML
    assert series(stale, "hw.gpu.memory.usage") == series(first, "hw.gpu.memory.usage")
    [(_, age)] = series(stale, "openlora.gpu.snapshot.age")
    assert age > 0
    for _ in range(5):
        collect(reader)
    assert sum(t.name == "openlora-otel-nvml" for t in threading.enumerate()) <= 1
    monkeypatch.setattr(gpu_thread, "MAX_AGE_S", 0.0)  # too old to serve: series go away rather than lie
    assert series(collect(reader), "hw.gpu.memory.usage") == []


@pytest.mark.parametrize(
    ("visible", "local_rank", "expected"),
    [
        (None, None, [0, 1, 2, 3, 4, 5, 6, 7]),
        (None, 3, [3]),  # torchrun: rank 3 of a node with every GPU visible
        ("2,3", 1, [3]),
        ("5", 0, [5]),
        ("6,1", None, [6, 1]),
        ("GPU-00000004", None, [4]),  # a UUID prefix, as CUDA accepts
        ("1,x,2", None, [1]),  # CUDA stops at the first invalid entry
        ("", None, []),
    ],
)
def test_process_mode_selects_this_process_gpus(visible, local_rank, expected) -> None:
    cards = h100s(8)
    collector = GpuCollector(
        FakeNvml(cards),
        devices="process",
        cuda_visible_devices=visible,
        local_rank=local_rank,
        torch_devices=lambda: None,
    )
    assert [d.index for d in collector.selection.selected()] == expected


def test_eight_ranks_on_a_node_report_eight_gpus_not_sixty_four() -> None:
    cards = h100s(8)
    reported = []
    for rank in range(8):
        collector = GpuCollector(
            FakeNvml(cards), devices="process", local_rank=rank, torch_devices=lambda: None
        )
        reported.extend(d.uuid for d in collector.selection.selected())
    assert sorted(reported) == sorted(c.uuid for c in cards)


def test_torch_devices_are_matched_by_uuid() -> None:
    cards = h100s(8)
    bare = cards[5].uuid.removeprefix("GPU-")  # torch reports the UUID without the prefix
    collector = GpuCollector(
        FakeNvml(cards), devices="process", local_rank=0, torch_devices=lambda: [(0, bare)]
    )
    assert [d.index for d in collector.selection.selected()] == [5]


def test_all_mode_reports_every_gpu() -> None:
    collector = GpuCollector(
        FakeNvml(h100s(8)), devices="all", local_rank=2, torch_devices=lambda: [(0, "x")]
    )
    assert len(collector.selection.selected()) == 8


def test_torch_allocator_gauges(collect) -> None:
    stats = {
        "allocated_bytes.all.current": 1000,
        "reserved_bytes.all.current": 4096,
        "allocated_bytes.all.peak": 3000,
        "num_ooms": 1,
        "num_alloc_retries": 2,
    }
    reader, _ = build(FakeNvml([]), allocator=lambda: [(0, "abcdef01-0000", stats)])
    data = collect(reader)
    attrs = {"hw.id": "GPU-abcdef01-0000", "openlora.torch.device": 0}
    assert series(data, "openlora.torch.memory.allocated") == [(attrs, 1000)]
    assert series(data, "openlora.torch.memory.reserved") == [(attrs, 4096)]
    assert series(data, "openlora.torch.memory.peak") == [(attrs, 3000)]
    assert series(data, "openlora.torch.memory.ooms") == [(attrs, 1)]
    assert series(data, "openlora.torch.memory.alloc_retries") == [(attrs, 2)]


def test_torch_not_initialized_reads_nothing() -> None:
    # torch may be imported in this test process, but CUDA is not initialized: nothing is read.
    assert gpu.torch_cuda_devices() is None
    assert gpu.torch_allocator_stats() == []


# -- setup_telemetry and OPENLORA_GPU_METRICS ---------------------------------------------


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml(h100s(2))
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: fake)
    return fake


def test_setup_registers_gpu_metrics_and_the_step_path_never_touches_nvml(
    collect, fake_backend: FakeNvml, memory_reader: InMemoryMetricReader
) -> None:
    config = TelemetryConfig(exporters=("none",), gpu_metrics="on", gpu_devices="all")
    telemetry = setup_telemetry(config=config, metric_readers=[memory_reader])
    assert telemetry.gpu is not None and fake_backend.initialized
    calls = fake_backend.total_calls
    for _ in range(1000):
        telemetry.training.record_step(loss=1.0, tokens=1)
    assert fake_backend.total_calls == calls  # recording does no NVML work at all
    data = collect(memory_reader)
    assert len(series(data, "hw.gpu.memory.usage")) == 2
    telemetry.shutdown()
    assert fake_backend.shutdowns == 1


def test_gpu_on_without_nvml_is_a_setup_error(fake_backend: FakeNvml) -> None:
    fake_backend.init_error = "Driver Not Loaded"
    with pytest.raises(ConfigError) as info:
        setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="on"))
    assert info.value.variable == "OPENLORA_GPU_METRICS"
    assert "Driver Not Loaded" in str(info.value)


def test_gpu_on_without_pynvml_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml, "load_pynvml_backend", missing)
    with pytest.raises(MissingDependencyError, match=r"nvidia-ml-py.*openlora-otel\[gpu\]"):
        setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="on"))


def test_gpu_auto_without_nvml_is_off_with_one_info_line(
    fake_backend: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake_backend.init_error = "NVML Shared Library Not Found"
    caplog.set_level(logging.INFO)
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    assert telemetry.gpu is None
    assert sum("GPU metrics off" in r.getMessage() for r in caplog.records) == 1
    telemetry.shutdown()


def test_gpu_auto_on_this_machine_without_a_driver() -> None:
    # The real backend: pynvml installed or not, no driver here, so auto turns GPU metrics off.
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    assert telemetry.gpu is None
    telemetry.shutdown()


def test_gpu_off_does_not_touch_nvml(fake_backend: FakeNvml) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="off"))
    assert telemetry.gpu is None and fake_backend.total_calls == 0
    telemetry.shutdown()


def test_pull_endpoint_serves_the_documented_gpu_names(
    fake_backend: FakeNvml, stepped_time: SteppedTime
) -> None:
    config = TelemetryConfig(
        prometheus_host="127.0.0.1", prometheus_port=0, gpu_metrics="on", gpu_devices="all"
    )
    telemetry = setup_telemetry(config=config)
    served_series(telemetry.prometheus_url)  # GPM activity needs a second snapshot
    fake_backend.inject_xid(fake_backend.gpus[0], 48)
    stepped_time.offset += 1.0
    served = served_series(telemetry.prometheus_url)
    telemetry.shutdown()
    assert fake_backend.event_sets == [] and fake_backend.freed_event_sets == 1  # freed before nvmlShutdown
    assert all(sample.freed for sample in fake_backend.samples)
    for spec in GPU_METRICS:
        if spec.name.startswith("openlora.torch.") or spec.name == "openlora.process.gpu.memory.usage":
            continue  # need CUDA in this process / this PID on the GPU
        assert spec.prometheus in served, (spec.name, spec.prometheus)

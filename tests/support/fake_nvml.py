"""Fakes for GPU tests without a GPU.

- :class:`FakeNvml` implements :class:`openlora_otel.hardware.nvml.NvmlBackend`: several GPUs, MIG
  instances, capabilities a device lacks, errors mid-run, per-call latency, and call counts.
  A :class:`FakeGpu` answers field values (per field, with NVML's own status and raw units,
  honouring the NVLink scope), XID events, remapped rows, PCIe link state and GPM samples;
  :func:`h100s` gives fully capable Hopper GPUs, :func:`older_gpu` a pre-Hopper board that lacks
  most of it (no GPM, no PCIe byte counters, no row remapper, no NVLink).
- :func:`fake_pynvml_module` is a stand-in for the ``pynvml`` module itself, with NVML's raw
  units (milliwatts, millijoules, MHz, percent, nanoseconds, KiB), its ctypes structs, and its
  exception classes, to test the real backend's conversions and call shapes.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field

from openlora_otel.hardware.nvml import (
    FI,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    SCOPE_ALL_LINKS,
    GpuError,
    GpuNotSupported,
)

_SAMPLE_CLOCK = itertools.count()


@dataclass
class FakeGpu:
    uuid: str
    index: int = 0
    name: str = "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = "00000000:01:00.0"
    utilization: float = 0.5
    encoder: float = 0.0
    decoder: float = 0.0
    memory_used: int = 10 * 2**30
    memory_total: int = 80 * 2**30
    power_w: float = 312.5
    energy_j: float = 123456.789
    temperature_c: float = 61.0
    ecc_corrected: int = 3
    ecc_uncorrected: int = 0
    sm_clock_hz: float = 1.98e9
    processes: dict[int, int] = field(default_factory=dict)
    mig: list[FakeGpu] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # backend method names that raise NotSupported
    failing: bool = False
    # Field values, in NVML's raw units; ids in unsupported_fields answer NOT_SUPPORTED.
    unsupported_fields: set[int] = field(default_factory=set)
    pcie_tx_bytes: int = 7_000_000_000
    pcie_rx_bytes: int = 9_000_000_000
    pcie_replay: int = 2
    pcie_correctable: int = 5
    pcie_non_fatal: int = 0
    pcie_fatal: int = 0
    nvlink_links: int = 18
    nvlink_tx_kib: int = 18 * 1_000_000  # divisible by the link count: per-link scopes answer exactly
    nvlink_rx_kib: int = 18 * 2_000_000
    # ns per reason: power (sw power cap), thermal, sync_boost, hw_thermal, hw_power_brake
    throttle_ns: dict[str, int] = field(
        default_factory=lambda: {
            "power": 1_500_000_000,
            "thermal": 250_000_000,
            "sync_boost": 0,
            "hw_thermal": 1_000,
            "hw_power_brake": 0,
        }
    )
    remap: tuple[int, int, int, int] = (1, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    recovery_action: int = 0
    link: tuple[int, int] = (16, 5)  # width, generation now
    link_max: tuple[int, int] = (16, 5)
    gpm: dict[int, float] | None = field(  # GPM metric id -> percent; None: no GPM (pre-Hopper)
        default_factory=lambda: {2: 87.5, 3: 40.0, 5: 62.5, 10: 55.0}
    )

    def field_value(self, field_id: int, scope: int) -> tuple[int, object]:
        """(nvmlReturn, raw value) for one field, as nvmlDeviceGetFieldValues reports it."""
        if self.failing:
            return NVML_ERROR_GPU_IS_LOST, None
        if field_id in self.unsupported_fields:
            return NVML_ERROR_NOT_SUPPORTED, None
        nvlink = {
            FI.NVLINK_THROUGHPUT_DATA_TX: self.nvlink_tx_kib,
            FI.NVLINK_THROUGHPUT_DATA_RX: self.nvlink_rx_kib,
        }
        if field_id in nvlink:
            if scope == SCOPE_ALL_LINKS:
                return NVML_SUCCESS, nvlink[field_id]
            if scope < self.nvlink_links:
                return NVML_SUCCESS, nvlink[field_id] // self.nvlink_links  # one link's share
            return NVML_ERROR_INVALID_ARGUMENT, None
        table = {
            FI.POWER_AVERAGE: round(self.power_w * 1000),
            FI.TOTAL_ENERGY_CONSUMPTION: round(self.energy_j * 1000),
            FI.ECC_SBE_VOL_TOTAL: self.ecc_corrected,
            FI.ECC_DBE_VOL_TOTAL: self.ecc_uncorrected,
            FI.PCIE_REPLAY_COUNTER: self.pcie_replay,
            FI.PCIE_COUNT_CORRECTABLE_ERRORS: self.pcie_correctable,
            FI.PCIE_COUNT_NON_FATAL_ERROR: self.pcie_non_fatal,
            FI.PCIE_COUNT_FATAL_ERROR: self.pcie_fatal,
            FI.PCIE_COUNT_TX_BYTES: self.pcie_tx_bytes,
            FI.PCIE_COUNT_RX_BYTES: self.pcie_rx_bytes,
            FI.NVLINK_LINK_COUNT: self.nvlink_links,
            FI.PERF_POLICY_POWER: self.throttle_ns["power"],
            FI.PERF_POLICY_THERMAL: self.throttle_ns["thermal"],
            FI.PERF_POLICY_SYNC_BOOST: self.throttle_ns["sync_boost"],
            FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: self.throttle_ns["hw_thermal"],
            FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: self.throttle_ns["hw_power_brake"],
            FI.REMAPPED_COR: self.remap[0],
            FI.REMAPPED_UNC: self.remap[1],
            FI.REMAPPED_PENDING: self.remap[2],
            FI.REMAPPED_FAILURE: self.remap[3],
            FI.GET_GPU_RECOVERY_ACTION: self.recovery_action,
        }
        if field_id not in table:
            return NVML_ERROR_INVALID_ARGUMENT, None  # an id this "driver" does not know
        return NVML_SUCCESS, table[field_id]


@dataclass
class FakeGpmSample:
    gpu: FakeGpu | None = None
    taken: int = -1
    values: dict[int, float] = field(default_factory=dict)
    freed: bool = False


class FakeNvml:
    """An NvmlBackend over FakeGpu objects (the handle is the FakeGpu itself)."""

    def __init__(self, gpus: list[FakeGpu], *, latency_s: float = 0.0, driver: str = "550.54.15") -> None:
        self.gpus = gpus
        self.latency_s = latency_s
        self.driver = driver
        self.calls: Counter[str] = Counter()
        self.initialized = False
        self.shutdowns = 0
        self.init_error: str | None = None
        self.events_supported = True  # False: nvmlEventSetCreate is NotSupported (no XID watching)
        self.xid_queue: list[tuple[str, int]] = []  # (GPU UUID, XID) the driver has queued
        self.registered: set[str] = set()
        self.event_sets: list[object] = []
        self.freed_event_sets = 0
        self.samples: list[FakeGpmSample] = []
        self.fields_asked: list[list[tuple[int, int]]] = []
        self.threads: Counter[str] = Counter()  # calls per calling thread's name
        self._lock = threading.Lock()

    def inject_xid(self, gpu: FakeGpu, code: int) -> None:
        """The driver reports an XID on ``gpu`` (delivered only if the GPU was registered)."""
        self.xid_queue.append((gpu.uuid, code))

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def _call(self, name: str, gpu: FakeGpu | None = None) -> None:
        with self._lock:
            self.calls[name] += 1
            self.threads[threading.current_thread().name] += 1
        if self.latency_s:
            time.sleep(self.latency_s)
        if gpu is not None:
            if gpu.failing:
                raise GpuError("GPU is lost")
            if name in gpu.unsupported:
                raise GpuNotSupported("Not Supported")

    def init(self) -> None:
        self._call("init")
        if self.init_error:
            raise GpuError(self.init_error)
        self.initialized = True

    def shutdown(self) -> None:
        self._call("shutdown")
        self.shutdowns += 1

    def driver_version(self) -> str:
        self._call("driver_version")
        return self.driver

    def device_count(self) -> int:
        self._call("device_count")
        return len(self.gpus)

    def handle(self, index: int) -> FakeGpu:
        self._call("handle")
        return self.gpus[index]

    def uuid(self, handle: FakeGpu) -> str:
        self._call("uuid")
        return handle.uuid

    def name(self, handle: FakeGpu) -> str:
        self._call("name")
        return handle.name

    def pci_bus_id(self, handle: FakeGpu) -> str:
        self._call("pci_bus_id")
        return handle.pci_bus_id

    def mig_handles(self, handle: FakeGpu) -> list[FakeGpu]:
        self._call("mig_handles")
        return list(handle.mig)

    def utilization(self, handle: FakeGpu) -> float:
        self._call("utilization", handle)
        return handle.utilization

    def encoder_utilization(self, handle: FakeGpu) -> float:
        self._call("encoder_utilization", handle)
        return handle.encoder

    def decoder_utilization(self, handle: FakeGpu) -> float:
        self._call("decoder_utilization", handle)
        return handle.decoder

    def memory(self, handle: FakeGpu) -> tuple[int, int]:
        self._call("memory", handle)
        return handle.memory_used, handle.memory_total

    def power_w(self, handle: FakeGpu) -> float:
        self._call("power_w", handle)
        return handle.power_w

    def energy_j(self, handle: FakeGpu) -> float:
        self._call("energy_j", handle)
        return handle.energy_j

    def temperature_c(self, handle: FakeGpu) -> float:
        self._call("temperature_c", handle)
        return handle.temperature_c

    def ecc_errors(self, handle: FakeGpu, corrected: bool) -> int:
        self._call("ecc_errors", handle)
        return handle.ecc_corrected if corrected else handle.ecc_uncorrected

    def sm_clock_hz(self, handle: FakeGpu) -> float:
        self._call("sm_clock_hz", handle)
        return handle.sm_clock_hz

    def process_memory(self, handle: FakeGpu) -> dict[int, int]:
        self._call("process_memory", handle)
        return dict(handle.processes)

    def field_values(self, handle: FakeGpu, fields) -> list[tuple[int, object]]:
        self._call("field_values", handle)
        self.fields_asked.append(list(fields))
        return [self._numbered(handle, field_id, scope) for field_id, scope in fields]

    def _numbered(self, handle: FakeGpu, field_id: int, scope: int) -> tuple[int, object]:
        """One field as this driver numbers it: early R580 drivers answer the hw_* throttle times at
        252/253 and power-smoothing settings at 270/271 (nvidia-smi 580.65.06 asks 251-253); later
        drivers the other way round (nvidia-ml-py 13.615's numbering). Both on a GPU with power
        smoothing. 580.159.04 already numbers them as the later ones and refuses 252/253
        (NotSupported), as read on an H200 on 2026-11-26; where in R580 that changed is not known:
        here from 580.159 on."""
        major, minor = (int(part) for part in self.driver.split(".")[:2])
        early_r580 = major == 580 and minor < 159
        r580 = {252: FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, 253: FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN}
        smoothing = {252: 0, 253: 1, 270: 30, 271: 4_000_000}  # settings: a level, a flag, a %, mW/s
        if handle.failing:
            return NVML_ERROR_GPU_IS_LOST, None
        if early_r580 and field_id in r580:
            return handle.field_value(r580[field_id], scope)
        if major == 580 and not early_r580 and field_id in r580:
            return NVML_ERROR_NOT_SUPPORTED, None
        if field_id in smoothing and early_r580 == (field_id >= 270):
            return NVML_SUCCESS, smoothing[field_id]
        return handle.field_value(field_id, scope)

    def pcie_replay_counter(self, handle: FakeGpu) -> int:
        self._call("pcie_replay_counter", handle)
        return handle.pcie_replay

    def remapped_rows(self, handle: FakeGpu) -> tuple[int, int, int, int]:
        self._call("remapped_rows", handle)
        return handle.remap

    def violation_s(self, handle: FakeGpu, policy: int) -> float:
        self._call("violation_s", handle)
        return {
            0: handle.throttle_ns["power"],
            1: handle.throttle_ns["thermal"],
            2: handle.throttle_ns["sync_boost"],
        }[policy] / 1e9

    def pcie_link(self, handle: FakeGpu) -> tuple[int, int]:
        self._call("pcie_link", handle)
        return handle.link

    def pcie_link_max(self, handle: FakeGpu) -> tuple[int, int]:
        self._call("pcie_link_max", handle)
        return handle.link_max

    def event_set_create(self) -> object:
        self._call("event_set_create")
        if not self.events_supported:
            raise GpuNotSupported("Not Supported")
        event_set = object()
        self.event_sets.append(event_set)
        return event_set

    def register_xid_events(self, handle: FakeGpu, event_set: object) -> None:
        self._call("register_xid_events", handle)
        assert event_set in self.event_sets
        self.registered.add(handle.uuid)

    def wait_xid(self, event_set: object) -> tuple[str, int] | None:
        self._call("wait_xid")
        assert event_set in self.event_sets
        while self.xid_queue:
            uuid, code = self.xid_queue.pop(0)
            if uuid in self.registered:
                return uuid, code
        return None

    def event_set_free(self, event_set: object) -> None:
        self._call("event_set_free")
        self.event_sets.remove(event_set)
        self.freed_event_sets += 1

    def gpm_supported(self, handle: FakeGpu) -> bool:
        self._call("gpm_supported", handle)
        return handle.gpm is not None

    def gpm_sample_alloc(self) -> FakeGpmSample:
        self._call("gpm_sample_alloc")
        sample = FakeGpmSample()
        self.samples.append(sample)
        return sample

    def gpm_sample_get(self, handle: FakeGpu, sample: FakeGpmSample) -> None:
        self._call("gpm_sample_get", handle)
        if handle.gpm is None:
            raise GpuNotSupported("Not Supported")
        assert not sample.freed
        sample.gpu, sample.taken, sample.values = handle, next(_SAMPLE_CLOCK), dict(handle.gpm)

    def gpm_metrics(self, sample1: FakeGpmSample, sample2: FakeGpmSample, metric_ids) -> dict[int, float]:
        self._call("gpm_metrics")
        # What real GPM needs: two samples of the same GPU, the older one first.
        if sample1.gpu is not sample2.gpu or not 0 <= sample1.taken < sample2.taken:
            raise GpuError("Invalid Argument")
        return {m: sample2.values[m] for m in metric_ids if m in sample2.values}

    def gpm_sample_free(self, sample: FakeGpmSample) -> None:
        self._call("gpm_sample_free")
        sample.freed = True


def h100s(count: int, **overrides) -> list[FakeGpu]:
    """``count`` fake GPUs with distinct UUIDs, indices and bus ids."""
    return [
        FakeGpu(
            uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444",
            index=i,
            pci_bus_id=f"00000000:{i + 1:02x}:00.0",
            **overrides,
        )
        for i in range(count)
    ]


def older_gpu(uuid: str = "GPU-0ld00000-1111-2222-3333-444444444444", index: int = 0, **overrides) -> FakeGpu:
    """A pre-Hopper PCIe board on an older driver's field set: no GPM, no PCIe byte or error counters,
    no row remapper, no NVLink, no throttle-duration fields (the violation-status call still answers)."""
    gone = {
        FI.PCIE_COUNT_TX_BYTES,
        FI.PCIE_COUNT_RX_BYTES,
        FI.PCIE_COUNT_CORRECTABLE_ERRORS,
        FI.PCIE_COUNT_NON_FATAL_ERROR,
        FI.PCIE_COUNT_FATAL_ERROR,
        FI.NVLINK_THROUGHPUT_DATA_TX,
        FI.NVLINK_THROUGHPUT_DATA_RX,
        FI.NVLINK_LINK_COUNT,
        FI.PERF_POLICY_POWER,
        FI.PERF_POLICY_THERMAL,
        FI.PERF_POLICY_SYNC_BOOST,
        FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        FI.REMAPPED_COR,
        FI.REMAPPED_UNC,
        FI.REMAPPED_PENDING,
        FI.REMAPPED_FAILURE,
        FI.GET_GPU_RECOVERY_ACTION,
        FI.POWER_AVERAGE,
    }
    defaults = dict(
        name="Tesla V100-PCIE-32GB",
        unsupported_fields=gone,
        unsupported={"remapped_rows"},
        gpm=None,
        nvlink_links=0,
        link=(16, 3),
        link_max=(16, 3),
    )
    defaults.update(overrides)
    return FakeGpu(uuid=uuid, index=index, **defaults)


# The ctypes layouts the real pynvml uses (nvidia-ml-py 13.615); test_gpu checks them against it when installed.
class c_nvmlValue_t(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):
    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


class c_metricInfo_t(ctypes.Structure):
    _fields_ = [("shortName", ctypes.c_char_p), ("longName", ctypes.c_char_p), ("unit", ctypes.c_char_p)]


class c_nvmlGpmMetric_t(ctypes.Structure):
    _fields_ = [
        ("metricId", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", ctypes.c_double),
        ("metricInfo", c_metricInfo_t),
    ]


class c_nvmlGpmMetricsGet_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("numMetrics", ctypes.c_uint),
        ("sample1", ctypes.c_void_p),
        ("sample2", ctypes.c_void_p),
        ("metrics", c_nvmlGpmMetric_t * 477),
    ]


class c_nvmlViolationTime_t(ctypes.Structure):
    _fields_ = [("referenceTime", ctypes.c_ulonglong), ("violationTime", ctypes.c_ulonglong)]


def fake_pynvml_module(
    *,
    not_supported: set[str] | None = None,
    lost: bool = False,
    field_status: dict[int, int] | None = None,
    xids: list[int] | None = None,
    missing: set[str] | None = None,
    memory_v2: bool = True,
) -> types.ModuleType:
    """A pynvml stand-in returning NVML's raw units for one GPU.

    ``field_status``: nvmlReturn per field id (default success); ``xids``: XID codes queued on the event set;
    ``missing``: entry points this "driver" lacks (an older libnvidia-ml: pynvml raises FunctionNotFound);
    ``memory_v2``: the driver has nvmlDeviceGetMemoryInfo_v2 (its ``used`` leaves out the driver's
    reserve, as nvidia-smi's memory.used does; the v1 ``used`` includes it, as a real H200 showed).
    """
    module = types.ModuleType("pynvml")
    not_supported = not_supported or set()
    missing = missing or set()
    field_status = field_status or {}
    xid_queue = list(xids or [])

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass

    module.NVMLError = NVMLError
    module.NVMLError_NotSupported = NVMLError_NotSupported
    module.NVMLError_Timeout = NVMLError_Timeout
    module.NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    module.NVML_TEMPERATURE_GPU = 0
    module.NVML_CLOCK_SM = 1
    module.NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    module.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    module.NVML_VOLATILE_ECC = 0
    module.NVML_DEVICE_MIG_ENABLE = 1
    module.nvmlEventTypeXidCriticalError = 0x8
    module.NVML_GPM_METRICS_GET_VERSION = 1
    module.nvmlMemory_v2 = 0x02000028  # pynvml's version stamp for c_nvmlMemory_v2_t
    module.c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t
    module.asked_fields = []  # what nvmlDeviceGetFieldValues was given, per call
    module.metrics_requests = []

    # Raw values per field id: (nvmlValueType_t, value).
    raw = {
        FI.POWER_AVERAGE: (1, 312_456),  # mW, unsigned int
        FI.TOTAL_ENERGY_CONSUMPTION: (3, 987_654_321),  # mJ
        FI.ECC_SBE_VOL_TOTAL: (3, 7),
        FI.ECC_DBE_VOL_TOTAL: (3, 1),
        FI.PCIE_COUNT_TX_BYTES: (3, 123_456_789_012),
        FI.PCIE_COUNT_RX_BYTES: (3, 223_456_789_012),
        FI.NVLINK_THROUGHPUT_DATA_TX: (3, 5_000_000),  # KiB
        FI.PERF_POLICY_POWER: (3, 2_500_000_000),  # ns
        FI.PCIE_REPLAY_COUNTER: (1, 4),
    }

    def field_values(handle, field_ids):
        module.asked_fields.append(list(field_ids))
        values = (c_nvmlFieldValue_t * len(field_ids))()
        for i, field_id in enumerate(field_ids):
            try:  # exactly how pynvml fills the request: a tuple sets the scope, a bare id does not
                (values[i].fieldId, values[i].scopeId) = field_id
            except TypeError:
                values[i].fieldId = field_id
            status = field_status.get(values[i].fieldId, 0 if values[i].fieldId in raw else 2)
            values[i].nvmlReturn = status
            if status == 0:
                kind, value = raw[values[i].fieldId]
                if values[i].fieldId == FI.NVLINK_THROUGHPUT_DATA_TX and values[i].scopeId != SCOPE_ALL_LINKS:
                    value //= 18  # link 0 alone
                values[i].valueType = kind
                setattr(values[i].value, {1: "uiVal", 3: "ullVal"}[kind], value)
        return values

    def wait(event_set, timeout_ms):
        assert timeout_ms == 0  # the helper thread never blocks in the driver
        if not xid_queue:
            raise NVMLError_Timeout("Timeout")
        return types.SimpleNamespace(device="handle0", eventType=0x8, eventData=xid_queue.pop(0))

    def metrics_get(request):
        module.metrics_requests.append((request.sample1, request.sample2, request.numMetrics))
        percent = {2: 87.5, 3: 40.0, 5: 62.5, 10: 55.0}
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in percent:
                metric.value, metric.nvmlReturn = percent[metric.metricId], 0
            else:
                metric.nvmlReturn = 3
        return request

    def api(name, value):
        def call(*args):
            if name in missing:  # what pynvml's _nvmlGetFunctionPointer raises for an absent symbol
                raise NVMLError_FunctionNotFound("Function Not Found")
            if lost:
                raise NVMLError("GPU is lost")
            if name in not_supported:
                raise NVMLError_NotSupported("Not Supported")
            return value(*args) if callable(value) else value

        setattr(module, name, call)

    api("nvmlInit", None)
    api("nvmlShutdown", None)
    api("nvmlSystemGetDriverVersion", b"550.54.15")
    api("nvmlDeviceGetCount", 1)
    api("nvmlDeviceGetHandleByIndex", "handle0")
    api("nvmlDeviceGetUUID", b"GPU-abcdef01-0000-0000-0000-000000000000")
    api("nvmlDeviceGetName", b"NVIDIA H100 80GB HBM3")
    api("nvmlDeviceGetPciInfo", types.SimpleNamespace(busId=b"00000000:19:00.0"))
    api("nvmlDeviceGetMigMode", (0, 0))
    api("nvmlDeviceGetMaxMigDeviceCount", 0)
    api("nvmlDeviceGetMigDeviceHandleByIndex", None)
    api("nvmlDeviceGetUtilizationRates", types.SimpleNamespace(gpu=37, memory=12))
    api("nvmlDeviceGetEncoderUtilization", (5, 167000))
    api("nvmlDeviceGetDecoderUtilization", (0, 167000))
    reserved = 620_756_992  # what an H200's driver reserved (1625.88 - 1011 MiB, v1 against nvidia-smi)

    def memory_info(handle, version=None):
        if version is None:
            return types.SimpleNamespace(used=1_234_567_890 + reserved, total=85_520_809_984, free=0)
        if not memory_v2:
            raise NVMLError_FunctionNotFound("Function Not Found")  # pynvml: no nvmlDeviceGetMemoryInfo_v2
        assert version == module.nvmlMemory_v2
        return types.SimpleNamespace(used=1_234_567_890, reserved=reserved, total=85_520_809_984, free=0)

    api("nvmlDeviceGetMemoryInfo", memory_info)
    api("nvmlDeviceGetPowerUsage", 312_456)  # milliwatts
    api("nvmlDeviceGetTotalEnergyConsumption", 987_654_321)  # millijoules
    api("nvmlDeviceGetTemperature", 61)
    api("nvmlDeviceGetTotalEccErrors", lambda handle, kind, counter: 7 if kind == 0 else 1)
    api("nvmlDeviceGetClockInfo", 1980)  # MHz
    api("nvmlDeviceGetFieldValues", field_values)
    api("nvmlDeviceGetPcieReplayCounter", 4)
    api("nvmlDeviceGetRemappedRows", (3, 1, 1, 0))
    api(
        "nvmlDeviceGetViolationStatus",
        lambda h, policy: c_nvmlViolationTime_t(0, 1_250_000_000 * (policy + 1)),
    )
    api("nvmlDeviceGetCurrPcieLinkWidth", 8)
    api("nvmlDeviceGetCurrPcieLinkGeneration", 4)
    api("nvmlDeviceGetMaxPcieLinkWidth", 16)
    api("nvmlDeviceGetMaxPcieLinkGeneration", 5)
    api("nvmlEventSetCreate", "event-set")
    api("nvmlDeviceRegisterEvents", None)
    module.nvmlEventSetWait_v2 = wait
    api("nvmlEventSetFree", None)
    api("nvmlGpmQueryDeviceSupport", types.SimpleNamespace(version=1, isSupportedDevice=1))
    api("nvmlGpmSampleAlloc", lambda: ctypes.c_void_p(id(object())))
    api("nvmlGpmSampleGet", lambda handle, sample: sample)
    api("nvmlGpmMetricsGet", metrics_get)
    api("nvmlGpmSampleFree", None)
    api(
        "nvmlDeviceGetComputeRunningProcesses",
        [
            types.SimpleNamespace(pid=42, usedGpuMemory=2_000_000_000),
            types.SimpleNamespace(pid=43, usedGpuMemory=None),
        ],
    )
    return module

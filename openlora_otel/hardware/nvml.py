"""The one object through which NVML is reached, so tests can hand in a fake.

:class:`NvmlBackend` is the interface the GPU collector uses (host values in SI units);
:class:`PynvmlBackend` implements it over ``pynvml``, turning NVML's errors into
:class:`GpuNotSupported` (stop asking) and :class:`GpuError` (try again later). The field ids are
nvml.h's numbers, written out: they are part of the driver ABI. See docs/reference/gpu-metrics.md.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "FI",
    "GPM",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_SUCCESS",
    "PERF_POLICY",
    "R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN",
    "R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN",
    "SCOPE_ALL_LINKS",
    "GpuError",
    "GpuNotSupported",
    "NvmlBackend",
    "NvmlUnavailable",
    "PynvmlBackend",
    "load_pynvml_backend",
    "start_backend",
]

# nvmlReturn_t values the collector tells apart in per-field results.
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2  # an older driver's answer for a field id it does not know
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15


class FI:
    """nvmlDeviceGetFieldValues field ids (``NVML_FI_DEV_*``) the collector reads."""

    ECC_SBE_VOL_TOTAL = 3  # corrected ECC errors since the driver loaded
    ECC_DBE_VOL_TOTAL = 4  # uncorrected
    PERF_POLICY_POWER = 74  # == CLOCKS_EVENT_REASON_SW_POWER_CAP; ns
    PERF_POLICY_THERMAL = 75  # ns
    PERF_POLICY_SYNC_BOOST = 76  # == CLOCKS_EVENT_REASON_SYNC_BOOST; ns
    TOTAL_ENERGY_CONSUMPTION = 83  # mJ
    NVLINK_LINK_COUNT = 91
    PCIE_REPLAY_COUNTER = 94
    NVLINK_THROUGHPUT_DATA_TX = 138  # KiB, scopeId = link, or SCOPE_ALL_LINKS for their sum
    NVLINK_THROUGHPUT_DATA_RX = 139
    REMAPPED_COR = 142
    REMAPPED_UNC = 143
    REMAPPED_PENDING = 144
    REMAPPED_FAILURE = 145
    PCIE_COUNT_CORRECTABLE_ERRORS = 173
    PCIE_COUNT_NON_FATAL_ERROR = 179
    PCIE_COUNT_FATAL_ERROR = 180
    POWER_AVERAGE = 185  # mW, scopeId = NVML_POWER_SCOPE_GPU (0)
    PCIE_COUNT_TX_BYTES = 197
    PCIE_COUNT_RX_BYTES = 198
    GET_GPU_RECOVERY_ACTION = 230  # NVML_GPU_RECOVERY_ACTION_*
    # These two moved from 252, 253 (R580 drivers: nvidia-smi 580.65.06 reads them there, and its
    # 270, 271 are power-smoothing settings) to 270, 271 (nvidia-ml-py 13.615's header). gpu.py asks
    # each driver at its own ids and older drivers not at all, so no other value is read as a time.
    CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN = 270  # ns
    CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN = 271  # ns


# The same two on R580 drivers (outside FI: no pynvml release names them so any longer).
R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN = 252
R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN = 253

SCOPE_ALL_LINKS = 0xFFFFFFFF  # UINT_MAX: nvml.h's scopeId for "summed over all NVLinks"


class PERF_POLICY:
    """nvmlPerfPolicyType_t values for nvmlDeviceGetViolationStatus (the per-value fallback)."""

    POWER = 0
    THERMAL = 1
    SYNC_BOOST = 2


class GPM:
    """GPM metric ids (``NVML_GPM_METRIC_*``): the activities are percentages, 0 to 100; the PCIe
    traffic is MiB/s, averaged between the two samples."""

    SM_UTIL = 2
    SM_OCCUPANCY = 3
    ANY_TENSOR_UTIL = 5
    DRAM_BW_UTIL = 10
    PCIE_TX_PER_SEC = 20
    PCIE_RX_PER_SEC = 21


class RECOVERY:
    """NVML_GPU_RECOVERY_ACTION_* (field GET_GPU_RECOVERY_ACTION)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5  # R57x headers called 5 GPU_RESET_BUS: an action either way
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


class GpuError(Exception):
    """An NVML call failed (GPU lost, driver trouble, timeout...)."""


class GpuNotSupported(GpuError):
    """The device does not support this query (MIG utilization, ECC on consumer cards...)."""


class NvmlBackend(Protocol):
    """What the GPU collector needs from NVML. ``handle`` values are opaque."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> Any: ...
    def uuid(self, handle: Any) -> str: ...
    def name(self, handle: Any) -> str: ...
    def pci_bus_id(self, handle: Any) -> str: ...
    def mig_handles(self, handle: Any) -> list[Any]: ...
    def utilization(self, handle: Any) -> float: ...
    def encoder_utilization(self, handle: Any) -> float: ...
    def decoder_utilization(self, handle: Any) -> float: ...
    def memory(self, handle: Any) -> tuple[int, int]: ...
    def power_w(self, handle: Any) -> float: ...
    def energy_j(self, handle: Any) -> float: ...
    def temperature_c(self, handle: Any) -> float: ...
    def ecc_errors(self, handle: Any, corrected: bool) -> int: ...
    def sm_clock_hz(self, handle: Any) -> float: ...
    def process_memory(self, handle: Any) -> dict[int, int]: ...
    # One call for many values: per field (nvmlReturn, value or None), in the order asked.
    def field_values(self, handle: Any, fields: Sequence[tuple[int, int]]) -> list[tuple[int, Any]]: ...
    # Per-value fallbacks where a field is unsupported.
    def pcie_replay_counter(self, handle: Any) -> int: ...
    def remapped_rows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def violation_s(self, handle: Any, policy: int) -> float: ...
    # PCIe link: (width in lanes, generation), now and the most GPU and slot support together.
    def pcie_link(self, handle: Any) -> tuple[int, int]: ...
    def pcie_link_max(self, handle: Any) -> tuple[int, int]: ...
    # XID errors: an event set the helper thread drains without waiting.
    def event_set_create(self) -> Any: ...
    def register_xid_events(self, handle: Any, event_set: Any) -> None: ...
    def wait_xid(self, event_set: Any) -> tuple[str, int] | None: ...
    def event_set_free(self, event_set: Any) -> None: ...
    # GPM (Hopper and later): activity between two samples.
    def gpm_supported(self, handle: Any) -> bool: ...
    def gpm_sample_alloc(self) -> Any: ...
    def gpm_sample_get(self, handle: Any, sample: Any) -> None: ...
    def gpm_metrics(self, sample1: Any, sample2: Any, metric_ids: Sequence[int]) -> dict[int, float]: ...
    def gpm_sample_free(self, sample: Any) -> None: ...


def load_pynvml_backend() -> PynvmlBackend:
    """Import pynvml and return a backend (not yet initialized). Raises ImportError when missing."""
    import pynvml

    return PynvmlBackend(pynvml)


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why. ``missing_package``: nvidia-ml-py is not
    installed (else NVML itself did not start: no driver, no GPU)."""

    def __init__(self, message: str, *, missing_package: bool) -> None:
        super().__init__(message)
        self.missing_package = missing_package


def start_backend() -> PynvmlBackend:
    """Load nvidia-ml-py and start NVML: the one way setup_telemetry() and ``doctor`` start it, so
    that ``doctor`` says what setup will do. Raises :class:`NvmlUnavailable`; the caller shuts the
    backend down."""
    try:
        backend = load_pynvml_backend()
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed", missing_package=True) from None
    try:
        backend.init()
    except GpuError as exc:
        raise NvmlUnavailable(f"NVML did not start ({exc})", missing_package=False) from None
    return backend


class PynvmlBackend:
    """NvmlBackend over the ``pynvml`` module (passed in, so nothing imports it at package import)."""

    def __init__(self, pynvml: Any) -> None:
        self._nv = pynvml
        self._xid_uuids: dict[Any, str] = {}  # registered device handle -> UUID, to name an event's GPU
        # nvmlDeviceGetMemoryInfo_v2 where pynvml and the driver have it (see memory()).
        self._memory_v2 = getattr(pynvml, "nvmlMemory_v2", None)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (self._nv.NVMLError_NotSupported, self._nv.NVMLError_FunctionNotFound) as exc:
            # FunctionNotFound: this driver's libnvidia-ml predates the call (GPM before R520, say);
            # as permanent as NotSupported, and no sign that the GPU itself is in trouble.
            raise GpuNotSupported(str(exc)) from None
        except self._nv.NVMLError as exc:
            raise GpuError(str(exc)) from None

    def init(self) -> None:
        self._call(self._nv.nvmlInit)

    def shutdown(self) -> None:
        self._call(self._nv.nvmlShutdown)

    def driver_version(self) -> str:
        return _text(self._call(self._nv.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:
        return int(self._call(self._nv.nvmlDeviceGetCount))

    def handle(self, index: int) -> Any:
        return self._call(self._nv.nvmlDeviceGetHandleByIndex, index)

    def uuid(self, handle: Any) -> str:
        return _text(self._call(self._nv.nvmlDeviceGetUUID, handle))

    def name(self, handle: Any) -> str:
        return _text(self._call(self._nv.nvmlDeviceGetName, handle))

    def pci_bus_id(self, handle: Any) -> str:
        info = self._call(self._nv.nvmlDeviceGetPciInfo, handle)
        return _text(info.busId)

    def mig_handles(self, handle: Any) -> list[Any]:
        try:
            current, _pending = self._call(self._nv.nvmlDeviceGetMigMode, handle)
        except GpuNotSupported:
            return []
        if current != self._nv.NVML_DEVICE_MIG_ENABLE:
            return []
        handles = []
        for index in range(int(self._call(self._nv.nvmlDeviceGetMaxMigDeviceCount, handle))):
            try:
                handles.append(self._call(self._nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, index))
            except GpuError:
                continue  # an empty slot
        return handles

    def utilization(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetUtilizationRates, handle).gpu / 100.0

    def encoder_utilization(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetEncoderUtilization, handle)[0] / 100.0

    def decoder_utilization(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetDecoderUtilization, handle)[0] / 100.0

    def memory(self, handle: Any) -> tuple[int, int]:
        """(used, total) bytes. Used as nvidia-smi shows it: the v2 reading, without the memory the
        driver reserves for itself (about 600 MiB on an H200, which the v1 reading counts as used);
        the v1 reading on drivers or pynvml releases without v2."""
        if self._memory_v2 is not None:
            try:
                info = self._call(self._nv.nvmlDeviceGetMemoryInfo, handle, self._memory_v2)
                return int(info.used), int(info.total)
            except GpuError:
                info = self._call(self._nv.nvmlDeviceGetMemoryInfo, handle)  # a lost GPU raises here too
                self._memory_v2 = None  # v1 answered where v2 did not: this driver has no v2
                return int(info.used), int(info.total)
        info = self._call(self._nv.nvmlDeviceGetMemoryInfo, handle)
        return int(info.used), int(info.total)

    def power_w(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetPowerUsage, handle) / 1000.0  # mW

    def energy_j(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetTotalEnergyConsumption, handle) / 1000.0  # mJ

    def temperature_c(self, handle: Any) -> float:
        return float(self._call(self._nv.nvmlDeviceGetTemperature, handle, self._nv.NVML_TEMPERATURE_GPU))

    def ecc_errors(self, handle: Any, corrected: bool) -> int:
        kind = (
            self._nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
            if corrected
            else self._nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        )
        return int(self._call(self._nv.nvmlDeviceGetTotalEccErrors, handle, kind, self._nv.NVML_VOLATILE_ECC))

    def sm_clock_hz(self, handle: Any) -> float:
        return self._call(self._nv.nvmlDeviceGetClockInfo, handle, self._nv.NVML_CLOCK_SM) * 1e6  # MHz

    def process_memory(self, handle: Any) -> dict[int, int]:
        processes = self._call(self._nv.nvmlDeviceGetComputeRunningProcesses, handle)
        # usedGpuMemory is None where the driver cannot tell (some containers, Windows WDDM).
        return {int(p.pid): int(p.usedGpuMemory) for p in processes if p.usedGpuMemory is not None}

    def field_values(self, handle: Any, fields: Sequence[tuple[int, int]]) -> list[tuple[int, Any]]:
        # (id, scope) tuples: pynvml sets scopeId only from a tuple, and leaves it 0 for a bare id
        # (which for NVLink throughput means link 0 alone, not all links).
        values = self._call(self._nv.nvmlDeviceGetFieldValues, handle, [tuple(f) for f in fields])
        return [
            (int(v.nvmlReturn), _field_value(v) if v.nvmlReturn == NVML_SUCCESS else None) for v in values
        ]

    def pcie_replay_counter(self, handle: Any) -> int:
        return int(self._call(self._nv.nvmlDeviceGetPcieReplayCounter, handle))

    def remapped_rows(self, handle: Any) -> tuple[int, int, int, int]:
        corrected, uncorrected, pending, failure = self._call(self._nv.nvmlDeviceGetRemappedRows, handle)
        return int(corrected), int(uncorrected), int(pending), int(failure)

    def violation_s(self, handle: Any, policy: int) -> float:
        return self._call(self._nv.nvmlDeviceGetViolationStatus, handle, policy).violationTime / 1e9  # ns

    def pcie_link(self, handle: Any) -> tuple[int, int]:
        width = self._call(self._nv.nvmlDeviceGetCurrPcieLinkWidth, handle)
        return int(width), int(self._call(self._nv.nvmlDeviceGetCurrPcieLinkGeneration, handle))

    def pcie_link_max(self, handle: Any) -> tuple[int, int]:
        # "possible with this device and system": a Gen5 GPU in a Gen4 slot says 4, not a fault.
        width = self._call(self._nv.nvmlDeviceGetMaxPcieLinkWidth, handle)
        return int(width), int(self._call(self._nv.nvmlDeviceGetMaxPcieLinkGeneration, handle))

    def event_set_create(self) -> Any:
        return self._call(self._nv.nvmlEventSetCreate)

    def register_xid_events(self, handle: Any, event_set: Any) -> None:
        self._call(
            self._nv.nvmlDeviceRegisterEvents, handle, self._nv.nvmlEventTypeXidCriticalError, event_set
        )
        # Learnt now, while the GPU answers: the GPU an XID 79 names may no longer answer for its UUID.
        self._xid_uuids[_handle_key(handle)] = self.uuid(handle)

    def wait_xid(self, event_set: Any) -> tuple[str, int] | None:
        try:
            data = self._nv.nvmlEventSetWait_v2(event_set, 0)  # 0 ms: take what is queued, never block
        except self._nv.NVMLError_Timeout:
            return None
        except self._nv.NVMLError as exc:
            raise GpuError(str(exc)) from None
        uuid = self._xid_uuids.get(_handle_key(data.device))
        return uuid if uuid is not None else self.uuid(data.device), int(data.eventData)

    def event_set_free(self, event_set: Any) -> None:
        self._call(self._nv.nvmlEventSetFree, event_set)

    def gpm_supported(self, handle: Any) -> bool:
        fn = getattr(self._nv, "nvmlGpmQueryDeviceSupport", None)
        if fn is None:  # nvidia-ml-py older than GPM
            return False
        return bool(self._call(fn, handle).isSupportedDevice)

    def gpm_sample_alloc(self) -> Any:
        return self._call(self._nv.nvmlGpmSampleAlloc)

    def gpm_sample_get(self, handle: Any, sample: Any) -> None:
        self._call(self._nv.nvmlGpmSampleGet, handle, sample)

    def gpm_metrics(self, sample1: Any, sample2: Any, metric_ids: Sequence[int]) -> dict[int, float]:
        request = self._nv.c_nvmlGpmMetricsGet_t()
        request.version = self._nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(metric_ids)
        request.sample1 = sample1
        request.sample2 = sample2
        for i, metric_id in enumerate(metric_ids):
            request.metrics[i].metricId = metric_id
        self._call(self._nv.nvmlGpmMetricsGet, request)
        return {
            int(request.metrics[i].metricId): float(request.metrics[i].value)
            for i in range(len(metric_ids))
            if request.metrics[i].nvmlReturn == NVML_SUCCESS
        }

    def gpm_sample_free(self, sample: Any) -> None:
        self._call(self._nv.nvmlGpmSampleFree, sample)


# nvmlValueType_t -> the member of the nvmlValue_t union that holds the value.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _field_value(field: Any) -> Any:
    member = _VALUE_MEMBERS.get(int(field.valueType))
    if member is None:
        return None
    return getattr(field.value, member)


def _handle_key(handle: Any) -> Any:
    """A device handle as a dict key: pynvml's handles are ctypes pointers, a new object per return."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

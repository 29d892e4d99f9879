"""The one object through which NVML is reached, so tests can hand in a fake.

:class:`NvmlBackend` is the interface the GPU collector uses: a handful of
plain calls, each returning host values in SI units where NVML uses others
(bytes, watts, joules, hertz). :class:`PynvmlBackend` implements it over
``pynvml`` (the ``nvidia-ml-py`` package, extra ``gpu``), translating NVML's
errors into :class:`GpuNotSupported` (this device lacks the capability: stop
asking) and :class:`GpuError` (something went wrong: try again later).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["GpuError", "GpuNotSupported", "NvmlBackend", "PynvmlBackend", "load_pynvml_backend"]


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
    def clock_event_reasons(self, handle: Any) -> int: ...
    def process_memory(self, handle: Any) -> dict[int, int]: ...


def load_pynvml_backend() -> PynvmlBackend:
    """Import pynvml and return a backend (not yet initialized). Raises ImportError when missing."""
    import pynvml

    return PynvmlBackend(pynvml)


class PynvmlBackend:
    """NvmlBackend over the ``pynvml`` module (passed in, so nothing imports it at package import)."""

    def __init__(self, pynvml: Any) -> None:
        self._nv = pynvml

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nv.NVMLError_NotSupported as exc:
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

    def clock_event_reasons(self, handle: Any) -> int:
        fn = getattr(self._nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            self._nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return int(self._call(fn, handle))

    def process_memory(self, handle: Any) -> dict[int, int]:
        processes = self._call(self._nv.nvmlDeviceGetComputeRunningProcesses, handle)
        # usedGpuMemory is None where the driver cannot tell (some containers, Windows WDDM).
        return {int(p.pid): int(p.usedGpuMemory) for p in processes if p.usedGpuMemory is not None}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

"""Fakes for GPU tests without a GPU.

- :class:`FakeNvml` implements :class:`openlora_otel.nvml.NvmlBackend`: several GPUs, MIG
  instances, capabilities a device lacks, errors mid-run, per-call latency, and call counts.
- :func:`fake_pynvml_module` is a stand-in for the ``pynvml`` module itself, with NVML's raw
  units (milliwatts, millijoules, MHz, percent, bytes names), to test the real backend's
  conversions.
"""

from __future__ import annotations

import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field

from openlora_otel.nvml import GpuError, GpuNotSupported


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
    throttle: int = 0x4  # sw_power_cap
    processes: dict[int, int] = field(default_factory=dict)
    mig: list[FakeGpu] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    failing: bool = False


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
        self._lock = threading.Lock()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def _call(self, name: str, gpu: FakeGpu | None = None) -> None:
        with self._lock:
            self.calls[name] += 1
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

    def clock_event_reasons(self, handle: FakeGpu) -> int:
        self._call("clock_event_reasons", handle)
        return handle.throttle

    def process_memory(self, handle: FakeGpu) -> dict[int, int]:
        self._call("process_memory", handle)
        return dict(handle.processes)


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


def fake_pynvml_module(*, not_supported: set[str] | None = None, lost: bool = False) -> types.ModuleType:
    """A pynvml stand-in returning NVML's raw units for one GPU."""
    module = types.ModuleType("pynvml")
    not_supported = not_supported or set()

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    module.NVMLError = NVMLError
    module.NVMLError_NotSupported = NVMLError_NotSupported
    module.NVML_TEMPERATURE_GPU = 0
    module.NVML_CLOCK_SM = 1
    module.NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    module.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    module.NVML_VOLATILE_ECC = 0
    module.NVML_DEVICE_MIG_ENABLE = 1

    def api(name, value):
        def call(*args):
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
    api("nvmlDeviceGetUtilizationRates", types.SimpleNamespace(gpu=37, memory=12))
    api("nvmlDeviceGetEncoderUtilization", (5, 167000))
    api("nvmlDeviceGetDecoderUtilization", (0, 167000))
    api("nvmlDeviceGetMemoryInfo", types.SimpleNamespace(used=1_234_567_890, total=85_520_809_984, free=0))
    api("nvmlDeviceGetPowerUsage", 312_456)  # milliwatts
    api("nvmlDeviceGetTotalEnergyConsumption", 987_654_321)  # millijoules
    api("nvmlDeviceGetTemperature", 61)
    api("nvmlDeviceGetTotalEccErrors", lambda handle, kind, counter: 7 if kind == 0 else 1)
    api("nvmlDeviceGetClockInfo", 1980)  # MHz
    api("nvmlDeviceGetCurrentClocksEventReasons", 0x44)
    api(
        "nvmlDeviceGetComputeRunningProcesses",
        [
            types.SimpleNamespace(pid=42, usedGpuMemory=2_000_000_000),
            types.SimpleNamespace(pid=43, usedGpuMemory=None),
        ],
    )
    return module

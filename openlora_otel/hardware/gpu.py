"""GPU telemetry: observable instruments under the ``hw.*`` semantic conventions, fed by one NVML snapshot per collection.

:class:`GpuMetrics` registers the instruments; each callback reads the collection's snapshot
(:mod:`openlora_otel.hardware.gpu_snapshot`) and never raises into the scrape. The torch allocator's
gauges never initialize CUDA. ``GpuCollector`` and ``FIELDS`` are re-exported here, where they were
defined before. See docs/reference/gpu-metrics.md.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.hardware.gpu_snapshot import FIELDS, Device, GpuCollector, Reading, torch_cuda_devices
from openlora_otel.hardware.nvml import RECOVERY
from openlora_otel.names import (
    ATTR_GPU_INDEX,
    ATTR_GPU_PARENT,
    ATTR_HW_STATE,
    ATTR_IO_DIRECTION,
    ATTR_REMAP_CAUSE,
    ATTR_THROTTLE_REASON,
    ATTR_XID_CODE,
    XID_BAD_GPU,
    XID_FAILED,
    XID_OTHER,
)

__all__ = ["FIELDS", "GpuCollector", "GpuMetrics"]

_logger = logging.getLogger(__name__)


def status_of(reading: Reading, xids: dict[str, int]) -> str:
    """``hw.state`` of a device: ok, degraded or failed (see names/gpu.py, hw.status)."""
    values = reading.values
    codes = {int(code) for code in xids if code != XID_OTHER}
    recovery = values.get("recovery_action")
    if (
        reading.lost
        or codes & set(XID_FAILED)
        or values.get("remap_failed")
        or recovery in (RECOVERY.NODE_REBOOT, RECOVERY.SYSTEM_REBOOT)
    ):
        return "failed"
    # Any other action the driver asks for (a GPU or bus reset, a drain, ones newer drivers add) means
    # the GPU needs attention: never ok.
    if codes & set(XID_BAD_GPU) or values.get("remap_pending") or recovery not in (None, RECOVERY.NONE):
        return "degraded"
    return "ok"


def torch_allocator_stats() -> list[tuple[int, str, dict[str, Any]]]:
    """(index, UUID, memory_stats) per CUDA device this process uses; empty if CUDA is not initialized."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    stats = []
    for index, uuid in torch_cuda_devices() or []:
        stats.append((index, uuid, torch.cuda.memory_stats(index)))
    return stats


class GpuMetrics:
    """The GPU instruments, registered on ``meter``, fed by a :class:`GpuCollector`."""

    def __init__(
        self,
        meter: Meter,
        collector: GpuCollector,
        *,
        allocator_stats: Callable[[], list[tuple[int, str, dict[str, Any]]]] | None = None,
    ) -> None:
        self.collector = collector
        # Looked up at call time, so the module-level reader can be swapped (tests, other frameworks).
        self._allocator_stats = allocator_stats or (lambda: torch_allocator_stats())
        spec = {m.name: m for m in names.GPU_METRICS}
        kinds = {
            "gauge": meter.create_observable_gauge,
            "counter": meter.create_observable_counter,
            "updowncounter": meter.create_observable_up_down_counter,
        }
        callbacks: dict[str, Callable[[CallbackOptions], Iterable[Observation]]] = {
            "hw.gpu.utilization": self._utilization,
            "hw.gpu.memory.usage": self._per_device(lambda v: v["memory"][0], "memory"),
            "hw.gpu.memory.limit": self._per_device(lambda v: v["memory"][1], "memory"),
            "hw.gpu.memory.utilization": self._per_device(
                lambda v: v["memory"][0] / v["memory"][1] if v["memory"][1] else None, "memory"
            ),
            "hw.power": self._per_device(lambda v: v["power"], "power", hw_type=True),
            "hw.energy": self._per_device(lambda v: v["energy"], "energy", hw_type=True),
            "hw.temperature": self._temperature,
            "hw.errors": self._errors(self._ECC_KEYS, hw_type=True),
            "openlora.gpu.pcie.errors": self._errors(self._PCIE_KEYS, hw_type=False),
            "openlora.gpu.clock.sm": self._per_device(lambda v: v["sm_clock"], "sm_clock"),
            "openlora.gpu.throttle.time": self._throttle_time,
            "hw.gpu.io": self._io("pcie_tx", "pcie_rx"),
            "openlora.gpu.nvlink.io": self._io("nvlink_tx", "nvlink_rx"),
            "openlora.gpu.xid.errors": self._xid_errors,
            "openlora.gpu.remap.rows": self._remap_rows,
            "openlora.gpu.remap.pending": self._per_device(
                lambda v: int(bool(v["remap_pending"])), "remap_pending"
            ),
            "openlora.gpu.remap.failed": self._per_device(
                lambda v: int(bool(v["remap_failed"])), "remap_failed"
            ),
            "openlora.gpu.pcie.link.width": self._per_device(lambda v: v["link"][0], "link"),
            "openlora.gpu.pcie.link.width.max": self._per_device(lambda v: v["link_max"][0], "link_max"),
            "openlora.gpu.pcie.link.generation": self._per_device(lambda v: v["link"][1], "link"),
            "openlora.gpu.pcie.link.generation.max": self._per_device(lambda v: v["link_max"][1], "link_max"),
            "hw.status": self._status,
            "openlora.gpu.sm.activity": self._per_device(lambda v: v["gpm.sm_activity"], "gpm.sm_activity"),
            "openlora.gpu.sm.occupancy": self._per_device(
                lambda v: v["gpm.sm_occupancy"], "gpm.sm_occupancy"
            ),
            "openlora.gpu.tensor.activity": self._per_device(
                lambda v: v["gpm.tensor_activity"], "gpm.tensor_activity"
            ),
            "openlora.gpu.dram.activity": self._per_device(
                lambda v: v["gpm.dram_activity"], "gpm.dram_activity"
            ),
            "openlora.process.gpu.memory.usage": self._process_memory,
            "openlora.torch.memory.allocated": self._allocator("allocated_bytes.all.current"),
            "openlora.torch.memory.reserved": self._allocator("reserved_bytes.all.current"),
            "openlora.torch.memory.peak": self._allocator("allocated_bytes.all.peak"),
            "openlora.torch.memory.ooms": self._allocator("num_ooms"),
            "openlora.torch.memory.alloc_retries": self._allocator("num_alloc_retries"),
            "openlora.gpu.snapshot.age": self._age,
        }
        for name, callback in callbacks.items():
            metric = spec[name]
            kinds[metric.kind](
                name, callbacks=[_guarded(callback)], unit=metric.unit, description=metric.description
            )

    def _attributes(self, device: Device, **extra: Any) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "hw.id": device.uuid,
            "hw.name": device.name,
            "hw.vendor": "NVIDIA",
            "hw.model": device.name,
            ATTR_GPU_INDEX: device.index,
        }
        if self.collector.driver_version:
            attributes["hw.driver_version"] = self.collector.driver_version
        if device.parent_uuid:
            attributes[ATTR_GPU_PARENT] = device.parent_uuid
        attributes.update(extra)
        return attributes

    def _sensor_attributes(self, device: Device) -> dict[str, Any]:
        """A temperature sensor's attributes: the conventions give hw.temperature hw.id, hw.name and hw.parent
        (and a sensor location), not hw.type nor the GPU's vendor, model or driver; ours name the GPU."""
        attributes: dict[str, Any] = {"hw.id": device.uuid, "hw.name": device.name, ATTR_GPU_INDEX: device.index}
        if device.parent_uuid:
            attributes[ATTR_GPU_PARENT] = device.parent_uuid
        return attributes

    def _readings(self) -> list[Reading]:
        snapshot, _ = self.collector.current()
        return snapshot.readings if snapshot is not None else []

    def _per_device(
        self, extract: Callable[[dict[str, Any]], Any], key: str, *, hw_type: bool = False
    ) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            out = []
            for reading in self._readings():
                if key not in reading.values:
                    continue
                value = extract(reading.values)
                if value is not None:
                    extra = {"hw.type": "gpu"} if hw_type else {}
                    out.append(Observation(value, self._attributes(reading.device, **extra)))
            return out

        return callback

    def _utilization(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            for key, task in (("utilization", "general"), ("encoder", "encoder"), ("decoder", "decoder")):
                if key in reading.values:
                    out.append(
                        Observation(
                            reading.values[key], self._attributes(reading.device, **{"hw.gpu.task": task})
                        )
                    )
        return out

    def _temperature(self, options: CallbackOptions) -> list[Observation]:
        return [
            Observation(reading.values["temperature"], self._sensor_attributes(reading.device))
            for reading in self._readings()
            if reading.values.get("temperature") is not None
        ]

    # error.type -> the value key it is read from: ECC errors on hw.errors (the conventions' GPU refinement
    # has `corrected` and `uncorrected` only), PCIe link errors on openlora.gpu.pcie.errors.
    _ECC_KEYS = (("corrected", "ecc_corrected"), ("uncorrected", "ecc_uncorrected"))
    _PCIE_KEYS = (
        ("replay", "pcie_replay"),
        ("correctable", "pcie_correctable"),
        ("non_fatal", "pcie_non_fatal"),
        ("fatal", "pcie_fatal"),
    )

    def _errors(
        self, keys: tuple[tuple[str, str], ...], *, hw_type: bool
    ) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            out = []
            for reading in self._readings():
                for kind, key in keys:
                    if key in reading.values:
                        extra = {"hw.type": "gpu", "error.type": kind} if hw_type else {"error.type": kind}
                        out.append(Observation(reading.values[key], self._attributes(reading.device, **extra)))
            return out

        return callback

    def _throttle_time(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            for reason in names.THROTTLE_REASONS:
                value = reading.values.get("throttle." + reason)
                if value is not None:
                    attributes = self._attributes(reading.device, **{ATTR_THROTTLE_REASON: reason})
                    out.append(Observation(value, attributes))
        return out

    def _io(self, transmit: str, receive: str) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            out = []
            for reading in self._readings():
                for key, direction in ((transmit, "transmit"), (receive, "receive")):
                    if key in reading.values:
                        attributes = self._attributes(reading.device, **{ATTR_IO_DIRECTION: direction})
                        out.append(Observation(reading.values[key], attributes))
            return out

        return callback

    def _xid_errors(self, options: CallbackOptions) -> list[Observation]:
        out = []
        seen: set[str] = set()
        for reading in self._readings():
            device = reading.device
            if device.physical_uuid in seen:
                continue  # the instances of one MIG GPU share its XIDs: count them once
            seen.add(device.physical_uuid)
            if device.is_mig:  # XIDs belong to the whole GPU
                device = self.collector.device(device.physical_uuid) or Device(
                    None, device.index, device.physical_uuid, device.name, device.pci_bus_id
                )
            for code, count in sorted(reading.values.get("xid", {}).items()):
                out.append(Observation(count, self._attributes(device, **{ATTR_XID_CODE: code})))
        return out

    def _remap_rows(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            for key, cause in (
                ("remap_correctable", "correctable"),
                ("remap_uncorrectable", "uncorrectable"),
            ):
                if key in reading.values:
                    attributes = self._attributes(reading.device, **{ATTR_REMAP_CAUSE: cause})
                    out.append(Observation(reading.values[key], attributes))
        return out

    def _status(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            state = status_of(reading, reading.values.get("xid", {}))
            for candidate in ("ok", "degraded", "failed"):
                attributes = self._attributes(reading.device, **{"hw.type": "gpu", ATTR_HW_STATE: candidate})
                out.append(Observation(int(candidate == state), attributes))
        return out

    def _process_memory(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            used = reading.values.get("process_memory", {}).get(self.collector.pid)
            if used is not None:
                out.append(Observation(used, self._attributes(reading.device)))
        return out

    def _allocator(self, key: str) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            return [
                Observation(stats.get(key, 0), {"hw.id": _gpu_uuid(uuid), "openlora.torch.device": index})
                for index, uuid, stats in self._allocator_stats()
            ]

        return callback

    def _age(self, options: CallbackOptions) -> list[Observation]:
        snapshot, age = self.collector.current()
        return [] if snapshot is None else [Observation(round(age, 3))]


def _gpu_uuid(uuid: str) -> str:
    """torch reports bare UUIDs; NVML (and so hw.id on the NVML metrics) prefixes them with GPU-."""
    return uuid if uuid.lower().startswith(("gpu-", "mig-")) else f"GPU-{uuid}"


def _guarded(
    callback: Callable[[CallbackOptions], list[Observation]],
) -> Callable[[CallbackOptions], list[Observation]]:
    warned: list[bool] = []

    def run(options: CallbackOptions) -> list[Observation]:
        try:
            return callback(options)
        except Exception:
            if not warned:
                warned.append(True)
                _logger.warning(
                    "openlora-otel: a GPU metric callback failed; it reports nothing", exc_info=True
                )
            return []

    return run

"""GPU telemetry: observable gauges under the ``hw.*`` semantic conventions, fed by one NVML snapshot per collection.

How it behaves, and why:

- **One snapshot per collection.** Every GPU instrument's callback asks
  :meth:`GpuCollector.current` for the snapshot; the first one in a collection
  takes it (about a dozen NVML calls per device), the rest reuse it (a snapshot
  younger than half a second is shared). NVML calls do not multiply with the
  number of instruments, and values are converted exactly (milliwatts to
  watts, MHz to Hz), never truncated to whole units.
- **Bounded.** A snapshot is taken on a helper thread; the collection waits at
  most ``OPENLORA_GPU_TIMEOUT``. If NVML is slower than that, the last good
  snapshot is served (up to 60 s old; ``openlora.gpu.snapshot.age`` says how
  old) and at most one snapshot is in flight, so a hung driver call never
  piles up threads nor stalls a scrape.
- **Which GPUs.** ``process`` (default): once torch has initialized CUDA, the
  devices torch uses, matched to NVML by UUID; before that, the devices in
  ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs), narrowed to ``LOCAL_RANK``'s
  one under torchrun. So eight ranks on a node report eight GPUs, not
  sixty-four series. ``all``: every GPU on the host (a node-level monitor).
  MIG instances are reported with their own memory; NVML gives no utilization
  for them, so none is reported.
- **Never breaks anything.** A capability a device lacks (``NotSupported``)
  is remembered and not asked again; any other failure drops that device from
  the snapshot, logs one warning per distinct problem, and the device's series
  come back when it answers again. Nothing raises into the scrape or training.
- **The torch allocator.** Read from ``torch.cuda.memory_stats`` only when
  torch is already imported and CUDA already initialized (never initializes it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.names import ATTR_GPU_INDEX, ATTR_GPU_PARENT, ATTR_THROTTLE_REASON
from openlora_otel.nvml import GpuError, GpuNotSupported, NvmlBackend

__all__ = ["THROTTLE_REASONS", "GpuCollector", "GpuMetrics"]

_logger = logging.getLogger(__name__)

# NVML clock event (throttle) reason bits and the names we report them under.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

_FRESH_FOR_S = 0.5  # snapshots younger than this are shared between callbacks and readers
_MAX_AGE_S = 60.0  # older than this, a stale snapshot is not served at all


@dataclass(frozen=True)
class Device:
    """One NVML device (a GPU or a MIG instance) and its identity attributes."""

    handle: Any
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    parent_uuid: str | None = None

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None


@dataclass
class Reading:
    device: Device
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Snapshot:
    taken: float
    readings: list[Reading]


def _norm_uuid(value: str) -> str:
    lowered = value.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if lowered.startswith(prefix):
            return lowered[len(prefix) :]
    return lowered


class GpuCollector:
    """Takes NVML snapshots of the selected devices, bounded in time, never raising."""

    # key -> (backend method, extra args); each a single NVML call per device.
    _QUERIES: tuple[tuple[str, str, tuple[Any, ...], bool], ...] = (
        # key, method, args, also for MIG instances
        ("memory", "memory", (), True),
        ("utilization", "utilization", (), False),
        ("encoder", "encoder_utilization", (), False),
        ("decoder", "decoder_utilization", (), False),
        ("power", "power_w", (), False),
        ("energy", "energy_j", (), False),
        ("temperature", "temperature_c", (), False),
        ("ecc_corrected", "ecc_errors", (True,), False),
        ("ecc_uncorrected", "ecc_errors", (False,), False),
        ("sm_clock", "sm_clock_hz", (), False),
        ("throttle", "clock_event_reasons", (), False),
        ("process_memory", "process_memory", (), True),
    )

    def __init__(
        self,
        backend: NvmlBackend,
        *,
        devices: str = "process",
        cuda_visible_devices: str | None = None,
        local_rank: int | None = None,
        timeout_s: float = 1.0,
        pid: int | None = None,
        torch_devices: Callable[[], list[tuple[int, str]] | None] | None = None,
    ) -> None:
        self._backend = backend
        self._mode = devices
        self._visible = cuda_visible_devices
        self._local_rank = local_rank
        self._timeout_s = timeout_s
        self._pid = os.getpid() if pid is None else pid
        self._torch_devices = torch_devices or torch_cuda_devices
        self._lock = threading.Lock()
        self._last: Snapshot | None = None
        self._inflight: threading.Event | None = None
        self._impatient_until = 0.0
        self._devices: list[Device] | None = None
        self._driver_version: str | None = None
        self._unsupported: set[tuple[str, str]] = set()
        self._warned: set[str] = set()

    # -- what callbacks call ------------------------------------------------
    def current(self) -> tuple[Snapshot | None, float]:
        """The snapshot to report and its age in seconds; (None, 0) when there is none worth serving."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last.taken < _FRESH_FOR_S:
                return self._last, now - self._last.taken
            if self._inflight is None:
                self._inflight = threading.Event()
                threading.Thread(target=self._take, name="openlora-otel-nvml", daemon=True).start()
                inflight: threading.Event | None = self._inflight
            elif now < self._impatient_until:
                inflight = None  # this collection already waited once for the stuck snapshot
            else:
                inflight = self._inflight
        if inflight is not None and not inflight.wait(self._timeout_s):
            with self._lock:
                self._impatient_until = time.monotonic() + _FRESH_FOR_S
            self._warn_once(
                "slow",
                f"an NVML snapshot took longer than {self._timeout_s:g} s; serving the last good one "
                "(see openlora.gpu.snapshot.age)",
            )
        with self._lock:
            snapshot = self._last
        if snapshot is None:
            return None, 0.0
        age = time.monotonic() - snapshot.taken
        if age > _MAX_AGE_S:
            return None, age
        return snapshot, age

    @property
    def driver_version(self) -> str | None:
        return self._driver_version

    # -- the helper thread --------------------------------------------------------
    def _take(self) -> None:
        try:
            snapshot = self.snapshot()
            with self._lock:
                self._last = snapshot
        except Exception:  # pragma: no cover - snapshot() catches per device; belt and braces
            self._warn_once("snapshot", "taking an NVML snapshot failed", exc=True)
        finally:
            with self._lock:
                event, self._inflight = self._inflight, None
            if event is not None:
                event.set()

    def snapshot(self) -> Snapshot:
        """Read every selected device once (synchronously: callers go through :meth:`current`)."""
        started = time.monotonic()
        readings = []
        for device in self._selected():
            reading = self._read(device)
            if reading is not None:
                readings.append(reading)
        return Snapshot(taken=started, readings=readings)

    def _discover(self) -> list[Device]:
        if self._devices is not None:
            return self._devices
        backend = self._backend
        devices: list[Device] = []
        try:
            if self._driver_version is None:
                self._driver_version = backend.driver_version()
            for index in range(backend.device_count()):
                handle = backend.handle(index)
                uuid = backend.uuid(handle)
                name = backend.name(handle)
                devices.append(Device(handle, index, uuid, name, backend.pci_bus_id(handle)))
                for mig in backend.mig_handles(handle):
                    devices.append(
                        Device(mig, index, backend.uuid(mig), name, backend.pci_bus_id(handle), uuid)
                    )
        except GpuError as exc:
            self._warn_once(f"discover:{exc}", f"listing GPUs through NVML failed ({exc}); will retry")
            return []
        self._devices = devices
        return devices

    def _selected(self) -> list[Device]:
        devices = self._discover()
        if self._mode == "all":
            return devices
        torch_uuids = self._torch_devices()
        if torch_uuids:
            wanted = {_norm_uuid(uuid) for _, uuid in torch_uuids}
            return [d for d in devices if _norm_uuid(d.uuid) in wanted]
        return self._visible_devices(devices)

    def _visible_devices(self, devices: list[Device]) -> list[Device]:
        gpus = [d for d in devices if not d.is_mig]
        if self._visible is None:
            chosen = gpus
        else:
            chosen = []
            for entry in (e.strip() for e in self._visible.split(",")):
                if not entry:
                    break
                if entry.isdigit():
                    matches = [d for d in gpus if d.index == int(entry)]
                else:  # a GPU- or MIG- UUID, or a unique prefix of one, as CUDA accepts
                    key = _norm_uuid(entry)
                    matches = [d for d in devices if _norm_uuid(d.uuid).startswith(key)]
                if len(matches) != 1:
                    break  # CUDA ignores everything from the first invalid entry on
                chosen.append(matches[0])
        if self._local_rank is not None and 0 <= self._local_rank < len(chosen) and len(chosen) > 1:
            chosen = [chosen[self._local_rank]]
        # A whole GPU in MIG mode is represented by its instances.
        result: list[Device] = []
        for device in chosen:
            instances = [d for d in devices if d.parent_uuid == device.uuid]
            result.extend(instances or [device])
        return result

    def _read(self, device: Device) -> Reading | None:
        reading = Reading(device)
        backend = self._backend
        for key, method, args, for_mig in self._QUERIES:
            if device.is_mig and not for_mig:
                continue
            if (device.uuid, key) in self._unsupported:
                continue
            try:
                reading.values[key] = getattr(backend, method)(device.handle, *args)
            except GpuNotSupported:
                self._unsupported.add((device.uuid, key))
            except GpuError as exc:
                self._warn_once(
                    f"{device.uuid}:{exc}",
                    f"GPU {device.index} ({device.uuid}) stopped answering NVML ({exc}); "
                    "its series are dropped until it answers again",
                )
                self._devices = None  # re-enumerate next time: handles may have changed
                return None
        return reading

    def _warn_once(self, key: str, message: str, *, exc: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning("openlora-otel: %s", message, exc_info=exc)


def torch_cuda_devices() -> list[tuple[int, str]] | None:
    """(torch index, UUID) of the CUDA devices this process uses, or None when CUDA is not initialized.

    Never imports torch nor initializes CUDA: it looks only if both already happened.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    used = []
    current = torch.cuda.current_device()
    for index in range(torch.cuda.device_count()):
        if index == current or torch.cuda.memory_reserved(index) > 0:
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            if uuid is not None:
                used.append((index, str(uuid)))
    return used or None


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
        self._pid = os.getpid()
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
            "hw.temperature": self._per_device(lambda v: v["temperature"], "temperature", hw_type=True),
            "hw.errors": self._errors,
            "openlora.gpu.clock.sm": self._per_device(lambda v: v["sm_clock"], "sm_clock"),
            "openlora.gpu.throttle": self._throttle,
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

    def _errors(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            for key, kind in (("ecc_corrected", "corrected"), ("ecc_uncorrected", "uncorrected")):
                if key in reading.values:
                    attributes = self._attributes(reading.device, **{"hw.type": "gpu", "error.type": kind})
                    out.append(Observation(reading.values[key], attributes))
        return out

    def _throttle(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            if "throttle" not in reading.values:
                continue
            mask = reading.values["throttle"]
            for reason, bit in THROTTLE_REASONS.items():
                attributes = self._attributes(reading.device, **{ATTR_THROTTLE_REASON: reason})
                out.append(Observation(1 if mask & bit else 0, attributes))
        return out

    def _process_memory(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for reading in self._readings():
            used = reading.values.get("process_memory", {}).get(self._pid)
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

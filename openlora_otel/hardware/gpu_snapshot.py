"""NVML snapshots of the GPUs: which devices, which values, read on a helper thread, one snapshot per collection.

How :class:`GpuCollector` behaves, and why (its readers are the instruments of :mod:`openlora_otel.hardware.gpu`):

- **One snapshot per collection.** Every GPU instrument's callback asks
  :meth:`GpuCollector.current` for the snapshot; the first one in a collection
  takes it, the rest reuse it (a snapshot younger than half a second is
  shared). NVML calls do not multiply with the number of instruments, and
  values are converted exactly (milliwatts to watts, MHz to Hz, nanoseconds to
  seconds), never truncated to whole units.
- **Few calls per snapshot.** Power, energy, ECC, PCIe and NVLink bytes,
  throttle times, PCIe errors and remapped rows come through one
  ``nvmlDeviceGetFieldValues`` call per GPU (:data:`FIELDS`). NVML answers per
  field: a field the GPU or driver lacks falls back to its own call where one
  exists (power, energy, ECC, replay counter, remapped rows, violation
  status), and the choice is remembered. The PCIe link's maximum is read once,
  its current width and generation at most once a minute (they change only
  when the link retrains). So a GPU costs 8 calls per snapshot (10 with GPM)
  where it cost 12, for about three times the values.
- **XID errors** come from an NVML event set registered for every GPU. The
  helper thread drains it without waiting (``nvmlEventSetWait_v2`` with a 0 ms
  timeout) at each snapshot: no thread blocks in the driver, and the training
  thread never touches NVML. Codes outside a bounded list count as ``other``.
- **GPM activity** (SM, occupancy, tensor, DRAM; Hopper and later) is the
  difference of two GPM samples: each snapshot takes one and reports the
  activity since the previous snapshot's. Absent (not zero) on older GPUs, on
  MIG instances, and on the first snapshot.
- **PCIe bytes** (``hw.gpu.io``). NVML's byte counter fields wrap at 2^32
  (4 GiB: 78 ms at full Gen5 x16 speed, seen on an H200), so where GPM gives
  PCIe traffic (Hopper and later) the bytes are its average rate between two
  samples times the time between them, summed from the second snapshot: no
  wrap, whatever the traffic (link traffic, protocol overhead included, and a
  fraction of a second in arrears, as measured on an H200). Elsewhere the fields are read, and a 32-bit
  value that went down is taken as one wrap (right while less than 4 GiB
  crosses between two snapshots). Which source a GPU uses is settled at its
  second snapshot and kept, so the counter never jumps between them; a GPU
  with GPM reports no PCIe bytes on its first snapshot.
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
  is remembered per device and value and not asked again; any other failure
  drops that device's values from the snapshot, logs one warning per distinct
  problem, reports the device as ``hw.status`` failed, and its series come
  back when it answers again. Nothing raises into the scrape or training.

:class:`GpuCollector` wires three collaborators, one job each: which GPUs
(:class:`~openlora_otel.hardware.gpu_devices.DeviceSelection`), what one GPU's
values are (:class:`~openlora_otel.hardware.gpu_reads.NvmlReads`) and the helper
thread (:class:`~openlora_otel.hardware.gpu_thread.SnapshotThread`). It keeps
what spans them: the XID event set and counts, the devices that stopped
answering, and one warning per problem.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openlora_otel.hardware.gpu_devices import Device, DeviceSelection, torch_cuda_devices
from openlora_otel.hardware.gpu_reads import FIELDS, NvmlReads, Reading
from openlora_otel.hardware.gpu_thread import SnapshotThread
from openlora_otel.hardware.nvml import GpuError, GpuNotSupported, NvmlBackend
from openlora_otel.names import XID_CODES, XID_OTHER

__all__ = ["FIELDS", "XID_PER_SNAPSHOT", "Device", "GpuCollector", "Reading", "Snapshot", "torch_cuda_devices"]

_logger = logging.getLogger(__name__)

XID_PER_SNAPSHOT = 256  # events drained per snapshot at most: a storm cannot hold the helper thread

_XID_KNOWN = frozenset(XID_CODES)


@dataclass
class Snapshot:
    taken: float
    readings: list[Reading]


class GpuCollector:
    """Takes NVML snapshots of the selected devices, bounded in time, never raising."""

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
        # The process whose GPU memory openlora.process.gpu.memory.usage reports.
        self.pid = os.getpid() if pid is None else pid
        # Which devices a snapshot reads; a fresh listing registers them for XID events.
        self.selection = DeviceSelection(
            backend,
            devices=devices,
            cuda_visible_devices=cuda_visible_devices,
            local_rank=local_rank,
            torch_devices=torch_devices,
            warn=self._warn_once,
            discovered=self._register_xid,
        )
        # What NVML refused, per device UUID and value: not asked again (the reads and XID registration).
        self._unsupported: set[tuple[str, str]] = set()
        self._warned: set[str] = set()
        self.reads = NvmlReads(
            backend,
            unsupported=self._unsupported,
            driver_version=lambda: self.selection.driver_version,
            warn=self._warn_once,
        )
        # Devices that stopped answering, by UUID, until they answer again (reported as failed).
        self._lost: dict[str, Device] = {}
        # XID errors: one event set for every GPU; counts per physical GPU UUID and code.
        self._event_set: Any = None
        self._xid_registered: set[str] = set()
        self._xid: dict[str, dict[str, int]] = {}
        # Snapshots are taken on its helper thread, bounded in time; it calls _release after close().
        self._thread = SnapshotThread(
            self.snapshot, timeout_s=timeout_s, release=self._release, warn=self._warn_once
        )

    # -- what callbacks call ------------------------------------------------
    def current(self) -> tuple[Snapshot | None, float]:
        """The snapshot to report and its age in seconds; (None, 0) when there is none worth serving."""
        return self._thread.current()

    @property
    def driver_version(self) -> str | None:
        return self.selection.driver_version

    def xid_counts(self, physical_uuid: str) -> dict[str, int]:
        """XID errors seen on a GPU since collection started, per code (or ``other``)."""
        return dict(self._xid.get(physical_uuid, {}))

    def device(self, uuid: str) -> Device | None:
        for device in self.selection.listed:
            if device.uuid == uuid:
                return device
        return self._lost.get(uuid)

    def close(self) -> None:
        """Free the event set and GPM samples (before nvmlShutdown); a snapshot in flight frees them when done."""
        self._thread.close()

    def _release(self) -> None:
        self.reads.release()
        if self._event_set is not None:
            try:
                self._backend.event_set_free(self._event_set)
            except Exception:
                _logger.debug("nvmlEventSetFree failed", exc_info=True)
            self._event_set = None

    def snapshot(self) -> Snapshot:
        """Read every selected device once (synchronously: callers go through :meth:`current`)."""
        started = time.monotonic()
        devices = self.selection.selected()
        self._drain_xid()
        readings = []
        for device in devices:
            reading = self.reads.read(device)
            if reading.lost:
                self.selection.forget()  # re-enumerate next time: handles may have changed
                self._lost[device.uuid] = device
            else:
                self._lost.pop(device.uuid, None)
            reading.values["xid"] = self.xid_counts(device.physical_uuid)
            readings.append(reading)
        # A GPU that fell off the bus may vanish from NVML's list altogether: still report it as failed.
        listed = {d.uuid for d in self.selection.listed} | {d.uuid for d in devices}
        selected = {d.uuid for d in devices}
        for uuid, device in list(self._lost.items()):
            if uuid in selected:
                continue
            if uuid in listed:
                del self._lost[uuid]  # listed and answering, just no longer this process's
            else:
                readings.append(Reading(device, {"xid": self.xid_counts(device.physical_uuid)}, lost=True))
        return Snapshot(taken=started, readings=readings)

    # -- XID events ---------------------------------------------------------------
    def _register_xid(self, devices: list[Device]) -> None:
        backend = self._backend
        for device in devices:
            if device.is_mig or device.uuid in self._xid_registered or (device.uuid, "xid") in self._unsupported:
                continue  # a MIG GPU's XIDs arrive on its parent's registration
            try:
                if self._event_set is None:
                    if ("", "event_set") in self._unsupported:
                        return
                    self._event_set = backend.event_set_create()
                backend.register_xid_events(device.handle, self._event_set)
                self._xid_registered.add(device.uuid)
            except GpuNotSupported:
                if self._event_set is None:
                    self._unsupported.add(("", "event_set"))
                    return
                self._unsupported.add((device.uuid, "xid"))
            except GpuError as exc:
                self._warn_once(
                    f"xid:{device.uuid}:{exc}", f"watching GPU {device.index} for XID errors failed ({exc})"
                )

    def _drain_xid(self) -> None:
        if self._event_set is None:
            return
        for _ in range(XID_PER_SNAPSHOT):
            try:
                event = self._backend.wait_xid(self._event_set)
            except GpuError as exc:
                self._warn_once(f"xid-wait:{exc}", f"reading XID events failed ({exc}); will retry")
                return
            if event is None:
                return
            uuid, code = event
            label = str(code) if code in _XID_KNOWN else XID_OTHER
            counts = self._xid.setdefault(uuid, {})
            counts[label] = counts.get(label, 0) + 1
            self._warn_once(f"xid:{uuid}:{code}", f"GPU {uuid} reported XID {code}")

    def _warn_once(self, key: str, message: str, *, exc: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning("openlora-otel: %s", message, exc_info=exc)

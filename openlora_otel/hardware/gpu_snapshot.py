"""NVML snapshots of the GPUs: which devices, which values, read on a helper thread, one snapshot per collection.

One snapshot serves every GPU instrument of a collection, from few NVML calls, taken on a helper
thread the collection waits on for at most ``OPENLORA_GPU_TIMEOUT`` (else the last good snapshot is
served): a hung driver call never stalls a scrape, and nothing raises into a scrape or training.
:class:`GpuCollector` wires which GPUs (``gpu_devices``), one GPU's reads (``gpu_reads``) and the
thread (``gpu_thread``), and keeps what spans them: the XID event set and counts, the devices that
stopped answering, one warning per problem. See docs/reference/gpu-metrics.md.
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

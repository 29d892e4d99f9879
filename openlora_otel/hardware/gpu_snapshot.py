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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openlora_otel.hardware.gpu_devices import Device, DeviceSelection, torch_cuda_devices
from openlora_otel.hardware.nvml import (
    FI,
    GPM,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    PERF_POLICY,
    R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
    R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
    SCOPE_ALL_LINKS,
    GpuError,
    GpuNotSupported,
    NvmlBackend,
)
from openlora_otel.names import XID_CODES, XID_OTHER

__all__ = ["FIELDS", "Device", "GpuCollector", "Reading", "Snapshot", "torch_cuda_devices"]

_logger = logging.getLogger(__name__)

_FRESH_FOR_S = 0.5  # snapshots younger than this are shared between callbacks and readers
_MAX_AGE_S = 60.0  # older than this, a stale snapshot is not served at all
_LINK_EVERY_S = 60.0  # the current PCIe link width/generation is re-read at most this often
_XID_PER_SNAPSHOT = 256  # events drained per snapshot at most: a storm cannot hold the helper thread


@dataclass(frozen=True)
class Field:
    """One value read through nvmlDeviceGetFieldValues, and how to read it without that call."""

    key: str
    field_id: int
    scope: int = 0
    scale: float = 1  # to SI units: multiply by (KiB -> bytes)
    per: float = 1  # ... or divide by (ns -> s, mW -> W): dividing keeps 1000 ns exactly 1e-6 s
    fallback: str | None = None  # backend method answering the same value
    fallback_args: tuple[Any, ...] = ()
    pick: int | None = None  # index into the fallback's tuple result
    min_driver: int = 0  # driver major versions the field id means this value in, from ...
    max_driver: int | None = None  # ... to (inclusive)
    # Asked only once the driver refused this other id for the same value (a renumbering within
    # one driver branch); never together with it.
    replaces: int | None = None

    @property
    def tag(self) -> str:
        """The key under which NVML's refusal of this field id is remembered."""
        return f"fi:{self.key}@{self.field_id}"


FIELDS: tuple[Field, ...] = (
    Field("power", FI.POWER_AVERAGE, per=1000, fallback="power_w"),
    Field("energy", FI.TOTAL_ENERGY_CONSUMPTION, per=1000, fallback="energy_j"),
    Field("ecc_corrected", FI.ECC_SBE_VOL_TOTAL, fallback="ecc_errors", fallback_args=(True,)),
    Field("ecc_uncorrected", FI.ECC_DBE_VOL_TOTAL, fallback="ecc_errors", fallback_args=(False,)),
    Field("pcie_replay", FI.PCIE_REPLAY_COUNTER, fallback="pcie_replay_counter"),
    Field("pcie_correctable", FI.PCIE_COUNT_CORRECTABLE_ERRORS),
    Field("pcie_non_fatal", FI.PCIE_COUNT_NON_FATAL_ERROR),
    Field("pcie_fatal", FI.PCIE_COUNT_FATAL_ERROR),
    Field("pcie_tx", FI.PCIE_COUNT_TX_BYTES),
    Field("pcie_rx", FI.PCIE_COUNT_RX_BYTES),
    Field("nvlink_links", FI.NVLINK_LINK_COUNT),
    Field("nvlink_tx", FI.NVLINK_THROUGHPUT_DATA_TX, scope=SCOPE_ALL_LINKS, scale=1024),  # KiB
    Field("nvlink_rx", FI.NVLINK_THROUGHPUT_DATA_RX, scope=SCOPE_ALL_LINKS, scale=1024),
    Field(
        "throttle.sw_power_cap",
        FI.PERF_POLICY_POWER,
        per=1e9,
        fallback="violation_s",
        fallback_args=(PERF_POLICY.POWER,),
    ),
    Field(
        "throttle.thermal",
        FI.PERF_POLICY_THERMAL,
        per=1e9,
        fallback="violation_s",
        fallback_args=(PERF_POLICY.THERMAL,),
    ),
    Field(
        "throttle.sync_boost",
        FI.PERF_POLICY_SYNC_BOOST,
        per=1e9,
        fallback="violation_s",
        fallback_args=(PERF_POLICY.SYNC_BOOST,),
    ),
    # Renumbered within R580 (see nvml.FI): early R580 drivers answer at 252/253 (and hold power
    # smoothing settings at 270/271); 580.159.04 refuses 252/253 and answers at 270/271, as every
    # later branch does (both read on an H200). So R580 is asked 252/253 first and 270/271 only
    # once refused. Drivers before R580 are not asked.
    Field(
        "throttle.hw_thermal_slowdown",
        R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        per=1e9,
        min_driver=580,
        max_driver=580,
    ),
    Field(
        "throttle.hw_power_brake_slowdown",
        R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        per=1e9,
        min_driver=580,
        max_driver=580,
    ),
    Field(
        "throttle.hw_thermal_slowdown",
        FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        per=1e9,
        min_driver=580,
        max_driver=580,
        replaces=R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
    ),
    Field(
        "throttle.hw_power_brake_slowdown",
        FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        per=1e9,
        min_driver=580,
        max_driver=580,
        replaces=R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
    ),
    Field(
        "throttle.hw_thermal_slowdown", FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, per=1e9, min_driver=581
    ),
    Field(
        "throttle.hw_power_brake_slowdown",
        FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        per=1e9,
        min_driver=581,
    ),
    Field("remap_correctable", FI.REMAPPED_COR, fallback="remapped_rows", pick=0),
    Field("remap_uncorrectable", FI.REMAPPED_UNC, fallback="remapped_rows", pick=1),
    Field("remap_pending", FI.REMAPPED_PENDING, fallback="remapped_rows", pick=2),
    Field("remap_failed", FI.REMAPPED_FAILURE, fallback="remapped_rows", pick=3),
    Field("recovery_action", FI.GET_GPU_RECOVERY_ACTION),
)

# GPM metric id -> the value key (percent in NVML, a fraction here).
_GPM_METRICS: dict[int, str] = {
    GPM.SM_UTIL: "gpm.sm_activity",
    GPM.SM_OCCUPANCY: "gpm.sm_occupancy",
    GPM.ANY_TENSOR_UTIL: "gpm.tensor_activity",
    GPM.DRAM_BW_UTIL: "gpm.dram_activity",
}
# GPM metric id -> the byte counter it feeds (MiB/s in NVML): see _count_pcie.
_GPM_PCIE: dict[int, str] = {GPM.PCIE_TX_PER_SEC: "pcie_tx", GPM.PCIE_RX_PER_SEC: "pcie_rx"}
_MIB = 1 << 20
_U32 = 1 << 32

_XID_KNOWN = frozenset(XID_CODES)


@dataclass
class Reading:
    device: Device
    values: dict[str, Any] = field(default_factory=dict)
    lost: bool = False  # NVML stopped answering for this device: only hw.status reports it


@dataclass
class Snapshot:
    taken: float
    readings: list[Reading]


def _driver_major(version: str | None) -> int:
    try:
        return int((version or "").split(".")[0])
    except ValueError:
        return 0


class GpuCollector:
    """Takes NVML snapshots of the selected devices, bounded in time, never raising."""

    # key -> backend method, extra args, also for MIG instances; each a single NVML call per device.
    _QUERIES: tuple[tuple[str, str, tuple[Any, ...], bool], ...] = (
        ("memory", "memory", (), True),
        ("utilization", "utilization", (), False),
        ("encoder", "encoder_utilization", (), False),
        ("decoder", "decoder_utilization", (), False),
        ("temperature", "temperature_c", (), False),
        ("sm_clock", "sm_clock_hz", (), False),
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
        self._timeout_s = timeout_s
        self._pid = os.getpid() if pid is None else pid
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
        self._lock = threading.Lock()
        self._last: Snapshot | None = None
        self._inflight: threading.Event | None = None
        self._impatient_until = 0.0
        self._unsupported: set[tuple[str, str]] = set()
        self._warned: set[str] = set()
        # Devices that stopped answering, by UUID, until they answer again (reported as failed).
        self._lost: dict[str, Device] = {}
        # Slow-changing values: PCIe link maximum (once) and current state (at most every _LINK_EVERY_S).
        self._link_max: dict[str, tuple[int, int]] = {}
        self._link_now: dict[str, tuple[float, tuple[int, int]]] = {}
        # XID errors: one event set for every GPU; counts per physical GPU UUID and code.
        self._event_set: Any = None
        self._xid_registered: set[str] = set()
        self._xid: dict[str, dict[str, int]] = {}
        # GPM: per GPU UUID, [previous sample, sample to fill, previous is valid, when it was taken].
        self._gpm: dict[str, list[Any]] = {}
        # PCIe bytes (see the module's docstring): per GPU UUID, the source ("gpm" or "fields") once
        # settled; the bytes summed from GPM; the fields' last raw value and the wraps added.
        self._pcie_source: dict[str, str] = {}
        self._pcie_gpm_bytes: dict[str, dict[str, float]] = {}
        self._pcie_raw: dict[str, dict[str, tuple[int, int]]] = {}
        self._closed = False

    # -- what callbacks call ------------------------------------------------
    def current(self) -> tuple[Snapshot | None, float]:
        """The snapshot to report and its age in seconds; (None, 0) when there is none worth serving."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last.taken < _FRESH_FOR_S:
                return self._last, now - self._last.taken
            if self._closed:
                inflight: threading.Event | None = None
            elif self._inflight is None:
                self._inflight = threading.Event()
                threading.Thread(target=self._take, name="openlora-otel-nvml", daemon=True).start()
                inflight = self._inflight
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
        with self._lock:
            self._closed = True
            busy = self._inflight is not None
        if not busy:
            self._release()

    def _release(self) -> None:
        backend = self._backend
        for slot in self._gpm.values():
            for sample in slot[:2]:
                try:
                    backend.gpm_sample_free(sample)
                except Exception:  # shutting down: nothing to do about it
                    _logger.debug("nvmlGpmSampleFree failed", exc_info=True)
        self._gpm.clear()
        if self._event_set is not None:
            try:
                backend.event_set_free(self._event_set)
            except Exception:
                _logger.debug("nvmlEventSetFree failed", exc_info=True)
            self._event_set = None

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
                closed = self._closed
            if closed:
                self._release()
            if event is not None:
                event.set()

    def snapshot(self) -> Snapshot:
        """Read every selected device once (synchronously: callers go through :meth:`current`)."""
        started = time.monotonic()
        devices = self.selection.selected()
        self._drain_xid()
        readings = []
        for device in devices:
            reading = self._read(device)
            if reading.lost:
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


    # -- reading one device -------------------------------------------------------
    def _read(self, device: Device) -> Reading:
        reading = Reading(device)
        try:
            self._read_plain(device, reading.values)
            if not device.is_mig:
                self._read_fields(device, reading.values)
                self._read_link(device, reading.values)
                sampled, between = self._read_gpm(device, reading.values)
                self._count_pcie(device, reading.values, sampled, between)
        except GpuError as exc:
            self._warn_once(
                f"{device.uuid}:{exc}",
                f"GPU {device.index} ({device.uuid}) stopped answering NVML ({exc}); "
                "its series are dropped until it answers again",
            )
            self.selection.forget()  # re-enumerate next time: handles may have changed
            # The PCIe bytes start over when it answers again (a reset zeroes the fields; a GPM
            # difference would span the outage): the counter drops, which reads as a reset.
            if (slot := self._gpm.get(device.uuid)) is not None:
                slot[2] = False
            self._pcie_raw.pop(device.uuid, None)
            return Reading(device, lost=True)
        return reading

    def _supported(self, device: Device, key: str) -> bool:
        return (device.uuid, key) not in self._unsupported

    def _ask(self, device: Device, key: str, method: str, *args: Any) -> Any:
        """One backend call, remembering NotSupported under ``key``; None when unsupported."""
        if not self._supported(device, key):
            return None
        try:
            return getattr(self._backend, method)(device.handle, *args)
        except GpuNotSupported:
            self._unsupported.add((device.uuid, key))
            return None

    def _read_plain(self, device: Device, values: dict[str, Any]) -> None:
        for key, method, args, for_mig in self._QUERIES:
            if device.is_mig and not for_mig:
                continue
            value = self._ask(device, key, method, *args)
            if value is not None:
                values[key] = value

    def _wanted_fields(self, device: Device) -> list[Field]:
        """The field ids to ask this device for now: its driver's numbering, none refused before."""
        driver = _driver_major(self.selection.driver_version)
        return [
            f
            for f in FIELDS
            if f.min_driver <= driver <= (f.max_driver or driver)
            and self._supported(device, f.tag)
            and (f.replaces is None or not self._supported(device, f"fi:{f.key}@{f.replaces}"))
        ]

    def _read_fields(self, device: Device, values: dict[str, Any]) -> None:
        wanted = self._wanted_fields(device)
        if wanted and self._supported(device, "field_values"):
            self._ask_fields(device, wanted, values)
            # Ids that replace one just refused are asked at once (the first snapshot has them too).
            again = [f for f in self._wanted_fields(device) if f.replaces is not None and f not in wanted]
            if again and self._supported(device, "field_values"):
                self._ask_fields(device, again, values)
        self._read_fallbacks(device, values)
        if values.get("nvlink_links") == 0:  # no NVLink: the throughput fields say 0, report nothing
            values.pop("nvlink_tx", None)
            values.pop("nvlink_rx", None)

    def _ask_fields(self, device: Device, wanted: list[Field], values: dict[str, Any]) -> None:
        try:
            results = self._backend.field_values(device.handle, [(f.field_id, f.scope) for f in wanted])
        except GpuNotSupported:
            self._unsupported.add((device.uuid, "field_values"))  # every value by its own call
            return
        for f, (status, value) in zip(wanted, results, strict=True):
            if status == NVML_SUCCESS and value is not None:
                values[f.key] = value * f.scale / f.per if (f.scale, f.per) != (1, 1) else value
            elif status in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                self._unsupported.add((device.uuid, f.tag))
            elif status == NVML_ERROR_GPU_IS_LOST:
                raise GpuError("GPU is lost")
            else:  # a passing problem with this one value: skip it this time
                self._warn_once(
                    f"{device.uuid}:field:{f.field_id}:{status}",
                    f"GPU {device.index}: NVML field {f.field_id} ({f.key}) failed with status {status}",
                )

    def _read_fallbacks(self, device: Device, values: dict[str, Any]) -> None:
        batched = self._supported(device, "field_values")
        answers: dict[tuple[str, tuple[Any, ...]], Any] = {}  # one call may answer several values
        for f in FIELDS:
            if f.fallback is None or f.key in values:
                continue
            if batched and self._supported(device, f.tag):
                continue  # the field answered or failed in passing; the fallback is for unsupported ones
            call = (f.fallback, f.fallback_args)
            if call not in answers:
                key = f"fb:{f.fallback}{f.fallback_args!r}"
                answers[call] = self._ask(device, key, f.fallback, *f.fallback_args)
            answer = answers[call]
            if answer is not None:
                values[f.key] = answer[f.pick] if f.pick is not None else answer

    def _read_link(self, device: Device, values: dict[str, Any]) -> None:
        if device.uuid not in self._link_max:
            limit = self._ask(device, "link_max", "pcie_link_max")
            if limit is not None:
                self._link_max[device.uuid] = limit
        if device.uuid in self._link_max:
            values["link_max"] = self._link_max[device.uuid]
        now = time.monotonic()
        cached = self._link_now.get(device.uuid)
        if cached is None or now - cached[0] >= _LINK_EVERY_S:
            link = self._ask(device, "link", "pcie_link")
            if link is None:
                return
            cached = self._link_now[device.uuid] = (now, link)
        values["link"] = cached[1]

    def _read_gpm(self, device: Device, values: dict[str, Any]) -> tuple[bool, dict[str, float] | None]:
        """The GPM activities into ``values``. Returns whether a GPM sample was taken, and the PCIe bytes
        since the previous one (None without one): :meth:`_count_pcie`'s input."""
        if not self._supported(device, "gpm"):
            return False, None
        backend = self._backend
        slot = self._gpm.get(device.uuid)
        between = None
        try:
            if slot is None:
                if not backend.gpm_supported(device.handle):
                    self._unsupported.add((device.uuid, "gpm"))
                    return False, None
                first = backend.gpm_sample_alloc()
                try:
                    second = backend.gpm_sample_alloc()
                except BaseException:
                    backend.gpm_sample_free(first)  # not kept anywhere yet: freed here or never
                    raise
                slot = self._gpm[device.uuid] = [first, second, False, 0.0]
            previous, sample, valid, previous_at = slot
            backend.gpm_sample_get(device.handle, sample)
            taken_at = time.monotonic()
            if valid:
                metrics = backend.gpm_metrics(previous, sample, [*_GPM_METRICS, *_GPM_PCIE])
                for metric_id, key in _GPM_METRICS.items():
                    if metric_id in metrics:
                        values[key] = metrics[metric_id] / 100.0
                # Bytes between the two samples: the average rate times the time between them.
                between = {
                    key: metrics[metric_id] * _MIB * (taken_at - previous_at)
                    for metric_id, key in _GPM_PCIE.items()
                    if metric_id in metrics
                }
            slot[:] = [sample, previous, True, taken_at]
        except GpuNotSupported:
            self._unsupported.add((device.uuid, "gpm"))
            return False, None
        except GpuError:
            if slot is not None:
                slot[2] = False  # the next difference would span the failure: start over
            raise
        return True, between

    def _count_pcie(
        self, device: Device, values: dict[str, Any], sampled: bool, between: dict[str, float] | None
    ) -> None:
        """``pcie_tx`` and ``pcie_rx`` as byte counters that do not wrap (see the module's docstring);
        ``sampled`` and ``between`` from :meth:`_read_gpm`."""
        uuid = device.uuid
        source = self._pcie_source.get(uuid)
        if source is None:
            if between is not None:
                source = "gpm" if len(between) == len(_GPM_PCIE) else "fields"
            elif sampled:  # a first GPM sample: whether GPM gives PCIe traffic shows at the next one
                values.pop("pcie_tx", None)
                values.pop("pcie_rx", None)
                return
            else:
                source = "fields"
            self._pcie_source[uuid] = source
        if source == "gpm":
            if not self._supported(device, "gpm"):  # GPM went away (MIG mode turned on, say): no bytes
                values.pop("pcie_tx", None)
                values.pop("pcie_rx", None)
                return
            totals = self._pcie_gpm_bytes.setdefault(uuid, dict.fromkeys(_GPM_PCIE.values(), 0.0))
            for key in totals:
                totals[key] += (between or {}).get(key, 0.0)  # none: a sample missed, its bytes unknown
                values[key] = int(totals[key])
            return
        raw_values = self._pcie_raw.setdefault(uuid, {})
        for key in _GPM_PCIE.values():
            if key not in values:
                continue
            raw = int(values[key])
            last, wraps = raw_values.get(key, (raw, 0))
            if raw < last < _U32:  # a 32-bit counter went round (a bigger value cannot have wrapped at 2^32)
                wraps += 1
            raw_values[key] = (raw, wraps)
            values[key] = raw + wraps * _U32

    # -- XID events ---------------------------------------------------------------
    def _register_xid(self, devices: list[Device]) -> None:
        backend = self._backend
        for device in devices:
            if device.is_mig or device.uuid in self._xid_registered or not self._supported(device, "xid"):
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
        for _ in range(_XID_PER_SNAPSHOT):
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

"""The NVML reads of one device for a :class:`~openlora_otel.hardware.gpu_snapshot.GpuCollector` snapshot.

What one snapshot asks each device, and how few calls it takes: the plain queries (:data:`QUERIES`),
the batched field values (:data:`FIELDS`) and their fallbacks, the PCIe link state, GPM activity, and
the PCIe byte counters that must not wrap. What a device refused is remembered and not asked again.
Apart from the collector so the NVML side can be read on its own; why each value is read as it is
is in :mod:`openlora_otel.hardware.gpu_snapshot`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openlora_otel.hardware.gpu_devices import Device
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

__all__ = ["FIELDS", "LINK_EVERY_S", "QUERIES", "Field", "NvmlReads", "Reading"]

_logger = logging.getLogger(__name__)

LINK_EVERY_S = 60.0  # the current PCIe link width/generation is re-read at most this often


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

# key -> backend method, extra args, also for MIG instances; each a single NVML call per device.
QUERIES: tuple[tuple[str, str, tuple[Any, ...], bool], ...] = (
    ("memory", "memory", (), True),
    ("utilization", "utilization", (), False),
    ("encoder", "encoder_utilization", (), False),
    ("decoder", "decoder_utilization", (), False),
    ("temperature", "temperature_c", (), False),
    ("sm_clock", "sm_clock_hz", (), False),
    ("process_memory", "process_memory", (), True),
)


@dataclass
class Reading:
    device: Device
    values: dict[str, Any] = field(default_factory=dict)
    lost: bool = False  # NVML stopped answering for this device: only hw.status reports it


def _driver_major(version: str | None) -> int:
    try:
        return int((version or "").split(".")[0])
    except ValueError:
        return 0


class NvmlReads:
    """Reads devices' values through ``backend``, remembering in ``unsupported`` what each refused (shared
    with the collector's XID registration) and keeping what lasts between snapshots: the PCIe link's,
    the GPM samples, the PCIe byte counts. ``driver_version()`` picks the field numbering; ``warn(key,
    message)`` reports a problem once per key."""

    def __init__(
        self,
        backend: NvmlBackend,
        *,
        unsupported: set[tuple[str, str]],
        driver_version: Callable[[], str | None],
        warn: Callable[[str, str], None],
    ) -> None:
        self._backend = backend
        self._unsupported = unsupported
        self._driver_version = driver_version
        self._warn_once = warn
        # Slow-changing values: PCIe link maximum (once) and current state (at most every LINK_EVERY_S).
        self._link_max: dict[str, tuple[int, int]] = {}
        self._link_now: dict[str, tuple[float, tuple[int, int]]] = {}
        # GPM: per GPU UUID, [previous sample, sample to fill, previous is valid, when it was taken].
        self._gpm: dict[str, list[Any]] = {}
        # PCIe bytes (see gpu_snapshot's docstring): per GPU UUID, the source ("gpm" or "fields") once
        # settled; the bytes summed from GPM; the fields' last raw value and the wraps added.
        self._pcie_source: dict[str, str] = {}
        self._pcie_gpm_bytes: dict[str, dict[str, float]] = {}
        self._pcie_raw: dict[str, dict[str, tuple[int, int]]] = {}

    def pcie_source(self, uuid: str) -> str | None:
        """Where a GPU's PCIe bytes come from, ``gpm`` or ``fields``, once settled (its second snapshot)."""
        return self._pcie_source.get(uuid)

    def release(self) -> None:
        """Free the GPM samples (before nvmlShutdown)."""
        backend = self._backend
        for slot in self._gpm.values():
            for sample in slot[:2]:
                try:
                    backend.gpm_sample_free(sample)
                except Exception:  # shutting down: nothing to do about it
                    _logger.debug("nvmlGpmSampleFree failed", exc_info=True)
        self._gpm.clear()

    def read(self, device: Device) -> Reading:
        """The device's values, or a lost reading when it stopped answering (its PCIe bytes then start over)."""
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
        for key, method, args, for_mig in QUERIES:
            if device.is_mig and not for_mig:
                continue
            value = self._ask(device, key, method, *args)
            if value is not None:
                values[key] = value

    def _wanted_fields(self, device: Device) -> list[Field]:
        """The field ids to ask this device for now: its driver's numbering, none refused before."""
        driver = _driver_major(self._driver_version())
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
        if cached is None or now - cached[0] >= LINK_EVERY_S:
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

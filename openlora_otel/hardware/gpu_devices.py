"""Which NVML devices a :class:`~openlora_otel.hardware.gpu_snapshot.GpuCollector` reads: its device selection.

NVML's devices are listed once (again after one stopped answering) and this process's are chosen
from them: ``process`` mode follows torch, else ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK`` as CUDA
reads them; ``all`` takes every GPU. Apart from the snapshot it feeds, so the rules CUDA follows can
be read and tested in one place (the behaviour is described in :mod:`openlora_otel.hardware.gpu_snapshot`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openlora_otel.hardware.nvml import GpuError, NvmlBackend

__all__ = ["Device", "DeviceSelection", "torch_cuda_devices"]


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

    @property
    def physical_uuid(self) -> str:
        """The whole GPU's UUID (a MIG instance's parent)."""
        return self.parent_uuid or self.uuid


def _norm_uuid(value: str) -> str:
    lowered = value.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if lowered.startswith(prefix):
            return lowered[len(prefix) :]
    return lowered


class DeviceSelection:
    """NVML's devices, listed once (again after :meth:`forget`), and the ones this process reports (:meth:`selected`).

    ``warn(key, message)`` reports a problem once per key; ``discovered(devices)`` is told each fresh listing.
    """

    def __init__(
        self,
        backend: NvmlBackend,
        *,
        devices: str = "process",
        cuda_visible_devices: str | None = None,
        local_rank: int | None = None,
        torch_devices: Callable[[], list[tuple[int, str]] | None] | None = None,
        warn: Callable[[str, str], None],
        discovered: Callable[[list[Device]], None],
    ) -> None:
        self._backend = backend
        self._mode = devices
        self._visible = cuda_visible_devices
        self._local_rank = local_rank
        self._torch_devices = torch_devices or torch_cuda_devices
        self._warn_once = warn
        self._discovered = discovered
        self._devices: list[Device] | None = None
        self._driver_version: str | None = None

    @property
    def driver_version(self) -> str | None:
        """The driver's version, read with the first listing (None before it)."""
        return self._driver_version

    @property
    def listed(self) -> list[Device]:
        """The last complete listing of NVML's devices: empty before one and after :meth:`forget`."""
        return self._devices or []

    def forget(self) -> None:
        """List the devices again next time (one stopped answering: handles may have changed)."""
        self._devices = None

    def _discover(self) -> list[Device]:
        if self._devices is not None:
            return self._devices
        backend = self._backend
        devices: list[Device] = []
        complete = True
        try:
            if self._driver_version is None:
                self._driver_version = backend.driver_version()
            count = backend.device_count()
        except GpuError as exc:
            self._warn_once(f"discover:{exc}", f"listing GPUs through NVML failed ({exc}); will retry")
            return []
        for index in range(count):
            try:
                handle = backend.handle(index)
                uuid = backend.uuid(handle)
                name = backend.name(handle)
                bus_id = backend.pci_bus_id(handle)
                found = [Device(handle, index, uuid, name, bus_id)]
                for mig in backend.mig_handles(handle):
                    found.append(Device(mig, index, backend.uuid(mig), name, bus_id, uuid))
            except GpuError as exc:
                # One GPU that fell off the bus must not take the others' series with it.
                self._warn_once(
                    f"discover:{index}:{exc}", f"GPU {index} did not answer NVML ({exc}); will retry"
                )
                complete = False
                continue
            devices.extend(found)
        if complete:
            self._devices = devices
        self._discovered(devices)
        return devices

    def selected(self) -> list[Device]:
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
                # ASCII: isdigit() also takes superscript digits, which int() refuses, and fullwidth ones, which
                # it reads but CUDA does not. int() refuses more than 4300 digits; no index has more than 20.
                if entry.isascii() and entry.isdigit():
                    matches = [d for d in gpus if len(entry) <= 20 and d.index == int(entry)]
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

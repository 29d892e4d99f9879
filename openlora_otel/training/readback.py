"""Deferred tensor values: folded on their own device, read back at collection without a sync.

The step path's kept tensors are folded every ``FOLD_EVERY`` on their device into small partials; at
collection they are combined per device and copied to pinned host memory asynchronously, then only
polled, so ``torch.cuda.set_sync_debug_mode("error")`` holds; a value not produced yet waits for the
next collection. Nothing here imports torch: callers pass the module they found in ``sys.modules``.
See docs/concepts/collection.md.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

# Devices without float64 support: the fold reduces in float32 there (decided by
# device type, not by trying float64 on every fold; counts stay exact to 2**24 a window).
_NO_FLOAT64 = frozenset({"mps"})
# How long a collection polls for a GPU read-back before carrying it to the next one.
_READBACK_WAIT_S = 0.2


@dataclass(frozen=True)
class Folded:
    """What a device read-back gives for one series (see `_fold`)."""

    total: float
    count: int
    nonfinite: int
    last: float | None
    highest: float
    lowest: float
    trailing: int

    @classmethod
    def from_values(cls, values: list[float]) -> Folded:
        total, count, nonfinite, last, highest, lowest, trailing = values
        return cls(total, int(count), int(nonfinite), last, highest, lowest, int(trailing))


def fold_by_device(tensors: list[Any], torch: Any) -> list[Any]:
    """One partial per device the tensors live on (almost always one)."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        return [_fold(tensors, torch)]
    groups: dict[Any, list[Any]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return [_fold(group, torch) for group in groups.values()]


def fold_partials(partials: list[Any], torch: Any) -> list[Any]:
    """Combine partial results into one per device."""
    groups: dict[Any, list[Any]] = {}
    for partial in partials:
        groups.setdefault(partial.device, []).append(partial)
    return [group[0] if len(group) == 1 else _combine(group, torch) for group in groups.values()]


def _reduce_dtype(device_type: str, torch: Any) -> Any:
    """float64 for the sums, except on a device that has none (MPS): float32 there."""
    return torch.float32 if device_type in _NO_FLOAT64 else torch.float64


def _fold(tensors: list[Any], torch: Any) -> Any:
    """Reduce 0-d tensors of one device to [sum of finite, n finite, n non-finite, last, max, min, trailing]; no sync.

    max and min are of the finite values (-inf and inf when there is none);
    trailing is how many values at the end are non-finite in a row.
    """
    dtype = _reduce_dtype(tensors[0].device.type, torch)
    stacked = (
        torch.stack([t.to(dtype) for t in tensors])
        if len({t.dtype for t in tensors}) > 1
        else torch.stack(tensors)
    )
    stacked = stacked.to(dtype)
    size = stacked.shape[0]
    finite = torch.isfinite(stacked)
    count = finite.sum().to(dtype)
    # Python scalars, not filled tensors: fewer kernels per fold.
    index = torch.arange(size, device=stacked.device, dtype=dtype)
    last_finite = torch.where(finite, index, -1.0).max()
    return torch.stack(
        (
            torch.where(finite, stacked, 0.0).sum(),
            count,
            size - count,
            stacked[-1],
            torch.where(finite, stacked, -math.inf).max(),
            torch.where(finite, stacked, math.inf).min(),
            (size - 1) - last_finite,
        )
    )


def _combine(partials: list[Any], torch: Any) -> Any:
    """Partials in the order they were folded, combined into one; no sync."""
    stacked = torch.stack(partials)
    index = torch.arange(stacked.shape[0], device=stacked.device, dtype=stacked.dtype)
    # The trailing run of the whole: the trailing runs from the last partial that had a
    # finite value onwards (the partials after it were non-finite throughout).
    has_finite = stacked[:, 1] > 0
    start = torch.where(has_finite, index, torch.full_like(index, -1.0)).max()
    trailing = torch.where(index >= start, stacked[:, 6], torch.zeros_like(index)).sum()
    return torch.cat(
        (
            stacked[:, :3].sum(dim=0),
            stacked[-1, 3:4],
            stacked[:, 4].max().reshape(1),
            stacked[:, 5].min().reshape(1),
            trailing.reshape(1),
        )
    )


def start_readback(partials: list[Any], deferred: list[Any], torch: Any, on_failure: Any) -> list[Any]:
    """Combine a series' partials and unfolded tensors into one partial per device; start copying each to the host.

    Each device is handled apart: one that fails (calls ``on_failure``) costs only its own values.
    """
    groups: dict[Any, tuple[list[Any], list[Any]]] = {}
    for partial in partials:
        groups.setdefault(partial.device, ([], []))[0].append(partial)
    for tensor in deferred:
        groups.setdefault(tensor.device, ([], []))[1].append(tensor)
    handles = []
    for device, (folded, unfolded) in groups.items():
        try:
            parts = folded + ([_fold(unfolded, torch)] if unfolded else [])
            partial = parts[0] if len(parts) == 1 else _combine(parts, torch)
            handles.append(_HostRead(partial) if device.type == "cpu" else _DeviceRead.start(partial, torch))
        except Exception:
            on_failure()
    return handles


class _HostRead:
    """A CPU tensor: readable right away."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def ready(self) -> bool:
        return True

    def values(self) -> list[float]:
        return self._tensor.tolist()


class _DeviceRead:
    """An asynchronous device-to-host copy into pinned memory, completed by polling an event."""

    def __init__(self, host: Any, event: Any) -> None:
        self._host = host
        self._event = event

    @classmethod
    def start(cls, tensor: Any, torch: Any) -> _DeviceRead:
        device = tensor.device
        if device.type == "cuda":
            with torch.cuda.device(device):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return cls(host, event)
        # Another accelerator (XPU, MPS, HPU, ...): the same steps through torch's
        # device-generic API, on that device's current stream.
        with torch.accelerator.device_index(device.index):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
        return cls(host, event)

    def ready(self) -> bool:
        return bool(self._event.query())

    def values(self) -> list[float]:
        return self._host.tolist()


def poll_readbacks(
    pending: list[tuple[str, list[Any]]],
    carry: list[tuple[str, list[Any]]],
    on_failure: Any = None,
    wait_s: float | None = None,
    stop: threading.Event | None = None,
) -> list[tuple[str, Folded]]:
    """Values of the finished read-backs; unfinished ones go to ``carry`` for the next collection.

    A read-back that raises is dropped alone (``on_failure(label)`` is called). The wait ends
    early when ``stop`` is set.
    """
    deadline = time.monotonic() + (_READBACK_WAIT_S if wait_s is None else wait_s)
    ready: list[tuple[str, Folded]] = []
    for label, handles in pending:
        waiting = []
        for handle in handles:
            try:
                while not handle.ready() and time.monotonic() < deadline and not (stop and stop.is_set()):
                    time.sleep(0.001)
                if handle.ready():
                    ready.append((label, Folded.from_values(handle.values())))
                else:
                    waiting.append(handle)
            except Exception:
                if on_failure is None:
                    raise
                on_failure(label)
        if waiting:
            carry.append((label, waiting))
    return ready

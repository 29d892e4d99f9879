"""A tensor that fails any read of its value on the host: the step path must never wait for the device.

Imports torch: import it after ``pytest.importorskip("torch")``."""

from __future__ import annotations

import torch

HOST_READS = {"item", "__float__", "__int__", "__index__", "__bool__", "cpu", "tolist", "numpy"}


class NoHostRead(torch.Tensor):
    """A tensor whose value cannot reach the host unless ``allow`` is set (as at collection)."""

    allow = False
    blocked: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not cls.allow:
            cls.blocked.append(name)
            raise AssertionError(f"host read {name} on the step path")
        return super().__torch_function__(func, types, args, kwargs or {})

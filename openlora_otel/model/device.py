"""Where ``openlora-otel demo`` and ``serve`` compute: ``--device auto|cpu|cuda|cuda:N``.

``auto`` (the default) is the first CUDA device when torch sees one, else the CPU.
On a CUDA device that supports bfloat16 the forward passes run under
``torch.autocast`` in bfloat16 (weights, optimizer state and the loss stay
float32); elsewhere everything is float32. A device that is not there is a
:class:`DeviceError` naming the choice and what this machine has, raised before
any model is built. The choice is parsed without torch (:func:`device_choice`,
an argparse type) and resolved with it (:func:`resolve_device`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEVICE_CHOICES",
    "DeviceError",
    "Placement",
    "add_device_argument",
    "device_choice",
    "device_problem",
    "resolve_device",
]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_CHOICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,4})?")


class DeviceError(ValueError):
    """The chosen device is not on this machine (the message says what is)."""


def device_choice(text: str) -> str:
    """An argparse type: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, lower-cased and stripped."""
    choice = text.strip().lower()
    if not _CHOICE.fullmatch(choice):
        raise argparse.ArgumentTypeError(f"expected {DEVICE_CHOICES}, got {text!r}")
    return choice


@dataclass(frozen=True)
class Placement:
    """A resolved device and the precision used on it."""

    device: Any  # torch.device
    autocast_dtype: Any = None  # torch.bfloat16 under autocast, None for plain float32

    @property
    def name(self) -> str:
        """``cpu`` or ``cuda:N``."""
        return str(self.device)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        """``bf16 autocast`` or ``fp32``, for the lines the commands print."""
        return "bf16 autocast" if self.autocast_dtype is not None else "fp32"

    @contextlib.contextmanager
    def autocast(self, torch: Any) -> Iterator[None]:
        """The forward pass's precision context (nothing on float32)."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            yield


def resolve_device(choice: str, torch: Any) -> Placement:
    """The :class:`Placement` for ``choice`` on this machine; :class:`DeviceError` when it is not there."""
    choice = device_choice(choice)
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return Placement(torch.device("cpu"))
    if not torch.cuda.is_available():
        if getattr(torch.version, "cuda", None) is None:
            why = f"this torch build ({torch.__version__}) has no CUDA support"
        else:
            why = (
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: check the "
                "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
            )
        raise DeviceError(f"--device {choice}: CUDA is not available here ({why}); use --device cpu or auto")
    count = torch.cuda.device_count()
    index = int(choice.partition(":")[2] or 0)
    if index >= count:
        have = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise DeviceError(
            f"--device {choice}: this machine has {count} CUDA device{'s' if count != 1 else ''} ({have})"
        )
    device = torch.device("cuda", index)
    bf16 = torch.cuda.get_device_capability(index)[0] >= 8  # Ampere and later compute in bfloat16
    return Placement(device, torch.bfloat16 if bf16 else None)


def add_device_argument(parser: argparse.ArgumentParser, what: str, default: str) -> None:
    parser.add_argument(
        "--device",
        type=device_choice,
        default=default,
        metavar="DEVICE",
        help=f"where to {what}: {DEVICE_CHOICES} (default %(default)s: the first CUDA device when torch "
        "sees one, else the CPU); on a CUDA device with bfloat16 (Ampere and later) the forward passes run "
        "under bf16 autocast",
    )


def device_problem(choice: str, torch: Any) -> str | None:
    """Why ``--device choice`` cannot be used on this machine, if it cannot."""
    try:
        resolve_device(choice, torch)
    except DeviceError as exc:
        return str(exc)
    return None

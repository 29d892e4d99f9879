"""What the record calls of `TrainingMetrics` accept: each argument checked, off the lock, before anything is recorded.

A wrong type is a programming error and raises at once; a non-finite value is
data and passes (the window counts it). Loss, gradient norm and learning rate
come back as a host float, a 0-d torch tensor (never read here: reading it
would sync the device) or a :class:`_Foreign` tensor-like, read at collection.
The rules are the ones :class:`~openlora_otel.training.metrics.TrainingMetrics`
documents.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable
from typing import Any

# OTLP carries integer points as int64: a larger count fails the whole export, every time.
_INT64_MAX = 2**63 - 1


class _Foreign:
    """A tensor-like that is not a torch tensor: kept as is and read with ``float()`` at collection."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _prepare(value: Any, what: str) -> Any:
    """Validate a loss / grad norm / learning rate off the lock: a host float, a 0-d torch tensor, or a `_Foreign`."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")
    if isinstance(value, (int, float)):
        number = _host_number(value, what)
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {value!r}")
        return number
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if not (value.is_cpu or value.is_cuda):  # two cheap flags first: the usual cases
            _check_device(value, what, torch)
        if value.numel() != 1:
            raise ValueError(f"{what} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            value = value.reshape(())  # shape metadata only; folding then stacks without per-item work
        return value
    numel = getattr(value, "numel", None)
    if callable(numel):  # a tensor-like from elsewhere: keep the reference, read it at collection
        if numel() != 1:
            raise ValueError(f"{what} must have exactly one element")
        return _Foreign(value)
    if hasattr(value, "__float__") and not hasattr(value, "__len__"):
        number = _host_number(value, what)  # NumPy scalars, Decimal: host values, no device involved
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {number!r}")
        return number
    raise TypeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")


def _check_device(tensor: Any, what: str, torch: Any) -> None:
    """Refuse, at the call, a tensor whose value could never be read back without a sync."""
    device = tensor.device
    if device.type == "meta":
        raise ValueError(f"{what} is a meta tensor, which has no data to report; pass a real tensor or a number")
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is None or current.type != device.type or not hasattr(torch, "Event"):
        raise ValueError(
            f"{what} is on device {str(device)!r}, which openlora-otel cannot read back asynchronously "
            "(CPU, CUDA and the current torch.accelerator are supported); pass a number instead"
        )


def _host_number(value: Any, what: str) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large for a float: {value!r}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}") from None


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a non-negative integer, got bool")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a Python int (reading a tensor here would sync the device)")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be a non-negative integer, got {type(value).__name__}") from None
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number}")
    if number > _INT64_MAX:
        raise ValueError(f"{what} must be <= 2**63 - 1 (the largest integer OTLP carries), got {number}")
    return number


def _seconds(value: Any, what: str) -> float:
    """A duration argument: a finite host number >= 0 (a tensor is refused, as for counts)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a Python number (reading a tensor here would sync the device)")
    number = _host_number(value, what)
    if not 0.0 <= number < math.inf:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")
    return number


def _positive(value: Any, what: str) -> float:
    number = _host_number(value, what)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{what} must be finite and > 0, got {value!r}")
    return number


def _adapter_values(
    r: int,
    alpha: float,
    dropout: float,
    target_modules: int | str | Iterable[str],
    *,
    trainable_params: int | None,
    total_params: int | None,
) -> dict[str, float]:
    """The adapter gauges' values from ``TrainingMetrics.set_adapter``'s arguments, by metric name."""
    rank = _count(r, "r")
    if rank == 0:
        raise ValueError("r must be > 0")
    alpha_value = _host_number(alpha, "alpha")
    if not (alpha_value > 0 and math.isfinite(alpha_value)):
        raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
    dropout_value = _host_number(dropout, "dropout")
    if not 0.0 <= dropout_value < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if isinstance(target_modules, str):
        modules: Any = 1  # one name or pattern, not its characters
    elif isinstance(target_modules, bytes):
        raise TypeError("target_modules must be a count, a module name or module names, got bytes")
    elif isinstance(target_modules, (list, tuple, set, frozenset, dict)):
        modules = len(target_modules)
    elif isinstance(target_modules, Iterable):
        modules = len(list(target_modules))
    else:
        modules = target_modules
    adapter: dict[str, float] = {
        "openlora.adapter.rank": rank,
        "openlora.adapter.alpha": alpha_value,
        "openlora.adapter.dropout": dropout_value,
        "openlora.adapter.target_modules": _count(modules, "target_modules"),
    }
    trainable = None if trainable_params is None else _count(trainable_params, "trainable_params")
    if trainable is not None:
        adapter["openlora.adapter.parameters.trainable"] = trainable
    if total_params is not None:
        total = _count(total_params, "total_params")
        adapter["openlora.model.parameters"] = total
        if trainable is not None:
            if trainable > total:
                raise ValueError("trainable_params cannot exceed total_params")
            adapter["openlora.adapter.trainable.ratio"] = trainable / total if total else 0.0
    return adapter

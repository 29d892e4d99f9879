"""What the record calls of `TrainingMetrics` accept: each argument checked, off the lock, before anything is recorded.

A wrong type is a programming error and raises at once; a non-finite value is
data and passes (the window counts it). Loss, gradient norm and learning rate
come back as a host float, a 0-d torch tensor (never read here: reading it
would sync the device) or a :class:`Foreign` tensor-like, read at collection.
The rules are the ones :class:`~openlora_otel.training.metrics.TrainingMetrics`
documents. The checks it imports have public names: they are the training package's
own, not re-exported by :mod:`openlora_otel.training`.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable
from typing import Any

# One-element CPU tensors are read at once (see _cpu_number). True keeps them as CUDA tensors are kept,
# folded on their device and read back at collection: the tests set it to run that path where there
# is no GPU (CI never has one).
DEFER_CPU_TENSORS = False

# OTLP carries integer points as int64: a larger count fails the whole export, every time.
INT64_MAX = 2**63 - 1
# The longest step_time_s / data_time_s accepted: one day. Longer is a unit mistake or garbage
# (1e308 once left the step-duration histogram's _sum at +Inf for the rest of the run).
MAX_STEP_TIME_S = 86400.0
# The types host_number converts without a second look (the others take the slow branch).
_PLAIN = (int, float)
# What the refusals say is accepted.
_ACCEPTED = "a number (a real Python or NumPy scalar, or a 0-d NumPy array) or a one-element tensor"


class Foreign:
    """A tensor-like that is not a torch tensor: kept as is and read with ``float()`` at collection."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def prepare_value(value: Any, what: str) -> Any:
    """Validate a loss / grad norm / learning rate off the lock: a host float, a 0-d torch tensor, or a `Foreign`.

    The usual cases (a Python number; a 0-d CPU or CUDA tensor) take the first
    branches with no check beyond what they always had; anything unusual (NumPy,
    sparse or meta tensors, foreign tensor-likes) is sorted out on later branches.
    """
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{what} must be {_ACCEPTED}, got {type(value).__name__}")
    if isinstance(value, (int, float)):
        number = host_number(value, what)
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {value!r}")
        return number
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if not (value.is_cpu or value.is_cuda):  # two cheap flags first: the usual cases
            _check_device(value, what, torch)
        if value.numel() != 1:
            raise ValueError(f"{what} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.is_cpu and not DEFER_CPU_TENSORS:
            return _cpu_number(value, what, torch)
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            if value.layout is not torch.strided:  # reshape() is not implemented for sparse layouts
                raise ValueError(f"{what} is a {value.layout} tensor; pass a dense tensor (.to_dense()) or a number")
            value = value.reshape(())  # shape metadata only; folding then stacks without per-item work
        return value
    numel = getattr(value, "numel", None)
    if callable(numel):  # a tensor-like from elsewhere: keep the reference, read it at collection
        try:
            count = numel()
        except Exception as exc:
            raise TypeError(
                f"{what}: {type(value).__name__}.numel() raised {type(exc).__name__}: {exc}; {what} must be {_ACCEPTED}"
            ) from exc
        if count != 1:
            raise ValueError(f"{what} must have exactly one element, got {count!r}")
        return Foreign(value)
    numpy = sys.modules.get("numpy")
    plain = hasattr(value, "__float__") and not hasattr(value, "__len__")
    if plain or (numpy is not None and isinstance(value, numpy.ndarray)):
        number = host_number(value, what)  # NumPy scalars and 0-d arrays, Decimal: host values, no device
        if what != "loss" and number < 0:
            raise ValueError(f"{what} must be >= 0, got {number!r}")
        return number
    raise TypeError(f"{what} must be {_ACCEPTED}, got {type(value).__name__}")


def _cpu_number(tensor: Any, what: str, torch: Any) -> float:
    """A one-element CPU tensor read at once: its value is ready (CPU kernels run before they return), so
    reading it syncs nothing, costs what the ``.item()`` of the usual recipe costs, and leaves nothing to
    keep and fold on the training thread (a fold of 512 kept tensors stalled every 512th step by a
    millisecond or more: ``benchmarks/bench_step_tail.py``)."""
    if tensor.layout is not torch.strided:
        raise ValueError(f"{what} is a {tensor.layout} tensor; pass a dense tensor (.to_dense()) or a number")
    number = host_number(tensor.item(), what)  # a bool or complex tensor: refused as its Python value is
    if what != "loss" and number < 0:
        raise ValueError(f"{what} must be >= 0, got {number!r}")
    return number


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


def host_number(value: Any, what: str) -> float:
    """``value`` read as a float on the host: a real number, NumPy's included; TypeError / ValueError otherwise.

    A Python int or float goes straight to ``float()``; any other type first
    takes :func:`_unusual_number`, which refuses what ``float()`` would take
    wrongly (a NumPy bool or complex) or fail on with a RuntimeError (a meta
    tensor, a tensor of several elements).
    """
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    if type(value) not in _PLAIN:
        value = _unusual_number(value, what)
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large for a float: {value!r}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}") from None
    except RuntimeError as exc:  # a tensor-like that cannot be read (a framework's own refusal)
        raise ValueError(f"{what} could not be read as a number ({exc}); pass {_ACCEPTED}") from exc


def _unusual_number(value: Any, what: str) -> Any:
    """What ``float()`` should read of a value that is not a Python int or float (the slow branch)."""
    numpy = sys.modules.get("numpy")  # not imported: nothing can be a NumPy value
    if numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic)):
        if value.dtype.kind not in "iuf":  # bool, complex, datetime, str, object: float() would lie or fail
            raise TypeError(f"{what} must be a real number, got a NumPy {value.dtype} value")
        if isinstance(value, numpy.ndarray):
            if value.ndim:
                raise ValueError(
                    f"{what} must be a number; got a NumPy array of shape {value.shape} "
                    "(a 0-d array is read as its scalar: pass array.reshape(()) or a number)"
                )
            value = value[()]  # the 0-d array's scalar, of the dtype checked above
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise ValueError(f"{what} is a meta tensor, which has no data to report; pass a real tensor or a number")
        if value.numel() != 1:
            raise ValueError(f"{what} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{what} must be a real number, got a {value.dtype} tensor")
    return value


def checked_count(value: Any, what: str) -> int:
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
    if number > INT64_MAX:
        raise ValueError(f"{what} must be <= 2**63 - 1 (the largest integer OTLP carries), got {number}")
    return number


def checked_seconds(value: Any, what: str) -> float:
    """A step's duration: a host number from 0 to ``MAX_STEP_TIME_S`` (a tensor is refused, as for counts).

    Past a day is refused rather than clamped: it is a unit mistake (milliseconds,
    nanoseconds) or garbage, and clamping would draw it as a real one-day step.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a Python number (reading a tensor here would sync the device)")
    number = host_number(value, what)
    if not 0.0 <= number <= MAX_STEP_TIME_S:  # also refuses NaN and the infinities
        raise ValueError(
            f"{what} must be finite and >= 0, at most {MAX_STEP_TIME_S:g} s (one day), got {value!r}"
            + (" (milliseconds or nanoseconds?)" if MAX_STEP_TIME_S < number < math.inf else "")
        )
    return number


def checked_positive(value: Any, what: str) -> float:
    number = host_number(value, what)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{what} must be finite and > 0, got {value!r}")
    return number


def adapter_values(
    r: int,
    alpha: float,
    dropout: float,
    target_modules: int | str | Iterable[str],
    *,
    trainable_params: int | None,
    total_params: int | None,
) -> dict[str, float]:
    """The adapter gauges' values from ``TrainingMetrics.set_adapter``'s arguments, by metric name."""
    rank = checked_count(r, "r")
    if rank == 0:
        raise ValueError("r must be > 0")
    alpha_value = host_number(alpha, "alpha")
    if not (alpha_value > 0 and math.isfinite(alpha_value)):
        raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
    dropout_value = host_number(dropout, "dropout")
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
        "openlora.adapter.target_modules": checked_count(modules, "target_modules"),
    }
    trainable = None if trainable_params is None else checked_count(trainable_params, "trainable_params")
    if trainable is not None:
        adapter["openlora.adapter.parameters.trainable"] = trainable
    if total_params is not None:
        total = checked_count(total_params, "total_params")
        adapter["openlora.model.parameters"] = total
        if trainable is not None:
            if trainable > total:
                raise ValueError("trainable_params cannot exceed total_params")
            adapter["openlora.adapter.trainable.ratio"] = trainable / total if total else 0.0
    return adapter

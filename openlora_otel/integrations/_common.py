"""What the framework callbacks share: owning a Telemetry, and describing a PEFT LoRA adapter."""

from __future__ import annotations

import logging
from typing import Any

from openlora_otel.telemetry import Telemetry, setup_telemetry
from openlora_otel.training import TrainingMetrics

__all__ = ["TelemetryOwner", "describe_lora"]

_logger = logging.getLogger("openlora_otel.integrations")


class TelemetryOwner:
    """Holds the Telemetry a callback reports to: the one given, or one it sets up (and then shuts down)."""

    def __init__(self, telemetry: Telemetry | None) -> None:
        self._telemetry = telemetry
        self._owned = False

    @property
    def training(self) -> TrainingMetrics:
        if self._telemetry is None:
            self._telemetry = setup_telemetry()
            self._owned = True
        return self._telemetry.training

    def flush(self) -> None:
        if self._telemetry is not None:
            self._telemetry.force_flush()

    def finish(self) -> None:
        """Flush at the end of training; shut down only a Telemetry this callback created."""
        if self._telemetry is None:
            return
        if self._owned:
            self._telemetry.shutdown()
            self._telemetry = None
            self._owned = False
        else:
            self._telemetry.force_flush()


def describe_lora(model: Any, training: TrainingMetrics) -> bool:
    """If ``model`` (or its ``.model``) carries a PEFT LoRA config, record the adapter's shape. True if found."""
    for candidate in (model, getattr(model, "model", None)):
        configs = getattr(candidate, "peft_config", None)
        if not isinstance(configs, dict) or not configs:
            continue
        name = getattr(candidate, "active_adapter", None)
        if not isinstance(name, str) or name not in configs:
            name = next(iter(configs))
        config = configs[name]
        rank = getattr(config, "r", None)
        if rank is None:  # not a LoRA config (prefix tuning, IA3, ...)
            return False
        targets = getattr(config, "target_modules", None) or ()
        if isinstance(targets, str):
            targets = (targets,)  # a regex: one pattern
        trainable = total = 0
        for parameter in candidate.parameters():
            count = parameter.numel()
            total += count
            if parameter.requires_grad:
                trainable += count
        training.set_adapter(
            r=int(rank),
            alpha=float(getattr(config, "lora_alpha", rank)),
            dropout=float(getattr(config, "lora_dropout", 0.0) or 0.0),
            target_modules=list(targets),
            trainable_params=trainable,
            total_params=total,
        )
        return True
    return False


def safe(hook: Any) -> Any:
    """Run a callback hook so that nothing it raises reaches the training loop (logged once per hook)."""
    warned: list[bool] = []

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            hook(self, *args, **kwargs)
        except Exception:
            if not warned:
                warned.append(True)
                _logger.warning(
                    "openlora-otel callback %s failed; training continues", hook.__name__, exc_info=True
                )
        return None

    wrapper.__name__ = hook.__name__
    wrapper.__doc__ = hook.__doc__
    return wrapper

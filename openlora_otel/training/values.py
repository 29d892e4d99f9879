"""The values a training run sets now and then, and the gauges that report them as they stand.

The epoch, the latest evaluation, the LoRA adapter's shape and the model's FLOPs per
token: :class:`~openlora_otel.training.metrics.TrainingMetrics`' ``record_epoch``,
``record_eval``, ``set_adapter`` and ``set_model_flops`` land in :class:`RunValues`, whose
documentation they keep. Apart from the window of steps because nothing here is per
step: each call replaces a value, and every collection reads it as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from openlora_otel import names
from openlora_otel.names import ATTR_EVAL_METRIC
from openlora_otel.training.arguments import checked_positive, host_number
from openlora_otel.training.window import observed

__all__ = ["RunValues"]

_MAX_EVAL_METRICS = 64


class RunValues:
    """The run's epoch, evaluation, adapter and model FLOPs, and their gauges.

    ``configured_peak``: the peak FLOP/s the configuration gave (``OPENLORA_PEAK_FLOPS``),
    already checked, or None. ``tokens_per_s()`` gives the throughput the collecting
    reader reports (achieved FLOP/s is that times the FLOPs per token). ``warn(key,
    message)`` logs once per key.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        configured_peak: float | None,
        tokens_per_s: Callable[[], float | None],
        warn: Callable[..., None],
    ) -> None:
        self._tokens_per_s = tokens_per_s
        self._warn_once = warn
        self._epoch: float | None = None
        self._eval_loss: float | None = None
        self._eval: dict[str, float] = {}
        self._adapter: dict[str, float] = {}
        # Model FLOPs: per token from set_model_flops(); the peak given there, unless
        # the configuration (OPENLORA_PEAK_FLOPS) set one, which wins.
        self._flops_per_token: float | None = None
        self._configured_peak = configured_peak
        self._peak_flops = self._configured_peak

        spec = {m.name: m for m in (*names.TRAINING_METRICS, *names.ADAPTER_METRICS)}

        def gauge(name: str, callback: Any) -> None:
            meter.create_observable_gauge(
                name, callbacks=[callback], unit=spec[name].unit, description=spec[name].description
            )

        # Counted with attributes, one at a time: a plain SDK counter.
        eval_nonfinite = spec["openlora.training.eval.nonfinite"]
        self._eval_nonfinite = meter.create_counter(
            eval_nonfinite.name, unit=eval_nonfinite.unit, description=eval_nonfinite.description
        )
        gauge("openlora.model.flops_per_token", lambda o: observed(self._flops_per_token))
        gauge("openlora.training.throughput.flops", lambda o: observed(self._achieved_flops()))
        gauge("openlora.training.peak_flops", lambda o: observed(self._peak_flops))
        gauge("openlora.training.model_flops.utilization", lambda o: observed(self._utilization()))
        gauge("openlora.training.epoch", lambda o: observed(self._epoch))
        gauge("openlora.training.eval.loss", lambda o: observed(self._eval_loss))
        gauge("openlora.training.eval.value", self._observe_eval)
        for adapter_spec in names.ADAPTER_METRICS:
            key = adapter_spec.name
            gauge(key, lambda o, key=key: observed(self._adapter.get(key)))

    def record_epoch(self, epoch: float) -> None:
        """See ``TrainingMetrics.record_epoch``."""
        value = host_number(epoch, "epoch")
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"epoch must be finite and >= 0, got {epoch!r}")
        self._epoch = value

    def record_eval(self, loss: Any, metrics: dict[str, Any]) -> None:
        """See ``TrainingMetrics.record_eval``."""
        values: dict[str, float] = {}
        if loss is not None:
            values["loss"] = host_number(loss, "loss")
        for key, value in metrics.items():
            if value is not None:
                values[key] = host_number(value, key)
        for key, number in values.items():
            if key != "loss" and key not in self._eval and len(self._eval) >= _MAX_EVAL_METRICS:
                self._warn_once(
                    "eval", f"more than {_MAX_EVAL_METRICS} evaluation metric names; {key!r} ignored"
                )
                continue
            if not math.isfinite(number):
                # Counted, so an alert can see it: the value's own series goes quiet.
                self._eval_nonfinite.add(1, {ATTR_EVAL_METRIC: key})
                self._warn_once(
                    f"eval-{key}",
                    f"evaluation {key} is {number}: OpenTelemetry cannot export a non-finite value, so "
                    "that series shows no value until a finite one is recorded; "
                    "openlora.training.eval.nonfinite counts it (warned once per name)",
                )
            if key == "loss":  # the `loss` argument: a keyword cannot repeat it
                self._eval_loss = number
            else:
                self._eval[key] = number

    def set_adapter(self, adapter: dict[str, float]) -> None:
        """See ``TrainingMetrics.set_adapter``: the adapter gauges' values by metric name (``adapter_values``)."""
        self._adapter = adapter

    def set_model_flops(self, per_token: float, peak_flops: float | None) -> None:
        """See ``TrainingMetrics.set_model_flops``."""
        flops = checked_positive(per_token, "per_token")
        peak = None if peak_flops is None else checked_positive(peak_flops, "peak_flops")
        self._flops_per_token = flops
        self._peak_flops = self._configured_peak if self._configured_peak is not None else peak

    def _achieved_flops(self) -> float | None:
        tokens_per_s, per_token = self._tokens_per_s(), self._flops_per_token
        return None if tokens_per_s is None or per_token is None else tokens_per_s * per_token

    def _utilization(self) -> float | None:
        achieved, peak = self._achieved_flops(), self._peak_flops
        return None if achieved is None or peak is None else achieved / peak

    def _observe_eval(self, options: CallbackOptions) -> list[Observation]:
        return [
            Observation(v, {ATTR_EVAL_METRIC: k}) for k, v in list(self._eval.items()) if math.isfinite(v)
        ]

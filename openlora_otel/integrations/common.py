"""What the framework callbacks share: owning a Telemetry, describing a PEFT LoRA adapter, timing steps."""

from __future__ import annotations

import logging
import time
from typing import Any

from openlora_otel.telemetry import Telemetry, setup_telemetry
from openlora_otel.training.arguments import MAX_STEP_TIME_S
from openlora_otel.training.goodput import ProgressFile
from openlora_otel.training.metrics import TrainingMetrics

__all__ = [
    "GUARD_SYNC_EVERY",
    "ModelFlops",
    "OpenMarks",
    "StepClock",
    "TelemetryOwner",
    "describe_lora",
    "model_hyperparameters",
    "safe",
    "start_progress",
]

# Under data parallelism the ranks agree on a guard's trip every this many optimizer steps
# (one all-reduce of one number, read back: a sync, so not every step).
GUARD_SYNC_EVERY = 10

_logger = logging.getLogger("openlora_otel.integrations")


class TelemetryOwner:
    """Holds the Telemetry a callback reports to: the one given, or one it sets up (and then shuts down)."""

    def __init__(self, telemetry: Telemetry | None) -> None:
        self._telemetry = telemetry
        self._owned = False

    @property
    def telemetry(self) -> Telemetry:
        if self._telemetry is None:
            self._telemetry = setup_telemetry()
            self._owned = True
        return self._telemetry

    @property
    def training(self) -> TrainingMetrics:
        return self.telemetry.training

    @property
    def active(self) -> bool:
        """A Telemetry is held now (reading ``training`` would not set one up)."""
        return self._telemetry is not None

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


class StepClock:
    """Host wall time of each optimizer step, and how much of it went to waiting for batches.

    The callbacks call :meth:`idle` where the training loop is between batches
    and about to fetch the next one (a step or micro-batch ended, an
    evaluation ended), :meth:`batch_started` when a (micro-)batch arrives and
    :meth:`step_ended` at the end of each optimizer step. A step's data wait
    is the sum of the gaps from :meth:`idle` to :meth:`batch_started` within
    it; its time runs from the first of those gaps' start to its end, less
    what :meth:`pause` / :meth:`resume` took out (an evaluation that ran in
    the middle of a step's micro-batches). Only ``perf_counter()`` calls: no
    device is touched.
    """

    __slots__ = ("_excluded", "_idle_since", "_paused_at", "_started", "_waited")

    def __init__(self) -> None:
        self._idle_since: float | None = None
        self._started: float | None = None
        self._waited: float | None = None
        self._excluded = 0.0
        self._paused_at: float | None = None

    def idle(self) -> None:
        """The loop is between batches: the time from here to the next batch is waiting for it."""
        self._idle_since = time.perf_counter()

    def batch_started(self) -> None:
        now = time.perf_counter()
        since, self._idle_since = self._idle_since, None
        if since is None:  # no idle point seen (a hook the framework skipped): no wait to claim
            if self._started is None:
                self._started = now
            return
        self._waited = (self._waited or 0.0) + (now - since)
        if self._started is None:
            self._started = since

    def pause(self) -> None:
        """Something that is not the step runs now (an evaluation): keep it out of the step's time."""
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        now = time.perf_counter()
        if self._paused_at is not None and self._started is not None:
            self._excluded += now - self._paused_at
        self._paused_at = None
        self._idle_since = now

    def step_ended(self) -> tuple[float | None, float | None]:
        """``(step_time_s, data_time_s)`` of the step that just ended; either is None when unknown.

        Each is at most ``MAX_STEP_TIME_S`` (a day): ``record_step`` refuses longer
        times, and a callback must not raise into the trainer because the machine
        slept (or sat at a breakpoint) for a day in the middle of a step.
        """
        now = time.perf_counter()
        step_time = None
        if self._started is not None:
            step_time = min(max(now - self._started - self._excluded, 0.0), MAX_STEP_TIME_S)
        waited = None if self._waited is None else min(self._waited, MAX_STEP_TIME_S)
        self._started = self._waited = None
        self._excluded = 0.0
        return step_time, waited


class OpenMarks:
    """Goodput marks (``training.phase(...)``) entered in one hook and left in another.

    A phase is open at most once; :meth:`leave_all` closes whatever a hook pair left open (a
    flag another callback cleared, a fit that raised). Cheap: the step path tests one list.
    """

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: list[tuple[str, Any]] = []

    def __bool__(self) -> bool:
        return bool(self._open)

    def is_open(self, phase: str) -> bool:
        return any(name == phase for name, _ in self._open)

    def enter(self, training: TrainingMetrics, phase: str) -> None:
        if self.is_open(phase):
            return
        mark = training.phase(phase)
        mark.__enter__()
        self._open.append((phase, mark))

    def leave(self, phase: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == phase:
                _, mark = self._open.pop(i)
                mark.__exit__(None, None, None)
                return

    def leave_all(self) -> None:
        while self._open:
            _, mark = self._open.pop()
            mark.__exit__(None, None, None)


def start_progress(
    training: TrainingMetrics, directory: Any, step: int, *, run_id: str, write: bool = True
) -> int:
    """At train start: keep the run's highest step in ``directory`` and say where this attempt starts.

    ``step``: the global step the trainer starts at (above 0 when it resumed from a checkpoint).
    The progress file (``openlora-progress.json``) says how far an earlier attempt got; the steps
    between ``step`` and that are done again (``lost_progress``). Starting at step 0, a file left
    by another run id is a different run's: it is ignored (and replaced at the first write), and
    nothing counts as lost (set ``OPENLORA_RUN_ID`` so that the attempts of a run restarted from
    scratch share one); :meth:`ProgressFile.earlier_attempt` holds that rule. ``write``:
    this process keeps the file (one process per node does; every process reads it).
    Returns the steps lost.
    """
    progress = ProgressFile(directory)
    if write:
        training.track_progress(progress.path)
    reached = progress.earlier_attempt(step, run_id=run_id)
    return training.resumed(step, reached=step if reached is None else reached)


class ModelFlops:
    """Reports the model's FLOPs per token once, at the first step whose sequence length is known.

    The attention term needs the sequence length, which only the first batch
    tells (a shape fact: tokens / samples). ``dtype`` is the matmuls' compute
    dtype (the mixed-precision setting), None for the model's own.
    """

    __slots__ = ("_dtype", "_model", "done")

    def __init__(self, model: Any, dtype: Any = None) -> None:
        self._model = model
        self._dtype = dtype
        self.done = model is None

    def step(self, training: TrainingMetrics, tokens: int | None, samples: int | None) -> None:
        if self.done:
            return
        self.done = True  # once, whatever happens below
        from openlora_otel.training.flops import report_model_flops

        seq_len = tokens // samples if tokens and samples else None
        report_model_flops(training, self._model, seq_len=seq_len, dtype=self._dtype)


def _lora(model: Any) -> tuple[Any, Any] | None:
    """The module that carries a PEFT LoRA config (``model`` or its ``.model``) and the active config."""
    for candidate in (model, getattr(model, "model", None)):
        configs = getattr(candidate, "peft_config", None)
        if not isinstance(configs, dict) or not configs:
            continue
        name = getattr(candidate, "active_adapter", None)
        if not isinstance(name, str) or name not in configs:
            name = next(iter(configs))
        config = configs[name]
        if getattr(config, "r", None) is None:  # not a LoRA config (prefix tuning, IA3, ...)
            return None
        return candidate, config
    return None


def _targets(config: Any) -> list[str]:
    targets = getattr(config, "target_modules", None) or ()
    if isinstance(targets, str):
        return [targets]  # a regex: one pattern
    return sorted(str(t) for t in targets)


def describe_lora(model: Any, training: TrainingMetrics) -> bool:
    """If ``model`` (or its ``.model``) carries a PEFT LoRA config, record the adapter's shape. True if found."""
    found = _lora(model)
    if found is None:
        return False
    candidate, config = found
    trainable = total = 0
    for parameter in candidate.parameters():
        count = parameter.numel()
        total += count
        if parameter.requires_grad:
            trainable += count
    training.set_adapter(
        r=int(config.r),
        alpha=float(getattr(config, "lora_alpha", config.r)),
        dropout=float(getattr(config, "lora_dropout", 0.0) or 0.0),
        target_modules=_targets(config),
        trainable_params=trainable,
        total_params=total,
    )
    return True


def model_hyperparameters(model: Any) -> dict[str, object]:
    """The LoRA shape and the base model's name, for ``openlora.run.info`` (what is known of them)."""
    values: dict[str, object] = {}
    found = _lora(model)
    if found is not None:
        _, config = found
        values.update(
            lora_r=config.r,
            lora_alpha=getattr(config, "lora_alpha", None),
            lora_dropout=getattr(config, "lora_dropout", None),
            lora_target_modules=_targets(config) or None,
            base_model=getattr(config, "base_model_name_or_path", None),
        )
    if not values.get("base_model"):
        for candidate in (
            model,
            getattr(model, "model", None),
            getattr(getattr(model, "model", None), "model", None),
        ):
            name = getattr(getattr(candidate, "config", None), "_name_or_path", None)
            if isinstance(name, str) and name:
                values["base_model"] = name
                break
    return values


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

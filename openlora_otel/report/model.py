"""What a report is drawn from: runs as time-ordered samples, turned into curves against the step.

History files and Prometheus both give a :class:`Run` of :class:`Row` samples; :func:`curves` turns
rows into ``(step, value)`` points the same way for both, so a run draws alike from either source.
:data:`QUANTITIES` (:mod:`openlora_otel.report.quantities`, re-exported) names each quantity once, by its
OpenTelemetry and its Prometheus name.
See docs/how-to/run-history.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from openlora_otel.names import GUARD_REASONS
from openlora_otel.report.goodput import TimeBreakdown, TimeSample

# Re-exported: the quantities were defined here before report.quantities held them.
from openlora_otel.report.quantities import (
    COMBINE,
    QUANTITIES,
    SLOWDOWN_REASONS,
    Quantity,
    promql_string,
    run_target,
)

__all__ = [
    "COMBINE",
    "EVAL_PREFIX",
    "PANELS",
    "QUANTITIES",
    "SLOWDOWN_REASONS",
    "Curve",
    "Divergence",
    "Line",
    "Panel",
    "ProcessRows",
    "Quantity",
    "ReportError",
    "Row",
    "Run",
    "common_hyperparameters",
    "curves",
    "differing_hyperparameters",
    "divergence",
    "eval_panels",
    "legend_labels",
    "promql_string",
    "run_target",
    "shown",
    "smooth",
    "step_times",
    "thin",
]


class ReportError(Exception):
    """Something the user can fix: a missing file, an unknown run, an unreachable server (exit status 2)."""


@dataclass(frozen=True)
class Row:
    """The values of one process at one time: one collection."""

    time_s: float
    values: dict[str, float]


# How much of a text read from a source the report shows: what the writer allows (MAX_RUN_ID_LENGTH,
# MAX_RUN_NAME_LENGTH, run.MAX_KEY_LENGTH and MAX_VALUE_LENGTH), with room for escapes.
SHOWN_ID = 160
SHOWN_NAME = 120
SHOWN_METRIC = 64
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def shown(text: object, limit: int | None = None) -> str:
    """``text`` as the report shows it: a lone surrogate (``\\ud800``, which UTF-8 cannot carry: the page,
    the PNG's text and the terminal fail on it) and a control character (a newline in a name would
    break the summary's lines) written as their escapes (``\\ud800``, ``\\n``), and at most ``limit``
    characters (a longer text ends in ``…``). Values come from files anyone can write.
    """
    text = str(text)
    if _UNSHOWN.search(text):
        text = _UNSHOWN.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


@dataclass(frozen=True)
class ProcessRows:
    """One rank's samples of a run (every attempt of it, in time order) and its goodput readings."""

    rank: int | None
    rows: list[Row]
    time: list[TimeSample] = field(default_factory=list)
    # The node of its latest process (an attempt may run on another): k8s.node.name, else host.name (in a
    # Kubernetes pod that is the pod's name).
    host: str | None = None


@dataclass
class Run:
    """One training run as read from a source: identity, hyperparameters and samples of its lowest rank.

    Its texts are kept as :func:`shown` makes them, whatever the source gave."""

    run_id: str
    name: str
    hyperparameters: dict[str, str]
    source: str
    rows: list[Row] = field(default_factory=list)
    rank: int | None = None
    ranks: int = 1
    # Where the time went (openlora.training.time), over every rank and attempt; None: not recorded.
    time: TimeBreakdown | None = None
    # How it ended (openlora.run.outcome of its lowest rank's latest line); None: not recorded.
    outcome: str | None = None
    # Every rank's samples, lowest rank first (``rows`` are the first's): what `diagnose` compares.
    processes: list[ProcessRows] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_id = shown(self.run_id, SHOWN_ID)
        self.name = shown(self.name, SHOWN_NAME)
        self.hyperparameters = {
            shown(key, SHOWN_METRIC): shown(value, SHOWN_NAME) for key, value in self.hyperparameters.items()
        }
        self.source = shown(self.source)
        if self.outcome is not None:
            self.outcome = shown(self.outcome, SHOWN_METRIC)


# -- curves --------------------------------------------------------------------------------
Curve = list[tuple[float, float]]
# Raw values that are not curves themselves (the eval loss has its own rule).
_DERIVED_FROM = frozenset({"eval_loss", "steps", "step_time_sum", "step_time_count", "tokens"})
# Row keys of openlora.training.eval.value: this prefix and the openlora.eval.metric (``eval.accuracy``).
EVAL_PREFIX = "eval."


def _is_eval(key: str) -> bool:
    return key == "eval_loss" or key.startswith(EVAL_PREFIX)


def curves(rows: Iterable[Row]) -> dict[str, Curve]:
    """``(step, value)`` points per quantity key, plus ``step_time`` and ``tokens_per_s``.

    Gauges cover the steps since the previous collection and are repeated while no
    step happens (a lingering process, a pause), so each gets the value of the
    first row that saw a new step count. The eval loss and the other eval metrics
    (``eval.<metric>``) are the exception: an
    evaluation can end after the last step, so they take the last row of a step
    and are kept only where they changed (one point per evaluation). Between two
    such rows, step time is the histogram's sum over its count (mean seconds per
    step) and throughput the tokens counted over the time between their latest steps
    (``last_step_time``; the rows' times when it is missing).
    """
    out: dict[str, Curve] = {}
    previous_step: float | None = None
    previous_hist: tuple[float, float] | None = None
    previous_tokens: tuple[float, float] | None = None  # (time, tokens) of the previous kept row
    for row in sorted(rows, key=lambda r: r.time_s):
        step = row.values.get("steps")
        if step is None or not math.isfinite(step):
            continue
        for key, value in row.values.items():
            if not _is_eval(key):
                continue
            points = out.setdefault(key, [])
            if points and points[-1][0] == step:
                points[-1] = (step, value)
            elif not points or not _same(points[-1][1], value):
                points.append((step, value))
        if step == previous_step:
            continue
        if previous_step is not None and step < previous_step:  # a restarted process: counters start over
            previous_hist = previous_tokens = None
        previous_step = step
        for key, value in row.values.items():
            if key in _DERIVED_FROM or _is_eval(key):
                continue
            out.setdefault(key, []).append((step, value))
        total, count = row.values.get("step_time_sum"), row.values.get("step_time_count")
        if total is not None and count is not None:
            if previous_hist is not None and count > previous_hist[1]:
                out.setdefault("step_time", []).append(
                    (step, (total - previous_hist[0]) / (count - previous_hist[1]))
                )
            previous_hist = (total, count)
        tokens = row.values.get("tokens")
        if tokens is not None:
            # The tokens counted up to the row's latest step, over the time between those steps: the
            # rows' own times would count one step in one interval and two in the next when lines and
            # steps do not line up (a 200 ms line, 150 ms steps: 500 then 1,000 tokens/s, for 667).
            at = row.values.get("last_step_time")
            at = at if at is not None and math.isfinite(at) else row.time_s
            if previous_tokens is not None and at > previous_tokens[0] and tokens >= previous_tokens[1]:
                out.setdefault("tokens_per_s", []).append(
                    (step, (tokens - previous_tokens[1]) / (at - previous_tokens[0]))
                )
            previous_tokens = (at, tokens)
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def step_times(rows: Iterable[Row]) -> dict[float, float]:
    """When each step drawn was reached: step -> Unix seconds, for an x axis by wall time.

    The time of the first row that saw the step count (the row :func:`curves` takes a step's
    gauges from): its latest step's timestamp (``last_step_time``) when it has one, else the
    row's own time.
    """
    out: dict[float, float] = {}
    for row in sorted(rows, key=lambda r: r.time_s):
        step = row.values.get("steps")
        if step is None or not math.isfinite(step) or step in out:
            continue
        at = row.values.get("last_step_time")
        at = at if at is not None and math.isfinite(at) and at > 0 else row.time_s
        if math.isfinite(at):
            out[step] = at
    return out


def smooth(points: Curve, weight: float) -> Curve:
    """TensorBoard's smoothing: an exponential moving average with weight ``weight`` (0 to below 1),
    debiased so that it starts at the first value rather than at 0.

    ``s_n = weight * s_(n-1) + (1 - weight) * y_n``, drawn as ``s_n / (1 - weight ** k)`` where ``k``
    counts the finite values so far. A NaN or infinite value is kept as it is and leaves the average
    alone (a diverged stretch shows as the gap it is). ``weight`` 0 returns the points unchanged.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"the smoothing weight is {weight!r}: expected 0 <= weight < 1")
    if weight == 0.0:
        return list(points)
    out: Curve = []
    last, count = 0.0, 0
    for x, y in points:
        if not math.isfinite(y):
            out.append((x, y))
            continue
        last = last * weight + (1.0 - weight) * y
        count += 1
        out.append((x, last / (1.0 - weight**count)))
    return out


def thin(points: Curve, limit: int, how: str) -> Curve:
    """At most ``limit`` points: consecutive points folded by ``how`` (``mean`` or ``max``), so a
    spike in a max line survives and a long run does not make a page of megabytes."""
    if len(points) <= limit:
        return points
    out: Curve = []
    size = len(points) / limit
    for i in range(limit):
        chunk = points[int(i * size) : int((i + 1) * size)]
        if not chunk:
            continue
        ys = [y for _, y in chunk]
        y = max(ys) if how == "max" else sum(ys) / len(ys)
        out.append((chunk[-1][0], y))
    return out


# -- panels --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Line:
    """One curve of a panel, drawn in each run's colour with this style."""

    key: str
    label: str
    style: str = "-"
    width: float = 1.8
    marker: str | None = None
    alpha: float = 1.0
    fold: str = "mean"
    smooth: bool = True  # --smooth applies (not to the sparse evaluation points)


@dataclass(frozen=True)
class Panel:
    """One plot: a title, the y axis with its unit, and its lines. ``scale`` multiplies the values."""

    key: str
    title: str
    ylabel: str
    lines: tuple[Line, ...]
    description: str
    scale: float = 1.0
    ylim: tuple[float, float] | None = None


PANELS: tuple[Panel, ...] = (
    Panel(
        "loss",
        "Loss",
        "loss",
        (
            Line("loss", "train (mean per interval)"),
            Line("loss_max", "train (max per interval)", ":", 1.2, alpha=0.7, fold="max"),
            Line("eval_loss", "eval", "--", 1.6, marker="o", smooth=False),
        ),
        "Training loss (mean, and max, over the steps of each collection interval) and the loss of each "
        "evaluation, against the optimizer step.",
    ),
    Panel(
        "grad_norm",
        "Gradient norm",
        "gradient norm (L2)",
        (
            Line("grad_norm", "mean per interval"),
            Line("grad_norm_max", "max per interval", ":", 1.2, alpha=0.7, fold="max"),
        ),
        "Gradient norm before clipping: mean and max over the steps of each collection interval.",
    ),
    Panel(
        "learning_rate",
        "Learning rate",
        "learning rate",
        (Line("learning_rate", "learning rate"),),
        "Learning rate of the latest step.",
    ),
    Panel(
        "throughput",
        "Throughput",
        "tokens / s",
        (Line("tokens_per_s", "tokens / s"),),
        "Training tokens per second of this process: the tokens counted between two points over the time "
        "between their latest steps.",
    ),
    Panel(
        "step_time",
        "Step time",
        "seconds per step",
        (Line("step_time", "mean per interval"),),
        "Mean time of one optimizer step over each collection interval, from the step-duration histogram.",
    ),
    Panel(
        "gpu_utilization",
        "GPU utilization",
        "busy (%)",
        (Line("gpu_utilization", "busy"),),
        "Fraction of time the GPU was busy, mean over the GPUs the process reports.",
        scale=100.0,
        ylim=(0.0, 105.0),
    ),
    Panel(
        "gpu_memory",
        "GPU memory in use",
        "GiB",
        (Line("gpu_memory", "in use"),),
        "GPU memory in use (all processes), the fullest of the GPUs the process reports.",
        scale=1 / 2**30,
    ),
)


def eval_panels(keys: Iterable[str]) -> list[Panel]:
    """A panel per evaluation metric other than the loss (``eval.<metric>`` curve keys), by name."""
    panels = []
    for key in sorted({k for k in keys if k.startswith(EVAL_PREFIX)}):
        metric = key[len(EVAL_PREFIX) :]
        percent = metric.lower() in ("accuracy", "acc", "exact_match", "f1")
        panels.append(
            Panel(
                "eval-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in metric),
                f"Eval {metric}",
                metric,
                (Line(key, metric, "--", 1.6, marker="o", smooth=False),),
                f"The evaluation metric {metric!r} (openlora.training.eval.value with "
                f"openlora.eval.metric={metric!r}) of each evaluation, against the step it ran at.",
                ylim=(0.0, 1.05) if percent else None,
            )
        )
    return panels


# -- divergence ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Divergence:
    """Where a run went wrong and what stopped it, for its marker and the table."""

    # (what, the first step it was counted by), earliest first: "non-finite loss", "non-finite
    # gradient norm", "guard tripped (nonfinite_loss)"; empty when only the outcome says so.
    events: tuple[tuple[str, float], ...]
    outcome: str | None  # how the run ended (openlora.run.outcome), when recorded

    @property
    def step(self) -> float | None:
        """Where the marker goes: the first event's step."""
        return self.events[0][1] if self.events else None

    @property
    def text(self) -> str:
        parts = [f"{what} by step {step:,.0f}" for what, step in self.events]
        if self.outcome == "stopped_by_guard":
            parts.append("stopped by the divergence guard")
        elif self.outcome and self.outcome != "running":
            parts.append(f"run {self.outcome}")
        return "; ".join(parts)


def divergence(rows: Iterable[Row], outcome: str | None = None) -> Divergence | None:
    """Where the run diverged: each of a non-finite loss, a non-finite gradient norm and a guard trip
    (per reason) at the step of the first row whose counter was above 0, earliest first, and how the
    run ended. None when none was counted and the outcome is not ``stopped_by_guard``.

    From the rows, not the curves: a trip counted after the last step (the guard checks on its own
    thread; the final line has it) is in a row of a step the curves already took."""
    candidates = [
        ("loss_nonfinite", "non-finite loss"),
        ("grad_norm_nonfinite", "non-finite gradient norm"),
        *((f"guard_trips_{r}", f"guard tripped ({r})") for r in GUARD_REASONS),
    ]
    ordered = sorted(rows, key=lambda r: r.time_s)
    events = []
    for order, (key, what) in enumerate(candidates):
        step = next(
            (
                r.values["steps"]
                for r in ordered
                if r.values.get(key, 0.0) > 0 and math.isfinite(r.values.get("steps", math.nan))
            ),
            None,
        )
        if step is not None:
            events.append((step, order, what))
    if not events and outcome != "stopped_by_guard":
        return None
    return Divergence(tuple((what, step) for step, _, what in sorted(events)), outcome)


# -- legends -------------------------------------------------------------------------------
# Short forms for legends; the run table shows the full keys.
_SHORT = {
    "learning_rate": "lr",
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "lora_target_modules": "targets",
    "batch_size": "bs",
    "gradient_accumulation_steps": "accum",
    "weight_decay": "wd",
    "warmup_steps": "warmup",
    "lr_scheduler": "sched",
    "base_model": "model",
}
# The order a reader looks for them in.
_ORDER = (
    "learning_rate",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "batch_size",
    "gradient_accumulation_steps",
    "epochs",
    "max_steps",
    "weight_decay",
    "warmup_steps",
    "lr_scheduler",
    "optimizer",
    "lora_target_modules",
    "base_model",
    "precision",
    "world_size",
    "seed",
)
_LEGEND_KEYS = 4  # more than this makes a legend wider than its plot; the table has them all
_ALONE = ("learning_rate", "lora_r")  # one run: nothing differs, these still say what it was


def _ordered(keys: Iterable[str]) -> list[str]:
    keys = set(keys)
    return [k for k in _ORDER if k in keys] + sorted(keys - set(_ORDER))


def differing_hyperparameters(runs: Sequence[Run]) -> list[str]:
    """The hyperparameter keys whose values are not the same for every run (a missing key counts)."""
    keys = {k for run in runs for k in run.hyperparameters}
    return _ordered(k for k in keys if len({run.hyperparameters.get(k) for run in runs}) > 1)


def common_hyperparameters(runs: Sequence[Run]) -> dict[str, str]:
    """The hyperparameters every run has with the same value."""
    if not runs:
        return {}
    first = runs[0].hyperparameters
    same = {k for k, v in first.items() if all(run.hyperparameters.get(k) == v for run in runs)}
    return {k: first[k] for k in _ordered(same)}


def legend_labels(runs: Sequence[Run]) -> list[str]:
    """``<name> (lr=..., r=...)`` per run, with the hyperparameters that tell the runs apart.

    Runs that share a name get their id's start after it, so no two labels are equal.
    """
    if len(runs) == 1:
        keys = [k for k in _ALONE if k in runs[0].hyperparameters]
    else:
        keys = differing_hyperparameters(runs)[:_LEGEND_KEYS]
    names = [run.name for run in runs]
    labels = []
    for run in runs:
        name = run.name if names.count(run.name) == 1 else f"{run.name} [{run.run_id[:8]}]"
        shown = [f"{_SHORT.get(k, k)}={run.hyperparameters[k]}" for k in keys if k in run.hyperparameters]
        labels.append(f"{name} ({', '.join(shown)})" if shown else name)
    return labels

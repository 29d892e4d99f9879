"""The evaluation detector: overfitting, the evaluation loss rising (lastingly, over several
evaluations) from its best while the training loss still falls."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from openlora_otel.report.diagnosis.findings import Evidence, Finding, attempts, finite, step_text
from openlora_otel.report.model import ProcessRows, curves, step_times

# Thresholds, each a documented choice (docs/how-to/diagnose.md).
OVERFIT_RISE = 0.05  # the last evaluation losses at least this much (relative) above the best one
OVERFIT_AFTER = 2  # ... the last this many evaluations, at least; and those after the best climbing
MIN_EVALUATIONS = 4
DIAGNOSE_PAGE = "https://openlora.github.io/openlora-otel/how-to/diagnose/#what-it-finds"


def _loss_at(points: Sequence[tuple[float, float]], step: float) -> float | None:
    """The training loss (window mean) of the last point at or before ``step``."""
    before = [value for at, value in points if at <= step and finite(value)]
    return before[-1] if before else None


def evaluation(processes: Sequence[ProcessRows]) -> list[Finding]:
    """Overfitting on the lowest rank that evaluates (ranks evaluate alike), per attempt."""
    for process in processes:
        for rows in attempts(process):
            drawn = curves(rows)
            evals = [(step, value) for step, value in drawn.get("eval_loss", []) if finite(value)]
            if len(evals) < MIN_EVALUATIONS:
                continue
            best_step, best = min(evals, key=lambda point: point[1])
            after = [(step, value) for step, value in evals if step > best_step]
            last_step, last = evals[-1]
            # A trend, not one high point of a noisy plateau: each of the last evaluations at least
            # OVERFIT_RISE above the best, and the ones after the best climbing (a positive slope); the
            # loss fell before its best (a first evaluation, before any training, is no best to keep).
            if (
                best <= 0
                or best_step == evals[0][0]
                or len(after) < OVERFIT_AFTER
                or any(value < best * (1 + OVERFIT_RISE) for _, value in after[-OVERFIT_AFTER:])
                or statistics.linear_regression([s for s, _ in after], [v for _, v in after])[0] <= 0
            ):
                continue
            train = drawn.get("loss", [])
            train_then, train_now = _loss_at(train, best_step), _loss_at(train, last_step)
            if train_then is None or train_now is None or train_now >= train_then:
                continue  # both rising: the training itself went wrong, not overfitting
            return [
                Finding(
                    "warning", "evaluation",
                    f"the evaluation loss rose {last / best - 1:.0%} from its best at step {step_text(best_step)} "
                    f"({best:.4g}) to step {step_text(last_step)} ({last:.4g}) while the training loss fell "
                    f"({train_then:.4g} to {train_now:.4g}): overfitting",
                    "the model learns the training set rather than what generalises: more steps or epochs than the "
                    "data supports, a learning rate too high late in the run, or too little regularisation",
                    (Evidence("openlora.training.eval.loss", best, "the best evaluation loss", best_step, process.rank),
                     Evidence("openlora.training.eval.loss", last, f"the last one, {len(after)} evaluations later; "
                              f"the last {OVERFIT_AFTER} at least {OVERFIT_RISE:.0%} above the best", last_step, process.rank),
                     Evidence("openlora.training.loss", train_now, f"the training loss then ({train_then:.4g} at the "
                              "best evaluation)", last_step, process.rank)),
                    ("a noisy evaluation: the evaluations after the best climb, and the last ones stay above it",
                     "a run gone wrong: the training loss kept falling"),
                    (f"keep the checkpoint nearest step {step_text(best_step)}, or stop there (early stopping)",
                     "fewer epochs, more data, or more dropout or weight decay (a LoRA: lora_dropout)"),
                    DIAGNOSE_PAGE, best_step, step_times(rows).get(best_step), process.rank, last / best,
                )
            ]  # fmt: skip
    return []


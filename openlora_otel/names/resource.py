"""Run identity metrics (openlora_otel.run.info, openlora_otel.run.outcome): the run's info series and how it
ended, with the outcome's attribute keys and values."""

from __future__ import annotations

from openlora_otel.names.common import MetricSpec

__all__ = ["ATTR_RUN_OUTCOME", "ATTR_RUN_SIGNAL", "RUN_METRICS", "RUN_OUTCOMES"]

# Attributes on openlora.run.outcome: how the run ended, and for `terminated` the signal's name.
ATTR_RUN_OUTCOME = "openlora.run.outcome"
ATTR_RUN_SIGNAL = "openlora.run.signal"
# What openlora.run.outcome reports: `running` until shutdown begins, then how the run ended. The
# sixth outcome, `vanished`, is never reported: the rules derive it (a run gone while `running`).
RUN_OUTCOMES = ("running", "finished", "stopped_by_guard", "terminated", "failed")

# The run's name and hyperparameters (openlora_otel.run): one info-style series per process.
RUN_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "openlora.run.info",
        "gauge",
        "",
        "1 while the process runs; attributes `openlora.run.name` (the run id when no name is given) and "
        "`openlora.hparam.<key>` per hyperparameter (at most 32, values at most 100 characters). "
        "One series per process: join it on `(job, instance)` for names in legends and alerts.",
    ),
    MetricSpec(
        "openlora.run.outcome",
        "gauge",
        "",
        "1; attribute `openlora.run.outcome`: `running` while the process runs, then, in the final "
        "collection, how the run ended: `finished`, `stopped_by_guard`, `terminated` (with `openlora.run.signal`: "
        "`SIGTERM`, `SIGINT`) or `failed` (with `error.type`, the exception's type). Carries `openlora.run.id` and "
        "`openlora.run.attempt`, so that it names its run and attempt after the target is gone. A run gone while `running` is `vanished` "
        "(derived by the rules).",
    ),
)

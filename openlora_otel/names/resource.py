"""The run's identity: the Resource keys that name a run and a rank (openlora_otel.run.resource), and the
run's info series and how it ended (openlora_otel.run.info, openlora_otel.run.outcome), with the outcome's
attribute keys and values."""

from __future__ import annotations

from openlora_otel.names.common import MetricSpec

__all__ = [
    "ATTR_RUN_OUTCOME",
    "ATTR_RUN_SIGNAL",
    "GROUP_RANK_ATTRIBUTE",
    "LOCAL_RANK_ATTRIBUTE",
    "RANK_ATTRIBUTE",
    "RUN_ATTEMPT_ATTRIBUTE",
    "RUN_ID_ATTRIBUTE",
    "RUN_METRICS",
    "RUN_NAME_ATTRIBUTE",
    "RUN_OUTCOMES",
    "WORLD_SIZE_ATTRIBUTE",
]

# Resource attributes (docs/concepts/run-identity.md): the run, and the launcher's rank variables (RANK,
# LOCAL_RANK, WORLD_SIZE, GROUP_RANK) as the configuration copies them.
RUN_ID_ATTRIBUTE = "openlora.run.id"
RUN_NAME_ATTRIBUTE = "openlora.run.name"
RUN_ATTEMPT_ATTRIBUTE = "openlora.run.attempt"  # OPENLORA_RUN_ATTEMPT, or a launcher's restart count + 1
RANK_ATTRIBUTE = "openlora.rank"
LOCAL_RANK_ATTRIBUTE = "openlora.local_rank"
WORLD_SIZE_ATTRIBUTE = "openlora.world_size"
GROUP_RANK_ATTRIBUTE = "openlora.group_rank"

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

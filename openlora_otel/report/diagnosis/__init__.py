"""Why a run went wrong, found from its own metrics: ranked findings with their evidence.

:func:`diagnose` runs small detectors over a :class:`~openlora_otel.report.model.Run` read from
history files (every rank's samples, :attr:`Run.processes`) and returns :class:`Finding` objects,
most severe first. Each says what happened and when (step, wall time, rank), the values that show
it and the series they came from, the likely cause with the alternatives it ruled out and why,
what to try, and the runbook entry. A healthy run gets no finding.

The detectors so far (issue 34 lists the rest):

- ``gpu_fault``: what a rank's GPU series show went wrong (fell off the bus, a failed row remap,
  uncorrected ECC errors during the run, failed, an XID of a bad GPU, a remap pending, degraded, a
  program's XIDs), the most specific first, with the step it was first seen at.
- ``divergence``: the first non-finite loss or gradient norm; whether the gradient norm grew before
  it, a loss spike preceded it, and the learning rate then.
- ``hang``: a rank that stopped stepping while the others went on, or a run whose telemetry kept
  reporting after its steps stopped.
- ``evaluation``: overfitting, the evaluation loss rising over several evaluations from its best
  while the training loss still falls.
- ``straggler``: a rank whose mean step time is well above the others', since when, and which of
  its own signals explains it: its GPU's clock held down (throttle reasons, SM clock, temperature),
  its data wait, its PCIe link trained narrow.
- ``memory``: a rank that ran out of GPU memory, whose allocated memory grows with the steps (and
  where it would run out), or whose allocator holds ever more than it hands out.
- ``throughput``: the step from which most ranks' steps became lastingly slower (a change point:
  medians before and after against the spread before), and what changed then (data wait, GPU
  throttling and clocks).
- ``input_bound``: the share of the run's time spent waiting for data.
- ``goodput``: where the rest of the time went, by cause across the attempts (restarts, checkpoint
  saves, idle stalls), when it is a quarter of the run's time or more (evaluating is a choice, shown only).

The detectors live in :mod:`.gpu`, :mod:`.training` (divergence, hang, input-bound), :mod:`.memory`, :mod:`.evaluation`,
:mod:`.stragglers`, :mod:`.throughput` and :mod:`.wasted` (goodput), what
they share in :mod:`.findings`, the JSON and text forms in :mod:`.output`.

:func:`to_json` gives the documented JSON form (:data:`JSON_SCHEMA`); :func:`text_lines` the printed one.
See docs/how-to/diagnose.md.
"""

from __future__ import annotations

from openlora_otel.report.diagnosis.evaluation import evaluation
from openlora_otel.report.diagnosis.findings import KINDS, SCHEMA_ID, SEVERITIES, Evidence, Finding
from openlora_otel.report.diagnosis.gpu import gpu_fault
from openlora_otel.report.diagnosis.memory import memory
from openlora_otel.report.diagnosis.output import JSON_SCHEMA, text_lines, to_json
from openlora_otel.report.diagnosis.stragglers import straggler
from openlora_otel.report.diagnosis.throughput import throughput
from openlora_otel.report.diagnosis.training import divergence, hang, input_bound
from openlora_otel.report.diagnosis.wasted import wasted
from openlora_otel.report.model import ProcessRows, Run

__all__ = ["JSON_SCHEMA", "KINDS", "SCHEMA_ID", "SEVERITIES", "Evidence", "Finding", "diagnose", "text_lines", "to_json"]


def diagnose(run: Run) -> list[Finding]:
    """Every detector's findings for ``run``, most severe (then most telling) first."""
    processes = run.processes or [ProcessRows(run.rank, run.rows, [])]
    found: list[Finding] = [*gpu_fault(processes), *divergence(processes),
                            *hang(processes, run.outcome, _max_steps(run.hyperparameters)),
                            *memory(processes), *evaluation(processes), *straggler(processes),
                            *throughput(processes), *input_bound(processes), *wasted(processes)]  # fmt: skip
    return sorted(found, key=lambda f: f.order)


def _max_steps(hyperparameters: dict[str, str]) -> float | None:
    """The run's planned number of steps (its ``max_steps`` hyperparameter), when it names one."""
    try:
        value = float(hyperparameters.get("max_steps", "nan"))
    except ValueError:
        return None
    return value if value > 0 and value != float("inf") else None

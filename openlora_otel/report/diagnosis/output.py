"""A diagnosis as JSON (:data:`JSON_SCHEMA`, its documented schema) and as printed text."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from openlora_otel.report.diagnosis.findings import (
    KINDS,
    SCHEMA_ID,
    SEVERITIES,
    Finding,
    finite,
    finite_or_none,
    rank_text,
    step_text,
    when_text,
)
from openlora_otel.report.model import Run


def _json_value(value: float | str) -> float | str:
    """A number as JSON can carry it: a non-finite one (a foreign writer's NaN) as its text."""
    return value if isinstance(value, str) or finite(value) else str(value)


def _finding_json(finding: Finding) -> dict[str, Any]:
    time_s = finite_or_none(finding.time_s)
    return {
        "severity": finding.severity,
        "kind": finding.kind,
        "title": finding.title,
        "step": finite_or_none(finding.step),
        "time": when_text(time_s) or None,
        "time_unix_s": time_s,
        "rank": finding.rank,
        "evidence": [
            {"series": e.series, "value": _json_value(e.value), "note": e.note, "step": finite_or_none(e.step),
             "rank": e.rank}
            for e in finding.evidence
        ],
        "cause": finding.cause,
        "ruled_out": list(finding.ruled_out),
        "try": list(finding.try_next),
        "runbook": finding.runbook,
    }


def to_json(runs: Iterable[tuple[Run, list[Finding]]]) -> dict[str, Any]:
    """The diagnosis of each run as :data:`JSON_SCHEMA` describes it."""
    return {
        "$schema": SCHEMA_ID,
        "runs": [
            {
                "run_id": run.run_id,
                "name": run.name,
                "source": run.source,
                "ranks": run.ranks,
                "steps": max(
                    (r.values["steps"] for r in run.rows if finite(r.values.get("steps")) and r.values["steps"] >= 0),
                    default=0.0,
                ),
                "outcome": run.outcome,
                "findings": [_finding_json(f) for f in findings],
            }
            for run, findings in runs
        ],
    }


def text_lines(run: Run, findings: Sequence[Finding]) -> list[str]:
    """The diagnosis of ``run`` as printed: a line for the run, then each finding, numbered."""
    name = f" ({run.name})" if run.name != run.run_id else ""
    lines = [f"run {run.run_id}{name}: {len(run.processes) or 1} rank(s), from {run.source}"]
    if not findings:
        lines.append("  no findings: no GPU fault, divergence, hang, memory growth, overfitting, straggler, slowdown, input wait or lost time found in its metrics")
    for number, finding in enumerate(findings, 1):
        lines.append(f"  {number}. [{finding.severity}] {finding.title}")
        lines.append(f"     likely cause: {finding.cause}")
        for item in finding.evidence:
            where = ", ".join(
                part for part in (f"step {step_text(item.step)}" if item.step is not None else "",
                                  rank_text(item.rank) if item.rank is not None else "") if part
            )  # fmt: skip
            value = item.value if isinstance(item.value, str) else f"{item.value:.6g}"
            lines.append(f"     evidence: {item.series} = {value}{f' ({where})' if where else ''}: {item.note}")
        for text in finding.ruled_out:
            lines.append(f"     ruled out: {text}")
        for text in finding.try_next:
            lines.append(f"     try: {text}")
        if finding.runbook:
            lines.append(f"     runbook: {finding.runbook}")
    return lines


_NUMBER_OR_NULL = {"type": ["number", "null"]}


JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "openlora-otel diagnose --json",
    "type": "object",
    "required": ["$schema", "runs"],
    "additionalProperties": False,
    "properties": {
        "$schema": {"const": SCHEMA_ID},
        "runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["run_id", "name", "source", "ranks", "steps", "outcome", "findings"],
                "additionalProperties": False,
                "properties": {
                    "run_id": {"type": "string"},
                    "name": {"type": "string"},
                    "source": {"type": "string"},
                    "ranks": {"type": "integer", "minimum": 1},
                    "steps": {"type": "number", "minimum": 0},
                    "outcome": {"type": ["string", "null"]},
                    "findings": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["severity", "kind", "title", "step", "time", "time_unix_s", "rank",
                                         "evidence", "cause", "ruled_out", "try", "runbook"],
                            "additionalProperties": False,
                            "properties": {
                                "severity": {"enum": list(SEVERITIES)},
                                "kind": {"enum": list(KINDS)},
                                "title": {"type": "string"},
                                "step": _NUMBER_OR_NULL,
                                "time": {"type": ["string", "null"]},
                                "time_unix_s": _NUMBER_OR_NULL,
                                "rank": {"type": ["integer", "null"]},
                                "evidence": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["series", "value", "note", "step", "rank"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "series": {"type": "string"},
                                            "value": {"type": ["number", "string"]},
                                            "note": {"type": "string"},
                                            "step": _NUMBER_OR_NULL,
                                            "rank": {"type": ["integer", "null"]},
                                        },
                                    },
                                },
                                "cause": {"type": "string"},
                                "ruled_out": {"type": "array", "items": {"type": "string"}},
                                "try": {"type": "array", "items": {"type": "string"}},
                                "runbook": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}  # fmt: skip

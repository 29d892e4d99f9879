"""The stack's alert printer reads webhook bodies from anything that can reach its port: property-based
tests (hypothesis, tests/support/fuzz.py) that any JSON body is printed without an exception and without
a control character, and that the runs it would diagnose are bounded; the bodies that once broke it are
kept as examples."""

from __future__ import annotations

import re
import threading
import types

from hypothesis import example, given
from hypothesis import strategies as st

from openlora_otel.stack import servers
from tests.support.fuzz import fuzz

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=5),
    max_leaves=30,
)
LABELS = st.dictionaries(
    st.sampled_from(["alertname", "severity", "instance", "openlora_run_id", "openlora_run_name"]) | st.text(max_size=10),
    JSON,
    max_size=6,
)
ALERT = st.fixed_dictionaries(
    {}, optional={"status": st.sampled_from(["firing", "resolved"]) | JSON, "labels": LABELS | JSON,
                  "annotations": st.dictionaries(st.just("summary") | st.text(max_size=10), JSON, max_size=3) | JSON},
)  # fmt: skip
BODY = st.fixed_dictionaries({}, optional={"status": JSON, "alerts": st.lists(ALERT | JSON, max_size=8) | JSON})
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


@fuzz
@given(BODY)
@example({"alerts": 7})
@example({"alerts": ["x", 3, None]})
@example({"alerts": [{"labels": ["a"], "annotations": 2}]})
@example({"alerts": [{"status": "resolved", "labels": {"alertname": "A\x1b]0;pwn\x07", "openlora_run_id": "r\x1b[2J"}}]})
def test_fuzz_any_notification_prints_without_error_or_control_characters(body: dict) -> None:
    for line in servers.format_notification(body):
        assert not CONTROL.search(line), line


@fuzz
@given(BODY)
def test_fuzz_the_runs_a_notification_would_have_diagnosed_are_few_and_plain(body: dict) -> None:
    printer = servers.AlertPrinter.__new__(servers.AlertPrinter)  # its state only: no server, no thread
    printer.__dict__.update(_diagnose_from="http://127.0.0.1:9", _diagnosed={}, _pending=0, _lock=threading.Lock())
    submitted: list[str] = []
    printer._diagnosis = types.SimpleNamespace(submit=lambda _f, run_id: submitted.append(run_id))
    printer._diagnose_alerts(body)
    assert len(submitted) <= servers.DIAGNOSES_PER_NOTIFICATION
    assert all(isinstance(r, str) and 0 < len(r) <= 160 for r in submitted)

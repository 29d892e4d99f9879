"""History file names from run ids and ranks: one file per run, never outside the directory (issue 29,
section 3: the run ids ``.`` and ``..`` both mapped to ``run.jsonl``)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource

from openlora_otel.config import run_id_problem
from openlora_otel.exporters.history_writer import history_path
from tests.support.fuzz import fuzz

DIRECTORY = Path("/history")


def _path(run_id: str, rank: object = None) -> Path:
    attributes: dict[str, object] = {"openlora.run.id": run_id}
    if rank is not None:
        attributes["openlora.rank"] = rank
    return history_path(DIRECTORY, Resource(attributes))  # type: ignore[arg-type]


def test_plain_run_ids_are_the_file_name_and_others_never_share_one() -> None:
    assert _path("job-7").name == "job-7.jsonl"
    assert _path("2f9c0a.run_1").name == "2f9c0a.run_1.jsonl"
    assert _path("job-7", 3).name == "job-7.rank3.jsonl"
    odd = [".", "..", "run", ".run", "a/b", "a_b", "a b", "x.rank0", "..x", "x" * 129]
    names = {_path(run_id).name for run_id in odd} | {_path("x", 0).name}
    assert len(names) == len(odd) + 1  # "x.rank0" is not rank 0 of "x"; "." is not "..", nor "run"
    assert _path(".").name.startswith("run-") and _path("a/b").name.startswith("a_b-")


@st.composite
def _run_ids(draw: st.DrawFn) -> str:
    """What OPENLORA_RUN_ID accepts (1 to 128 printable characters), leaning on the characters that matter."""
    text = draw(
        st.text(
            st.sampled_from([".", "/", "_", "-", "a", "r", "k", "n", "0", " ", "ü", "\\"]) | st.characters(),
            min_size=1,
            max_size=128,
        )
    )
    return text if run_id_problem(text) is None else "fallback"


@fuzz
@given(
    a=_run_ids(), b=_run_ids(), rank_a=st.none() | st.integers(0, 99) | st.text(max_size=8), rank_b=st.none()
)
@example(a=".", b="..", rank_a=None, rank_b=None)
@example(a="x.rank0", b="x", rank_a=None, rank_b=0)
def test_fuzz_history_names(a: str, b: str, rank_a: object, rank_b: object) -> None:
    """Two different (run id, rank) never name one file; every name stays in the directory."""
    first, second = _path(a, rank_a), _path(b, rank_b)
    for path in (first, second):
        assert path.parent == DIRECTORY and path.name.endswith(".jsonl")
        assert not path.name.startswith(".") and "/" not in path.name and len(path.name.encode()) <= 255
    if (a, rank_a if rank_a is None else str(rank_a)) != (b, rank_b if rank_b is None else str(rank_b)):
        assert first != second

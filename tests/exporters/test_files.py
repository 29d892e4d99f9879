"""Files that are not what they claim (issue 29, section 3): the shared reader (openlora_otel/files.py),
the progress file and the history files read through it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from openlora_otel.files import NotARegularFile, open_regular_file, read_regular_file
from openlora_otel.report.history_reader import read_history
from openlora_otel.report.history_source import read_runs
from openlora_otel.report.model import ReportError
from openlora_otel.training.goodput import ProgressFile
from tests.support.fuzz import fuzz
from tests.support.polling import within


def _make(kind: str, path: Path) -> str:
    """Put a ``kind`` at ``path``; what the refusal calls it."""
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
        return "a character device"
    path.mkdir()
    return "a directory"


KINDS = ["fifo", "dev-zero", "directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_only_regular_files_are_read(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "f"
    what = _make(kind, path)
    with pytest.raises(NotARegularFile) as info:
        within(10, lambda: read_regular_file(path, max_bytes=100))
    assert str(info.value) == f"{path} is {what}, not a regular file"
    with pytest.raises(NotARegularFile):
        within(10, lambda: open_regular_file(path))


def test_a_regular_file_is_read_up_to_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 1024)
    assert read_regular_file(path, max_bytes=1024) == b"x" * 1024
    link = tmp_path / "link"
    link.symlink_to(path)  # a link to a regular file is one
    assert read_regular_file(link, max_bytes=2048) == b"x" * 1024
    with pytest.raises(NotARegularFile, match=r"is larger than 1,023 bytes"):
        read_regular_file(path, max_bytes=1023)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", max_bytes=10)


@pytest.mark.parametrize("kind", KINDS)
def test_a_progress_file_that_is_no_file_is_ignored_with_one_warning(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO made resumed() block forever; a link to /dev/zero raised MemoryError out of it."""
    path = tmp_path / ProgressFile.NAME
    what = _make(kind, path)
    progress = ProgressFile(tmp_path)
    assert within(10, progress.reached) is None
    assert within(10, lambda: progress.earlier_attempt(5, run_id="r")) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"openlora-otel: could not read {path} is {what}, not a regular file; ignored"
    ]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_history_file_that_is_no_file_is_a_clear_error(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    what = _make(kind, path)
    with pytest.raises(NotARegularFile):
        within(10, lambda: list(read_history(path)))
    for given_path in (path, tmp_path):  # named, or found in the directory
        with pytest.raises(ReportError, match=f"^{path} is {what}, not a regular file$"):
            within(10, lambda given_path=given_path: read_runs([str(given_path)]))


# -- property-based: whatever the progress file holds, a step count or None, never an exception ----

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@st.composite
def _progress_content(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["object", "any", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "any":
        return json.dumps(draw(_VALUES)).encode()
    body = {
        "run_id": draw(st.text(max_size=10)),
        "step": draw(_VALUES | st.integers()),
        "attempt": draw(_VALUES),
    }
    return json.dumps(body).encode()


@fuzz
@given(content=_progress_content())
@example(content=b"[" * 100_000 + b"]" * 100_000)  # deeper than json follows, and over the bound
@example(content=b'{"run_id": "r", "step": 18446744073709551616}')  # past int64
@example(content=b'{"run_id": "r", "step": true}')
def test_fuzz_progress_file(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    directory = tmp_path_factory.mktemp("progress")
    (directory / ProgressFile.NAME).write_bytes(content)
    step = ProgressFile(directory).reached()
    assert step is None or (isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**63)

"""The files of the demo's --checkpoint-dir that are not what they claim (issue 29, section 3).

``run.json`` and ``checkpoint.pt`` are read only when they are regular files of a bounded size; every
refusal is one line on stderr and exit status 2, before anything starts; nothing is left behind.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from openlora_otel.cli import main
from openlora_otel.demo.checkpoint import (
    CHECKPOINT_FILE,
    RUN_FILE,
    CheckpointError,
    read_checkpoint,
    read_run_file,
)
from tests.support.fuzz import fuzz
from tests.support.polling import within


def _demo(*args: str, timeout: float = 120.0) -> int:
    """``openlora-otel demo ARGS`` in a thread, so a demo that hangs fails the test instead of stopping it."""

    def demo() -> int:
        try:
            return main(["demo", "--steps", "2", "--batch-size", "2", "--quiet", *args])
        except SystemExit as exc:
            return exc.code  # type: ignore[return-value]

    return within(timeout, demo, "the demo")


def _one_line_refusal(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 or lines[0].startswith("usage:"), err
    for word in words:
        assert word in lines[-1], err
    return lines[-1]


def _checkpoint(directory: Path, state: object) -> None:
    directory.mkdir(exist_ok=True)
    torch.save(state, directory / CHECKPOINT_FILE)


class _Runs:
    """A pickle that would run code when loaded without weights_only."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


GOOD_STATE = {
    "step": 5,
    "adapter": {"w": torch.zeros(2)},
    "optimizer": {},
    "scheduler": {},
    "generator": torch.ByteTensor([1, 2]),
}


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", ["is not a checkpoint torch reads with weights_only=True (EOFError)"]),
        (
            b"\x00garbage\xff" * 100,
            ["is not a checkpoint torch reads", "UnpicklingError: Unsupported operand"],
        ),
        (b"PK\x03\x04junk", ["is not a checkpoint torch reads", "RuntimeError"]),
        ({"step": 5}, ["not a checkpoint of this demo", "adapter"]),
        ({**GOOD_STATE, "adapter": {}}, ["adapter is not a set of tensors"]),
        ({**GOOD_STATE, "step": "five"}, ["not a step number"]),
        ([1, 2, 3], ["holds a list"]),
        (_Runs(), ["is not a checkpoint torch reads", "unsupported GLOBAL", "system"]),
    ],
    ids=["empty", "garbage", "zip-garbage", "no-adapter", "empty-adapter", "step-text", "a-list", "code"],
)
def test_a_checkpoint_that_is_not_one_is_refused_in_one_line(
    content: object, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    if isinstance(content, bytes):
        (directory / CHECKPOINT_FILE).write_bytes(content)
    elif isinstance(content, _Runs):
        (directory / CHECKPOINT_FILE).write_bytes(pickle.dumps(content, protocol=2))
    else:
        _checkpoint(directory, content)
    assert _demo("--checkpoint-dir", str(directory), "--resume") == 2
    _one_line_refusal(capsys, "openlora-otel demo: --resume:", str(directory / CHECKPOINT_FILE), *words)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_checkpoint_that_is_no_file_is_refused_not_read(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / CHECKPOINT_FILE
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    code = None
    if kind == "directory":
        path.mkdir()
        # Without --resume too: the checkpoint save would fail only after training.
        assert _demo("--checkpoint-dir", str(tmp_path)) == 2
        _one_line_refusal(capsys, f"{path} is a directory")
    code = _demo("--checkpoint-dir", str(tmp_path), "--resume")
    assert code == 2
    what = {"fifo": "a FIFO", "dev-zero": "a character device", "directory": "a directory"}[kind]
    _one_line_refusal(capsys, f"{path} is {what}")


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("deep", ["nested too deeply"]),
        ("garbage", ["is not JSON"]),
        ("list", ["holds a JSON list"]),
        ("fifo", ["is a FIFO, not a regular file"]),
        ("dev-zero", ["is a character device"]),
        ("huge", ["is larger than 64 KiB"]),
    ],
)
def test_a_run_file_that_is_not_one_is_refused_in_one_line(
    kind: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _checkpoint(tmp_path, GOOD_STATE)
    path = tmp_path / RUN_FILE
    if kind == "deep":
        path.write_text("[" * 20_000 + "]" * 20_000)  # the 100k deep is refused by its size
    elif kind == "garbage":
        path.write_bytes(b"\xff{not json")
    elif kind == "list":
        path.write_text("[1, 2]")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        path.write_text(json.dumps({"run_id": "r", "attempt": 1, "pad": "x" * 70_000}))
    assert _demo("--checkpoint-dir", str(tmp_path), "--resume") == 2
    _one_line_refusal(capsys, "openlora-otel demo: --resume:", str(path), *words)


def test_a_run_file_that_is_a_directory_is_refused_and_nothing_is_left_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / RUN_FILE).mkdir()
    assert _demo("--checkpoint-dir", str(tmp_path)) == 2
    _one_line_refusal(capsys, f"{tmp_path / RUN_FILE} is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_FILE]  # no .run.json.<pid>.tmp


def test_a_missing_run_file_is_none_and_a_good_one_is_read(tmp_path: Path) -> None:
    assert read_run_file(tmp_path) is None
    (tmp_path / RUN_FILE).write_text('{"run_id": "r", "attempt": 2}')
    assert read_run_file(tmp_path) == {"run_id": "r", "attempt": 2}
    _checkpoint(tmp_path, GOOD_STATE)
    assert read_checkpoint(tmp_path, torch)["step"] == 5


# -- property-based: whatever the files hold, a dict or one CheckpointError -------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@fuzz
@given(content=st.one_of(st.binary(max_size=300), _JSON.map(lambda v: json.dumps(v).encode())))
@example(content=b"[" * 100_000 + b"]" * 100_000)
@example(content=b"[" * 20_000 + b"]" * 20_000)
@example(content=b"\xff{")
def test_fuzz_run_file(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    directory = tmp_path_factory.mktemp("run")
    (directory / RUN_FILE).write_bytes(content)
    try:
        data = read_run_file(directory)
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(directory / RUN_FILE) in str(exc)
    else:
        assert isinstance(data, dict)


def _mutated_checkpoint(data: st.DataObject) -> bytes:
    """A real checkpoint's bytes, cut short, overwritten in places, or with bytes added."""
    import io

    buffer = io.BytesIO()
    state = data.draw(st.sampled_from([GOOD_STATE, {"step": 1}, {**GOOD_STATE, "adapter": []}, [], 7]))
    torch.save(state, buffer)
    raw = bytearray(buffer.getvalue())
    for _ in range(data.draw(st.integers(0, 4))):
        how = data.draw(st.sampled_from(["cut", "flip", "append"]))
        if how == "cut" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)) :]
        elif how == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        else:
            raw += data.draw(st.binary(max_size=16))
    return bytes(raw)


@fuzz
@given(data=st.data())
@example(data=None)  # the first example: an empty file
def test_fuzz_checkpoint(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject | None) -> None:
    directory = tmp_path_factory.mktemp("ckpt")
    raw = b"" if data is None else _mutated_checkpoint(data)
    (directory / CHECKPOINT_FILE).write_bytes(raw)
    try:
        state = read_checkpoint(directory, torch)
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(directory / CHECKPOINT_FILE) in str(exc)
    else:
        assert isinstance(state["step"], int) and state["adapter"]


def test_a_checkpoint_of_another_lora_rank_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--checkpoint-dir", str(tmp_path), "--eval-every", "0", "--exporter", "none", "--device", "cpu"]
    assert _demo(*common, "--checkpoint-every", "1", "--lora-r", "8") == 0
    capsys.readouterr()
    assert _demo(*common, "--resume", "--lora-r", "4", timeout=300) == 2
    _one_line_refusal(capsys, "--resume:", f"{tmp_path / CHECKPOINT_FILE} does not fit this model")

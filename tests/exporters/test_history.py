"""The run history file (OPENLORA_HISTORY_DIR): OTLP JSON Lines from a real demo run, the final line on
SIGTERM, failures logged once and survived, the size bound, and reading it back."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import Exemplar as SdkExemplar
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from openlora_otel import ConfigError, setup_telemetry
from openlora_otel._deps import MissingDependencyError
from openlora_otel.config import MIN_HISTORY_MAX_BYTES
from openlora_otel.exporters.history_writer import HistoryExporter, encode_line, history_path
from openlora_otel.report.history_reader import read_history
from tests.support.history_files import A_DAY_MS, history_config
from tests.support.otlp_receiver import HangingEndpoint
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
STEPS = "openlora.training.steps"


def _exporter(telemetry: object) -> HistoryExporter:
    """The history exporter behind the Telemetry's first reader (the guard's inner exporter)."""
    reader = telemetry.meter_provider._metric_readers[0]  # type: ignore[attr-defined]
    return reader._exporter._inner


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _steps(path: Path) -> list[float | None]:
    return [snapshot.value(STEPS) for snapshot in read_history(path)]


def _keys(node: object) -> set[str]:
    if isinstance(node, dict):
        return set(node).union(*(_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_keys(v) for v in node))
    return set()


# -- a real demo run -----------------------------------------------------------------
def _demo_env(directory: Path) -> dict[str, str]:
    return child_env(
        OPENLORA_HISTORY_DIR=str(directory),
        OPENLORA_HISTORY_INTERVAL="200",
        OTEL_METRICS_EXPORTER="none",
        OPENLORA_GPU_METRICS="off",
        PYTHONPATH=str(ROOT),
    )


@pytest.mark.process
def test_a_demo_run_leaves_otlp_json_lines_that_decode_into_the_proto(tmp_path: Path) -> None:
    directory = tmp_path / "history"
    result = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "demo", "--steps", "40", "--eval-every", "20", "--run-name", "lr-3e-3"],
        cwd=ROOT,
        env=_demo_env(directory),
        capture_output=True,
        text=True,
        timeout=600,  # 15 s on an idle 2-core machine; minutes when others share it
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_id = re.search(r"^run (\S+) \(lr-3e-3\): 40 steps", result.stdout, re.MULTILINE).group(1)
    path = directory / f"{run_id}.jsonl"
    assert sorted(p.name for p in directory.iterdir()) == [path.name]
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.decode("utf-8").splitlines()
    # 40 steps take seconds at a 200 ms interval: many lines, not just the final one.
    assert len(lines) >= 5
    for line in lines:
        body = json.loads(line)
        # OTLP/JSON: lowerCamelCase keys, enums as integers, 64-bit integers as decimal strings.
        assert all(re.fullmatch(r"[a-z][A-Za-z]*", key) for key in _keys(body)), _keys(body)
        request = json_format.Parse(line, ExportMetricsServiceRequest())
        assert json_format.MessageToDict(request, use_integers_for_enums=True) == body
    last = json.loads(lines[-1])
    (resource_metrics,) = last["resourceMetrics"]
    metrics = {m["name"]: m for sm in resource_metrics["scopeMetrics"] for m in sm["metrics"]}
    steps = metrics[STEPS]["sum"]
    assert steps["aggregationTemporality"] == 2  # AGGREGATION_TEMPORALITY_CUMULATIVE, as a number
    assert steps["isMonotonic"] is True
    assert steps["dataPoints"][0]["asInt"] == "40"
    assert isinstance(steps["dataPoints"][0]["timeUnixNano"], str)

    snapshots = list(read_history(path))
    assert len(snapshots) == len(lines)
    final = snapshots[-1]
    assert final.resource["openlora.run.id"] == run_id
    assert final.resource["openlora.run.name"] == "lr-3e-3"
    assert final.value(STEPS) == 40
    (info,) = final.metrics["openlora.run.info"]
    assert info.value == 1
    assert info.attributes["openlora.run.name"] == "lr-3e-3"
    assert info.attributes["openlora.hparam.lora_r"] == "8"
    assert info.attributes["openlora.hparam.base_model"] == "tiny-llama"
    assert info.attributes["openlora.hparam.max_steps"] == "40"
    assert "openlora.hparam.learning_rate" in info.attributes
    # Cumulative and complete: the steps never go back, and the evaluations are in the file.
    steps_seen = [s for s in _steps(path) if s is not None]
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] == 40
    assert any(s.metrics.get("openlora.training.eval.loss") for s in snapshots)


@pytest.mark.process
def test_sigterm_in_the_middle_of_a_demo_run_still_writes_the_final_line(tmp_path: Path) -> None:
    directory = tmp_path / "history"
    process = subprocess.Popen(
        [sys.executable, "-m", "openlora_otel", "demo", "--steps", "100000", "--eval-every", "0", "--quiet"],
        cwd=ROOT,
        env=_demo_env(directory),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 400
        stepping = False
        while time.monotonic() < deadline and process.poll() is None and not stepping:
            time.sleep(0.2)
            for path in directory.glob("*.jsonl"):
                stepping = any((s or 0) >= 3 for s in _steps(path))
        assert stepping, "the demo never wrote a line with steps"
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
    assert process.returncode == 143, stderr[-3000:]
    taken = int(re.search(r"stopped by SIGTERM after (\d+) steps; telemetry flushed", stdout).group(1))
    (path,) = directory.glob("*.jsonl")
    assert _steps(path)[-1] == taken
    assert path.read_bytes().endswith(b"\n")


@pytest.mark.process
def test_sigterm_to_a_plain_script_writes_the_final_line_through_the_shutdown(tmp_path: Path) -> None:
    """No periodic line (a day apart): the only line is the one the SIGTERM guard's shutdown writes."""
    script = textwrap.dedent(
        """
        import time
        from openlora_otel import setup_telemetry
        telemetry = setup_telemetry(run_id="term")
        for _ in range(5000):
            telemetry.training.record_step(loss=1.0, tokens=7)
        print("READY", flush=True)
        time.sleep(60)
        print("NOT KILLED", flush=True)
        """
    )
    env = child_env(
        OPENLORA_HISTORY_DIR=str(tmp_path),
        OPENLORA_HISTORY_INTERVAL=str(int(A_DAY_MS)),
        OTEL_METRICS_EXPORTER="none",
        OPENLORA_QUIET="true",
        PYTHONPATH=str(ROOT),
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "READY"
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
    assert process.returncode == 143, stderr[-3000:]
    assert "NOT KILLED" not in stdout
    assert _steps(tmp_path / "term.jsonl") == [5000]


# -- setup ---------------------------------------------------------------------------
def test_a_directory_that_cannot_be_created_fails_at_setup_naming_the_variable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    before = threading.active_count()
    with pytest.raises(ConfigError) as caught:
        setup_telemetry(config=history_config(blocker / "history"))
    assert caught.value.variable == "OPENLORA_HISTORY_DIR"
    assert str(blocker / "history") in str(caught.value)
    assert "Not a directory" in str(caught.value)
    assert threading.active_count() == before  # no reader thread was started
    # The process can set up again once the directory is fixed.
    telemetry = setup_telemetry(config=history_config(tmp_path / "history"), run_id="ok")
    assert telemetry.shutdown()
    assert _steps(tmp_path / "history" / "ok.jsonl")


def test_the_history_needs_the_otlp_extra_and_says_so_at_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openlora_otel import _deps

    real = _deps.is_installed
    monkeypatch.setattr(
        _deps, "is_installed", lambda module: False if module.endswith("otlp.proto.common") else real(module)
    )
    with pytest.raises(MissingDependencyError) as caught:
        setup_telemetry(config=history_config(tmp_path / "history"))
    message = str(caught.value)
    assert "OPENLORA_HISTORY_DIR" in message
    assert "opentelemetry-exporter-otlp-proto-common" in message
    assert "pip install 'openlora-otel[otlp]'" in message
    assert not (tmp_path / "history").exists()


def test_file_names_carry_the_rank_and_never_leave_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resource = Resource({"openlora.run.id": "job-7", "openlora.rank": 3})
    assert history_path(tmp_path, resource) == tmp_path / "job-7.rank3.jsonl"
    path = history_path(tmp_path, Resource({"openlora.run.id": "../../etc/x y"}))
    assert re.fullmatch(r"_\.\._etc_x_y-[0-9a-f]{12}\.jsonl", path.name) and path.parent == tmp_path
    # The rank too: OTEL_RESOURCE_ATTRIBUTES can set it to any string.
    for rank, name in (("/../../escaped", r"r\.rank_\.\._\.\._escaped-[0-9a-f]{12}"), ("a/b", r"r\.ranka_b-[0-9a-f]{12}")):
        path = history_path(tmp_path, Resource({"openlora.run.id": "r", "openlora.rank": rank}))
        assert re.fullmatch(name + r"\.jsonl", path.name) and path.parent == tmp_path

    telemetry = setup_telemetry(
        config=history_config(tmp_path, resource_attributes={"openlora.rank": 1}), run_id="ddp-run"
    )
    # The line that says where the metrics go names the file.
    assert f"metrics written to {tmp_path / 'ddp-run.rank1.jsonl'} every 86400 s" in capsys.readouterr().err
    telemetry.training.record_step(loss=1.0)
    assert telemetry.shutdown()
    (snapshot,) = read_history(tmp_path / "ddp-run.rank1.jsonl")
    assert snapshot.resource["openlora.rank"] == 1
    assert snapshot.value(STEPS) == 1


# -- failures at run time -------------------------------------------------------------
def _history_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "run history" in r.getMessage() and r.levelno >= logging.WARNING]


def test_a_directory_removed_mid_run_is_logged_once_and_survived(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "history"
    telemetry = setup_telemetry(config=history_config(directory), run_id="gone")
    path = directory / "gone.jsonl"
    telemetry.training.record_step(loss=1.0)
    assert telemetry.force_flush()
    assert _steps(path) == [1]

    shutil.rmtree(directory)
    caplog.set_level(logging.INFO)
    for _ in range(4):
        telemetry.training.record_step(loss=1.0)
        telemetry.force_flush()
    warnings = _history_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "failed" in warnings[0] and "training continues" in warnings[0]

    directory.mkdir()  # someone puts it back: the next line starts a new file
    telemetry.training.record_step(loss=1.0)
    telemetry.force_flush()
    warnings = _history_warnings(caplog)
    assert len(warnings) == 2 and "recovered" in warnings[1]
    assert _steps(path) == [6]
    assert telemetry.shutdown()
    assert _steps(path) == [6, 6]


def test_a_write_cut_short_by_a_full_disk_leaves_only_whole_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    telemetry = setup_telemetry(config=history_config(tmp_path), run_id="full")
    path = tmp_path / "full.jsonl"
    telemetry.training.record_step(loss=1.0)
    telemetry.force_flush()
    good = path.read_bytes()

    real_write = os.write
    calls = {"n": 0}

    def half_then_full(fd: int, data: bytes) -> int:
        if bytes(data[:20]).startswith(b'{"resourceMetrics"') or calls["n"]:
            calls["n"] += 1
            if calls["n"] == 1:
                return real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(os, "write", half_then_full)
    telemetry.training.record_step(loss=1.0)
    telemetry.force_flush()
    monkeypatch.setattr(os, "write", real_write)
    assert calls["n"] == 2  # half a line went out, then the disk was full
    assert path.read_bytes() == good  # cut back to the last whole line
    (warning,) = _history_warnings(caplog)
    assert "No space left on device" in warning

    telemetry.training.record_step(loss=1.0)
    assert telemetry.shutdown()
    assert _steps(path) == [1, 3]


def test_the_final_line_goes_out_behind_a_hanging_otlp_collector(tmp_path: Path) -> None:
    """The history reader shuts down first: a push export stuck until the bound does not cost the file
    its final line."""
    hanging = HangingEndpoint()
    try:
        config = history_config(tmp_path, exporters=("otlp",), export_interval_ms=60_000.0, shutdown_timeout_s=1.0)
        config = config.replace(
            otlp=config.otlp.__class__(endpoint=f"http://127.0.0.1:{hanging.port}/v1/metrics", timeout_s=30.0)
        )
        telemetry = setup_telemetry(config=config, run_id="stuck")
        for _ in range(7):
            telemetry.training.record_step(loss=1.0)
        telemetry.shutdown()
        assert _steps(tmp_path / "stuck.jsonl") == [7]
    finally:
        hanging.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.process  # a forked child
def test_a_forked_worker_writes_nothing_to_the_file(tmp_path: Path) -> None:
    """A DataLoader worker forked from the training process gets a copy of the reader (the SDK restarts its
    thread there); its frozen copy of the metrics must not be appended to the run's file."""
    telemetry = setup_telemetry(config=history_config(tmp_path, history_interval_ms=100.0), run_id="fork")
    telemetry.training.record_step(loss=1.0)
    pid = os.fork()
    if pid == 0:  # the worker: steps the parent never took, then several intervals, then shutdown
        try:
            for _ in range(100):
                telemetry.training.record_step(loss=1.0)
            time.sleep(0.6)
            telemetry.shutdown()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert telemetry.shutdown()
    steps = _steps(tmp_path / "fork.jsonl")
    assert steps and set(steps) <= {None, 1}, steps


# -- the bound ---------------------------------------------------------------------------
def test_the_file_stays_within_the_bound_and_keeps_the_whole_run_at_a_lower_resolution(tmp_path: Path) -> None:
    telemetry = setup_telemetry(
        config=history_config(tmp_path, history_max_bytes=MIN_HISTORY_MAX_BYTES), run_id="long"
    )
    path = tmp_path / "long.jsonl"
    exporter = _exporter(telemetry)
    collections = 600
    for step in range(1, collections + 1):
        telemetry.training.record_step(loss=1.0 / step, tokens=10)
        telemetry.force_flush()
        assert path.stat().st_size <= MIN_HISTORY_MAX_BYTES
    assert exporter.compactions >= 2
    assert exporter.stride == 2**exporter.compactions
    assert telemetry.shutdown()
    assert path.stat().st_size <= MIN_HISTORY_MAX_BYTES

    steps = _steps(path)
    assert steps[0] == 1  # the first collection
    assert steps[-1] == collections  # the final values
    # Monotonic; the shutdown's line may repeat the last flush's values.
    assert all(a < b for a, b in itertools.pairwise(steps[:-1])) and steps[-2] <= steps[-1]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    # Evenly thinned: no gap wider than the current stride, and the file is more than a quarter full.
    assert max(gaps) <= exporter.stride
    assert path.stat().st_size > MIN_HISTORY_MAX_BYTES / 4
    for line in _lines(path):
        json_format.Parse(line, ExportMetricsServiceRequest())


def test_the_last_collection_is_written_at_shutdown_even_when_thinning_skips_it(tmp_path: Path) -> None:
    telemetry = setup_telemetry(config=history_config(tmp_path), run_id="thin")
    exporter = _exporter(telemetry)
    telemetry.training.record_step(loss=1.0)
    telemetry.force_flush()
    exporter.stride = 8  # as after three compactions
    for _ in range(3):
        telemetry.training.record_step(loss=1.0)
        telemetry.force_flush()  # skipped: not every 8th
    assert _steps(tmp_path / "thin.jsonl") == [1]
    assert telemetry.shutdown()  # its collection is skipped too, and written all the same
    assert _steps(tmp_path / "thin.jsonl") == [1, 4]


def test_compaction_keeps_the_first_the_last_and_every_other_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    exporter = HistoryExporter(path, max_bytes=MIN_HISTORY_MAX_BYTES)
    for count, kept in ((7, [0, 2, 4, 6]), (6, [0, 2, 4, 5]), (3, [0, 2]), (2, None), (1, None)):
        path.write_bytes(b"".join(b'{"n":%d}\n' % i for i in range(count)) + b'{"torn')
        size = exporter._compact()
        if kept is None:
            assert size is None
            continue
        assert path.read_bytes() == b"".join(b'{"n":%d}\n' % i for i in kept)
        assert size == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]  # no temporary left behind


# -- the encoding and the reader --------------------------------------------------------
def test_exemplar_ids_are_hex_and_nan_is_a_string(tmp_path: Path) -> None:
    exemplar = SdkExemplar(
        filtered_attributes={}, value=2.0, time_unix_nano=5, span_id=0x00F067AA0BA902B7,
        trace_id=0x5B8EFFF798038103D269B633813FC60C,
    )
    point = NumberDataPoint(attributes={"k": "v"}, start_time_unix_nano=0, time_unix_nano=5, value=float("nan"), exemplars=[exemplar])
    data = MetricsData(
        resource_metrics=[
            ResourceMetrics(
                resource=Resource({"openlora.run.id": "r"}),
                scope_metrics=[
                    ScopeMetrics(
                        scope=InstrumentationScope("s"),
                        metrics=[Metric(name="g", description="", unit="1", data=Gauge(data_points=[point]))],
                        schema_url="",
                    )
                ],
                schema_url="",
            )
        ]
    )
    line = encode_line(data)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    body = json.loads(line)
    (dp,) = body["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["gauge"]["dataPoints"]
    assert dp["asDouble"] == "NaN"
    assert dp["exemplars"][0]["spanId"] == "00f067aa0ba902b7"
    assert dp["exemplars"][0]["traceId"] == "5b8efff798038103d269b633813fc60c"
    path = tmp_path / "one.jsonl"
    path.write_bytes(line)
    (snapshot,) = read_history(path)
    assert snapshot.resource == {"openlora.run.id": "r"}
    (p,) = snapshot.metrics["g"]
    assert p.attributes == {"k": "v"} and p.value != p.value  # NaN


def test_the_reader_skips_a_torn_last_line_and_lines_that_are_not_otlp(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    telemetry = setup_telemetry(config=history_config(tmp_path), run_id="r")
    telemetry.training.record_step(loss=0.5, grad_norm=2.0, step_time_s=0.25)
    telemetry.shutdown()
    path = tmp_path / "r.jsonl"
    (line,) = _lines(path)
    body = json.loads(line)
    assert all(re.fullmatch(r"[a-z][A-Za-z]*", key) for key in _keys(body))
    metrics = {m["name"]: m for m in body["resourceMetrics"][0]["scopeMetrics"][0]["metrics"]}
    assert metrics[STEPS]["sum"]["aggregationTemporality"] == 2
    assert metrics["openlora.training.step.duration"]["histogram"]["dataPoints"][0]["count"] == "1"
    assert json_format.MessageToDict(
        json_format.Parse(line, ExportMetricsServiceRequest()), use_integers_for_enums=True
    ) == body
    path.write_text(line + "\nnot json\n" + line + "\n" + line[: len(line) // 2], encoding="utf-8")
    caplog.set_level(logging.WARNING)
    snapshots = list(read_history(path))
    assert [s.line for s in snapshots] == [1, 3]
    assert any("line 2" in r.getMessage() for r in caplog.records)
    snapshot = snapshots[0]
    assert snapshot.value(STEPS) == 1
    assert snapshot.value("openlora.training.loss") == 0.5
    (duration,) = snapshot.metrics["openlora.training.step.duration"]
    assert duration.value is None and duration.count == 1 and duration.sum == pytest.approx(0.25)
    assert len(duration.bucket_counts) == len(duration.bounds) + 1
    assert snapshot.time_s == pytest.approx(time.time(), abs=60)

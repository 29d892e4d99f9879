"""benchmarks/gpu_check.py, the prepared GPU check, in its dry run: the fake NVML, an nvidia-smi made from the same
fake, the demo and `serve` on the CPU. So the script cannot rot between the times a GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.fixture
def dry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> gpu_check.Context:
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)  # the dry run puts the fake there
    return gpu_check.Context(gpu_check.argparse.Namespace(dry_run=True, out=tmp_path, snapshots=10, pairs=1, serve_pairs=1, serve_seconds=2))


@pytest.mark.process
def test_the_dry_run_runs_every_stage_that_needs_no_hardware(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip("fastapi")
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", str(tmp_path), "--dry-run"],
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert report["dry_run"] is True
    assert list(stages) == list(gpu_check.STAGES)
    assert {name for name, s in stages.items() if s["status"] == "skipped"} == set(gpu_check.NEEDS_HARDWARE)
    assert all(s["status"] == "ok" for name, s in stages.items() if name not in gpu_check.NEEDS_HARDWARE)
    compared = {row["field"]: row for row in stages["values"]["compared"]}
    # Every value the fake's nvidia-smi gives went through our collector and its unit conversion.
    assert compared["memory.total"]["ours"] == pytest.approx(85_520_809_984 / 2**20)
    assert compared["power.draw"]["ours"] == pytest.approx(312.456)
    assert compared["clocks.sm"]["ours"] == pytest.approx(1980)
    assert compared["clocks_event_reasons_counters.sw_power_cap"]["ours"] == pytest.approx(2.5e6)
    assert sum(row["within"] == "yes" for row in compared.values()) >= 18
    assert not [row for row in compared.values() if row["within"] == "NO"]
    assert "power.draw.average" in stages["values"]["absent_in_smi"]
    assert stages["snapshot"]["details"]["NVML calls per snapshot (median)"] > 0
    assert stages["demo_sync"]["details"]["steps"] == 40
    assert stages["demo_sync"]["details"]["hf_trainer"]["steps"] == 10
    assert "pair 1" not in stages["demo_speed"]["summary"] and "ratio median" in stages["demo_speed"]["summary"]
    assert "req/s" in stages["serve_speed"]["summary"]
    page = (tmp_path / "gpu_check.md").read_text()
    assert page.startswith("# GPU check (dry run: fake NVML, CPU)")
    assert "| memory.total | 81559 | 81559 / 81559 | 1 | yes | MiB |" in page


def test_a_value_off_from_nvidia_smi_is_a_finding(dry: gpu_check.Context) -> None:
    """The comparison can fail: a wrong conversion on our side would show as a NO."""
    real_query = dry.smi.query

    def doubled(fields: list[str]) -> dict:
        answer = real_query(fields)
        for values in answer.values():
            values["clocks.sm"] *= 2  # as if we read MHz as half a GHz
        return answer

    dry.smi.query = doubled
    stage: dict = {}
    summary = gpu_check.stage_values(dry, stage)
    assert stage["mismatches"] == ["clocks.sm"] and stage["ok"] is False
    assert "outside: clocks.sm" in summary


def test_nvidia_smi_cells_become_numbers_or_none() -> None:
    assert gpu_check._smi_number(" 81559 ") == 81559
    assert gpu_check._smi_number("Yes") == 1 and gpu_check._smi_number("Not Active") == 0
    assert gpu_check._smi_number("[N/A]") is None and gpu_check._smi_number("[Not Supported]") is None


def test_unknown_stages_are_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--stages", "values,warp"])
    assert "--stages: unknown warp" in capsys.readouterr().err

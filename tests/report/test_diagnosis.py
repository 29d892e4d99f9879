"""openlora_otel.report.diagnosis on runs built in memory: each detector finds what it is for (and the
right step and rank), stays quiet on a healthy run, ranks its findings; the JSON form validates
against its schema and the text form says everything the finding holds."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from openlora_otel.report.diagnosis import JSON_SCHEMA, diagnose, text_lines, to_json
from openlora_otel.report.goodput import TimeSample
from openlora_otel.report.model import ProcessRows, Row, Run

T0 = 1_800_000_000.0


def rows(steps: int, *, step_s: float = 0.1, every: int = 5, start: float = T0, **overrides) -> list[Row]:
    """A healthy rank: a row every ``every`` steps, steps of ``step_s`` seconds; ``overrides``: functions
    of the step that replace values (``loss=lambda s: ...``)."""
    out = []
    for step in range(every, steps + 1, every):
        values = {
            "steps": float(step),
            "last_step_time": start + step * step_s,
            "loss": 2.0 - step / 1000,
            "loss_max": 2.1 - step / 1000,
            "grad_norm": 1.0,
            "grad_norm_max": 1.2,
            "learning_rate": 2e-4,
            "loss_nonfinite": 0.0,
            "grad_norm_nonfinite": 0.0,
            "step_time_sum": step * step_s,
            "step_time_count": float(step),
        }
        for key, value in overrides.items():
            values[key] = value(step)
        out.append(Row(start + step * step_s, values))
    return out


def phases(productive: float, data_wait: float, rank: int | None = None) -> list[TimeSample]:
    return [TimeSample(T0 + 60, {"productive": productive, "data_wait": data_wait, "startup": 1.0}, rank=rank)]


def run(*processes: ProcessRows) -> Run:
    return Run("r1", "a-run", {}, "files", rows=processes[0].rows, ranks=len(processes), processes=list(processes))


def test_a_healthy_run_has_no_finding() -> None:
    healthy = run(*(ProcessRows(rank, rows(200), phases(20.0, 0.5, rank)) for rank in range(4)))
    assert diagnose(healthy) == []
    assert text_lines(healthy, [])[1].strip().startswith("no findings")


def test_a_learning_rate_too_high_the_gradient_norm_grew_before_the_loss_went_nan() -> None:
    def norm(step: int) -> float:
        return 1.0 if step < 60 else 1.0 * 3 ** ((step - 60) / 5)

    def nonfinite(step: int) -> float:
        return max(0.0, step - 89.0)  # NaN from step 90 on, every step

    process = ProcessRows(0, rows(120, grad_norm=norm, grad_norm_max=lambda s: 1.5 * norm(s), loss_nonfinite=nonfinite,
                                  learning_rate=lambda s: 5e-2))  # fmt: skip
    (finding,) = diagnose(run(process, ProcessRows(1, rows(120), [])))
    assert (finding.kind, finding.severity, finding.step, finding.rank) == ("divergence", "critical", 90.0, 0)
    assert "learning rate too high" in finding.cause and "0.05" in finding.cause
    assert finding.ruled_out and "bad batch" in finding.ruled_out[0]
    series = {e.series for e in finding.evidence}
    assert {"openlora.training.loss.nonfinite", "openlora.training.gradient_norm.max", "openlora.training.learning_rate"} <= series


def test_a_loss_spike_before_the_nan_points_at_a_batch() -> None:
    process = ProcessRows(
        None,
        rows(100, loss_max=lambda s: 40.0 if s == 50 else 2.1, loss_nonfinite=lambda s: 1.0 if s >= 55 else 0.0),
    )
    (finding,) = diagnose(run(process))
    assert finding.kind == "divergence" and finding.step == 55.0 and finding.rank is None
    assert "bad batch" in finding.cause and "step 50" in finding.cause


def test_a_nan_without_warning_is_numerical() -> None:
    (finding,) = diagnose(run(ProcessRows(0, rows(100, grad_norm_nonfinite=lambda s: 2.0 if s >= 40 else 0.0))))
    assert finding.title.startswith("the gradient norm went non-finite at step 39")
    assert "without warning" in finding.cause


def test_a_straggler_is_named_with_its_rank_since_when_and_whether_its_data_wait_explains_it() -> None:
    slow = rows(200, step_time_sum=lambda s: s * 0.1 + max(0, s - 100) * 0.15)  # from step 100: 2.5x
    processes = [ProcessRows(rank, rows(200), phases(20.0, 0.2, rank)) for rank in range(3)]
    (finding,) = diagnose(run(*processes, ProcessRows(3, slow, phases(20.0, 0.2, 3))))
    assert (finding.kind, finding.rank, finding.step) == ("straggler", 3, 105.0)
    assert finding.severity == "warning" and "no cause found" in finding.cause  # 1.75x over the run
    assert [r.split(":")[0] for r in finding.ruled_out] == ["its data loader", "its node's CPUs", "its GPU"]
    # Its data wait explains it when it waits far more than the others.
    (finding,) = [f for f in diagnose(run(*processes, ProcessRows(3, slow, phases(10.0, 8.0, 3)))) if f.kind == "straggler"]
    assert finding.cause.startswith("its data loader")


def gpu(**overrides) -> dict:
    """A healthy GPU's readings of a rank (the counters' own starting values: ECC errors since the driver
    loaded, throttle seconds), each a function of the step in ``overrides``."""
    values = {"gpu_failed": lambda s: 0.0, "gpu_degraded": lambda s: 0.0, "remap_pending": lambda s: 0.0,
              "remap_failed": lambda s: 0.0, "ecc_uncorrected": lambda s: 2.0, "gpu_clock_sm": lambda s: 1.98e9,
              "throttle_thermal": lambda s: 0.25, "throttle_sw_power_cap": lambda s: 1.5 + s * 0.001,
              "pcie_width": lambda s: 16.0, "pcie_width_max": lambda s: 16.0}  # fmt: skip
    values.update(overrides)
    return values


@pytest.mark.parametrize(
    ("fault", "severity", "title", "runbook"),
    [
        ({"xid_off_bus": lambda s: float(s >= 60), "xid_errors": lambda s: float(s >= 60),
          "gpu_failed": lambda s: float(s >= 60)}, "critical", "fell off the bus (XID 79)", "openloragpufelloffthebus"),
        ({"remap_failed": lambda s: float(s >= 60), "gpu_failed": lambda s: float(s >= 60)}, "critical",
         "failed to remap a bad memory row", "openloragpurowremapfailed"),
        ({"ecc_uncorrected": lambda s: 2.0 + (s >= 60)}, "critical", "had uncorrected ECC errors",
         "openloragpuuncorrectedeccerrors"),
        ({"gpu_failed": lambda s: float(s >= 60)}, "critical", "failed", "openloragpufailed"),
        ({"xid_bad_gpu": lambda s: float(s >= 60), "xid_errors": lambda s: float(s >= 60),
          "gpu_degraded": lambda s: float(s >= 60)}, "critical", "reported an XID of a bad GPU", "openloragpuhardwarexid"),
        ({"remap_pending": lambda s: float(s >= 60), "gpu_degraded": lambda s: float(s >= 60)}, "warning",
         "has a row remap waiting for a reset", "openloragpurowremappending"),
        ({"gpu_degraded": lambda s: float(s >= 60)}, "warning", "is degraded", "openloragpudegraded"),
        ({"xid_errors": lambda s: float(s >= 60)}, "info", "reported XIDs", "openloragpuhardwarexid"),
    ],
    ids=["off-bus", "remap-failed", "ecc", "failed", "bad-xid", "remap-pending", "degraded", "program-xid"],
)  # fmt: skip
def test_a_gpu_fault_is_named_with_its_rank_step_and_runbook(fault: dict, severity: str, title: str, runbook: str) -> None:
    healthy = ProcessRows(0, rows(100, **gpu()), phases(10.0, 0.1, 0))
    faulty = ProcessRows(1, rows(100, **gpu(**fault)), phases(10.0, 0.1, 1))
    (finding,) = diagnose(run(healthy, faulty))
    assert finding.severity == severity
    assert (finding.kind, finding.rank, finding.step, finding.time_s) == ("gpu_fault", 1, 60.0, T0 + 6.0)
    assert finding.title.startswith(f"rank 1's GPU {title} between steps 55 and 60"), finding.title
    assert finding.runbook.endswith(f"#{runbook}")
    assert {e.step for e in finding.evidence} == {60.0}


def test_a_pending_remap_is_a_warning_and_counters_from_before_the_run_are_not_its_faults() -> None:
    pending = ProcessRows(1, rows(100, **gpu(remap_pending=lambda s: float(s >= 60))), [])
    (finding,) = diagnose(run(ProcessRows(0, rows(100, **gpu())), pending))
    assert (finding.severity, finding.kind, finding.runbook.rsplit("#")[1]) == ("warning", "gpu_fault", "openloragpurowremappending")
    # 7 uncorrected errors since the driver loaded, none during the run; a new attempt's lower count
    # (another GPU) is a new base, not an error.
    old = ProcessRows(0, rows(100, **gpu(ecc_uncorrected=lambda s: 7.0 if s < 50 else 3.0)), [])
    assert diagnose(run(old, ProcessRows(1, rows(100, **gpu())))) == []


def test_what_is_not_a_gpu_fault_of_the_run() -> None:
    """Found by review: each of these once read as a critical GPU fault of a healthy run."""
    healthy = ProcessRows(0, rows(100, **gpu()))
    # A pending remap (degraded), then a program's own XID 13: the remap's warning, not a bad GPU's XID.
    pending = gpu(remap_pending=lambda s: float(s >= 60), gpu_degraded=lambda s: float(s >= 60),
                  xid_errors=lambda s: float(s >= 90))  # fmt: skip
    (finding,) = diagnose(run(healthy, ProcessRows(1, rows(100, **pending))))
    assert (finding.severity, finding.runbook.rsplit("#")[1]) == ("warning", "openloragpurowremappending")
    # One reading of a failed GPU (an NVML timeout reads so) is not a failed GPU; one in the last reading is.
    assert diagnose(run(healthy, ProcessRows(1, rows(100, **gpu(gpu_failed=lambda s: float(s == 50)))))) == []
    (finding,) = diagnose(run(healthy, ProcessRows(1, rows(100, **gpu(gpu_failed=lambda s: float(s == 100))))))
    assert (finding.severity, finding.step) == ("critical", 100.0)
    # A resumed attempt (its counters start again) on a GPU with more uncorrected errors from before the run.
    resumed = rows(50, **gpu()) + [
        Row(r.time_s + 10, {**r.values, "ecc_uncorrected": 9.0}) for r in rows(50, start=T0 + 10, **gpu())
    ]
    assert diagnose(run(healthy, ProcessRows(1, resumed))) == []
    # Two GPUs summed, one of whose reads failed once: the sum dips and comes back.
    dip = gpu(ecc_uncorrected=lambda s: 1.0 if s == 50 else 2.0)
    assert diagnose(run(healthy, ProcessRows(1, rows(100, **dip)))) == []


def test_a_resumed_attempt_on_a_gpu_throttled_before_the_run_is_not_throttled() -> None:
    others = [ProcessRows(rank, rows(200, **gpu()), phases(20.0, 0.2, rank)) for rank in range(3)]
    first = rows(100, step_time_sum=lambda s: s * 0.2, **gpu())
    second = [Row(r.time_s + 30, {**r.values, "throttle_sw_power_cap": 5000.0 + r.values["steps"] * 0.001})
              for r in rows(100, start=T0 + 30, step_time_sum=lambda s: s * 0.2, **gpu())]  # fmt: skip
    (finding,) = diagnose(run(*others, ProcessRows(3, first + second, phases(20.0, 0.2, 3))))
    assert finding.kind == "straggler" and finding.cause.startswith("no cause found"), finding.cause


def test_a_straggler_waiting_for_data_is_its_data_loader_whatever_its_idle_clock() -> None:
    others = [ProcessRows(rank, rows(200, **gpu()), phases(20.0, 0.2, rank)) for rank in range(3)]
    starved = rows(200, step_time_sum=lambda s: s * 0.2, **gpu(gpu_clock_sm=lambda s: 1.0e9))
    (finding,) = [f for f in diagnose(run(*others, ProcessRows(3, starved, phases(13.0, 7.0, 3)))) if f.kind == "straggler"]
    assert finding.cause.startswith("its data loader"), finding.cause
    assert any(r.startswith("its GPU's clock") and "clocks down" in r for r in finding.ruled_out), finding.ruled_out


def test_a_gpu_fault_comes_before_what_it_caused() -> None:
    """A GPU whose memory went bad, then a loss gone NaN: the GPU is the top finding."""
    faulty = ProcessRows(0, rows(100, **gpu(ecc_uncorrected=lambda s: 2.0 + (s >= 50)),
                                 loss_nonfinite=lambda s: float(s >= 55)), [])  # fmt: skip
    assert [f.kind for f in diagnose(run(faulty))] == ["gpu_fault", "divergence"]


def test_a_straggler_whose_gpu_was_throttled_or_clocked_down_or_its_link_narrow() -> None:
    slow = {"step_time_sum": lambda s: s * 0.2}  # 2x the others
    others = [ProcessRows(rank, rows(200, **gpu()), phases(20.0, 0.2, rank)) for rank in range(3)]
    # 60 % of its time held down by heat (0.1 s steps: 0.06 s a step), against 0 for the others.
    hot = gpu(throttle_thermal=lambda s: 0.25 + s * 0.06, gpu_clock_sm=lambda s: 1.2e9)
    (finding,) = diagnose(run(*others, ProcessRows(3, rows(200, **hot, **slow), phases(20.0, 0.2, 3))))
    assert finding.cause.startswith("its GPU's clock was held down by heat (thermal) 60% of its time, the other ranks 0%")
    assert {e.series for e in finding.evidence} >= {"openlora.gpu.throttle.time", "openlora.gpu.clock.sm"}
    assert "cooling" in finding.try_next[0]
    assert [r.split(":")[0] for r in finding.ruled_out] == ["its data loader", "its node's CPUs"]
    # Clocked down without a throttle counter to say why.
    (finding,) = diagnose(run(*others, ProcessRows(3, rows(200, **gpu(gpu_clock_sm=lambda s: 1.4e9), **slow), [])))
    assert finding.cause.startswith("its GPU's SM clock averaged 1,400 MHz, the other ranks' 1,980 MHz")
    # Its data loader explains more than its GPU: named first, the GPU ruled out as explaining less.
    (finding,) = [f for f in diagnose(run(*others, ProcessRows(3, rows(200, **hot, **slow), phases(4.0, 16.0, 3))))
                  if f.kind == "straggler"]  # fmt: skip
    assert finding.cause.startswith("its data loader") and finding.ruled_out[0].startswith("its GPU's clock was held")
    # A link trained narrow, nothing else different.
    narrow = gpu(pcie_width=lambda s: 8.0)
    (finding,) = diagnose(run(*others, ProcessRows(3, rows(200, **narrow, **slow), phases(20.0, 0.2, 3))))
    assert finding.cause == "its GPU's PCIe link ran on 8 of the 16 lanes GPU and slot support"
    assert [r.split(":")[0] for r in finding.ruled_out] == [
        "its data loader", "its node's CPUs", "its GPU's throttle counters", "its GPU's clock"]  # fmt: skip


def test_a_straggler_on_a_node_busy_elsewhere_and_ranks_sharing_one_node() -> None:
    """Four ranks, one per node, each node's LOCAL_RANK 0 reporting its CPUs' idle share: rank 3's node is
    92 % busy against the others' 15 %, and rank 3 is the straggler; its cause is its host. Two ranks
    on the same busy node, one of them slow: nothing to compare the node with, not the cause."""
    slow = {"step_time_sum": lambda s: s * 0.2}  # 2x the others

    def node(rank: int, idle: float, **values) -> ProcessRows:
        return ProcessRows(rank, rows(200, host_cpu_idle=lambda s: idle, **values), phases(20.0, 0.2, rank), f"node-{rank}")

    (finding,) = diagnose(run(*(node(rank, 0.85) for rank in range(3)), node(3, 0.08, **slow)))
    assert (finding.kind, finding.rank) == ("straggler", 3)
    assert finding.cause.startswith("its host was busy elsewhere: its node node-3's CPUs were 92% busy, the other "
                                    "ranks' nodes 15%"), finding.cause  # fmt: skip
    assert "node-3" in finding.try_next[0] and ("system.cpu.utilization", 0.92) in [(e.series, e.value) for e in finding.evidence]
    assert not any(r.startswith("its host") or r.startswith("its node") for r in finding.ruled_out)
    # Found by review: a GPU held down by heat is a direct sign, and wins over a busy node (a share of CPU
    # time, not of the rank's); the node then explains less.
    hot = gpu(throttle_thermal=lambda s: 0.25 + s * 0.04)
    (finding,) = diagnose(run(*(node(rank, 0.7, **gpu()) for rank in range(3)), node(3, 0.2, **hot, **slow)))
    assert finding.cause.startswith("its GPU's clock was held down by heat (thermal) 40% of its time"), finding.cause
    assert finding.ruled_out[0].startswith("its host was busy elsewhere: its node node-3's CPUs were 80% busy"), finding.ruled_out
    # A node only a little busier: ruled out, with the figures.
    (finding,) = diagnose(run(*(node(rank, 0.85) for rank in range(3)), node(3, 0.70, **slow)))
    assert "no cause found" in finding.cause and "its host: its node node-3's CPUs were 30% busy" in finding.ruled_out[1]
    shared = [ProcessRows(0, rows(200, host_cpu_idle=lambda s: 0.1), phases(20.0, 0.2, 0), "node-a"),
              ProcessRows(1, rows(200, **slow), phases(20.0, 0.2, 1), "node-a")]  # fmt: skip
    (finding,) = diagnose(run(*shared))
    assert "no cause found" in finding.cause and "no other rank ran on another node" in finding.ruled_out[1]


GIB = 2**30


def memory(**overrides) -> dict:
    """A rank's torch allocator on an 80 GiB GPU: 20 GiB allocated, 22 reserved, no OOM."""
    values = {"torch_allocated": lambda s: 20.0 * GIB, "torch_reserved": lambda s: 22.0 * GIB,
              "gpu_memory_limit": lambda s: 80.0 * GIB, "torch_ooms": lambda s: 0.0}  # fmt: skip
    values.update(overrides)
    return values


def test_memory_out_of_it_growing_and_fragmented() -> None:
    healthy = ProcessRows(0, rows(200, **memory()))
    # An out-of-memory error at step 120, and the rank's steps end there: critical.
    died = [r for r in rows(200, **memory(torch_ooms=lambda s: float(s >= 120))) if r.values["steps"] <= 125]
    (finding,) = diagnose(run(healthy, ProcessRows(1, died)))
    assert (finding.severity, finding.kind, finding.rank, finding.step) == ("critical", "memory", 1, 120.0)
    assert finding.title.startswith("rank 1 ran out of GPU memory by step 120") and "stopped stepping" in finding.title
    # One the program caught and went on from (a batch size search): a warning.
    (finding,) = diagnose(run(healthy, ProcessRows(1, rows(200, **memory(torch_ooms=lambda s: float(s >= 10))))))
    assert (finding.severity, finding.kind) == ("warning", "memory") and "and went on" in finding.title
    # 50 MiB more every step: 8.5 GiB over the readings after the warm-up (from step 25); 80 GiB reached
    # near step 1,434 (19.8 GiB at step 200, 60.2 GiB to go at 50 MiB a step).
    growing = memory(torch_allocated=lambda s: 10.0 * GIB + s * 50 * 2**20, torch_reserved=lambda s: 12.0 * GIB + s * 50 * 2**20)
    (finding,) = diagnose(run(healthy, ProcessRows(1, rows(200, **growing))))
    assert (finding.severity, finding.kind, finding.rank) == ("warning", "memory", 1)
    assert "grows steadily" in finding.title and "runs out near step 1,434" in finding.title, finding.title
    # The allocator reserving ever more than it hands out.
    fragmented = memory(torch_reserved=lambda s: 22.0 * GIB + s * 80 * 2**20)
    (finding,) = diagnose(run(healthy, ProcessRows(1, rows(200, **fragmented))))
    assert finding.kind == "memory" and finding.title.startswith("rank 1's allocator holds 17.6 GiB it does not hand out")


def test_memory_that_fills_up_at_the_start_or_wanders_is_no_growth() -> None:
    # The optimizer's state and the caches in the first readings, then flat.
    warm = memory(torch_allocated=lambda s: 5.0 * GIB if s <= 10 else 20.0 * GIB)
    # Up and down by a GiB around 20 (sequences of varying length): no steady climb.
    wandering = memory(torch_allocated=lambda s: (20.0 + ((s * 7919) % 13 - 6) / 6) * GIB)
    # A second attempt (its counters start again) that holds more than the first: not growth.
    second = rows(100, **memory()) + [Row(r.time_s + 30, {**r.values, "torch_allocated": 30.0 * GIB})
                                      for r in rows(100, start=T0 + 30, **memory())]  # fmt: skip
    # Found by review, each once read as growth or fragmentation: a single jump mid-run (a buffer kept
    # after the first evaluation), a jump in a run of few readings, a reserve flat at the activations'
    # peak whose last reading came between steps.
    jump = memory(torch_allocated=lambda s: 20.0 * GIB if s < 100 else 23.0 * GIB)
    short = [r for r in rows(30, every=5, **memory(torch_allocated=lambda s: 20.0 * GIB if s < 20 else 32.0 * GIB))]
    between = memory(torch_reserved=lambda s: 40.0 * GIB, torch_allocated=lambda s: 22.0 * GIB if s == 200 else 36.0 * GIB)
    for process in (rows(200, **warm), rows(200, **wandering), second, rows(200, **jump), short, rows(200, **between)):
        assert diagnose(run(ProcessRows(0, rows(200, **memory())), ProcessRows(1, process))) == []


def slower_from(step: int, factor: float = 2.0, step_s: float = 0.1):
    """step_time_sum of steps of ``step_s`` seconds that take ``factor`` times as long from ``step`` on."""
    return lambda s: s * step_s + max(0, s - step) * step_s * (factor - 1)


def test_a_lasting_slowdown_of_the_run_its_step_and_what_changed_then() -> None:
    slowed = [ProcessRows(rank, rows(300, step_time_sum=slower_from(100), **gpu())) for rank in range(4)]
    (finding,) = diagnose(run(*slowed))
    assert (finding.severity, finding.kind, finding.step, finding.rank) == ("warning", "throughput", 105.0, None)
    assert finding.title.startswith("every rank became 2.00x slower per step between steps 100 and 105"), finding.title
    assert finding.title.endswith("and stayed so")
    assert finding.cause.startswith("no cause found among the signals recorded: the slowed ranks changed together")
    # Held down by heat from then on, on every rank: that is what changed.
    hot = gpu(throttle_thermal=lambda s: 0.25 + max(0, s - 100) * 0.1, gpu_clock_sm=lambda s: 1.98e9 if s <= 100 else 1.3e9)
    (finding,) = diagnose(run(*(ProcessRows(rank, rows(300, step_time_sum=slower_from(100), **hot)) for rank in range(4))))
    assert "the GPU's clock held down (thermal)" in finding.cause and "openlora.gpu.clock.sm" in {e.series for e in finding.evidence}
    # Waiting for data from then on (goodput readings at every row).
    def waits(rank: int) -> list[TimeSample]:
        return [TimeSample(T0 + step * 0.1, {"productive": step * 0.1, "data_wait": max(0, step - 100) * 0.1}, rank=rank)
                for step in range(5, 301, 5)]  # fmt: skip
    starving = [ProcessRows(rank, rows(300, step_time_sum=slower_from(100), **gpu()), waits(rank)) for rank in range(4)]
    (finding, *_) = [f for f in diagnose(run(*starving)) if f.kind == "throughput"]
    assert "the data loader: waiting for data 50% of its time after, 0% before" in finding.cause, finding.cause


def test_one_slowed_rank_or_a_passing_slowdown_is_no_slowdown_of_the_run() -> None:
    healthy = [ProcessRows(rank, rows(300)) for rank in range(3)]
    one = ProcessRows(3, rows(300, step_time_sum=slower_from(100)))
    assert [f.kind for f in diagnose(run(*healthy, one))] == ["straggler"]
    # Three slow readings (15 steps 3x as long) in the middle, then as before.
    passing = lambda s: s * 0.1 + min(max(0, s - 100), 15) * 0.2  # noqa: E731
    assert diagnose(run(*(ProcessRows(rank, rows(300, step_time_sum=passing)) for rank in range(4)))) == []
    # Found by review: steps twice as long with twice the tokens (longer sequences from step 100) are
    # no slower; two ranks that slowed 180 steps apart did not change together; steps of no time before.
    longer = {"step_time_sum": slower_from(100), "tokens": lambda s: s * 1000.0 + max(0, s - 100) * 1000.0}
    assert diagnose(run(*(ProcessRows(rank, rows(300, **longer)) for rank in range(2)))) == []
    apart = [ProcessRows(0, rows(300, step_time_sum=slower_from(60))), ProcessRows(1, rows(300, step_time_sum=slower_from(240)))]
    assert "throughput" not in [f.kind for f in diagnose(run(*apart))]
    zero = ProcessRows(0, rows(300, step_time_sum=lambda s: max(0, s - 50) * 0.1))
    assert "throughput" not in [f.kind for f in diagnose(run(zero))]


def evaluated(eval_loss, loss=lambda s: 2.0 - s / 400) -> dict:
    """Rows of a rank that evaluates every 20 steps (eval_loss a function of the evaluation's step)."""
    return {"eval_loss": lambda s: eval_loss(s - s % 20), "loss": loss}


def test_overfitting_the_evaluation_loss_rising_from_its_best_while_the_training_loss_falls() -> None:
    # Best at step 100 (1.5), then up 0.05 an evaluation: 1.75 at step 200; the training loss falls throughout.
    rising = evaluated(lambda s: 2.0 - s / 200 if s <= 100 else 1.5 + (s - 100) / 400)
    (finding,) = diagnose(run(ProcessRows(0, rows(200, **rising))))
    assert (finding.severity, finding.kind, finding.step) == ("warning", "evaluation", 100.0)
    assert finding.title.startswith("the evaluation loss rose 17% from its best at step 100 (1.5) to step 200 (1.75)")
    assert finding.time_s is not None and "overfitting" in finding.title


def test_an_evaluation_loss_that_wobbles_or_rises_with_the_training_loss_is_not_overfitting() -> None:
    cases = [
        evaluated(lambda s: 2.0 - s / 200 if s <= 100 else 1.5 + (0.1 if s % 40 else -0.02)),  # back under its best once
        evaluated(lambda s: 2.0 - s / 200 if s <= 160 else 1.2 + (s - 160) / 1000),  # 3 % up at the end only
        evaluated(lambda s: 2.0 - s / 200 if s <= 100 else 1.5 + (s - 100) / 400, loss=lambda s: 1.0 + s / 100),  # both rise
        evaluated(lambda s: 2.0 - s / 200),  # falls throughout
        # Found by review: a flat evaluation loss with 3 % noise after its lowest point.
        evaluated(lambda s: {120: 1.010, 140: 1.023, 160: 0.992, 180: 1.021, 200: 1.031}.get(s, 1.5 - s * 0.00521)),
        # ... and the lowest evaluation the first (before any training), the rest above it.
        evaluated(lambda s: 1.0 if s < 40 else 1.2 + s / 1000),
    ]
    for values in cases:
        assert diagnose(run(ProcessRows(0, rows(200, **values)))) == []


def attempt(rank: int, number: int, **phases: float) -> TimeSample:
    return TimeSample(T0 + 100 * number, phases, steps_lost=40.0 if number > 1 else 0.0, attempt=number, rank=rank,
                      process=f"rank{rank}-attempt{number}")  # fmt: skip


def test_time_lost_to_restarts_across_attempts_by_cause() -> None:
    """Two ranks, two attempts: the second redid 40 steps (120 s a rank), loaded a checkpoint and started
    up again: restarts cost 350 of 1,000 rank-seconds."""
    processes = [
        ProcessRows(rank, rows(100), [attempt(rank, 1, startup=20.0, productive=200.0, checkpoint_save=5.0),
                                      attempt(rank, 2, startup=40.0, checkpoint_load=15.0, lost_progress=120.0,
                                              productive=100.0)])
        for rank in (0, 1)
    ]  # fmt: skip
    (finding,) = diagnose(run(*processes))
    assert (finding.severity, finding.kind) == ("warning", "goodput")
    assert finding.title == "36% of the run's time went to other work than training, most of it to restarts (35%)"
    assert finding.cause.startswith("goodput 60% over 2 attempt(s) and 4 process(es): restarts 35%, checkpoint saves 1%")
    # The same time in one attempt that simply ran longer: nothing lost to restarts, nothing to say.
    once = [ProcessRows(rank, rows(100), [attempt(rank, 1, startup=20.0, productive=460.0, checkpoint_save=5.0)])
            for rank in (0, 1)]  # fmt: skip
    assert diagnose(run(*once)) == []
    # One process without a rank (no torchrun), resumed: its second attempt's restart counts.
    single = ProcessRows(None, rows(100), [
        TimeSample(T0 + 100, {"startup": 20.0, "productive": 400.0}, attempt=1, process="a"),
        TimeSample(T0 + 200, {"startup": 40.0, "checkpoint_load": 15.0, "lost_progress": 250.0, "productive": 200.0},
                   steps_lost=40.0, attempt=2, process="b")])  # fmt: skip
    (finding,) = diagnose(run(single))
    assert finding.kind == "goodput" and "most of it to restarts" in finding.title, finding.title
    # A restart that cost little (a few steps done again) is still said, as info.
    cheap = ProcessRows(None, rows(100), [
        TimeSample(T0 + 100, {"startup": 20.0, "productive": 400.0}, attempt=1, process="a"),
        TimeSample(T0 + 200, {"startup": 20.0, "checkpoint_load": 1.0, "lost_progress": 4.0, "productive": 200.0},
                   steps_lost=5.0, attempt=2, process="b")])  # fmt: skip
    (finding,) = diagnose(run(cheap))
    assert (finding.severity, finding.kind) == ("info", "goodput"), finding
    assert finding.title == "the run restarted 1 time(s): 5 step(s) done again; the restarts cost 25 s (4% of the run's time)"


def test_what_is_no_time_lost() -> None:
    """Found by review: the time after the last step (a merge, an upload), eight ranks of a smoke run,
    and processes without their attempt or rank, each once read as time lost."""
    after_training = ProcessRows(0, rows(100, last_step_time=lambda s: T0 + 10.0),
                                 [attempt(0, 1, startup=20.0, productive=1200.0, evaluation=150.0, checkpoint_save=40.0,
                                          idle=250.0)])  # fmt: skip
    after_training.rows.append(Row(T0 + 260.0, dict(after_training.rows[-1].values)))  # its last reading, 250 s on
    smoke = [ProcessRows(rank, rows(100), [attempt(rank, 1, startup=20.0, productive=20.0, evaluation=10.0, idle=8.0)])
             for rank in range(8)]  # fmt: skip
    unnumbered = [ProcessRows(None, rows(100), [TimeSample(T0 + 60, {"startup": 30.0, "productive": 100.0,
                                                                    "checkpoint_load": 40.0}, process=f"p{i}")])
                  for i in range(4)]  # fmt: skip
    for processes in ([after_training], smoke, unnumbered):
        assert "goodput" not in [f.kind for f in diagnose(run(*processes))]


def test_a_hung_rank_and_a_run_that_stopped_stepping() -> None:
    # Rank 0 steps to 100 (a step a second) and goes on reporting, without a step, to 200 s; the
    # others step on to 300 s.
    stuck = rows(200, step_s=1.0, last_step_time=lambda s: T0 + min(s, 100) * 1.0)
    others = [ProcessRows(rank, rows(200, step_s=1.0, start=T0 + 100), []) for rank in (1, 2)]
    (finding,) = diagnose(run(ProcessRows(0, stuck, []), *others))
    assert (finding.kind, finding.severity, finding.rank, finding.step) == ("hang", "critical", 0, 100.0)
    assert "went on reporting for 100 s" in finding.evidence[0].note
    # A rank whose rows end with its steps ended (an attempt with more ranks than the next): not hung.
    ended = rows(100, step_s=1.0)
    assert diagnose(run(ProcessRows(0, ended, []), *others)) == []
    # Every rank stopped while the rows kept coming.
    frozen = [ProcessRows(rank, rows(2000, last_step_time=lambda s: T0 + min(s, 500) * 0.1), []) for rank in (0, 1)]
    (finding,) = diagnose(run(*frozen))
    assert finding.kind == "hang" and finding.rank is None and "no rank stepped after step 500" in finding.title
    # Found by the corpus's real hung run: the goodput clock books a stall (no step for a minute) as idle,
    # and idle once counted as work done between steps; the hang went unseen.
    stalled = [ProcessRows(p.rank, p.rows, [TimeSample(T0 + 50, {"productive": 50.0, "idle": 0.0}, rank=p.rank),
                                            TimeSample(T0 + 200, {"productive": 110.0, "idle": 90.0}, rank=p.rank)])
               for p in frozen]  # fmt: skip
    (finding,) = diagnose(run(*stalled))
    assert finding.kind == "hang" and "no rank stepped after step 500" in finding.title, finding


def test_a_run_that_ended_or_evaluates_after_its_last_step_is_not_hung() -> None:
    """The rows of a run go on after its last step when it evaluates, saves a checkpoint or lingers
    once finished: none of that is a hang."""
    after = [ProcessRows(rank, rows(2000, last_step_time=lambda s: T0 + min(s, 500) * 0.1), []) for rank in (0, 1)]
    finished = run(*after)
    finished.outcome = "finished"
    assert diagnose(finished) == []
    # A hung run is often ended from outside (a time limit, a person) or by a collective's timeout: still
    # a hang, that says how it ended.
    for ended in ("terminated", "failed"):
        killed = run(*after)
        killed.outcome = ended
        (finding,) = diagnose(killed)
        assert finding.kind == "hang" and finding.title.endswith(f"; then the run {ended}"), finding.title
    # Found by review: a run that reached its planned last step (max_steps) finished training, whatever
    # it did after (a save, an upload) and however it ended; a run of one attempt only.
    for ended in ("running", "terminated", "failed"):
        saving = run(*after)
        saving.outcome, saving.hyperparameters = ended, {"max_steps": "500"}
        assert diagnose(saving) == [], ended
    # Found by review: a requeue's gap between two attempts, and a later attempt that has not stepped
    # yet, are no silence after a step. Attempt 1 steps to 500 and is preempted; attempt 2 starts 600 s
    # later and is still loading its checkpoint (steps 0) when preempted again.
    first = rows(500, step_s=0.1)
    loading = [Row(first[-1].time_s + 600 + i * 10, {"steps": 0.0, "step_time_count": 0.0}) for i in range(4)]
    requeued = run(ProcessRows(0, first + loading, []))
    requeued.outcome = "terminated"
    assert diagnose(requeued) == []
    # Still running, but evaluating for the 150 s since its last step (its goodput readings say so).
    evaluating = [
        ProcessRows(p.rank, p.rows, [TimeSample(T0 + 50, {"productive": 45.0, "evaluation": 0.0}, rank=p.rank),
                                     TimeSample(T0 + 200, {"productive": 50.0, "evaluation": 148.0}, rank=p.rank)])
        for p in after
    ]  # fmt: skip
    assert diagnose(run(*evaluating)) == []


def test_an_input_bound_run_and_the_order_of_findings() -> None:
    (finding,) = diagnose(run(ProcessRows(0, rows(100), phases(10.0, 4.0))))
    assert (finding.kind, finding.severity) == ("input_bound", "warning")
    nan = ProcessRows(0, rows(100, loss_nonfinite=lambda s: max(0.0, s - 79.0)), phases(10.0, 12.0))
    found = diagnose(run(nan))
    assert [f.kind for f in found] == ["divergence", "input_bound"]  # critical first
    assert found[1].severity == "critical"  # 55% waiting


def test_the_json_form_validates_and_holds_no_nan() -> None:
    nan = ProcessRows(0, rows(100, loss_nonfinite=lambda s: max(0.0, s - 79.0), loss=lambda s: math.nan if s >= 80 else 2.0))
    slow = ProcessRows(1, rows(100, step_time_sum=lambda s: s * 0.3), phases(10.0, 1.0, 1))
    the_run = run(nan, slow)
    document = to_json([(the_run, diagnose(the_run)), (run(ProcessRows(0, rows(50))), [])])
    text = json.dumps(document, allow_nan=False)
    jsonschema.validate(json.loads(text), JSON_SCHEMA)
    assert [f["kind"] for f in document["runs"][0]["findings"]] == ["divergence", "straggler"]
    assert document["runs"][1]["findings"] == []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**document, "runs": [{**document["runs"][0], "extra": 1}]}, JSON_SCHEMA)


def test_the_text_form_says_what_the_finding_holds() -> None:
    the_run = run(ProcessRows(0, rows(100, loss_nonfinite=lambda s: max(0.0, s - 79.0))))
    (finding,) = diagnose(the_run)
    text = "\n".join(text_lines(the_run, [finding]))
    for part in (finding.title, finding.cause, *finding.ruled_out, *finding.try_next, finding.runbook):
        assert part in text
    assert all(e.series in text for e in finding.evidence)


def test_a_learning_rate_no_fine_tune_uses_explains_a_divergence_with_nothing_before_it() -> None:
    """A learning rate of 10 blows up in the first steps: the first history line already counts the NaN,
    so there is nothing earlier to compare the gradient norm with; its size and the rate say it."""
    process = ProcessRows(None, rows(20, loss_nonfinite=lambda s: float(s - 2), grad_norm_max=lambda s: 5.8e6,
                                     learning_rate=lambda s: 10.0))  # fmt: skip
    (finding,) = diagnose(run(process))
    assert finding.step == 3.0
    assert "the gradient norm reached 5.8e+06" in finding.cause and "far above what fine-tunes use" in finding.cause
    # A rate like that alone, the gradient norm unrecorded, still names it.
    quiet = ProcessRows(None, [Row(r.time_s, {k: v for k, v in r.values.items() if not k.startswith("grad_norm")})
                               for r in process.rows])  # fmt: skip
    (finding,) = diagnose(run(quiet))
    assert finding.cause.startswith("a learning rate too high; the learning rate, 10, is far above")


def test_odd_values_from_a_foreign_writer_never_reach_the_json_as_nan_and_a_resume_keeps_its_own_steps() -> None:
    """A NaN step count, an infinite counter, a phase of inf seconds, negative steps: the JSON holds no
    NaN and validates; a NaN counted in a resumed attempt (steps from 0 again) is at that attempt's step."""
    nan_step = [Row(r.time_s, {**r.values, "steps": math.nan if r.values["steps"] == 50 else r.values["steps"]})
                for r in rows(100, loss_nonfinite=lambda s: max(0.0, s - 49.0))]  # fmt: skip
    odd = ProcessRows(0, nan_step, [TimeSample(T0 + 60, {"productive": math.inf, "data_wait": 5.0}, rank=0)])
    negative = [Row(r.time_s, {**r.values, "steps": -r.values["steps"], "loss_nonfinite": math.inf}) for r in rows(100)]
    the_run = run(odd, ProcessRows(1, negative, []))
    document = to_json([(the_run, diagnose(the_run))])
    jsonschema.validate(json.loads(json.dumps(document, allow_nan=False)), JSON_SCHEMA)
    assert all(f["kind"] != "input_bound" for f in document["runs"][0]["findings"])  # the inf phase is no share
    # A first attempt to step 1,000, then a resumed one counting from 0: its NaN at about step 5.
    first = rows(1000, step_s=0.01)
    resumed = rows(20, start=T0 + 100, loss_nonfinite=lambda s: max(0.0, s - 5.0))  # 5 by step 10, on since
    (finding,) = diagnose(run(ProcessRows(0, first + resumed, [])))
    assert finding.step == 6.0, finding.title


def test_a_nan_the_run_recovered_from_is_a_warning() -> None:
    """One bad step the divergence guard skipped, then a healthy run: worth knowing, not critical."""
    process = ProcessRows(0, rows(200, loss_nonfinite=lambda s: 1.0 if s >= 50 else 0.0))
    (finding,) = diagnose(run(process))
    assert finding.severity == "warning" and "then it recovered (0 more non-finite in the 150 steps after)" in finding.title
    assert finding.step == 50.0

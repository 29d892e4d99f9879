"""The cluster dashboard (grafana/dashboards/openlora-cluster.json): the ranks of one run side by
side, who reports, who is slow, who stopped stepping, and the GPUs behind them.

It reads the recording rules of the `openlora-ranks` group (openlora_otel/rules/openlora.yml),
which already carry openlora_run_id and openlora_rank, so its queries stay cheap on a store
holding thousands of ranks.
"""

from __future__ import annotations

from typing import Any

from .common import (
    DATASOURCE_VARIABLE,
    GPU_STATE_MAPPINGS,
    GPU_STATE_THRESHOLDS,
    INPUT_BOUND_THRESHOLD,
    RUN_VARIABLE,
    dashboard,
    panel,
    row,
    target,
    thresholds,
    variable,
)
from .layout import Grid

# Recorded series of the openlora-ranks group: all carry openlora_run_id; the rank:* ones also
# openlora_rank, job and instance.
RUN_ONLY = 'openlora_run_id=~"$run"'
RANK_SEL = f'job=~"$job", {RUN_ONLY}'
STRAGGLER_THRESHOLD = 1.5  # OpenloraRankStraggling fires above this ratio (openlora_otel/rules/openlora.yml)
HUNG_AFTER_S = 300  # OpenloraRankHung: a rank's last step older than 5 minutes
RANK_LEGEND = "rank {{openlora_rank}} ({{instance}})"
STRAGGLER_COLORS = thresholds((None, "green"), (1.2, "orange"), (STRAGGLER_THRESHOLD, "red"))
AGE_COLORS = thresholds((None, "green"), (60, "orange"), (HUNG_AFTER_S, "red"))


def ranks(grid: Grid) -> list[dict[str, Any]]:
    """Who reports, who is slow and why, who stopped stepping: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Cluster: the ranks of a run side by side", grid.header())]
    panels += [
        panel(
            "stat",
            "Ranks reporting / world size",
            "Ranks of the run whose endpoint answers (run:openlora_ranks_reporting:count) against the world size "
            "the ranks report (run:openlora_world_size:max). Fewer reporting than the world size for 5 minutes "
            "fires OpenloraRanksMissing.",
            "short",
            [
                target(f"run:openlora_ranks_reporting:count{{{RUN_ONLY}}}", "reporting {{openlora_run_id}}"),
                target(f"run:openlora_world_size:max{{{RUN_ONLY}}}", "world size {{openlora_run_id}}"),
            ],
            at=grid.cell(6, 4),
        ),
        panel(
            "stat",
            "Total tokens/s",
            "Tokens per second of the whole run, all ranks summed (run:openlora_training_throughput_tokens_per_second:sum).",
            "short",
            [
                target(
                    f"run:openlora_training_throughput_tokens_per_second:sum{{{RUN_ONLY}}}",
                    "{{openlora_run_id}}",
                )
            ],
            at=grid.cell(6, 4),
        ),
        panel(
            "stat",
            "Worst straggler ratio",
            f"The highest rank straggler ratio of the run: that rank's mean step time / the median of the "
            f"other ranks' (rank:openlora_training_straggler_ratio:2m, whose baseline is the median of the ranks "
            f"less the slowest). 1 is a typical rank; above {STRAGGLER_THRESHOLD} for 3 minutes fires "
            f"OpenloraRankStraggling.",
            "none",
            [
                target(
                    f"max by (openlora_run_id) (rank:openlora_training_straggler_ratio:2m{{{RANK_SEL}}})",
                    "{{openlora_run_id}}",
                )
            ],
            at=grid.cell(6, 4),
            defaults={"decimals": 2, "thresholds": STRAGGLER_COLORS},
        ),
        panel(
            "stat",
            "Oldest last step",
            "Seconds since the rank that stepped longest ago took its latest optimizer step "
            "(rank:openlora_training_last_step_age_seconds). A hung rank grows here within one scrape.",
            "s",
            [
                target(
                    f"max by (openlora_run_id) (rank:openlora_training_last_step_age_seconds{{{RANK_SEL}}})",
                    "{{openlora_run_id}}",
                )
            ],
            at=grid.cell(6, 4),
            defaults={"thresholds": AGE_COLORS},
        ),
    ]
    panels += [
        panel(
            "bargauge",
            "Step time per rank, slowest first",
            "Mean optimizer step time of each rank over 2 minutes (rank:openlora_training_step_duration_seconds:mean2m), "
            "slowest at the top.",
            "s",
            [
                target(
                    f"sort_desc(rank:openlora_training_step_duration_seconds:mean2m{{{RANK_SEL}}})",
                    RANK_LEGEND,
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "bargauge",
            "Straggler ratio per rank, highest first",
            f"Each rank's mean step time / the median of the run's ranks less the slowest "
            f"(rank:openlora_training_straggler_ratio:2m; for the slowest rank, the median of the others); red "
            f"above {STRAGGLER_THRESHOLD}, where OpenloraRankStraggling fires after 3 minutes.",
            "none",
            [
                target(
                    f"sort_desc(rank:openlora_training_straggler_ratio:2m{{{RANK_SEL}}})",
                    RANK_LEGEND,
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"decimals": 2, "min": 0, "thresholds": STRAGGLER_COLORS},
        ),
        panel(
            "bargauge",
            "Last step age per rank, oldest first",
            "Seconds since each rank's latest optimizer step (rank:openlora_training_last_step_age_seconds); red "
            "past 5 minutes, where OpenloraRankHung fires if other ranks still step.",
            "s",
            [
                target(
                    f"sort_desc(rank:openlora_training_last_step_age_seconds{{{RANK_SEL}}})",
                    RANK_LEGEND,
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0, "thresholds": AGE_COLORS},
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "Step time per rank, the run's median and max",
            "Mean step time per rank over 2 minutes (rank:openlora_training_step_duration_seconds:mean2m) "
            "and the run's median and slowest rank (run:openlora_training_step_duration_seconds:median2m, "
            "run:openlora_training_step_duration_seconds:max2m).",
            "s",
            [
                target(f"rank:openlora_training_step_duration_seconds:mean2m{{{RANK_SEL}}}", RANK_LEGEND),
                target(
                    f"run:openlora_training_step_duration_seconds:median2m{{{RUN_ONLY}}}",
                    "median {{openlora_run_id}}",
                ),
                target(
                    f"run:openlora_training_step_duration_seconds:max2m{{{RUN_ONLY}}}",
                    "max {{openlora_run_id}}",
                ),
            ],
            at=grid.cell(12, 8),
        ),
        panel(
            "timeseries",
            "Straggler ratio per rank",
            f"Each rank's mean step time / the median of the run's ranks less the slowest, over time "
            f"(rank:openlora_training_straggler_ratio:2m); the line is the alert threshold {STRAGGLER_THRESHOLD}.",
            "none",
            [target(f"rank:openlora_training_straggler_ratio:2m{{{RANK_SEL}}}", RANK_LEGEND)],
            at=grid.cell(12, 8),
            defaults={
                "min": 0,
                "thresholds": thresholds((None, "green"), (STRAGGLER_THRESHOLD, "red")),
                "custom": {"thresholdsStyle": {"mode": "line"}},
            },
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "GPU utilization per node",
            "Mean utilization of the GPUs each node's ranks report, per host (hw.gpu.utilization, hw_gpu_task=general: "
            "hw_gpu_utilization pulled, hw_gpu_utilization_ratio through the collector; host_name from target_info).",
            "percentunit",
            [
                target(
                    'avg by (openlora_run_id, host_name) ({__name__=~"hw_gpu_utilization(_ratio)?", '
                    f'hw_gpu_task="general", job=~"$job"}}'
                    f" * on (job, instance) group_left (openlora_run_id, host_name) target_info{{{RUN_ONLY}}})",
                    "{{host_name}}",
                )
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0, "max": 1},
        ),
        panel(
            "timeseries",
            "Tokens/s: run total and per rank",
            "Tokens per second of the run (run:openlora_training_throughput_tokens_per_second:sum) and of each rank "
            "(openlora_training_throughput_tokens_per_second joined with target_info for the rank).",
            "short",
            [
                target(
                    f"run:openlora_training_throughput_tokens_per_second:sum{{{RUN_ONLY}}}",
                    "total {{openlora_run_id}}",
                ),
                target(
                    'openlora_training_throughput_tokens_per_second{job=~"$job"}'
                    f" * on (job, instance) group_left (openlora_run_id, openlora_rank) target_info{{{RUN_ONLY}}}",
                    RANK_LEGEND,
                ),
            ],
            at=grid.cell(12, 8),
        ),
    ]
    # An input-bound rank is a classic straggler: its own loader or storage is slow, and under
    # synchronous data parallelism every other rank waits for it.
    panels += [
        panel(
            "bargauge",
            "Data-wait fraction per rank, highest first",
            "Share of each rank's wall time spent waiting for its batches, averaged over 2 minutes "
            "(rank:openlora_training_data_wait_fraction:avg2m); red above "
            f"{INPUT_BOUND_THRESHOLD:g}, where OpenloraInputBound fires after 10 minutes. A straggler with a "
            "high fraction is slow at loading data, not at computing.",
            "percentunit",
            [
                target(
                    f"sort_desc(rank:openlora_training_data_wait_fraction:avg2m{{{RANK_SEL}}})",
                    RANK_LEGEND,
                    instant=True,
                )
            ],
            at=grid.cell(12, 8),
            defaults={
                "min": 0,
                "max": 1,
                "thresholds": thresholds((None, "green"), (INPUT_BOUND_THRESHOLD, "red")),
            },
        ),
        panel(
            "bargauge",
            "MFU per rank, lowest first",
            "Model FLOPs utilization of each rank, averaged over 2 minutes "
            "(rank:openlora_training_model_flops_utilization:avg2m): achieved model FLOP/s over its device's "
            "peak. Absent for ranks without a known peak (CPU without OPENLORA_PEAK_FLOPS) or without "
            "set_model_flops().",
            "percentunit",
            [
                target(
                    f"sort(rank:openlora_training_model_flops_utilization:avg2m{{{RANK_SEL}}})",
                    RANK_LEGEND,
                    instant=True,
                )
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
    ]
    return panels


# A straggler with a low data wait is slow at computing: its GPU may be held down or failing.
# The raw GPU series stay with the training dashboard; these records are one value per rank.
def gpus_behind_ranks(grid: Grid) -> list[dict[str, Any]]:
    """Each rank's GPUs, worst first: status, XID errors, throttling: the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("GPUs behind the ranks", grid.header())]
    panels += [
        panel(
            "bargauge",
            "Worst GPU status per rank, worst first",
            "The worst hw.status of each rank's GPUs (rank:openlora_gpu_status:max): ok, degraded (a bad-GPU "
            "XID, a pending row remap, a reset the driver asks for) or failed (lost by NVML, XID 79, a failed "
            "row remap, a reboot the driver asks for). The training dashboard's GPU health row says which GPU "
            "and why; alerts OpenloraGpuDegraded and OpenloraGpuFailed.",
            "none",
            [target(f"sort_desc(rank:openlora_gpu_status:max{{{RANK_SEL}}})", RANK_LEGEND, instant=True)],
            at=grid.cell(8, 8),
            defaults={
                "min": 0,
                "max": 2,
                "mappings": GPU_STATE_MAPPINGS,
                "thresholds": GPU_STATE_THRESHOLDS,
            },
        ),
        panel(
            "bargauge",
            "XID errors per rank, most first",
            "XID errors the driver reported for each rank's GPUs since its process started watching "
            "(rank:openlora_gpu_xid_errors:sum); a rank appears with its first. Which codes: the training "
            "dashboard's XID panel (79 and the bad-GPU codes alert, the program's own do not).",
            "short",
            [target(f"sort_desc(rank:openlora_gpu_xid_errors:sum{{{RANK_SEL}}})", RANK_LEGEND, instant=True)],
            at=grid.cell(8, 8),
            defaults={"min": 0, "decimals": 0},
        ),
        panel(
            "timeseries",
            "GPU throttled time per rank",
            "Per throttle reason, the largest share of time one of each rank's GPUs had its clock held down, "
            "over 2 minutes (rank:openlora_gpu_throttle:ratio2m). Reasons overlap. A straggler throttled "
            "for power or heat is slow at computing: check its cooling and power cap.",
            "percentunit",
            [
                target(
                    f"rank:openlora_gpu_throttle:ratio2m{{{RANK_SEL}}}",
                    "rank {{openlora_rank}} {{openlora_gpu_throttle_reason}} ({{instance}})",
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0, "max": 1},
        ),
    ]
    return panels


def build() -> dict[str, Any]:
    """The cluster dashboard: the ranks of the selected run side by side."""
    grid = Grid()
    panels = [*ranks(grid), *gpus_behind_ranks(grid)]
    templating = [
        DATASOURCE_VARIABLE,
        variable("job", "Job", "label_values(target_info, job)"),
        RUN_VARIABLE,
    ]
    return dashboard(
        "openlora-cluster",
        "openlora-otel: cluster",
        "The ranks of a distributed openlora-otel run side by side: who reports, who is slow, "
        "who stopped stepping. Reads the openlora-ranks recording rules.",
        ["openlora", "training", "distributed"],
        templating,
        panels,
    )

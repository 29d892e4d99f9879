"""The training dashboard (grafana/dashboards/openlora-training.json): LoRA fine-tuning runs, one
or several side by side, per rank: the run's progress, its training metrics, input and compute,
evaluation and divergence; the GPU and host rows are in training_hardware.py.
"""

from __future__ import annotations

from typing import Any

from .common import (
    BY_RUN,
    DATASOURCE_VARIABLE,
    HPARAM_VARIABLE,
    INPUT_BOUND_THRESHOLD,
    LEGEND,
    RUN,
    RUN_LEGEND,
    RUN_VARIABLE,
    SEL,
    dashboard,
    histogram_quantile,
    panel,
    row,
    target,
    thresholds,
    variable,
)
from .layout import Grid
from .training_hardware import gpu, gpu_activity, gpu_health, host


def input_and_compute(grid: Grid) -> list[dict[str, Any]]:
    """Is the run waiting for its data, and how much of the device's peak does it use: the row, next on the grid."""
    legend = LEGEND
    panels: list[dict[str, Any]] = [row("Input and compute", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Data-wait fraction",
            "Share of wall time spent waiting for batches over each collection window "
            "(openlora_training_data_wait_fraction: the data_time_s given to record_step over the time between "
            f"steps), 0 to 1. The line is {INPUT_BOUND_THRESHOLD:g}: averaged above it over 5 minutes, for 10 "
            "minutes while steps advance, OpenloraInputBound fires.",
            "percentunit",
            [target(f"openlora_training_data_wait_fraction{{{SEL}}}{RUN}", legend)],
            at=grid.cell(6, 8),
            defaults={
                "min": 0,
                "max": 1,
                "thresholds": thresholds((None, "green"), (INPUT_BOUND_THRESHOLD, "red")),
                "custom": {"thresholdsStyle": {"mode": "line"}},
            },
        ),
        panel(
            "timeseries",
            "Data wait per step",
            "Mean time a step waited for its batch over each collection window "
            "(openlora_training_data_wait_duration_seconds): compare it with the step time quantiles.",
            "s",
            [target(f"openlora_training_data_wait_duration_seconds{{{SEL}}}{RUN}", legend)],
            at=grid.cell(6, 8),
        ),
        panel(
            "timeseries",
            "Model FLOP/s: achieved and peak",
            "Achieved model FLOP/s, tokens per second times the model's training FLOPs per token "
            "(openlora_training_throughput_flops_per_second; present once set_model_flops() was called, which "
            "the framework callbacks do), and the peak of the process's device it is measured against "
            "(openlora_training_peak_flops_per_second: OPENLORA_PEAK_FLOPS, else the datasheet table).",
            "flops",
            [
                target(f"openlora_training_throughput_flops_per_second{{{SEL}}}{RUN}", f"achieved {legend}"),
                target(f"openlora_training_peak_flops_per_second{{{SEL}}}{RUN}", f"peak {legend}"),
            ],
            at=grid.cell(6, 8),
        ),
        panel(
            "timeseries",
            "MFU (model FLOPs utilization)",
            "Achieved model FLOP/s over the device's peak (openlora_training_model_flops_utilization), 0 to 1. "
            "Absent where no peak is known: on CPU, and on GPUs the datasheet table does not list, unless "
            "OPENLORA_PEAK_FLOPS gives the peak; absent too until set_model_flops() was called.",
            "percentunit",
            [target(f"openlora_training_model_flops_utilization{{{SEL}}}{RUN}", legend)],
            at=grid.cell(6, 8),
            defaults={"min": 0},
        ),
    ]
    return panels


def evaluation_and_divergence(grid: Grid) -> list[dict[str, Any]]:
    """Evaluation metrics beyond the loss, non-finite evaluations, divergence guard trips: the row, next on the grid."""
    legend = LEGEND
    panels: list[dict[str, Any]] = [row("Evaluation and divergence", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Evaluation metrics",
            "The latest value of each evaluation metric besides the loss (perplexity, accuracy, ...), one series "
            "per openlora_eval_metric (openlora_training_eval_value). A NaN or infinite value cannot be exported: "
            "its series has a gap, and the non-finite panel counts it.",
            "none",
            [target(f"openlora_training_eval_value{{{SEL}}}{RUN}", "{{openlora_eval_metric}} " + legend)],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Non-finite evaluations",
            "Evaluation values that were NaN or infinite since the process started, per openlora_eval_metric "
            "(loss for the eval loss; openlora_training_eval_nonfinite_total). The series appears with the first "
            "one; OpenloraEvalNonFinite fires on it.",
            "short",
            [
                target(
                    f"openlora_training_eval_nonfinite_total{{{SEL}}}{RUN}",
                    "{{openlora_eval_metric}} " + legend,
                )
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Divergence guard trips",
            "Times the divergence guard tripped since the process started, per openlora_guard_reason "
            "(nonfinite_loss, loss_spike; openlora_training_guard_trips_total, at 0 from attach_guard()). "
            "A trip stops the run under the framework callbacks; OpenloraDivergenceGuardTripped fires on it.",
            "short",
            [
                target(
                    f"openlora_training_guard_trips_total{{{SEL}}}{RUN}",
                    "{{openlora_guard_reason}} " + legend,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
    ]
    return panels


# The openlora-energy records (openlora_otel/rules/openlora.yml): each GPU's energy counter split among
# the training ranks that report it by their share of its tokens. They carry the run id (not its name:
# run:openlora_run:name adds it) and, per rank, job and instance.
ENERGY_SEL = f'{SEL}, openlora_run_id=~"$run"'
RUN_ENERGY_SEL = 'openlora_run_id=~"$run"'
RUN_NAME = " * on (openlora_run_id) group_left (openlora_run_name) run:openlora_run:name"
ENERGY_RUN_LEGEND = "{{openlora_run_name}}"
ENERGY_RANK_LEGEND = "{{openlora_run_name}} rank {{openlora_rank}} {{instance}}"


def energy(grid: Grid) -> list[dict[str, Any]]:
    """The GPUs' energy per run: its total, per training token, per optimizer step, its power: the row,
    next on the grid."""
    panels: list[dict[str, Any]] = [row("Energy", grid.header())]
    counter, share = "rank_gpu:hw_energy_joules_total:by_run", "rank_gpu:openlora_training_energy:share2m"
    over_range = f"{{{ENERGY_SEL}, hw_id=~\"$gpu\"}}[$__range]"
    increase = f"(max_over_time({counter}{over_range}) - min_over_time({counter}{over_range}))"
    kwh = (
        f"sum by (openlora_run_id) ({increase} * on (job, instance, hw_id, openlora_run_id) group_left () "
        f"avg_over_time({share}{over_range})) / 3.6e6{RUN_NAME}"
    )
    panels += [
        panel(
            "stat",
            "Run energy (kWh)",
            f"Energy of each run's GPUs over the time range (the whole run when the range covers it), in kWh: "
            f"per GPU the rise of its energy counter from the range's first to its last sample ({counter}: "
            f"hw_energy_joules_total with the rank's run) times the rank's average share of it ({share}: its share "
            "of the tokens trained on that GPU; 1 for a GPU the rank has to itself), summed. NVML counts the "
            "whole GPU, idle power included; the Energy section of the docs' GPU metrics page has the method and its limits.",
            "kwatth",
            [target(kwh, ENERGY_RUN_LEGEND, instant=True)],
            at=grid.cell(6, 6),
            defaults={"decimals": 3},
        ),
        panel(
            "timeseries",
            "Energy per training token",
            "Joules per training token over 2 minutes, per run (run:openlora_training_energy_per_token_joules:2m: "
            "the run's GPU energy / all its ranks' tokens) and per rank "
            "(rank:openlora_training_energy_per_token_joules:2m). None while no token is processed.",
            "joule",
            [
                target(
                    f"run:openlora_training_energy_per_token_joules:2m{{{RUN_ENERGY_SEL}}}{RUN_NAME}",
                    ENERGY_RUN_LEGEND,
                ),
                target(
                    f"rank:openlora_training_energy_per_token_joules:2m{{{ENERGY_SEL}}}{RUN_NAME}",
                    ENERGY_RANK_LEGEND,
                ),
            ],
            at=grid.cell(6, 6),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Energy per optimizer step",
            "Joules per optimizer step over 2 minutes, per run (run:openlora_training_energy_per_step_joules:2m: "
            "all ranks' GPU energy / the run's steps, which every rank takes) and per rank "
            "(rank:openlora_training_energy_per_step_joules:2m: that rank's part).",
            "joule",
            [
                target(
                    f"run:openlora_training_energy_per_step_joules:2m{{{RUN_ENERGY_SEL}}}{RUN_NAME}",
                    ENERGY_RUN_LEGEND,
                ),
                target(
                    f"rank:openlora_training_energy_per_step_joules:2m{{{ENERGY_SEL}}}{RUN_NAME}",
                    ENERGY_RANK_LEGEND,
                ),
            ],
            at=grid.cell(6, 6),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Run power",
            "Average power of each run's share of its GPUs over 2 minutes (run:openlora_training_energy_joules:rate2m) "
            "and of each rank's (rank:openlora_training_energy_joules:rate2m), from the energy counters.",
            "watt",
            [
                target(f"run:openlora_training_energy_joules:rate2m{{{RUN_ENERGY_SEL}}}{RUN_NAME}", ENERGY_RUN_LEGEND),
                target(f"rank:openlora_training_energy_joules:rate2m{{{ENERGY_SEL}}}{RUN_NAME}", ENERGY_RANK_LEGEND),
            ],
            at=grid.cell(6, 6),
            defaults={"min": 0},
        ),
    ]
    return panels


def run_overview(grid: Grid) -> list[dict[str, Any]]:
    """Where each selected run stands: one stat per run and quantity, the row, next on the grid."""
    panels: list[dict[str, Any]] = [row("Run overview", grid.header())]
    stats = [
        (
            "Optimizer steps",
            "Optimizer steps taken, per run (openlora_training_steps_total).",
            "short",
            f"sum by ({BY_RUN}) (openlora_training_steps_total{{{SEL}}}{RUN})",
        ),
        (
            "Tokens",
            "Training tokens processed, per run (openlora_training_tokens_total).",
            "short",
            f"sum by ({BY_RUN}) (openlora_training_tokens_total{{{SEL}}}{RUN})",
        ),
        (
            "Loss",
            "Mean training loss of the latest window per run, averaged over its ranks (openlora_training_loss).",
            "none",
            f"avg by ({BY_RUN}) (openlora_training_loss{{{SEL}}}{RUN})",
        ),
        (
            "Tokens/s",
            "Tokens per second over the latest window per run, summed over its ranks "
            "(openlora_training_throughput_tokens_per_second).",
            "short",
            f"sum by ({BY_RUN}) (openlora_training_throughput_tokens_per_second{{{SEL}}}{RUN})",
        ),
        (
            "Non-finite losses",
            "Steps whose loss was NaN or infinite, per run (openlora_training_loss_nonfinite_total).",
            "short",
            f"sum by ({BY_RUN}) (openlora_training_loss_nonfinite_total{{{SEL}}}{RUN})",
        ),
        (
            "Trainable fraction",
            "LoRA trainable parameters / all parameters, per run (openlora_adapter_trainable_ratio).",
            "percentunit",
            f"max by ({BY_RUN}) (openlora_adapter_trainable_ratio{{{SEL}}}{RUN})",
        ),
    ]
    for title, description, unit, expr in stats:
        panels.append(
            panel("stat", title, description, unit, [target(expr, RUN_LEGEND)], at=grid.cell(4, 4))
        )
    return panels


def training_metrics(grid: Grid) -> list[dict[str, Any]]:
    """Loss, gradient norm, learning rate, step time, throughput, the adapter: the row, next on the grid."""
    legend = LEGEND
    panels: list[dict[str, Any]] = [row("Training", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Loss: window mean, max and min; eval loss",
            "Training loss over each collection window: the mean (openlora_training_loss), the largest and the "
            "smallest step (openlora_training_loss_max, openlora_training_loss_min), so that a one-step spike shows "
            "at its full height, not averaged away; and the latest evaluation loss (openlora_training_eval_loss).",
            "none",
            [
                target(f"openlora_training_loss{{{SEL}}}{RUN}", f"mean {legend}"),
                target(f"openlora_training_loss_max{{{SEL}}}{RUN}", f"max {legend}"),
                target(f"openlora_training_loss_min{{{SEL}}}{RUN}", f"min {legend}"),
                target(f"openlora_training_eval_loss{{{SEL}}}{RUN}", f"eval {legend}"),
            ],
            at=grid.cell(12, 8),
        ),
        panel(
            "timeseries",
            "Gradient norm: window mean and max",
            "Gradient norm over each collection window: the mean (openlora_training_gradient_norm) and the largest "
            "step (openlora_training_gradient_norm_max): a single exploding step shows in full.",
            "none",
            [
                target(f"openlora_training_gradient_norm{{{SEL}}}{RUN}", f"mean {legend}"),
                target(f"openlora_training_gradient_norm_max{{{SEL}}}{RUN}", f"max {legend}"),
            ],
            at=grid.cell(12, 8),
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "Learning rate",
            "Learning rate of the latest step (openlora_training_learning_rate).",
            "none",
            [target(f"openlora_training_learning_rate{{{SEL}}}{RUN}", legend)],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Step time quantiles",
            "p50 / p90 / p99 of the optimizer step's wall time, from the histogram openlora_training_step_duration_seconds.",
            "s",
            [
                target(
                    histogram_quantile(
                        q,
                        "openlora_training_step_duration_seconds",
                        ("job", "instance"),
                        lambda series: f"rate({series}{{{SEL}}}[$__rate_interval])",
                    )
                    + RUN,
                    f"p{int(q * 100)} {legend}",
                )
                for q in (0.5, 0.9, 0.99)
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Throughput",
            "Tokens and samples per second over each collection window (openlora_training_throughput_tokens_per_second, openlora_training_throughput_samples_per_second).",
            "short",
            [
                target(f"openlora_training_throughput_tokens_per_second{{{SEL}}}{RUN}", f"tokens/s {legend}"),
                target(
                    f"openlora_training_throughput_samples_per_second{{{SEL}}}{RUN}", f"samples/s {legend}"
                ),
            ],
            at=grid.cell(8, 8),
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "Non-finite values",
            "Steps with a NaN or infinite loss or gradient norm, per rate interval (openlora_training_loss_nonfinite_total, openlora_training_gradient_norm_nonfinite_total).",
            "short",
            [
                target(
                    f"increase(openlora_training_loss_nonfinite_total{{{SEL}}}[$__rate_interval]){RUN}",
                    f"loss {legend}",
                ),
                target(
                    f"increase(openlora_training_gradient_norm_nonfinite_total{{{SEL}}}[$__rate_interval]){RUN}",
                    f"grad norm {legend}",
                ),
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Steps per second",
            "Optimizer steps per second (rate of openlora_training_steps_total) and the epoch (openlora_training_epoch).",
            "short",
            [
                target(
                    f"rate(openlora_training_steps_total{{{SEL}}}[$__rate_interval]){RUN}",
                    f"steps/s {legend}",
                ),
                target(f"openlora_training_epoch{{{SEL}}}{RUN}", f"epoch {legend}"),
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "table",
            "Adapter and model",
            "The LoRA adapter: rank, alpha, dropout, targeted modules, trainable and total parameters (openlora_adapter_rank, openlora_adapter_alpha, openlora_adapter_dropout, openlora_adapter_target_modules, openlora_adapter_parameters_trainable, openlora_model_parameters), and the model's training FLOPs per token (openlora_model_flops_per_token, once set_model_flops() was called).",
            "short",
            [
                target(f"{name}{{{SEL}}}{RUN}", name.removeprefix("openlora_"), format="table", instant=True)
                for name in (
                    "openlora_adapter_rank",
                    "openlora_adapter_alpha",
                    "openlora_adapter_dropout",
                    "openlora_adapter_target_modules",
                    "openlora_adapter_parameters_trainable",
                    "openlora_model_parameters",
                    "openlora_model_flops_per_token",
                )
            ],
            at=grid.cell(8, 8),
            transformations=[{"id": "merge", "options": {}}],
        ),
    ]
    return panels


def where_the_time_went(grid: Grid) -> list[dict[str, Any]]:
    """Goodput: each run's wall time by cause (openlora_training_time_seconds_total by
    openlora_training_phase), its productive share, the steps restarts made it do again: the row, next
    on the grid."""
    panels: list[dict[str, Any]] = [row("Where the time went", grid.header())]
    time = f"attempt:openlora_training_time_seconds_total:by_run{{{ENERGY_SEL}}}"
    rate = f"sum by (openlora_run_id, openlora_training_phase) (rate({time}[$__rate_interval]))"
    share = f"{rate} / on (openlora_run_id) group_left () sum by (openlora_run_id) ({rate})"
    # Each attempt's rise over the range (its counter never resets), as the Energy row does it.
    series = f"attempt:openlora_training_time_seconds_total:by_run{{{ENERGY_SEL}{{phase}}}}[$__range]"
    over_range = f"sum by (openlora_run_id) (max_over_time({series}) - min_over_time({series}))"
    productive = over_range.replace("{phase}", ', openlora_training_phase="productive"')
    everything = over_range.replace("{phase}", "")
    goodput_steps = thresholds((None, "red"), (0.5, "yellow"), (0.8, "green"))
    panels += [
        panel(
            "timeseries",
            "Time by cause",
            "Share of each run's wall time (all ranks and attempts) in each phase of openlora_training_time_seconds_total "
            "(attempt:openlora_training_time_seconds_total:by_run: the counter with the run and attempt): productive "
            "is goodput; startup, data_wait, evaluation, checkpoint_save, checkpoint_load, lost_progress (steps "
            "redone after a restart) and idle (a stall, the time after the last step) are badput. The "
            "OpenloraLowGoodput section of the docs' Alert runbooks page says what to do about each.",
            "percentunit",
            [target(f"({share}){RUN_NAME}", "{{openlora_run_name}} {{openlora_training_phase}}")],
            at=grid.cell(8, 8),
            defaults={"min": 0, "max": 1, "custom": {"stacking": {"mode": "normal"}, "fillOpacity": 60}},
        ),
        panel(
            "stat",
            "Goodput over the range",
            "Productive share of each run's wall time over the time range (the whole run when the range covers "
            "it), all ranks and attempts: the rise of openlora_training_time_seconds_total{openlora_training_phase="
            '"productive"} / the rise of all its phases, each attempt\'s from its first to its last sample in the '
            "range (attempt:openlora_training_time_seconds_total:by_run).",
            "percentunit",
            [target(f"({productive} / ({everything} > 0)){RUN_NAME}", ENERGY_RUN_LEGEND, instant=True)],
            at=grid.cell(4, 8),
            defaults={
                "min": 0,
                "max": 1,
                "decimals": 1,
                "thresholds": goodput_steps,
                "color": {"mode": "thresholds"},
            },
        ),
        panel(
            "timeseries",
            "Goodput, last hour",
            "Productive share of each run's time over the hour before each point (run:openlora_training_goodput:ratio1h, "
            "all ranks and attempts). OpenloraLowGoodput fires under 50% for 15 minutes while the run reports.",
            "percentunit",
            [
                target(
                    f"run:openlora_training_goodput:ratio1h{{{RUN_ENERGY_SEL}}}{RUN_NAME}", ENERGY_RUN_LEGEND
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0, "max": 1, "thresholds": goodput_steps},
        ),
        panel(
            "bargauge",
            "Steps lost per attempt",
            "Steps each attempt of a run did again because it resumed from a checkpoint older than the step an "
            "earlier attempt reached (openlora_training_steps_lost_total, counted from 0 by each attempt; "
            "attempt:openlora_training_steps_lost_total:by_run carries the attempt): the most of one rank per "
            "attempt, every rank redoes the same steps. The run's total over the last hour is "
            "run:openlora_training_steps_lost:increase1h.",
            "none",
            [
                target(
                    "max by (openlora_run_id, openlora_run_attempt) (max_over_time("
                    f"attempt:openlora_training_steps_lost_total:by_run{{{ENERGY_SEL}}}[$__range])){RUN_NAME}",
                    "{{openlora_run_name}} attempt {{openlora_run_attempt}}",
                    instant=True,
                ),
                target(
                    f"run:openlora_training_steps_lost:increase1h{{{RUN_ENERGY_SEL}}}{RUN_NAME}",
                    "{{openlora_run_name}} last hour",
                    instant=True,
                ),
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0, "decimals": 0},
        ),
    ]
    return panels


def build() -> dict[str, Any]:
    """The training dashboard: one run or several, each rank's training, GPUs and host."""
    grid = Grid()
    gpu_legend = LEGEND + " {{hw_id}}"
    panels = [
        *run_overview(grid),
        *training_metrics(grid),
        *input_and_compute(grid),
        *evaluation_and_divergence(grid),
        *where_the_time_went(grid),
        *gpu(grid, gpu_legend),
        *energy(grid),
        *gpu_activity(grid, gpu_legend),
        *gpu_health(grid, gpu_legend),
        *host(grid),
    ]
    templating = [
        DATASOURCE_VARIABLE,
        variable("job", "Job", "label_values(target_info, job)"),
        RUN_VARIABLE,
        HPARAM_VARIABLE,
        variable(
            "instance",
            "Rank / instance",
            'label_values(target_info{job=~"$job", openlora_run_id=~"$run"}, instance)',
        ),
        variable(
            "gpu", "GPU", 'label_values(hw_gpu_memory_limit_bytes{job=~"$job", instance=~"$instance"}, hw_id)'
        ),
    ]
    return dashboard(
        "openlora-training",
        "openlora-otel: training and GPUs",
        "LoRA fine-tuning runs reported by openlora-otel, on the pull path or through the OpenTelemetry Collector.",
        ["openlora", "training", "gpu"],
        templating,
        panels,
    )

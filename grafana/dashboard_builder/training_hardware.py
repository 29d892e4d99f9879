"""The training dashboard's hardware rows: each GPU (utilization, memory, power, clocks), what its
units and links do, its health (the openlora-gpu alerts' inputs), and the host and process.
"""

from __future__ import annotations

from typing import Any

from .common import (
    GPU,
    GPU_STATE_MAPPINGS,
    GPU_STATE_THRESHOLDS,
    GPU_STATES,
    LEGEND,
    RUN,
    SEL,
    panel,
    row,
    target,
)
from .layout import Grid


def gpu(grid: Grid, gpu_legend: str) -> list[dict[str, Any]]:
    """Utilization, memory, power, temperature, ECC, clocks of each GPU: the row, next on the grid."""
    legend = LEGEND
    panels: list[dict[str, Any]] = [row("GPU", grid.header())]
    panels += [
        panel(
            "timeseries",
            "GPU utilization",
            "Fraction of time each GPU was busy (hw.gpu.utilization, hw_gpu_task=general: hw_gpu_utilization pulled, hw_gpu_utilization_ratio through the collector).",
            "percentunit",
            [
                target(
                    f'{{__name__=~"hw_gpu_utilization(_ratio)?", hw_gpu_task="general", {GPU}}}{RUN}',
                    gpu_legend,
                )
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "GPU memory used vs limit",
            "Memory in use and in total per GPU, all processes (hw_gpu_memory_usage_bytes, hw_gpu_memory_limit_bytes).",
            "bytes",
            [
                target(f"hw_gpu_memory_usage_bytes{{{GPU}}}{RUN}", f"used {gpu_legend}"),
                target(f"hw_gpu_memory_limit_bytes{{{GPU}}}{RUN}", f"limit {gpu_legend}"),
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "torch allocator",
            "The caching allocator of this process: allocated, reserved and peak bytes (openlora_torch_memory_allocated_bytes, openlora_torch_memory_reserved_bytes, openlora_torch_memory_peak_bytes).",
            "bytes",
            [
                target(f"openlora_torch_memory_allocated_bytes{{{GPU}}}{RUN}", f"allocated {gpu_legend}"),
                target(f"openlora_torch_memory_reserved_bytes{{{GPU}}}{RUN}", f"reserved {gpu_legend}"),
                target(f"openlora_torch_memory_peak_bytes{{{GPU}}}{RUN}", f"peak {gpu_legend}"),
            ],
            at=grid.cell(8, 8),
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "Power and energy",
            "Power draw per GPU (hw_power_watts) and average power from the energy counter (rate of hw_energy_joules_total).",
            "watt",
            [
                target(f'hw_power_watts{{hw_type="gpu", {GPU}}}{RUN}', f"power {gpu_legend}"),
                target(
                    f'rate(hw_energy_joules_total{{hw_type="gpu", {GPU}}}[$__rate_interval]){RUN}',
                    f"from energy {gpu_legend}",
                ),
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Temperature",
            "GPU core temperature (hw_temperature_celsius: a temperature sensor's series, no hw_type under the "
            "conventions; openlora_gpu_index tells the GPUs' sensors from others).",
            "celsius",
            [target(f'hw_temperature_celsius{{openlora_gpu_index!="", {GPU}}}{RUN}', gpu_legend)],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "ECC errors",
            "ECC memory errors per rate interval, corrected and uncorrected (hw_errors_total, hw_type=gpu, error_type corrected or uncorrected; the PCIe link errors, openlora_gpu_pcie_errors_total, are in the GPU health row).",
            "short",
            [
                target(
                    f'increase(hw_errors_total{{hw_type="gpu", error_type=~"corrected|uncorrected", {GPU}}}[$__rate_interval]){RUN}',
                    "{{error_type}} " + gpu_legend,
                )
            ],
            at=grid.cell(8, 8),
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "SM clock",
            "Current SM clock per GPU (openlora_gpu_clock_sm_hertz).",
            "hertz",
            [target(f"openlora_gpu_clock_sm_hertz{{{GPU}}}{RUN}", gpu_legend)],
            at=grid.cell(6, 8),
        ),
        panel(
            "timeseries",
            "Clock throttled",
            "Share of time the GPU clock was held down, per reason (rate of openlora_gpu_throttle_time_seconds_total, "
            "by openlora_gpu_throttle_reason: sw_power_cap, thermal, sync_boost, hw_thermal_slowdown, "
            "hw_power_brake_slowdown). Reasons overlap in time: do not add them up. Running at the power cap "
            "under full load is usual; thermal and hw_* slowdowns are not.",
            "percentunit",
            [
                target(
                    f"rate(openlora_gpu_throttle_time_seconds_total{{{GPU}}}[$__rate_interval]){RUN}",
                    "{{openlora_gpu_throttle_reason}} " + gpu_legend,
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0, "max": 1},
        ),
        panel(
            "timeseries",
            "This process's GPU memory",
            "GPU memory the driver accounts to the training process (openlora_process_gpu_memory_usage_bytes).",
            "bytes",
            [target(f"openlora_process_gpu_memory_usage_bytes{{{GPU}}}{RUN}", gpu_legend)],
            at=grid.cell(6, 8),
        ),
        panel(
            "timeseries",
            "NVML snapshot age",
            "Age of the NVML snapshot behind the GPU values; above a second means NVML was slow and older values were served (openlora_gpu_snapshot_age_seconds).",
            "s",
            [target(f"openlora_gpu_snapshot_age_seconds{{{SEL}}}{RUN}", legend)],
            at=grid.cell(6, 8),
        ),
    ]
    return panels


def gpu_activity(grid: Grid, gpu_legend: str) -> list[dict[str, Any]]:
    """The row of what the GPU's units and links do: GPM activity, PCIe and NVLink bytes per second."""
    panels: list[dict[str, Any]] = [row("GPU activity and interconnect", grid.header())]
    gpm = (
        ("openlora_gpu_sm_activity", "SM active"),
        ("openlora_gpu_sm_occupancy", "SM occupancy"),
        ("openlora_gpu_tensor_activity", "tensor active"),
        ("openlora_gpu_dram_activity", "DRAM bandwidth"),
    )
    panels += [
        panel(
            "timeseries",
            "SM, tensor and DRAM activity",
            "What the GPU's units did between two snapshots (NVML GPM, Hopper and later; absent before Hopper "
            "and on MIG instances): fraction of SMs busy (openlora_gpu_sm_activity), resident warps over the "
            "maximum (openlora_gpu_sm_occupancy), fraction of time the tensor cores were busy "
            "(openlora_gpu_tensor_activity), DRAM bandwidth used over its peak (openlora_gpu_dram_activity). "
            "Utilization says a kernel ran; these say how much of the GPU it used.",
            "percentunit",
            [target(f"{name}{{{GPU}}}{RUN}", f"{label} {gpu_legend}") for name, label in gpm],
            at=grid.cell(8, 8),
            defaults={"min": 0, "max": 1},
        ),
        panel(
            "timeseries",
            "PCIe throughput",
            "Bytes per second over PCIe per direction, transmit (GPU to host) and receive (rate of "
            "hw_gpu_io_bytes_total by network_io_direction: the link's traffic, protocol overhead included, "
            "from GPM on Hopper and later; from NVML's "
            "32-bit byte fields elsewhere, right while under 4 GiB crosses between two scrapes; absent "
            "where the driver has neither).",
            "Bps",
            [
                target(
                    f"rate(hw_gpu_io_bytes_total{{{GPU}}}[$__rate_interval]){RUN}",
                    "{{network_io_direction}} " + gpu_legend,
                )
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "NVLink throughput",
            "Data bytes per second over all NVLinks of the GPU per direction (rate of "
            "openlora_gpu_nvlink_io_bytes_total by network_io_direction; absent on GPUs without NVLink).",
            "Bps",
            [
                target(
                    f"rate(openlora_gpu_nvlink_io_bytes_total{{{GPU}}}[$__rate_interval]){RUN}",
                    "{{network_io_direction}} " + gpu_legend,
                )
            ],
            at=grid.cell(8, 8),
        ),
    ]
    return panels


def gpu_health(grid: Grid, gpu_legend: str) -> list[dict[str, Any]]:
    """The row of the GPU's health: hw.status, XID errors, row remapping, the PCIe link and its errors
    (what the openlora-gpu alerts read)."""
    panels: list[dict[str, Any]] = [row("GPU health", grid.header())]
    status = " or ".join(
        f'(hw_status{{hw_type="gpu", hw_state="{state}", {GPU}}} == 1) * {value}' for state, value, _ in GPU_STATES
    )
    panels += [
        panel(
            "state-timeline",
            "GPU status",
            "hw.status per GPU (hw_status, hw_type=gpu, the state whose series is 1): failed when NVML lost the "
            "GPU, after an XID 79 or a failed row remap, or when the driver asks for a node or system reboot; "
            "degraded after an XID that means a bad GPU, while a row remap is pending, or when the driver asks "
            "for any other recovery, a GPU or bus reset or a drain (alerts OpenloraGpuFailed, OpenloraGpuDegraded).",
            "none",
            [target(f"max without (hw_state) ({status}){RUN}", gpu_legend)],
            at=grid.cell(8, 8),
            defaults={
                "mappings": GPU_STATE_MAPPINGS,
                "color": {"mode": "thresholds"},
                "thresholds": GPU_STATE_THRESHOLDS,
            },
            options={"showValue": "auto", "mergeValues": True, "rowHeight": 0.9},
        ),
        panel(
            "timeseries",
            "XID errors",
            "XID errors the driver reported since the process started watching, per code "
            "(openlora_gpu_xid_errors_total by openlora_gpu_xid_code; a series appears with its first XID). "
            "79: the GPU fell off the bus; 48 62 64 74 92 94 95 119 120 140 143 154: a bad GPU; the others "
            "are the program's own (13, 31, 43, ...). A MIG GPU's are on the whole GPU.",
            "short",
            [
                target(
                    f"openlora_gpu_xid_errors_total{{{GPU}}}{RUN}",
                    "XID {{openlora_gpu_xid_code}} " + gpu_legend,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"custom": {"drawStyle": "line", "lineInterpolation": "stepAfter", "showPoints": "always"}},
        ),
        panel(
            "timeseries",
            "Row remapping",
            "Memory rows remapped over the GPU's life by cause (openlora_gpu_remap_rows_total by "
            "openlora_gpu_remap_cause), and 1 while a remap waits for a GPU reset (openlora_gpu_remap_pending) "
            "or once one failed (openlora_gpu_remap_failed). Ampere and later datacenter GPUs only.",
            "short",
            [
                target(
                    f"openlora_gpu_remap_rows_total{{{GPU}}}{RUN}",
                    "{{openlora_gpu_remap_cause}} rows " + gpu_legend,
                ),
                target(f"openlora_gpu_remap_pending{{{GPU}}}{RUN}", "pending " + gpu_legend),
                target(f"openlora_gpu_remap_failed{{{GPU}}}{RUN}", "failed " + gpu_legend),
            ],
            at=grid.cell(8, 8),
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "PCIe link vs maximum",
            "Lanes and generation the PCIe link runs at now (openlora_gpu_pcie_link_width, "
            "openlora_gpu_pcie_link_generation) against the most GPU and slot support together "
            "(openlora_gpu_pcie_link_width_max, openlora_gpu_pcie_link_generation_max). Fewer lanes is a "
            "fault (OpenloraGpuPcieLinkNarrow); a lower generation only under load (an idle GPU lowers it "
            "to save power; OpenloraGpuPcieLinkGenerationLow).",
            "short",
            [
                target(f"openlora_gpu_pcie_link_width{{{GPU}}}{RUN}", "width " + gpu_legend),
                target(f"openlora_gpu_pcie_link_width_max{{{GPU}}}{RUN}", "width max " + gpu_legend),
                target(f"openlora_gpu_pcie_link_generation{{{GPU}}}{RUN}", "generation " + gpu_legend),
                target(f"openlora_gpu_pcie_link_generation_max{{{GPU}}}{RUN}", "generation max " + gpu_legend),
            ],
            at=grid.cell(12, 8),
        ),
        panel(
            "timeseries",
            "PCIe errors",
            "PCIe link errors per rate interval (openlora_gpu_pcie_errors_total, error_type replay, and where the "
            "driver counts them correctable, non_fatal, fatal). Replays rising steadily mean a "
            "marginal link (OpenloraGpuPcieReplaysRising); a fatal error, a failed one.",
            "short",
            [
                target(
                    f"increase(openlora_gpu_pcie_errors_total{{{GPU}}}[$__rate_interval]){RUN}",
                    "{{error_type}} " + gpu_legend,
                )
            ],
            at=grid.cell(12, 8),
        ),
    ]
    return panels


# Whole disks only: a partition's bytes are also its disk's, and loop or RAM devices are not
# storage. Interfaces that are not the node's own links: loopback, containers' veth pairs (Calico's
# cali*, Cilium's lxc*) and bridges, traffic-shaping ifb (the host metrics leave all but loopback out). Both as in the host metrics page's queries (tests/hardware/test_host.py).
WHOLE_DISKS = 'system_device=~"(sd|vd|xvd|hd)[a-z]+|nvme[0-9]+n[0-9]+"'
NODE_LINKS = 'network_interface_name!~"lo|veth.*|cali.*|lxc.*|docker.*|br-.*|ifb.*"'


def host(grid: Grid) -> list[dict[str, Any]]:
    """Host and process metrics (openlora_otel/hardware/host.py): the row, next on the grid.

    process.* come from every process, system.* from one process per node (LOCAL_RANK 0),
    so a node's system series are under its rank-0 instance. The attribute keys are the semantic
    conventions', as labels with `_` for `.` (cpu.mode -> cpu_mode). system.cpu.utilization has
    unit 1: system_cpu_utilization pulled, system_cpu_utilization_ratio through the collector;
    only its idle mode is reported.
    """
    legend = LEGEND
    cpu = '__name__=~"system_cpu_utilization(_ratio)?"'
    panels: list[dict[str, Any]] = [row("Host", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Process CPU",
            "CPU time the training process used per second, in cores, user and system "
            "(rate of process_cpu_time_seconds_total by cpu_mode). A data-parallel rank near one core while its "
            "GPU idles is bound by Python on the host.",
            "short",
            [
                target(
                    f"sum by (job, instance, cpu_mode) (rate(process_cpu_time_seconds_total{{{SEL}}}[$__rate_interval])){RUN}",
                    "{{cpu_mode}} " + legend,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Process memory (RSS)",
            "Resident memory of the training process (process_memory_usage_bytes): host RAM, not GPU memory.",
            "bytes",
            [target(f"process_memory_usage_bytes{{{SEL}}}{RUN}", legend)],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Process disk I/O",
            "Bytes per second the training process read from and wrote to storage, page-cache hits not included "
            "(rate of process_disk_io_bytes_total by disk_io_direction): data loading and checkpoints.",
            "Bps",
            [
                target(
                    f"rate(process_disk_io_bytes_total{{{SEL}}}[$__rate_interval]){RUN}",
                    "{{disk_io_direction}} " + legend,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
    ]
    panels += [
        panel(
            "timeseries",
            "Node CPU busy",
            "Share of the node's CPU time not idle (I/O wait counts as busy), the mean over its logical CPUs and "
            "the busiest one (1 minus system.cpu.utilization with cpu_mode idle: system_cpu_utilization pulled, "
            "system_cpu_utilization_ratio through the collector). Reported by LOCAL_RANK 0 only. The mean near 1 "
            "while the GPUs idle: the loader's workers are short of CPU; one CPU pegged: a single-threaded "
            "input pipeline.",
            "percentunit",
            [
                target(
                    f'(1 - avg by (job, instance) ({{{cpu}, cpu_mode="idle", {SEL}}})){RUN}',
                    f"mean {legend}",
                ),
                target(
                    f'(1 - min by (job, instance) ({{{cpu}, cpu_mode="idle", {SEL}}})){RUN}',
                    f"busiest CPU {legend}",
                ),
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0, "max": 1},
        ),
        panel(
            "timeseries",
            "Node memory",
            "Node memory used, total minus available (system_memory_usage_bytes, system_memory_state used), "
            "and available (system_memory_linux_available_bytes, Linux): the two add up to the total. "
            "Reported by LOCAL_RANK 0 only.",
            "bytes",
            [
                target(
                    f'system_memory_usage_bytes{{system_memory_state="used", {SEL}}}{RUN}',
                    "used " + legend,
                ),
                target(f"system_memory_linux_available_bytes{{{SEL}}}{RUN}", "available " + legend),
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Node disk I/O",
            "Bytes per second read and written by the node's whole disks, sd*, vd*, xvd*, hd* and nvme*n* "
            "(partitions would count twice, loop and RAM devices are not storage; rate of "
            "system_disk_io_bytes_total by disk_io_direction). Reported by LOCAL_RANK 0 only.",
            "Bps",
            [
                target(
                    f"sum by (job, instance, disk_io_direction) (rate(system_disk_io_bytes_total{{{WHOLE_DISKS}, {SEL}}}"
                    f"[$__rate_interval])){RUN}",
                    "{{disk_io_direction}} " + legend,
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Node network I/O",
            "Bytes per second received and transmitted through the node's own interfaces, loopback, veth "
            "(cali, lxc), docker, bridge and ifb interfaces left out (rate of system_network_io_bytes_total by network_io_direction): "
            "remote data, checkpoints, NCCL's socket transport (RDMA bypasses the kernel and does not show). "
            "Reported by LOCAL_RANK 0 only.",
            "Bps",
            [
                target(
                    f"sum by (job, instance, network_io_direction) (rate(system_network_io_bytes_total{{{NODE_LINKS}, {SEL}}}"
                    f"[$__rate_interval])){RUN}",
                    "{{network_io_direction}} " + legend,
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0},
        ),
    ]
    return panels

"""Writes grafana/dashboards/openlora-training.json, openlora-cluster.json and openlora-inference.json; tests check the committed files match.

Every query filters by the template variables (job, run, instance, gpu) and
joins target_info on (job, instance) for the run id, which works the same on
the pull path and through the collector. Where the paths name a series
differently (hw.gpu.* gauges with unit 1 get _ratio through the collector), the
query matches both names with a __name__ regex.

The cluster dashboard compares the ranks of one run. It reads the recording
rules of the `openlora-ranks` group (openlora_otel/rules/openlora.yml), which
already carry openlora_run_id and openlora_rank, so its queries stay cheap on
a store holding thousands of ranks.

The inference dashboard reads a server's InferenceMetrics series, which carry the adapter as a
label; a `service` variable picks the servers, and the latency objective and error-ratio threshold
it draws are those of the `openlora-inference` alerts. A server's service name is target_info's
service_name when pulled; pushed (through a Collector or into Prometheus 3's OTLP receiver) it is
the job, and target_info has no service_name: the variable and its filter take either.

    python grafana/build_dashboard.py

Plain dicts on purpose. grafana-foundation-sdk (the 11.6 flavour, the newest with a Grafana
version; none for 12) was tried on a slice in issue 12: the panel, row and variable helpers and
the "Input and compute" row took 182 lines against 186 here, its only saving the automatic grid
layout; its JSON was ours but for defaults it adds, no variable `definition`, and no panel ids or
query refIds unless set by hand. Not worth an alpha dependency whose versions are build stamps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Loaded by path (the tests) or run as a script from any directory: dashboard_builder sits beside this file.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from dashboard_builder.layout import Grid, GridPos  # noqa: E402

DASHBOARDS = HERE / "dashboards"
OUT = DASHBOARDS / "openlora-training.json"
CLUSTER_OUT = DASHBOARDS / "openlora-cluster.json"
INFERENCE_OUT = DASHBOARDS / "openlora-inference.json"
DS = {"type": "prometheus", "uid": "${datasource}"}

# The run filter: multiplying by target_info (value 1) keeps the value, keeps only the
# selected runs' processes, and adds the run id as a label.
RUN_FILTER = ' * on (job, instance) group_left (openlora_run_id) target_info{openlora_run_id=~"$run"}'
# Then openlora_run_info (value 1, one series per process) adds the run's name and the value of
# the hyperparameter the hparam variable picks, for legends that tell runs apart. A key the run
# does not have leaves that part of its legend empty; a process without openlora_run_info at all
# (an older openlora-otel) drops out of the panels.
RUN_INFO = " * on (job, instance) group_left (openlora_run_name, openlora_hparam_$hparam) openlora_run_info"
RUN = RUN_FILTER + RUN_INFO
BY_RUN = "openlora_run_id, openlora_run_name, openlora_hparam_$hparam"
RUN_LEGEND = "{{openlora_run_name}} $hparam={{openlora_hparam_$hparam}}"
LEGEND = RUN_LEGEND + " {{instance}}"
SEL = 'job=~"$job", instance=~"$instance"'
GPU = f'{SEL}, hw_id=~"$gpu"'

def target(expr: str, legend: str, ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def panel(
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: list[dict],
    at: GridPos,
    defaults: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    for index, item in enumerate(targets):
        item["refId"] = chr(ord("A") + index)
    body: dict[str, Any] = {
        "id": 0,  # numbered by dashboard()
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": at,
        "fieldConfig": {"defaults": {"unit": unit, **(defaults or {})}, "overrides": []},
        "targets": targets,
    }
    if kind == "timeseries":
        body["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        }
    if kind == "stat":
        body["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
        }
    if kind == "bargauge":
        # One bar per series, in the order the query returns them (sort_desc: worst first).
        body["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
        }
    body.update(extra)
    return body


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    """Grafana threshold steps: the first has no lower bound (None)."""
    return {"mode": "absolute", "steps": [{"value": value, "color": color} for value, color in steps]}


def row(title: str, at: GridPos) -> dict[str, Any]:
    """A row header at ``at`` (a grid's :meth:`~dashboard_builder.layout.Grid.header`)."""
    return {
        "id": 0,  # numbered by dashboard()
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": at,
        "panels": [],
    }


def variable(
    name: str, label: str, query: str, *, regex: str = "", default: str | None = None
) -> dict[str, Any]:
    """A query variable refreshed on time range change: several values, All at first; or,
    given a default, one value."""
    body: dict[str, Any] = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-query"},
        "definition": query,
        "regex": regex,
        "refresh": 2,
        "includeAll": default is None,
        "multi": default is None,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }
    if default is None:
        body["allValue"] = ".*"
    else:
        body["current"] = {"selected": True, "text": default, "value": default}
    return body


# The runs seen in the time range, each offered by its name (openlora_run_info) with its run id
# as the value, so that the panels keep filtering target_info by id. openlora_run_info has no id:
# the join on (job, instance) is evaluated at each step of a subquery (two runs one after the
# other on the same endpoint are never joined to each other's name), and each pair's value is the
# last time it was seen: sorted newest first, a run renamed at train start (the callbacks) is
# offered by its latest name (Grafana keeps the first option of a value). A run without
# openlora_run_info (an older openlora-otel) is still offered, by its id.
def run_names(targets: str, *, by_service: bool = False) -> str:
    """The run variable's query over the target_info series that match ``targets`` (and, ``by_service``,
    the servers the service variable picks: see :func:`service_target_info`)."""
    info = service_target_info(targets) if by_service else f"target_info{{{targets}}}"
    last = (
        service_target_info(targets, "[$__range]", around="last_over_time")
        if by_service
        else f"last_over_time(target_info{{{targets}}}[$__range])"
    )
    return (
        "sort_desc(max_over_time(timestamp(group by (openlora_run_id, openlora_run_name) ("
        f"openlora_run_info * on (job, instance) group_left (openlora_run_id) {info}"
        "))[$__range:$__interval]) or on (openlora_run_id) group by (openlora_run_id) ("
        f"{last}))"
    )


def service_target_info(matchers: str, range_: str = "", *, around: str = "") -> str:
    """target_info{``matchers``} of the services the ``service`` variable picks, on every path: pulled,
    target_info carries service_name; pushed, service.name is the job and target_info has none (the
    Collector's exporters and Prometheus' OTLP receiver move it to job). ``around``: a function
    applied to each selector (with ``range_``), as ``last_over_time``."""
    parts = [
        f'target_info{{{matchers}, service_name=~"$service"}}{range_}',
        f'target_info{{{matchers}, service_name="", job=~"$service"}}{range_}',
    ]
    if around:
        parts = [f"{around}({part})" for part in parts]
    return f"({parts[0]} or {parts[1]})"


# The service variable: target_info's service_name when there is one, else its job (see above).
SERVICE_QUERY = (
    'query_result(group by (service_name) (target_info{job=~"$job", service_name!=""})'
    ' or group by (job) (target_info{job=~"$job", service_name=""}))'
)
SERVICE_REGEX = '/(?:service_name|job)="(?<value>[^"]+)"/'


RUN_NAMES = run_names('job=~"$job"')
# Grafana's named groups: text is what the list shows, value what $run becomes. The g flag
# lets the two groups match in either order; without a name, the text is the id.
RUN_NAME_REGEX = '/openlora_run_id="(?<value>[^"]+)"|openlora_run_name="(?<text>[^"]+)"/g'
RUN_VARIABLE = variable("run", "Run", f"query_result({RUN_NAMES})", regex=RUN_NAME_REGEX)
# The hyperparameter legends show: a key of openlora_run_info's openlora_hparam_<key> labels.
HPARAM_VARIABLE = variable(
    "hparam",
    "Hyperparameter in legends",
    "label_names(openlora_run_info)",
    regex="/^openlora_hparam_(.+)$/",
    default="learning_rate",
)


# Every openlora dashboard links to the others (Grafana lists the dashboards with this tag),
# keeping the time range and the variables they share (job, run).
LINKS = [
    {
        "title": "openlora dashboards",
        "type": "dashboards",
        "tags": ["openlora"],
        "asDropdown": True,
        "includeVars": True,
        "keepTime": True,
    }
]

DATASOURCE_VARIABLE = {
    "name": "datasource",
    "label": "Data source",
    "type": "datasource",
    "query": "prometheus",
    "current": {"selected": True, "text": "Prometheus", "value": "openlora-prometheus"},
    "hide": 0,
}


def dashboard(
    uid: str,
    title: str,
    description: str,
    tags: list[str],
    templating: list[dict[str, Any]],
    panels: list[dict[str, Any]],
) -> dict[str, Any]:
    """The settings every openlora dashboard shares around its own variables and panels; numbers the
    panels (their ids) 1, 2, ... in their order."""
    for number, item in enumerate(panels, start=1):
        item["id"] = number
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": templating},
        "annotations": {"list": []},
        "links": LINKS,
        "panels": panels,
    }


# OpenloraInputBound fires when a process's data-wait fraction averages above this
# (openlora_otel/rules/openlora.yml); the panels draw it as a line.
INPUT_BOUND_THRESHOLD = 0.25


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


# Whole disks only: a partition's bytes are also its disk's, and loop or RAM devices are not
# storage. Interfaces that are not the node's own links: loopback, containers' veth pairs and
# bridges, traffic-shaping ifb. Both as in the README's host queries (tests/test_host.py).
WHOLE_DISKS = 'device=~"(sd|vd|xvd|hd)[a-z]+|nvme[0-9]+n[0-9]+"'
NODE_LINKS = 'device!~"lo|veth.*|docker.*|br-.*|ifb.*"'


def host(grid: Grid) -> list[dict[str, Any]]:
    """Host and process metrics (opentelemetry-instrumentation-system-metrics, openlora_otel/hardware/host.py): the row, next on the grid.

    process.* come from every process, system.* from one process per node (LOCAL_RANK 0),
    so a node's system series are under its rank-0 instance. system.cpu.utilization has
    unit 1: system_cpu_utilization pulled, system_cpu_utilization_ratio through the collector;
    only its idle state is reported.
    """
    legend = LEGEND
    cpu = '__name__=~"system_cpu_utilization(_ratio)?"'
    panels: list[dict[str, Any]] = [row("Host", grid.header())]
    panels += [
        panel(
            "timeseries",
            "Process CPU",
            "CPU time the training process used per second, in cores, user and system "
            "(rate of process_cpu_time_seconds_total by type). A data-parallel rank near one core while its "
            "GPU idles is bound by Python on the host.",
            "short",
            [
                target(
                    f"sum by (job, instance, type) (rate(process_cpu_time_seconds_total{{{SEL}}}[$__rate_interval])){RUN}",
                    "{{type}} " + legend,
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
            "(rate of process_disk_io_bytes_total by direction): data loading and checkpoints.",
            "Bps",
            [
                target(
                    f"rate(process_disk_io_bytes_total{{{SEL}}}[$__rate_interval]){RUN}",
                    "{{direction}} " + legend,
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
            "the busiest one (1 minus system.cpu.utilization with state idle: system_cpu_utilization pulled, "
            "system_cpu_utilization_ratio through the collector). Reported by LOCAL_RANK 0 only. The mean near 1 "
            "while the GPUs idle: the loader's workers are short of CPU; one CPU pegged: a single-threaded "
            "input pipeline.",
            "percentunit",
            [
                target(
                    f'(1 - avg by (job, instance) ({{{cpu}, state="idle", {SEL}}})){RUN}',
                    f"mean {legend}",
                ),
                target(
                    f'(1 - min by (job, instance) ({{{cpu}, state="idle", {SEL}}})){RUN}',
                    f"busiest CPU {legend}",
                ),
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0, "max": 1},
        ),
        panel(
            "timeseries",
            "Node memory",
            "Node memory used (total minus available) and available (system_memory_usage_bytes, state used and "
            "available). Reported by LOCAL_RANK 0 only.",
            "bytes",
            [
                target(
                    f'system_memory_usage_bytes{{state=~"used|available", {SEL}}}{RUN}',
                    "{{state}} " + legend,
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Node disk I/O",
            "Bytes per second read and written by the node's whole disks, sd*, vd*, xvd*, hd* and nvme*n* "
            "(partitions would count twice, loop and RAM devices are not storage; rate of "
            "system_disk_io_bytes_total by direction). Reported by LOCAL_RANK 0 only.",
            "Bps",
            [
                target(
                    f"sum by (job, instance, direction) (rate(system_disk_io_bytes_total{{{WHOLE_DISKS}, {SEL}}}"
                    f"[$__rate_interval])){RUN}",
                    "{{direction}} " + legend,
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Node network I/O",
            "Bytes per second received and transmitted through the node's own interfaces, loopback, veth, "
            "docker, bridge and ifb interfaces left out (rate of system_network_io_bytes_total by direction): "
            "remote data, checkpoints, NCCL's socket transport (RDMA bypasses the kernel and does not show). "
            "Reported by LOCAL_RANK 0 only.",
            "Bps",
            [
                target(
                    f"sum by (job, instance, direction) (rate(system_network_io_bytes_total{{{NODE_LINKS}, {SEL}}}"
                    f"[$__rate_interval])){RUN}",
                    "{{direction}} " + legend,
                )
            ],
            at=grid.cell(6, 8),
            defaults={"min": 0},
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
            "hw_gpu_io_bytes_total by network_io_direction; absent on drivers without the PCIe byte counters).",
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


# hw.status as one number per GPU for the state timeline: 0 ok, 1 degraded, 2 failed (the current
# state's series is 1, the other two 0).
GPU_STATES = (("ok", 0, "green"), ("degraded", 1, "orange"), ("failed", 2, "red"))
# Those numbers shown as their state's name and colour (the training dashboard's state timeline,
# the cluster dashboard's worst status per rank).
GPU_STATE_MAPPINGS = [
    {
        "type": "value",
        "options": {str(value): {"text": state, "color": color, "index": value} for state, value, color in GPU_STATES},
    }
]
GPU_STATE_THRESHOLDS = thresholds((None, "green"), (1, "orange"), (2, "red"))


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
            "PCIe errors per rate interval (hw_errors_total, hw_type=gpu, error_type pcie_replay, and where the "
            "driver counts them pcie_correctable, pcie_non_fatal, pcie_fatal). Replays rising steadily mean a "
            "marginal link (OpenloraGpuPcieReplaysRising); a fatal error, a failed one.",
            "short",
            [
                target(
                    f'increase(hw_errors_total{{hw_type="gpu", error_type=~"pcie_.+", {GPU}}}[$__rate_interval]){RUN}',
                    "{{error_type}} " + gpu_legend,
                )
            ],
            at=grid.cell(12, 8),
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
                    f"histogram_quantile({q}, sum by (le, job, instance) (rate(openlora_training_step_duration_seconds_bucket{{{SEL}}}[$__rate_interval])){RUN})",
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
            "GPU core temperature (hw_temperature_celsius, hw_type=gpu).",
            "celsius",
            [target(f'hw_temperature_celsius{{hw_type="gpu", {GPU}}}{RUN}', gpu_legend)],
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "ECC errors",
            "ECC memory errors per rate interval, corrected and uncorrected (hw_errors_total, hw_type=gpu, error_type corrected or uncorrected; the PCIe error types are in the GPU health row).",
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


def build() -> dict[str, Any]:
    """The training dashboard: one run or several, each rank's training, GPUs and host."""
    grid = Grid()
    gpu_legend = LEGEND + " {{hw_id}}"
    panels = [
        *run_overview(grid),
        *training_metrics(grid),
        *input_and_compute(grid),
        *evaluation_and_divergence(grid),
        *gpu(grid, gpu_legend),
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


# -- the cluster dashboard -------------------------------------------------------------------

# Recorded series of the openlora-ranks group: all carry openlora_run_id; the rank:* ones also
# openlora_rank, job and instance.
RUN_ONLY = 'openlora_run_id=~"$run"'
RANK_SEL = f'job=~"$job", {RUN_ONLY}'
STRAGGLER_THRESHOLD = 1.5  # OpenloraRankStraggling fires above this ratio (openlora_otel/rules/openlora.yml)
HUNG_AFTER_S = 300  # OpenloraRankHung: a rank's last step older than 5 minutes


def build_cluster() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    grid = Grid()
    panels.append(row("Cluster: the ranks of a run side by side", grid.header()))
    rank_legend = "rank {{openlora_rank}} ({{instance}})"
    straggler_colors = thresholds((None, "green"), (1.2, "orange"), (STRAGGLER_THRESHOLD, "red"))
    age_colors = thresholds((None, "green"), (60, "orange"), (HUNG_AFTER_S, "red"))
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
            f"The highest rank straggler ratio of the run: that rank's mean step time / the run's median "
            f"(rank:openlora_training_straggler_ratio:2m). 1 is a typical rank; above {STRAGGLER_THRESHOLD} for "
            f"3 minutes fires OpenloraRankStraggling.",
            "none",
            [
                target(
                    f"max by (openlora_run_id) (rank:openlora_training_straggler_ratio:2m{{{RANK_SEL}}})",
                    "{{openlora_run_id}}",
                )
            ],
            at=grid.cell(6, 4),
            defaults={"decimals": 2, "thresholds": straggler_colors},
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
            defaults={"thresholds": age_colors},
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
                    rank_legend,
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
        ),
        panel(
            "bargauge",
            "Straggler ratio per rank, highest first",
            f"Each rank's mean step time / the run's median (rank:openlora_training_straggler_ratio:2m); red above "
            f"{STRAGGLER_THRESHOLD}, where OpenloraRankStraggling fires after 3 minutes.",
            "none",
            [
                target(
                    f"sort_desc(rank:openlora_training_straggler_ratio:2m{{{RANK_SEL}}})",
                    rank_legend,
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"decimals": 2, "min": 0, "thresholds": straggler_colors},
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
                    rank_legend,
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0, "thresholds": age_colors},
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
                target(f"rank:openlora_training_step_duration_seconds:mean2m{{{RANK_SEL}}}", rank_legend),
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
            f"Each rank's mean step time / the run's median over time (rank:openlora_training_straggler_ratio:2m); "
            f"the line is the alert threshold {STRAGGLER_THRESHOLD}.",
            "none",
            [target(f"rank:openlora_training_straggler_ratio:2m{{{RANK_SEL}}}", rank_legend)],
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
                    rank_legend,
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
                    rank_legend,
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
                    rank_legend,
                    instant=True,
                )
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
    ]
    # A straggler with a low data wait is slow at computing: its GPU may be held down or failing.
    # The raw GPU series stay with the training dashboard; these records are one value per rank.
    panels.append(row("GPUs behind the ranks", grid.header()))
    panels += [
        panel(
            "bargauge",
            "Worst GPU status per rank, worst first",
            "The worst hw.status of each rank's GPUs (rank:openlora_gpu_status:max): ok, degraded (a bad-GPU "
            "XID, a pending row remap, a reset the driver asks for) or failed (lost by NVML, XID 79, a failed "
            "row remap, a reboot the driver asks for). The training dashboard's GPU health row says which GPU "
            "and why; alerts OpenloraGpuDegraded and OpenloraGpuFailed.",
            "none",
            [target(f"sort_desc(rank:openlora_gpu_status:max{{{RANK_SEL}}})", rank_legend, instant=True)],
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
            [target(f"sort_desc(rank:openlora_gpu_xid_errors:sum{{{RANK_SEL}}})", rank_legend, instant=True)],
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


# -- the inference dashboard -------------------------------------------------------------------

# A server's series (openlora_otel.inference, names.INFERENCE_METRICS) carry the adapter as its own
# label; the server's run id and service name are in target_info, as for training.
ADAPTER_SEL = 'job=~"$job", instance=~"$instance", openlora_adapter_name=~"$adapter"'
SERVING = " * on (job, instance) group_left (openlora_run_id) " + service_target_info('openlora_run_id=~"$run"')
REQUESTS = "gen_ai_server_request_duration_seconds"
# Errors the client caused; the rest (exceptions, overloaded) are the server's
# (OpenloraInferenceErrorRatioHigh in openlora_otel/rules/openlora.yml leaves out the same).
CLIENT_ERRORS = "unknown_adapter|invalid_request|cancelled"
SERVER_ERRORS = f'error_type!="", error_type!~"{CLIENT_ERRORS}"'
# OpenloraInferenceLatencyHigh: p95 of successful requests above this (openlora_otel/rules/openlora.yml);
# the latency panels draw it. Change both together (a test compares them).
LATENCY_OBJECTIVE_S = 10
ERROR_RATIO_THRESHOLD = 0.05  # OpenloraInferenceErrorRatioHigh


def rate(series: str, selector: str) -> str:
    return f"rate({series}{{{selector}}}[$__rate_interval])"


def quantiles(histogram: str, selector: str) -> list[dict[str, Any]]:
    """p50 / p95 / p99 of a histogram over the selected servers and adapters."""
    return [
        target(
            f"histogram_quantile({q}, sum by (le) ({rate(histogram + '_bucket', selector)}{SERVING}))",
            f"p{int(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def objective_line(threshold: float) -> dict[str, Any]:
    return {
        "thresholds": thresholds((None, "green"), (threshold, "red")),
        "custom": {"thresholdsStyle": {"mode": "line"}},
    }


def build_inference() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    sel = ADAPTER_SEL
    ok = f'{sel}, error_type=""'
    failed = f'{sel}, error_type!=""'
    all_requests = f"sum({rate(REQUESTS + '_count', sel)}{SERVING})"
    server_errors = f"sum({rate(REQUESTS + '_count', f'{sel}, {SERVER_ERRORS}')}{SERVING})"
    grid = Grid()
    panels.append(row("Serving overview", grid.header()))
    stats = [
        (
            "Requests/s",
            f"Requests finished per second, every outcome, over the selected servers and adapters "
            f"(rate of {REQUESTS}_count).",
            "reqps",
            all_requests,
            {},
        ),
        (
            "Server error ratio",
            f"Share of requests that failed through the server's fault: an error_type other than the "
            f"clients' {CLIENT_ERRORS.replace('|', ', ')} (rate of {REQUESTS}_count). 0 with no such error; "
            f"above {ERROR_RATIO_THRESHOLD:.0%} for 5 minutes OpenloraInferenceErrorRatioHigh fires.",
            "percentunit",
            f"({server_errors} or vector(0)) / ({all_requests} > 0)",
            {"thresholds": thresholds((None, "green"), (ERROR_RATIO_THRESHOLD, "red"))},
        ),
        (
            "p95 request duration",
            f"95th percentile of the successful requests' duration ({REQUESTS}); red above the "
            f"{LATENCY_OBJECTIVE_S} s objective of OpenloraInferenceLatencyHigh.",
            "s",
            f"histogram_quantile(0.95, sum by (le) ({rate(REQUESTS + '_bucket', ok)}{SERVING}))",
            {"thresholds": thresholds((None, "green"), (LATENCY_OBJECTIVE_S, "red"))},
        ),
        (
            "Running requests",
            "Requests being generated now (openlora_inference_requests_running).",
            "short",
            f"sum(openlora_inference_requests_running{{{sel}}}{SERVING})",
            {},
        ),
        (
            "Waiting requests",
            "Requests in the servers' queues now (openlora_inference_requests_waiting).",
            "short",
            f"sum(openlora_inference_requests_waiting{{{sel}}}{SERVING})",
            {},
        ),
        (
            "Adapters loaded",
            "Adapters loaded now, counted once per server (openlora_inference_adapter_loaded == 1).",
            "short",
            f"count((openlora_inference_adapter_loaded{{{sel}}} == 1){SERVING})",
            {},
        ),
    ]
    for title, description, unit, expr, defaults in stats:
        panels.append(
            panel("stat", title, description, unit, [target(expr, title)], at=grid.cell(4, 4), defaults=defaults)
        )

    panels.append(row("Requests", grid.header()))
    panels += [
        panel(
            "timeseries",
            "Requests/s by adapter",
            f"Requests finished per second per adapter, every outcome (rate of {REQUESTS}_count by "
            "openlora_adapter_name). `base` is requests without an adapter, `other` adapters past the cap "
            "(OPENLORA_INFERENCE_MAX_ADAPTERS). A loaded adapter is listed at 0 before its first request.",
            "reqps",
            [
                target(
                    f"sum by (openlora_adapter_name) ({rate(REQUESTS + '_count', sel)}{SERVING})",
                    "{{openlora_adapter_name}}",
                )
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Error ratio by error type",
            f"Share of all requests that failed, per error_type (rate of {REQUESTS}_count with error_type "
            "over the rate of all): unknown_adapter (404), invalid_request (400/422) and cancelled (the "
            "client left mid-stream) are the clients'; overloaded (503, queue full) and exception class names "
            "the server's. The server's together is the line OpenloraInferenceErrorRatioHigh watches "
            f"({ERROR_RATIO_THRESHOLD:.0%}).",
            "percentunit",
            [
                target(
                    f"sum by (error_type) ({rate(REQUESTS + '_count', failed)}{SERVING})"
                    f" / on () group_left () ({all_requests} > 0)",
                    "{{error_type}}",
                ),
                target(f"{server_errors} / ({all_requests} > 0)", "server's errors together"),
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0, **objective_line(ERROR_RATIO_THRESHOLD)},
        ),
    ]

    panels.append(row("Latency", grid.header()))
    panels += [
        panel(
            "timeseries",
            "Request duration p50 / p95 / p99",
            f"Duration of successful requests, from arrival to the last token, queue time included "
            f"({REQUESTS}). The line is the {LATENCY_OBJECTIVE_S} s objective: p95 above it over 5 minutes, "
            "for 10 minutes, fires OpenloraInferenceLatencyHigh. Buckets double from 10 ms: a "
            "percentile is exact to within its bucket.",
            "s",
            quantiles(REQUESTS, ok),
            at=grid.cell(8, 8),
            defaults=objective_line(LATENCY_OBJECTIVE_S),
        ),
        panel(
            "timeseries",
            "Time to first token p50 / p95 / p99",
            "From the request's arrival to its first output token, queue time included, successful requests "
            "(gen_ai_server_time_to_first_token_seconds): what a streaming client waits before text appears.",
            "s",
            quantiles("gen_ai_server_time_to_first_token_seconds", sel),
            at=grid.cell(8, 8),
        ),
        panel(
            "timeseries",
            "Time per output token p50 / p95 / p99",
            "Time per output token after the first, successful requests with at least two output tokens "
            "(gen_ai_server_time_per_output_token_seconds): the decoding speed a client sees.",
            "s",
            quantiles("gen_ai_server_time_per_output_token_seconds", sel),
            at=grid.cell(8, 8),
        ),
    ]
    by_adapter = "le, openlora_adapter_name"
    panels += [
        panel(
            "timeseries",
            "p95 request duration by adapter",
            f"95th percentile of the successful requests' duration per adapter ({REQUESTS}), "
            f"with the {LATENCY_OBJECTIVE_S} s objective.",
            "s",
            [
                target(
                    f"histogram_quantile(0.95, sum by ({by_adapter}) ({rate(REQUESTS + '_bucket', ok)}{SERVING}))",
                    "{{openlora_adapter_name}}",
                )
            ],
            at=grid.cell(12, 8),
            defaults=objective_line(LATENCY_OBJECTIVE_S),
        ),
        panel(
            "timeseries",
            "p95 time to first token by adapter",
            "95th percentile of the time to first token per adapter (gen_ai_server_time_to_first_token_seconds).",
            "s",
            [
                target(
                    f"histogram_quantile(0.95, sum by ({by_adapter}) "
                    f"({rate('gen_ai_server_time_to_first_token_seconds_bucket', sel)}{SERVING}))",
                    "{{openlora_adapter_name}}",
                )
            ],
            at=grid.cell(12, 8),
        ),
    ]

    panels.append(row("Tokens and load", grid.header()))
    tokens = "openlora_inference_token_usage_sum"
    output, prompt = f'{sel}, gen_ai_token_type="output"', f'{sel}, gen_ai_token_type="input"'
    panels += [
        panel(
            "timeseries",
            "Output tokens/s by adapter",
            "Tokens generated per second per adapter, and prompt tokens read per second, successful requests "
            f'(rate of {tokens} with gen_ai_token_type="output" and "input").',
            "short",
            [
                target(
                    f"sum by (openlora_adapter_name) ({rate(tokens, output)}{SERVING})",
                    "{{openlora_adapter_name}}",
                ),
                target(
                    f"sum by (openlora_adapter_name) ({rate(tokens, prompt)}{SERVING})",
                    "input {{openlora_adapter_name}}",
                ),
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Running and waiting requests",
            "Requests being generated (openlora_inference_requests_running) and requests in the queue "
            "(openlora_inference_requests_waiting), per server. A queue that never drains and keeps "
            "rising fires OpenloraInferenceQueueGrowing.",
            "short",
            [
                target(
                    f"sum by (instance) (openlora_inference_requests_running{{{sel}}}{SERVING})",
                    "running {{instance}}",
                ),
                target(
                    f"sum by (instance) (openlora_inference_requests_waiting{{{sel}}}{SERVING})",
                    "waiting {{instance}}",
                ),
            ],
            at=grid.cell(12, 8),
            defaults={"min": 0},
        ),
    ]

    panels.append(row("Adapters", grid.header()))
    loads = "openlora_inference_adapter_load_duration_seconds"
    panels += [
        panel(
            "state-timeline",
            "Adapters loaded, per server",
            "When each adapter was loaded on each server (openlora_inference_adapter_loaded == 1; 0 after "
            "unload). An adapter stays listed while loaded, whether or not it has requests.",
            "short",
            [
                target(
                    f"(openlora_inference_adapter_loaded{{{sel}}} == 1){SERVING}",
                    "{{openlora_adapter_name}} {{instance}}",
                )
            ],
            at=grid.cell(8, 8),
            defaults={"mappings": [{"type": "value", "options": {"1": {"text": "loaded", "color": "green"}}}]},
            options={"mergeValues": True, "showValue": "never", "rowHeight": 0.8},
        ),
        panel(
            "bargauge",
            "Adapter load time, slowest first",
            f"Mean time each adapter took to load on each server, successful loads ({loads}_sum / "
            f"{loads}_count); usually one load each.",
            "s",
            [
                target(
                    f"sort_desc((sum by (job, instance, openlora_adapter_name) ({loads}_sum{{{ok}}})"
                    f" / (sum by (job, instance, openlora_adapter_name) ({loads}_count{{{ok}}}) > 0))"
                    f"{SERVING})",
                    "{{openlora_adapter_name}} {{instance}}",
                    instant=True,
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
        panel(
            "timeseries",
            "Failed adapter loads",
            f"Loads that failed since the server started, per adapter and error_type ({loads}_count with "
            "error_type). A new failure fires OpenloraInferenceAdapterLoadFailed.",
            "short",
            [
                target(
                    f"sum by (instance, openlora_adapter_name, error_type) "
                    f"({loads}_count{{{failed}}}{SERVING})",
                    "{{openlora_adapter_name}} {{error_type}} {{instance}}",
                )
            ],
            at=grid.cell(8, 8),
            defaults={"min": 0},
        ),
    ]
    serving_runs = run_names('job=~"$job"', by_service=True)
    templating = [
        DATASOURCE_VARIABLE,
        variable("job", "Job", "label_values(target_info, job)"),
        variable("service", "Service", SERVICE_QUERY, regex=SERVICE_REGEX),
        variable("run", "Run", f"query_result({serving_runs})", regex=RUN_NAME_REGEX),
        variable(
            "instance",
            "Server / instance",
            "query_result(group by (instance) "
            + service_target_info('job=~"$job", openlora_run_id=~"$run"')
            + ")",
            regex='/instance="(?<value>[^"]+)"/',
        ),
        variable(
            "adapter",
            "Adapter",
            f'label_values({REQUESTS}_count{{job=~"$job", instance=~"$instance"}}, openlora_adapter_name)',
        ),
    ]
    return dashboard(
        "openlora-inference",
        "openlora-otel: inference",
        "LoRA adapters served with openlora-otel's InferenceMetrics (openlora-otel serve or your own server): "
        "traffic, errors, latency, tokens, queue and adapters, per adapter.",
        ["openlora", "inference"],
        templating,
        panels,
    )


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def render_cluster() -> str:
    return json.dumps(build_cluster(), indent=2) + "\n"


def render_inference() -> str:
    return json.dumps(build_inference(), indent=2) + "\n"


if __name__ == "__main__":
    for path, text in ((OUT, render()), (CLUSTER_OUT, render_cluster()), (INFERENCE_OUT, render_inference())):
        path.write_text(text)
        print(f"wrote {path}")

"""Host and process metrics (openlora_otel.hardware.host): the selection of system.* and process.*
metrics it observes (from /proc on Linux, psutil elsewhere), in the semantic conventions' names, kinds,
units and attribute keys."""

from __future__ import annotations

from collections.abc import Mapping

from openlora_otel.names.common import MetricSpec

__all__ = ["HOST_ATTRIBUTES", "HOST_METRICS"]

# Metric -> the attribute keys its points carry (semantic-conventions keys; the Prometheus exporters
# write them with `_` for `.`: cpu_mode, system_memory_state, network_interface_name, ...).
HOST_ATTRIBUTES: Mapping[str, tuple[str, ...]] = {
    "system.cpu.utilization": ("cpu.logical_number", "cpu.mode"),
    "system.memory.usage": ("system.memory.state",),
    "system.memory.linux.available": (),
    "system.disk.io": ("system.device", "disk.io.direction"),
    "system.network.io": ("network.interface.name", "network.io.direction"),
    "process.cpu.time": ("cpu.mode",),
    "process.memory.usage": (),
    "process.disk.io": ("disk.io.direction",),
}

# The instruments of the selection (MetricSpec, so the Prometheus names on both paths come from
# prometheus_name): kinds and units are the conventions', descriptions say what we observe.
HOST_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "system.cpu.utilization",
        "gauge",
        "1",
        "Share of time each logical CPU (`cpu.logical_number`, from 0) spent idle (`cpu.mode=idle`) since the "
        "previous collection, 0 to 1; busy is 1 minus it (iowait counts as busy). Node only (`LOCAL_RANK` 0).",
    ),
    MetricSpec(
        "system.memory.usage",
        "updowncounter",
        "By",
        "Node memory in use (`system.memory.state=used`: total minus available, as `free` shows it). Node only.",
    ),
    MetricSpec(
        "system.memory.linux.available",
        "updowncounter",
        "By",
        "Node memory available for starting new applications without swapping (MemAvailable); with `used` "
        "it adds up to the total. Node only, Linux only.",
    ),
    MetricSpec(
        "system.disk.io",
        "counter",
        "By",
        "Bytes read and written (`disk.io.direction`) per block device (`system.device`: whole disks, "
        "device-mapper and md devices; not partitions, loop, RAM or floppy devices, as node_exporter). Node only.",
    ),
    MetricSpec(
        "system.network.io",
        "counter",
        "By",
        "Bytes received and transmitted (`network.io.direction`) per network interface "
        "(`network.interface.name`: `lo` and the node's own links; containers' veth pairs, Calico's and "
        "Cilium's pod interfaces, docker bridges and ifb devices left out). Node only.",
    ),
    MetricSpec(
        "process.cpu.time", "counter", "s", "CPU seconds of this process by `cpu.mode` (`user`, `system`)."
    ),
    MetricSpec("process.memory.usage", "updowncounter", "By", "Resident set size (RSS) of this process."),
    MetricSpec(
        "process.disk.io",
        "counter",
        "By",
        "Bytes this process read from and wrote to storage (`disk.io.direction`; page-cache hits not included).",
    ),
)

"""GPU metrics (openlora_otel.hardware): the hardware semantic conventions' hw.* series and the
openlora.gpu.*, openlora.process.* and openlora.torch.* ones, with their attribute keys and values."""

from __future__ import annotations

from openlora_otel.names.common import MetricSpec

__all__ = [
    "ATTR_GPU_INDEX",
    "ATTR_GPU_PARENT",
    "ATTR_HW_STATE",
    "ATTR_IO_DIRECTION",
    "ATTR_REMAP_CAUSE",
    "ATTR_THROTTLE_REASON",
    "ATTR_XID_CODE",
    "GPU_ERROR_TYPES",
    "GPU_METRICS",
    "GPU_PCIE_ERROR_TYPES",
    "THROTTLE_REASONS",
    "XID_BAD_GPU",
    "XID_CODES",
    "XID_FAILED",
    "XID_OTHER",
    "XID_OTHER_KNOWN",
]

# GPU metrics. The hw.* names, units and attributes are the OpenTelemetry semantic
# conventions (hardware / GPU, status Development); those keep their unit `1`
# even though the Collector then names them *_ratio, because the conventions
# say so. openlora.* names cover what the conventions have no word for.
ATTR_GPU_INDEX = "openlora.gpu.index"
ATTR_GPU_PARENT = "openlora.gpu.parent_id"
ATTR_THROTTLE_REASON = "openlora.gpu.throttle.reason"
ATTR_XID_CODE = "openlora.gpu.xid.code"
ATTR_REMAP_CAUSE = "openlora.gpu.remap.cause"
ATTR_IO_DIRECTION = "network.io.direction"
ATTR_HW_STATE = "hw.state"

# openlora.gpu.throttle.time: why the clock was held below what was asked for. Each reason is a
# cumulative duration NVML keeps; they overlap in time, so they are not summed.
THROTTLE_REASONS = ("sw_power_cap", "thermal", "sync_boost", "hw_thermal_slowdown", "hw_power_brake_slowdown")

# hw.errors `error.type` on a GPU: ECC (volatile, since the driver loaded), the two values the conventions'
# GPU refinement of hw.errors has. PCIe link errors have no place there: they are their own counter,
# openlora.gpu.pcie.errors, whose `error.type` is one of GPU_PCIE_ERROR_TYPES.
GPU_ERROR_TYPES = ("corrected", "uncorrected")
GPU_PCIE_ERROR_TYPES = ("replay", "correctable", "non_fatal", "fatal")

# XID codes counted under their own `openlora.gpu.xid.code` value; every other code counts as "other",
# so the attribute has at most len(XID_CODES) + 1 values. The classes drive hw.status and the alerts:
# - XID_FAILED: the GPU is gone (fell off the bus): hw.state failed.
# - XID_BAD_GPU: a hardware or firmware fault that needs a reset, a drain or a replacement: degraded.
# - the rest are raised by what a program did (illegal address, a killed context...) or are
#   informational (a row remap was recorded; the pending remap shows on its own series).
XID_FAILED = (79,)
XID_BAD_GPU = (48, 62, 64, 74, 92, 94, 95, 119, 120, 140, 143, 154)
XID_OTHER_KNOWN = (13, 31, 32, 43, 45, 61, 63, 68, 69, 109, 121)
XID_CODES: tuple[int, ...] = tuple(sorted((*XID_FAILED, *XID_BAD_GPU, *XID_OTHER_KNOWN)))
XID_OTHER = "other"

GPU_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "hw.gpu.utilization",
        "gauge",
        "1",
        "Fraction of time the GPU was busy over the driver's sample period, per `hw.gpu.task` (general, encoder, decoder). Not reported for MIG instances.",
        "openlora_gpu_utilization",
    ),
    MetricSpec(
        "hw.gpu.memory.usage",
        "updowncounter",
        "By",
        "GPU memory in use, all processes.",
        "openlora_vram_usage_mb",
    ),
    MetricSpec("hw.gpu.memory.limit", "updowncounter", "By", "GPU memory in total."),
    MetricSpec("hw.gpu.memory.utilization", "gauge", "1", "GPU memory in use / total."),
    MetricSpec("hw.power", "gauge", "W", "Power draw of the GPU (`hw.type=gpu`)."),
    MetricSpec("hw.energy", "counter", "J", "Energy the GPU used since the driver loaded (`hw.type=gpu`)."),
    MetricSpec(
        "hw.temperature",
        "gauge",
        "Cel",
        f"GPU core temperature, with the attributes the conventions give a temperature sensor (`hw.id`, `hw.name`) "
        f"and `{ATTR_GPU_INDEX}`; no `hw.type`, vendor, model or driver version.",
    ),
    MetricSpec(
        "hw.errors",
        "counter",
        "{error}",
        "GPU ECC memory errors (`hw.type=gpu`) since the driver loaded, per `error.type`: `corrected`, `uncorrected`.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.errors",
        "counter",
        "{error}",
        "PCIe link errors of the GPU since the driver loaded, per `error.type`: `replay` (packets resent), and where "
        "the driver counts them `correctable`, `non_fatal`, `fatal`.",
    ),
    MetricSpec("openlora.gpu.clock.sm", "gauge", "Hz", "Current SM clock."),
    MetricSpec(
        "openlora.gpu.throttle.time",
        "counter",
        "s",
        f"Time the clock was held down, per `{ATTR_THROTTLE_REASON}` (`sw_power_cap`, `thermal`, `sync_boost`, "
        "`hw_thermal_slowdown`, `hw_power_brake_slowdown`), as NVML accumulates it: its rate is the fraction of "
        "time throttled for that reason. Reasons overlap; each is absent where the GPU or driver lacks its counter.",
    ),
    MetricSpec(
        "hw.gpu.io",
        "counter",
        "By",
        f"Bytes moved over PCIe, `{ATTR_IO_DIRECTION}` `transmit` (GPU to host) or `receive`: from GPM's "
        "traffic rates since the collector started (Hopper and later, no wrap), else NVML's byte fields "
        "with 32-bit wraps added back.",
    ),
    MetricSpec(
        "openlora.gpu.nvlink.io",
        "counter",
        "By",
        f"Data bytes moved over all NVLinks of the GPU (protocol overhead excluded), `{ATTR_IO_DIRECTION}` "
        "`transmit` or `receive`; absent on GPUs without NVLink.",
    ),
    MetricSpec(
        "openlora.gpu.xid.errors",
        "counter",
        "{error}",
        f"XID errors the driver reported since this process started watching, per `{ATTR_XID_CODE}` (a known "
        "code such as `79`, or `other`); a series appears with its first error.",
    ),
    MetricSpec(
        "openlora.gpu.remap.rows",
        "counter",
        "{row}",
        f"Memory rows remapped over the GPU's life, per `{ATTR_REMAP_CAUSE}` (`correctable`, `uncorrectable`).",
    ),
    MetricSpec(
        "openlora.gpu.remap.pending",
        "gauge",
        "",
        "1 while a row remap waits for a GPU reset to take effect, else 0.",
    ),
    MetricSpec(
        "openlora.gpu.remap.failed",
        "gauge",
        "",
        "1 once a row remap failed (no spare rows left: the GPU needs replacing), else 0.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.width",
        "gauge",
        "{lane}",
        "PCIe lanes the link runs on now (read at most once a minute).",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.width.max",
        "gauge",
        "{lane}",
        "Most PCIe lanes this GPU and its slot support together.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.generation",
        "gauge",
        "",
        "PCIe generation the link runs at now (read at most once a minute); idle GPUs drop it to save power.",
    ),
    MetricSpec(
        "openlora.gpu.pcie.link.generation.max",
        "gauge",
        "",
        "Highest PCIe generation this GPU and its slot support together.",
    ),
    MetricSpec(
        "hw.status",
        "updowncounter",
        "1",
        f"1 for the GPU's current `{ATTR_HW_STATE}` and 0 for the other two (`ok`, `degraded`, `failed`; "
        "`hw.type=gpu`): failed when NVML lost the GPU, an XID 79 was seen, a row remap failed or the driver asks "
        "for a node reboot; degraded after an XID that means a bad GPU, while a remap is pending, or when the "
        "driver asks for any other recovery (a GPU or bus reset, a drain).",
    ),
    MetricSpec(
        "openlora.gpu.sm.activity",
        "gauge",
        "",
        "Fraction of SMs busy between two snapshots, 0 to 1 (NVML GPM; Hopper and later, not for MIG instances).",
    ),
    MetricSpec(
        "openlora.gpu.sm.occupancy",
        "gauge",
        "",
        "Resident warps over the SMs' maximum between two snapshots, 0 to 1 (NVML GPM; Hopper and later).",
    ),
    MetricSpec(
        "openlora.gpu.tensor.activity",
        "gauge",
        "",
        "Fraction of time the tensor cores were busy between two snapshots, 0 to 1 (NVML GPM; Hopper and later).",
    ),
    MetricSpec(
        "openlora.gpu.dram.activity",
        "gauge",
        "",
        "DRAM bandwidth used over its peak between two snapshots, 0 to 1 (NVML GPM; Hopper and later).",
    ),
    MetricSpec(
        "openlora.process.gpu.memory.usage",
        "updowncounter",
        "By",
        "GPU memory this process holds, as the driver accounts it (absent where the driver cannot see the process, as in some containers).",
    ),
    MetricSpec(
        "openlora.torch.memory.allocated",
        "updowncounter",
        "By",
        "Bytes the torch caching allocator has handed out on this device.",
    ),
    MetricSpec(
        "openlora.torch.memory.reserved",
        "updowncounter",
        "By",
        "Bytes the torch caching allocator holds from the driver.",
    ),
    MetricSpec(
        "openlora.torch.memory.peak",
        "gauge",
        "By",
        "Peak of allocated bytes since the process started (or since the peak was reset).",
    ),
    MetricSpec(
        "openlora.torch.memory.ooms", "counter", "{error}", "Out-of-memory errors the torch allocator raised."
    ),
    MetricSpec(
        "openlora.torch.memory.alloc_retries",
        "counter",
        "{retry}",
        "Allocations that succeeded only after freeing the allocator's cache.",
    ),
    MetricSpec(
        "openlora.gpu.snapshot.age",
        "gauge",
        "s",
        "Age of the NVML snapshot behind the GPU values: 0 when fresh, more when NVML was too slow and the last good one was served.",
    ),
)

"""The machine a run is on: GPU gauges, the NVML access they go through, and host and process metrics.

:mod:`.gpu` (the GPU instruments), :mod:`.gpu_snapshot` (their NVML snapshots, with
:mod:`.gpu_devices`, :mod:`.gpu_reads` and :mod:`.gpu_thread`), :mod:`.nvml` (NVML behind one
object), :mod:`.host` (host and process metrics) and :mod:`.procfs` (their reads of Linux's ``/proc``;
psutil elsewhere). Nothing is imported here:
``setup_telemetry`` imports each module only when its metrics are on, and none imports ``pynvml`` or
torch at import time. See docs/architecture.md.
"""

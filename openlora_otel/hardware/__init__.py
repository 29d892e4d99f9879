"""The machine a run is on: GPU gauges, the NVML access they go through, and host and process metrics.

- :mod:`openlora_otel.hardware.gpu`: the GPU instruments, fed by one NVML snapshot per collection.
- :mod:`openlora_otel.hardware.gpu_snapshot`: those snapshots: which GPUs and values, read on a
  helper thread, bounded in time. ``GpuCollector`` there wires :mod:`~openlora_otel.hardware.gpu_devices`
  (which GPUs), :mod:`~openlora_otel.hardware.gpu_reads` (the NVML reads of one GPU) and
  :mod:`~openlora_otel.hardware.gpu_thread` (the helper thread).
- :mod:`openlora_otel.hardware.nvml`: the one object NVML is reached through, so tests can hand in a fake.
- :mod:`openlora_otel.hardware.host`: host and process metrics, read with psutil and named by the
  semantic conventions.

Nothing is imported here: ``setup_telemetry`` imports each module only when its metrics are on,
and none of them imports ``pynvml`` or torch at import time.
"""

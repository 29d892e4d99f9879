"""One prepared check of the GPU paths on a CUDA machine, in minutes; a dry run of every stage that needs no hardware.

Stages, each timed, each failing on its own (one stage's failure never stops the next):

- ``env``: torch, CUDA, the GPU, the driver, nvidia-smi.
- ``values``: with a bf16 matmul load on the GPU, every GPU value through our collector (the
  instruments a reader collects, after unit conversion), next to ``nvidia-smi --query-gpu``
  read just before and just after, with a tolerance per value; energy against power x time;
  GPM activity under the load, next to ``nvidia-smi dmon``; the process's memory next to
  ``--query-compute-apps``; the torch allocator gauges next to ``torch.cuda``. Values nvidia-smi
  does not offer and values the driver lacks (NVML answers NotSupported) are listed.
- ``fields``: the raw answer (status, value) of every field id the collector may ask, the
  throttle ids among them, twice under load, with ``nvidia-smi -q -d PERFORMANCE`` beside them:
  which ids this driver knows and in which unit its throttle counters run.
- ``pcie``: the PCIe byte counters before and after copying a known number of bytes each way.
- ``snapshot``: NVML calls per snapshot, by call, and the time of one snapshot (p50, p99, max).
- ``cuda_tests``: ``tests/hardware/test_cuda.py`` (no sync under ``set_sync_debug_mode("error")``).
- ``demo_sync``: the demo on CUDA under ``set_sync_debug_mode("warn")`` while a reader
  collects every 0.25 s; each synchronizing call is attributed by its Python stack to the
  telemetry (must be none) or to the demo's own code (its progress line, evaluations).
- ``demo_speed``: demo steps/s, telemetry on vs ``OTEL_SDK_DISABLED=true``, interleaved pairs
  (``benchmarks/bench_demo_overhead.py``).
- ``serve_speed``: ``serve`` requests/s the same way (``benchmarks/bench_serve_overhead.py``).

Writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` after every stage, so a run cut short
keeps what it measured. ``--dry-run`` (forced without CUDA) runs ``values``, ``fields`` and
``snapshot`` against the fake NVML of ``tests/support/fake_nvml.py`` with an nvidia-smi made from the
same fake, and the demo and serve stages on the CPU at a small size; ``pcie`` and
``cuda_tests`` need hardware and say so. The dry run is a test (``tests/hardware/test_gpu_check.py``).

    python benchmarks/gpu_check.py OUT [--dry-run] [--stages values,snapshot,...]
    bash benchmarks/gpu_check.sh OUT   # on a machine without network: installs the carried wheels first
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = (
    "env",
    "values",
    "fields",
    "pcie",
    "snapshot",
    "cuda_tests",
    "demo_sync",
    "demo_speed",
    "serve_speed",
)
NEEDS_HARDWARE = {"pcie": "copies bytes over a real PCIe link", "cuda_tests": "needs a CUDA device"}
MIB = 1024 * 1024

# nvidia-smi --query-gpu field -> (our metric, attributes that pick the point, ours -> nvidia-smi's unit,
# absolute tolerance, relative tolerance, note). Gauges are compared with the range of the readings
# nvidia-smi gave just before and just after ours, widened by the tolerance.
SMI_VALUES: tuple[tuple[str, str, dict[str, Any], Callable[[float], float], float, float, str], ...] = (
    ("memory.total", "hw.gpu.memory.limit", {}, lambda v: v / MIB, 1, 0, "MiB"),
    ("memory.used", "hw.gpu.memory.usage", {}, lambda v: v / MIB, 64, 0.01, "MiB"),
    ("utilization.gpu", "hw.gpu.utilization", {"hw.gpu.task": "general"}, lambda v: v * 100, 10, 0, "%"),
    ("utilization.encoder", "hw.gpu.utilization", {"hw.gpu.task": "encoder"}, lambda v: v * 100, 5, 0, "%"),
    ("utilization.decoder", "hw.gpu.utilization", {"hw.gpu.task": "decoder"}, lambda v: v * 100, 5, 0, "%"),
    ("temperature.gpu", "hw.temperature", {}, lambda v: v, 2, 0, "C"),
    ("clocks.sm", "openlora.gpu.clock.sm", {}, lambda v: v / 1e6, 15, 0.05, "MHz"),
    ("power.draw.average", "hw.power", {}, lambda v: v, 15, 0.10, "W (1 s average, as ours)"),
    ("power.draw", "hw.power", {}, lambda v: v, 25, 0.15, "W (nvidia-smi's default reading)"),
    ("ecc.errors.corrected.volatile.total", "hw.errors", {"error.type": "corrected"}, lambda v: v, 0, 0, ""),
    ("ecc.errors.uncorrected.volatile.total", "hw.errors", {"error.type": "uncorrected"}, lambda v: v, 0, 0, ""),
    ("pcie.link.gen.current", "openlora.gpu.pcie.link.generation", {}, lambda v: v, 0, 0, "read at most once a minute"),
    ("pcie.link.width.current", "openlora.gpu.pcie.link.width", {}, lambda v: v, 0, 0, "read at most once a minute"),
    ("pcie.link.gen.max", "openlora.gpu.pcie.link.generation.max", {}, lambda v: v, 0, 0, ""),
    ("pcie.link.width.max", "openlora.gpu.pcie.link.width.max", {}, lambda v: v, 0, 0, ""),
    ("remapped_rows.correctable", "openlora.gpu.remap.rows", {"openlora.gpu.remap.cause": "correctable"}, lambda v: v, 0, 0, ""),
    ("remapped_rows.uncorrectable", "openlora.gpu.remap.rows", {"openlora.gpu.remap.cause": "uncorrectable"}, lambda v: v, 0, 0, ""),
    ("remapped_rows.pending", "openlora.gpu.remap.pending", {}, lambda v: v, 0, 0, "1 = yes"),
    ("remapped_rows.failure", "openlora.gpu.remap.failed", {}, lambda v: v, 0, 0, "1 = yes"),
    *(
        (
            f"clocks_event_reasons_counters.{smi}",
            "openlora.gpu.throttle.time",
            {"openlora.gpu.throttle.reason": ours},
            lambda v: v * 1e6,
            1000,
            0.02,
            "us",
        )
        for smi, ours in (
            ("sw_power_cap", "sw_power_cap"),
            ("sync_boost", "sync_boost"),
            ("sw_thermal_slowdown", "thermal"),
            ("hw_thermal_slowdown", "hw_thermal_slowdown"),
            ("hw_power_brake_slowdown", "hw_power_brake_slowdown"),
        )
    ),
)  # fmt: skip


# -- the record ---------------------------------------------------------------------------------


class Report:
    """What the stages found; written as JSON and Markdown after each stage."""

    def __init__(self, out: Path, dry_run: bool) -> None:
        self.out = out
        self.data: dict[str, Any] = {
            "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "stages": {},
        }

    def stage(self, name: str) -> dict[str, Any]:
        return self.data["stages"].setdefault(name, {"status": "running"})

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# GPU check{' (dry run: fake NVML, CPU)' if data['dry_run'] else ''}", ""]
    stages = data["stages"]
    lines += ["| stage | status | seconds | summary |", "| --- | --- | --- | --- |"]
    for name, stage in stages.items():
        lines.append(
            f"| {name} | {stage['status']} | {_fmt(stage.get('seconds'))} | {stage.get('summary', '')} |"
        )
    env = stages.get("env", {})
    if env.get("facts"):
        lines += ["", "## Machine", ""] + [f"- {k}: {v}" for k, v in env["facts"].items()]
    values = stages.get("values", {})
    if values.get("compared"):
        lines += [
            "",
            "## Values: ours next to nvidia-smi",
            "",
            "| nvidia-smi field | ours | nvidia-smi before / after | tolerance | within | note |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in values["compared"]:
            lines.append(
                f"| {row['field']} | {_fmt(row['ours'])} | {_fmt(row['smi_before'])} / {_fmt(row['smi_after'])} "
                f"| {_fmt(row['tolerance'])} | {row['within']} | {row['note']} |"
            )
    for key, title in (
        ("absent_in_smi", "nvidia-smi does not offer"),
        ("driver_lacks", "values absent from our snapshot (the driver or GPU lacks them, after fallbacks)"),
        ("asked_and_refused", "NVML calls answered NotSupported (then not asked again)"),
        ("checks", "other checks"),
    ):
        if values.get(key):
            lines += ["", f"### {title}", ""] + [f"- {item}" for item in values[key]]
    for name in ("fields", "pcie", "snapshot", "cuda_tests", "demo_sync", "demo_speed", "serve_speed"):
        details = stages.get(name, {}).get("details")
        if details:
            lines += ["", f"## {name}", "", "```", json.dumps(details, indent=1, default=str)[:6000], "```"]
    for name, stage in stages.items():
        if stage.get("error"):
            lines += ["", f"## {name} failed", "", "```", stage["error"][-3000:], "```"]
    return "\n".join(lines) + "\n"


# -- nvidia-smi, real or made from the fake ----------------------------------------------------


def _smi_number(text: str) -> float | None:
    text = text.strip()
    lowered = text.lower()
    if lowered in ("yes", "active"):
        return 1.0
    if lowered in ("no", "not active"):
        return 0.0
    try:
        return float(text)
    except ValueError:
        return None  # [N/A], [Not Supported], ...


class Smi:
    """nvidia-smi on this machine."""

    def __init__(self) -> None:
        self.binary = shutil.which("nvidia-smi")
        self.fields: set[str] = set()
        if self.binary:
            help_text = self._run("--help-query-gpu", timeout=20)
            # Each field opens a line with its name in quotes, aliases after it: "clocks.current.sm" or "clocks.sm".
            for line in help_text.splitlines():
                if line.startswith('"'):
                    self.fields.update(re.findall(r'"([a-z0-9_.]+)"', line))

    def _run(self, *args: str, timeout: float = 20) -> str:
        done = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"nvidia-smi {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[:300]}")
        return done.stdout

    def query(self, fields: list[str]) -> dict[str, dict[str, float | None]]:
        """{GPU UUID: {field: value}} for the fields this nvidia-smi offers.

        One field it lists but refuses on this GPU fails the whole query: then each field is asked
        alone, and the ones refused are dropped (and no longer asked).
        """
        try:
            return self._query(fields)
        except RuntimeError:
            kept = []
            for field in fields:
                try:
                    self._query([field])
                    kept.append(field)
                except RuntimeError:
                    self.fields.discard(field)
            fields[:] = kept
            return self._query(kept)

    def _query(self, fields: list[str]) -> dict[str, dict[str, float | None]]:
        asked = ["uuid", *fields]
        out = self._run(f"--query-gpu={','.join(asked)}", "--format=csv,noheader,nounits")
        result = {}
        for line in out.strip().splitlines():
            cells = [c.strip() for c in line.split(",")]
            result[cells[0]] = {f: _smi_number(c) for f, c in zip(fields, cells[1:], strict=False)}
        return result

    def text(self, *args: str, timeout: float = 20) -> str:
        return self._run(*args, timeout=timeout)


class FakeSmi:
    """What nvidia-smi would print for the fake pynvml module's GPU, in nvidia-smi's units."""

    def __init__(self, pynvml: Any) -> None:
        self.binary = "fake"
        self._nv = pynvml
        self.fields = {row[0] for row in SMI_VALUES} - {"power.draw.average"}  # as an older nvidia-smi

    def query(self, fields: list[str]) -> dict[str, dict[str, float | None]]:
        nv, handle = self._nv, "handle0"
        memory = nv.nvmlDeviceGetMemoryInfo(handle, nv.nvmlMemory_v2)  # what nvidia-smi reads
        utilization = nv.nvmlDeviceGetUtilizationRates(handle)
        remapped = nv.nvmlDeviceGetRemappedRows(handle)
        known = {
            "memory.total": memory.total / MIB,
            "memory.used": memory.used / MIB,
            "utilization.gpu": utilization.gpu,
            "utilization.encoder": nv.nvmlDeviceGetEncoderUtilization(handle)[0],
            "utilization.decoder": nv.nvmlDeviceGetDecoderUtilization(handle)[0],
            "temperature.gpu": nv.nvmlDeviceGetTemperature(handle, 0),
            "clocks.sm": nv.nvmlDeviceGetClockInfo(handle, 1),
            "power.draw": nv.nvmlDeviceGetPowerUsage(handle) / 1000,
            "ecc.errors.corrected.volatile.total": nv.nvmlDeviceGetTotalEccErrors(handle, 0, 0),
            "ecc.errors.uncorrected.volatile.total": nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0),
            "pcie.link.gen.current": nv.nvmlDeviceGetCurrPcieLinkGeneration(handle),
            "pcie.link.width.current": nv.nvmlDeviceGetCurrPcieLinkWidth(handle),
            "pcie.link.gen.max": nv.nvmlDeviceGetMaxPcieLinkGeneration(handle),
            "pcie.link.width.max": nv.nvmlDeviceGetMaxPcieLinkWidth(handle),
            "remapped_rows.correctable": remapped[0],
            "remapped_rows.uncorrectable": remapped[1],
            "remapped_rows.pending": remapped[2],
            "remapped_rows.failure": remapped[3],
            # The fake answers the power-cap counter in ns through the field; nvidia-smi shows us.
            "clocks_event_reasons_counters.sw_power_cap": 2_500_000_000 / 1000,
        }
        uuid = nv.nvmlDeviceGetUUID(handle).decode()
        return {uuid: {f: known.get(f) for f in fields}}

    def text(self, *args: str, timeout: float = 20) -> str:
        return "(dry run: no nvidia-smi)"


# -- our side ---------------------------------------------------------------------------------


def points(data: Any) -> list[tuple[str, dict[str, Any], float]]:
    """(metric name, attributes, value) of every point a reader collected."""
    found = []
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    found.append((metric.name, dict(point.attributes), getattr(point, "value", None)))
    return found


def pick(found: list[tuple[str, dict[str, Any], float]], name: str, uuid: str, **attributes: Any) -> float | None:
    for metric, attrs, value in found:
        if metric == name and attrs.get("hw.id", uuid) == uuid and all(attrs.get(k) == v for k, v in attributes.items()):
            return value
    return None


class Counting:
    """An NVML backend that counts the calls made through it, and their time, by method."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.calls: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._backend, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            started = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return call


class Load:
    """bf16 matmuls on a thread, keeping the GPU busy (utilization, power and clocks off idle)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        size = 8192
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.stop_event = threading.Event()
        self.products = 0
        self.thread = threading.Thread(target=self._run, name="gpu-check-load", daemon=True)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            for _ in range(16):
                self.a @ self.b
            self.torch.cuda.synchronize()
            self.products += 16

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(30)


class Context:
    """What the stages share: the mode, torch, the NVML backend factory, nvidia-smi."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.torch: Any = None
        with contextlib.suppress(ImportError):
            import torch

            self.torch = torch
        self.cuda = self.torch is not None and self.torch.cuda.is_available()
        self.dry = args.dry_run or not self.cuda
        self.fake_module: Any = None
        if self.dry:
            from tests.support.fake_nvml import fake_pynvml_module

            self.fake_module = fake_pynvml_module()
            sys.modules["pynvml"] = self.fake_module  # what setup_telemetry's NVML backend imports
            self.smi: Any = FakeSmi(self.fake_module)
        else:
            self.smi = Smi()
        self.device = "cpu" if self.dry else "cuda"

    def backend(self) -> Any:
        from openlora_otel.hardware.nvml import load_pynvml_backend

        backend = load_pynvml_backend()  # the real PynvmlBackend, over the fake module in a dry run
        backend.init()
        return backend

    def load(self) -> Any:
        if self.dry:
            return contextlib.nullcontext()
        return Load(self.torch, self.torch.device("cuda"))


# -- the stages --------------------------------------------------------------------------------


def stage_env(ctx: Context, stage: dict[str, Any]) -> str:
    facts: dict[str, Any] = {"python": sys.version.split()[0], "dry_run": ctx.dry}
    torch = ctx.torch
    if torch is not None:
        facts["torch"] = torch.__version__
        facts["torch CUDA"] = torch.version.cuda
        if ctx.cuda:
            facts["GPU"] = torch.cuda.get_device_name(0)
            facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            facts["GPUs visible"] = torch.cuda.device_count()
    backend = ctx.backend()
    try:
        facts["driver (NVML)"] = backend.driver_version()
        facts["NVML devices"] = backend.device_count()
    finally:
        backend.shutdown()
    facts["nvidia-ml-py"] = "fake (tests/support/fake_nvml.py)" if ctx.dry else _version("nvidia-ml-py")
    facts["nvidia-smi"] = ctx.smi.binary
    facts["nvidia-smi query fields offered"] = len(ctx.smi.fields)
    for package in ("opentelemetry-sdk", "transformers", "peft"):
        facts[package] = _version(package)
    stage["facts"] = facts
    return f"{facts.get('GPU', 'no GPU')}, driver {facts['driver (NVML)']}, torch {facts.get('torch')}"


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _telemetry(ctx: Context, reader: Any) -> Any:
    from openlora_otel import TelemetryConfig, setup_telemetry

    config = TelemetryConfig(
        exporters=("none",),
        handle_sigterm=False,
        host_metrics=False,
        gpu_metrics="on",
        gpu_devices="all" if ctx.dry else "process",
        gpu_timeout_s=5.0,
    )
    return setup_telemetry("openlora-gpu-check", config=config, metric_readers=[reader])


def stage_values(ctx: Context, stage: dict[str, Any]) -> str:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from openlora_otel.hardware import gpu, gpu_reads

    fields = [row[0] for row in SMI_VALUES if row[0] in ctx.smi.fields]
    stage["absent_in_smi"] = [row[0] for row in SMI_VALUES if row[0] not in ctx.smi.fields]
    reader = InMemoryMetricReader()
    compared, checks = [], []
    with ctx.load() as load:
        telemetry = _telemetry(ctx, reader)
        try:
            time.sleep(0 if ctx.dry else 4)  # clocks, power and utilization settle under the load
            reader.get_metrics_data()  # discovery, the first GPM sample
            time.sleep(0 if ctx.dry else 1.2)
            before = ctx.smi.query(fields)
            ours = points(reader.get_metrics_data())
            after = ctx.smi.query(fields)
            uuid = next(iter(before))
            for field, metric, attributes, convert, absolute, relative, note in SMI_VALUES:
                if field not in fields:
                    continue
                value = pick(ours, metric, uuid, **attributes)
                smi = (before[uuid].get(field), after.get(uuid, {}).get(field))
                row = {
                    "field": field,
                    "metric": metric,
                    "ours": None if value is None else convert(value),
                    "smi_before": smi[0],
                    "smi_after": smi[1],
                    "note": note,
                }
                known = [v for v in smi if v is not None]
                if row["ours"] is None or not known:
                    row["tolerance"] = None
                    row["within"] = "n/a" if row["ours"] is None and not known else "one side only"
                else:
                    tolerance = absolute + relative * max(abs(v) for v in known)
                    row["tolerance"] = tolerance
                    low, high = min(known) - tolerance, max(known) + tolerance
                    row["within"] = "yes" if low <= row["ours"] <= high else "NO"
                compared.append(row)
            collector = telemetry.gpu.collector
            snapshot, _ = collector.current()
            present = set(snapshot.readings[0].values) if snapshot and snapshot.readings else set()
            expected = {f.key for f in gpu.FIELDS} | {q[0] for q in gpu_reads.QUERIES}
            expected |= {"link", "link_max", "xid"} | {f"gpm.{k}" for k in ("sm_activity", "sm_occupancy", "tensor_activity", "dram_activity")}
            stage["driver_lacks"] = sorted(expected - present)
            stage["asked_and_refused"] = sorted(f"{key} ({uuid_})" for uuid_, key in collector._unsupported)
            checks += _energy_check(ctx, reader, uuid)
            checks += _gpm_check(ctx, ours, uuid)
            checks += _process_memory_check(ctx, ours, uuid)
            checks.append(f"hw.status: {[(a.get('hw.state'), v) for m, a, v in ours if m == 'hw.status' and v]}")
            checks.append(f"XID errors: {[(a.get('openlora.gpu.xid.code'), v) for m, a, v in ours if m == 'openlora.gpu.xid.errors']}")
            if load is not None and not ctx.dry:
                checks.append(f"load: {load.products} bf16 8192^3 products while reading")
        finally:
            telemetry.shutdown()
    if not ctx.dry:
        checks += _allocator_check(ctx)
    stage["absent_in_smi"] = [row[0] for row in SMI_VALUES if row[0] not in ctx.smi.fields]
    stage["compared"] = compared
    stage["checks"] = checks
    off = [row["field"] for row in compared if row["within"] == "NO"]
    stage["mismatches"] = off
    stage["ok"] = not off and not any(c.startswith("MISMATCH") for c in checks)
    return (
        f"{sum(r['within'] == 'yes' for r in compared)} of {len(compared)} values within tolerance"
        + (f"; outside: {', '.join(off)}" if off else "")
        + f"; {len(stage['absent_in_smi'])} fields not in this nvidia-smi; driver lacks {len(stage['driver_lacks'])}"
    )


def _energy_check(ctx: Context, reader: Any, uuid: str) -> list[str]:
    """The energy counter's increase against the power readings over the same seconds."""
    samples = []
    for _ in range(4):
        found = points(reader.get_metrics_data())
        samples.append((time.monotonic(), pick(found, "hw.energy", uuid), pick(found, "hw.power", uuid)))
        time.sleep(0 if ctx.dry else 1.5)
    if any(e is None for _, e, _ in samples):
        return ["energy: no hw.energy"]
    elapsed = samples[-1][0] - samples[0][0]
    if elapsed <= 0 or samples[-1][1] == samples[0][1]:
        return [f"energy: the counter did not move ({samples[0][1]} J) over {elapsed:.2f} s"]
    from_energy = (samples[-1][1] - samples[0][1]) / elapsed
    power = statistics.mean(p for _, _, p in samples if p is not None)
    ratio = from_energy / power if power else float("nan")
    verdict = "ok" if 0.85 <= ratio <= 1.15 else "MISMATCH"
    return [f"{verdict} energy: {from_energy:.1f} W from hw.energy over {elapsed:.1f} s vs hw.power mean {power:.1f} W (ratio {ratio:.3f})"]


def _gpm_check(ctx: Context, ours: list, uuid: str) -> list[str]:
    gpm = {
        key: pick(ours, f"openlora.gpu.{key}", uuid)
        for key in ("sm.activity", "sm.occupancy", "tensor.activity", "dram.activity")
    }
    lines = [f"GPM (fractions, ours): {gpm}"]
    if ctx.dry:
        return lines
    if gpm["sm.activity"] is None:
        lines.append("GPM: no SM activity reported (GPM unsupported here?)")
    elif gpm["sm.activity"] < 0.5 or (gpm["tensor.activity"] or 0) < 0.05:
        lines.append(
            f"MISMATCH GPM: SM activity {gpm['sm.activity']} / tensor {gpm['tensor.activity']} "
            "under a saturating bf16 matmul load"
        )
    with contextlib.suppress(Exception):
        lines.append("nvidia-smi dmon -s u --gpm-metrics 2,3,5,10:\n" + ctx.smi.text("dmon", "-c", "2", "-s", "u", "--gpm-metrics", "2,3,5,10", timeout=15))
    return lines


def _process_memory_check(ctx: Context, ours: list, uuid: str) -> list[str]:
    mine = pick(ours, "openlora.process.gpu.memory.usage", uuid)
    line = f"this process's GPU memory (ours): {None if mine is None else mine / MIB:.1f} MiB" if mine is not None else "this process's GPU memory: not reported (ours)"
    if ctx.dry:
        return [line]
    with contextlib.suppress(Exception):
        apps = ctx.smi.text("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
        line += f"; nvidia-smi --query-compute-apps (pid, MiB): {apps.strip()!r}; our pid {os.getpid()}"
    return [line]


def _allocator_check(ctx: Context) -> list[str]:
    """The torch allocator gauges against torch.cuda, read with no load running."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    torch = ctx.torch
    reader = InMemoryMetricReader()
    telemetry = _telemetry(ctx, reader)
    try:
        held = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        found = points(reader.get_metrics_data())
        allocated = [v for m, _, v in found if m == "openlora.torch.memory.allocated"]
        reserved = [v for m, _, v in found if m == "openlora.torch.memory.reserved"]
        expect = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
        del held
    finally:
        telemetry.shutdown()
    same = allocated == [expect[0]] and reserved == [expect[1]]
    return [f"{'ok' if same else 'MISMATCH'} torch allocator: ours allocated {allocated} reserved {reserved}; torch.cuda {expect}"]


def stage_fields(ctx: Context, stage: dict[str, Any]) -> str:
    from openlora_otel.hardware import gpu
    from openlora_otel.hardware.nvml import (
        FI,
        R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
    )

    ids = sorted({(f.field_id, f.scope) for f in gpu.FIELDS} | {(74, 0), (75, 0), (76, 0), (R580_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, 0), (R580_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN, 0), (FI.CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN, 0), (FI.CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN, 0)})
    backend = ctx.backend()
    readings = []
    try:
        handle = backend.handle(0)
        with ctx.load():
            for _ in range(2):
                started = time.monotonic()
                answers = backend.field_values(handle, ids)
                readings.append({"t": round(started, 3), "answers": {f"{i}/{s}": a for (i, s), a in zip(ids, answers, strict=True)}})
                time.sleep(0 if ctx.dry else 2)
        performance = ctx.smi.text("-q", "-d", "PERFORMANCE")
    finally:
        backend.shutdown()
    first = readings[0]["answers"]
    known = [k for k, (status, _) in first.items() if status == 0]
    unknown = {k: status for k, (status, _) in first.items() if status != 0}
    names = {f"{f.field_id}/{f.scope}": f.key for f in gpu.FIELDS}
    stage["details"] = {
        "ids answered (id/scope -> our key)": {k: names.get(k, "(throttle candidate)") for k in known},
        "ids refused (id/scope -> nvmlReturn)": unknown,
        "readings 2 s apart (status, raw value)": readings,
        "nvidia-smi -q -d PERFORMANCE": performance[-3000:],
    }
    return f"{len(known)} field ids answered, {len(unknown)} refused ({', '.join(f'{k}: {v}' for k, v in unknown.items())})"


def stage_pcie(ctx: Context, stage: dict[str, Any]) -> str:
    """Copy a known number of bytes each way for about a second; read the byte counters right after,
    and again 0.25 s, 1 s and 3 s later (a counter the driver updates in arrears catches up), with
    the driver's own throughput figure (nvmlDeviceGetPcieThroughput, KB/s over 20 ms) sampled
    during the copy; and what ``hw.gpu.io`` moved by: a snapshot of our collector just before the
    copy and one just after (from GPM's rates where the GPU has them, else the fields)."""
    import pynvml

    from openlora_otel.hardware.gpu import GpuCollector
    from openlora_otel.hardware.nvml import FI

    torch = ctx.torch
    backend = ctx.backend()
    collector = None
    size = 1024 * MIB
    rounds = 48

    def ours() -> dict[str, float | None]:
        assert collector is not None
        values = collector.snapshot().readings[0].values
        return {"tx": values.get("pcie_tx"), "rx": values.get("pcie_rx")}

    def moved(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
        """(after - before) / bytes copied, per direction."""
        return {
            key: None if before[key] is None or after[key] is None else round((after[key] - before[key]) / copied, 4)
            for key in ("tx", "rx")
        }

    copied = size * rounds
    try:
        collector = GpuCollector(backend, devices="all", timeout_s=5.0, torch_devices=lambda: None)
        collector.snapshot()  # two snapshots: a GPU with GPM settles where its PCIe bytes come from at the second
        uuid = collector.snapshot().readings[0].device.uuid
        handle = backend.handle(0)
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        ids = [(FI.PCIE_COUNT_TX_BYTES, 0), (FI.PCIE_COUNT_RX_BYTES, 0)]
        results = {}
        for direction in ("host_to_device", "device_to_host"):
            torch.cuda.synchronize()
            time.sleep(1)
            raw_before = backend.field_values(handle, ids)
            before = {name: value for name, (_, value) in zip(("tx", "rx"), raw_before, strict=True)}
            ours_before = ours()
            rates: dict[str, list[float]] = {"tx": [], "rx": []}
            copying = threading.Event()
            copying.set()

            def sample(rates: dict[str, list[float]] = rates, copying: threading.Event = copying) -> None:
                while copying.is_set():
                    with contextlib.suppress(Exception):
                        for key, counter in (("tx", pynvml.NVML_PCIE_UTIL_TX_BYTES), ("rx", pynvml.NVML_PCIE_UTIL_RX_BYTES)):
                            rates[key].append(pynvml.nvmlDeviceGetPcieThroughput(handle, counter) * 1024 / 1e9)
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.perf_counter()
            for _ in range(rounds):
                if direction == "host_to_device":
                    device.copy_(host, non_blocking=True)
                else:
                    host.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            ours_after = ours()
            copying.clear()
            sampler.join(5)
            reads = {}
            for delay in (0.0, 0.25, 1.0, 3.0):
                time.sleep(max(0.0, started + seconds + delay - time.perf_counter()))
                after = {name: value for name, (_, value) in zip(("tx", "rx"), backend.field_values(handle, ids), strict=True)}
                reads[f"+{delay:g} s"] = moved(before, after)
            ours_later = ours()  # 3 s after the copy: what GPM counted in arrears, if anything
            results[direction] = {
                "bytes copied": copied,
                "seconds": round(seconds, 3),
                "GB/s (copied / time)": round(copied / seconds / 1e9, 2),
                "driver throughput GB/s during the copy (max tx, max rx)": (
                    round(max(rates["tx"], default=0), 2),
                    round(max(rates["rx"], default=0), 2),
                ),
                "counter delta / bytes copied (tx, rx), read after the copy at": reads,
                "raw before": raw_before,
                "hw.gpu.io delta / bytes copied (tx, rx)": moved(ours_before, ours_after),
                "hw.gpu.io delta / bytes copied (tx, rx), 3 s later": moved(ours_before, ours_later),
            }
        results["hw.gpu.io source"] = collector.reads.pcie_source(uuid)
    finally:
        if collector is not None:
            collector.close()
        backend.shutdown()
    stage["details"] = results
    h2d = results["host_to_device"]["counter delta / bytes copied (tx, rx), read after the copy at"]["+3 s"]
    d2h = results["device_to_host"]["counter delta / bytes copied (tx, rx), read after the copy at"]["+3 s"]
    ours_h2d = results["host_to_device"]["hw.gpu.io delta / bytes copied (tx, rx)"]
    ours_d2h = results["device_to_host"]["hw.gpu.io delta / bytes copied (tx, rx)"]
    return (
        f"3 s after copying {size * rounds / 2**30:.0f} GiB each way, counter delta / bytes copied: "
        f"host->device rx {h2d['rx']} (tx {h2d['tx']}), device->host tx {d2h['tx']} (rx {d2h['rx']}); "
        f"hw.gpu.io (from {results['hw.gpu.io source']}): host->device rx {ours_h2d['rx']}, "
        f"device->host tx {ours_d2h['tx']}"
    )


def stage_snapshot(ctx: Context, stage: dict[str, Any]) -> str:
    from openlora_otel.hardware.gpu import GpuCollector

    backend = Counting(ctx.backend())
    collector = GpuCollector(backend, devices="all", timeout_s=5.0, torch_devices=lambda: None)
    count = 50 if ctx.dry else ctx.args.snapshots
    try:
        collector.snapshot()  # discovery, XID registration, the link maximum
        times, calls = [], []
        per_call: Counter[str] = Counter()
        backend.seconds.clear()
        for _ in range(count):
            backend.calls.clear()
            started = time.perf_counter()
            snapshot = collector.snapshot()
            times.append(time.perf_counter() - started)
            calls.append(sum(backend.calls.values()))
            per_call.update(backend.calls)
        values = sum(len(r.values) for r in snapshot.readings)
    finally:
        collector.close()
        backend.shutdown()
    times.sort()
    stage["details"] = {
        "snapshots": count,
        "GPUs": len(snapshot.readings),
        "values per snapshot": values,
        "NVML calls per snapshot (median)": statistics.median(calls),
        "calls per snapshot by method": {k: round(v / count, 2) for k, v in sorted(per_call.items())},
        "ms per snapshot by method (mean)": {
            k: round(1000 * v / count, 3) for k, v in sorted(backend.seconds.items(), key=lambda kv: -kv[1])
        },
        "ms p50": round(1000 * times[len(times) // 2], 3),
        "ms p99": round(1000 * times[min(len(times) - 1, int(len(times) * 0.99))], 3),
        "ms max": round(1000 * times[-1], 3),
    }
    d = stage["details"]
    return f"{d['NVML calls per snapshot (median)']} NVML calls, {values} values; p50 {d['ms p50']} ms, p99 {d['ms p99']} ms, max {d['ms max']} ms over {count}"


def _run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run(command, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=timeout)


def stage_cuda_tests(ctx: Context, stage: dict[str, Any]) -> str:
    done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/hardware/test_cuda.py"], timeout=300)
    tail = (done.stdout + done.stderr).strip().splitlines()
    stage["details"] = {"exit": done.returncode, "output": tail[-30:]}
    stage["ok"] = done.returncode == 0
    return tail[-1] if tail else f"exit {done.returncode}"


def stage_demo_sync(ctx: Context, stage: dict[str, Any]) -> str:
    result_file = ctx.args.out / "demo_sync.json"
    steps = "40" if ctx.dry else "600"
    done = _run(
        [sys.executable, __file__, str(ctx.args.out), "--child", "demo_sync", "--device", ctx.device, "--child-steps", steps],
        timeout=300,
    )
    if done.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"the demo child exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    details = json.loads(result_file.read_text())
    stage["details"] = details
    # The demo's own progress line and evaluations do sync: seeing them shows the watch works.
    control = details["demo_syncs"] > 0 if details["sync_debug"] else True
    stage["ok"] = details["telemetry_syncs"] == 0 and details["steps"] > 0 and control
    mode = "sync debug mode warn" if details["sync_debug"] else "no sync debug mode (no CUDA)"
    return (
        f"{details['steps']} steps on {details['device']} ({mode}), {details['collections']} collections: "
        f"{details['telemetry_syncs']} syncs in the telemetry, {details['demo_syncs']} in the demo's own code, "
        f"{details['other_syncs']} elsewhere (the HF Trainer path's {details['hf_trainer']['steps']} steps included)"
    )


def child_demo_sync(out: Path, device: str, steps: int) -> None:
    """Run in a process of its own: the demo with a reader collecting, every sync attributed."""
    import logging
    import warnings

    import torch
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.demo.train import run_demo

    ctx_args = argparse.Namespace(dry_run=device == "cpu")
    ctx = Context(ctx_args)
    syncs: Counter[tuple[str, str]] = Counter()
    collecting = "gpu-check-collect"

    def classify(stack: list[traceback.FrameSummary], thread: str) -> tuple[str, str]:
        for frame in reversed(stack):
            path = frame.filename.replace("\\", "/")
            if "/openlora_otel/" in path:
                inside = path.split("/openlora_otel/", 1)[1]
                where = f"openlora_otel/{inside}:{frame.lineno} ({frame.name})"
                return ("demo" if inside.startswith(("demo/", "inference/")) else "telemetry"), where
        frames = [f for f in stack if not f.filename.endswith("warnings.py")]
        last = frames[-1] if frames else None
        where = f"{last.filename}:{last.lineno} ({last.name}) on thread {thread}" if last else f"? on thread {thread}"
        return ("telemetry" if thread == collecting else "other"), where

    original = warnings.showwarning

    def hook(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            syncs[classify(traceback.extract_stack()[:-1], threading.current_thread().name)] += 1
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = hook
    warnings.simplefilter("always")
    logged: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logging.getLogger("openlora_otel").addHandler(Capture(logging.WARNING))
    sync_debug = device != "cpu"
    collections = [0]

    def watched(options: DemoOptions) -> Any:
        """One demo run with its own telemetry, a reader collecting every 0.25 s, syncs watched."""
        reader = InMemoryMetricReader()
        telemetry = _telemetry(ctx, reader)
        stop = threading.Event()

        def collect() -> None:
            while not stop.wait(0.25):
                reader.get_metrics_data()
                collections[0] += 1

        collector = threading.Thread(target=collect, name=collecting, daemon=True)
        if sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        collector.start()
        try:
            return run_demo(options, telemetry, where="memory", out=io.StringIO())
        finally:
            stop.set()
            collector.join(10)
            if sync_debug:
                torch.cuda.set_sync_debug_mode(0)
            telemetry.shutdown()

    result = watched(DemoOptions(steps=steps, batch_size=16, eval_every=100, device=device))
    loop_syncs = Counter(syncs)
    # The Hugging Face Trainer path with our callback, under the same watch.
    hf = watched(DemoOptions(steps=max(10, steps // 10), batch_size=16, eval_every=0, device=device, hf_trainer=True))
    by_class: Counter[str] = Counter()
    for (kind, _), n in syncs.items():
        by_class[kind] += n
    hf_syncs: Counter[str] = Counter()
    for (kind, _), n in (syncs - loop_syncs).items():
        hf_syncs[kind] += n
    (out / "demo_sync.json").write_text(
        json.dumps(
            {
                "device": device,
                "sync_debug": sync_debug,
                "steps": result.steps,
                "seconds": round(result.seconds, 2),
                "tokens_per_s": round(result.tokens_per_s),
                "collections": collections[0],
                "telemetry_syncs": by_class["telemetry"],
                "demo_syncs": by_class["demo"],
                "other_syncs": by_class["other"],
                "hf_trainer": {"steps": hf.steps, "tokens_per_s": round(hf.tokens_per_s), "syncs": dict(hf_syncs)},
                "where": {f"{kind}: {where}": n for (kind, where), n in syncs.most_common(20)},
                "openlora_otel warnings": logged[:20],
            },
            indent=1,
        )
    )


def _pairs(lines: list[str], pattern: str) -> list[tuple[float, float]]:
    found = [re.search(pattern, line) for line in lines]
    return [(float(m.group(1)), float(m.group(2))) for m in found if m]


def stage_demo_speed(ctx: Context, stage: dict[str, Any]) -> str:
    pairs, steps = (1, 20) if ctx.dry else (ctx.args.pairs, 300)
    done = _run(
        [sys.executable, "benchmarks/bench_demo_overhead.py", "--pairs", str(pairs), "--steps", str(steps), "--device", ctx.device],
        timeout=400,
    )
    lines = (done.stdout + done.stderr).splitlines()
    found = _pairs(lines, r"on ([0-9.]+) steps/s, off ([0-9.]+) steps/s")
    if done.returncode != 0 or not found:
        raise RuntimeError(f"bench_demo_overhead exited {done.returncode}: {lines[-20:]}")
    ratios = [on / off for on, off in found]
    stage["details"] = {"steps per run": steps, "pairs (on, off steps/s)": found, "ratios": [round(r, 4) for r in ratios]}
    return (
        f"{steps}-step runs on {ctx.device}: median on {statistics.median(on for on, _ in found):.1f} steps/s, "
        f"off {statistics.median(off for _, off in found):.1f}; ratio median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f} to {max(ratios):.3f}, {len(found)} pairs)"
    )


def stage_serve_speed(ctx: Context, stage: dict[str, Any]) -> str:
    pairs, seconds, warmup = (1, 2, 1) if ctx.dry else (ctx.args.serve_pairs, ctx.args.serve_seconds, 2)
    done = _run(
        [
            sys.executable, "benchmarks/bench_serve_overhead.py", "--pairs", str(pairs), "--seconds", str(seconds),
            "--warmup", str(warmup), "--slots", "4", "--device", ctx.device,
        ],
        timeout=600,
    )  # fmt: skip
    lines = (done.stdout + done.stderr).splitlines()
    found = _pairs(lines, r"telemetry on ([0-9.]+) req/s .*off ([0-9.]+) req/s")
    if done.returncode != 0 or not found:
        raise RuntimeError(f"bench_serve_overhead exited {done.returncode}: {lines[-20:]}")
    ratios = [on / off for on, off in found if off]
    stage["details"] = {"counted seconds per side": seconds, "pairs (on, off req/s)": found, "lines": lines[-6:]}
    return (
        f"on {ctx.device}: median on {statistics.median(on for on, _ in found):.1f} req/s, "
        f"off {statistics.median(off for _, off in found):.1f}; ratio median {statistics.median(ratios):.3f} ({len(found)} pairs)"
    )


RUNNERS: dict[str, Callable[[Context, dict[str, Any]], str]] = {
    "env": stage_env,
    "values": stage_values,
    "fields": stage_fields,
    "pcie": stage_pcie,
    "snapshot": stage_snapshot,
    "cuda_tests": stage_cuda_tests,
    "demo_sync": stage_demo_sync,
    "demo_speed": stage_demo_speed,
    "serve_speed": stage_serve_speed,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="the fake NVML and the CPU (forced without CUDA)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    parser.add_argument("--snapshots", type=int, default=300, help="timed snapshots (default %(default)s)")
    parser.add_argument("--pairs", type=int, default=3, help="demo on/off pairs (default %(default)s)")
    parser.add_argument("--serve-pairs", type=int, default=2, help="serve on/off pairs (default %(default)s)")
    parser.add_argument(
        "--serve-seconds", type=float, default=10, help="counted seconds per serve side (default %(default)s)"
    )
    parser.add_argument("--budget-s", type=float, default=480, help="no stage starts after this (default %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--child-steps", type=int, default=600, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "demo_sync":
        child_demo_sync(args.out, args.device, args.child_steps)
        return 0
    chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in RUNNERS]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args)
    report = Report(args.out, ctx.dry)
    began = time.monotonic()
    failed = []
    for name in chosen:
        stage = report.stage(name)
        if ctx.dry and name in NEEDS_HARDWARE:
            stage.update(status="skipped", summary=f"dry run: {NEEDS_HARDWARE[name]}")
            report.write()
            continue
        if time.monotonic() - began > args.budget_s:
            stage.update(status="skipped", summary=f"past --budget-s {args.budget_s:g}")
            report.write()
            continue
        started = time.monotonic()
        print(f"[{time.monotonic() - began:6.1f} s] {name} ...", flush=True)
        try:
            stage["summary"] = RUNNERS[name](ctx, stage)
            stage["status"] = "ok" if stage.get("ok", True) else "FINDING"
        except Exception:
            stage["status"] = "error"
            stage["error"] = traceback.format_exc()
        stage["seconds"] = round(time.monotonic() - started, 1)
        if stage["status"] != "ok":
            failed.append(name)
        print(f"[{time.monotonic() - began:6.1f} s] {name}: {stage['status']}: {stage.get('summary', '')}", flush=True)
        report.write()
    report.data["seconds"] = round(time.monotonic() - began, 1)
    report.write()
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}; {len(failed)} stage(s) not ok: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The run's MeterProvider, built from configuration, and the hardware metrics attached to it.

:func:`build_provider` makes the Resource, the configured readers and the views into one SDK
provider, stopping what it started when a step fails; :class:`Hardware` holds the GPU and host
metrics of a ``Telemetry`` and stops them. Kept apart from ``telemetry.py`` so that the handle
is about the run's life, not about how its parts are put together.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import Meter, MeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader

from openlora_otel.config import ConfigError, TelemetryConfig
from openlora_otel.exporters.readers import build_readers
from openlora_otel.inference.metrics import inference_views
from openlora_otel.names import LOCAL_RANK_ATTRIBUTE, RUN_ID_ATTRIBUTE
from openlora_otel.run.resource import build_resource
from openlora_otel.training.metrics import collecting_for, step_duration_view
from openlora_otel.views import observable_views

__all__ = ["Hardware", "build_provider", "current_global_provider", "start_nvml"]

# The messages keep the logger they always had.
_logger = logging.getLogger("openlora_otel.telemetry")


def current_global_provider() -> MeterProvider | None:
    """The provider set with ``set_meter_provider``, or None while only the default proxy is there."""
    provider = metrics.get_meter_provider()
    # The API hands out a proxy until a real provider is set; it is private, so
    # recognise it by module rather than importing it.
    if type(provider).__name__ == "_ProxyMeterProvider":
        return None
    return provider


def start_nvml(config: TelemetryConfig) -> Any:
    """An initialized NVML backend, or None when GPU metrics are off or (with ``auto``) unavailable."""
    if config.gpu_metrics == "off":
        return None
    from openlora_otel._deps import MissingDependencyError
    from openlora_otel.hardware import nvml

    try:
        return nvml.start_backend()
    except nvml.NvmlUnavailable as exc:
        if config.gpu_metrics != "on":
            hint = " (pip install 'openlora-otel[gpu]')" if exc.missing_package else ""
            _logger.info("GPU metrics off: %s%s", exc, hint)
            return None
        if exc.missing_package:
            raise MissingDependencyError(
                "OPENLORA_GPU_METRICS=on needs the package 'nvidia-ml-py', which is not installed: "
                "pip install 'openlora-otel[gpu]'"
            ) from None
        raise ConfigError(
            "OPENLORA_GPU_METRICS", "on", "`auto` or `off` where NVML cannot start", str(exc)
        ) from None


def build_provider(
    config: TelemetryConfig,
    resource_attributes: Mapping[str, str | int | float | bool] | None,
    extra_readers: Sequence[MetricReader],
) -> tuple[SDKMeterProvider, Any, list[MetricReader]]:
    """Create the readers and the provider; on any failure, stop whatever was started.

    Returns the provider, the pull endpoint (or None) and every reader, each made to
    collect under its own key (:func:`~openlora_otel.training.metrics.collecting_for`).
    """
    resource = build_resource(config, extra_attributes=resource_attributes)
    if resource.attributes.get(RUN_ID_ATTRIBUTE) != config.run_id:  # pragma: no cover - invariant
        raise AssertionError("run id missing from the resource")

    built = build_readers(config, resource)
    readers, prometheus = built.readers, built.prometheus
    try:
        # shutdown_on_exit=False: our own atexit hook shuts down within the bound;
        # the SDK's would wait for its full export timeout on a dead endpoint.
        provider = SDKMeterProvider(
            metric_readers=[*readers, *extra_readers],
            resource=resource,
            shutdown_on_exit=False,
            views=[
                step_duration_view(exponential=config.exponential_histograms),
                *inference_views(exponential=config.exponential_histograms),
                *observable_views(),
            ],
        )
    except BaseException:
        built.close()
        raise
    provider._openlora_otel = True  # type: ignore[attr-defined]
    every = [*readers, *extra_readers]
    for reader in every:
        _collect_as_itself(reader)
    return provider, prometheus, every


def _collect_as_itself(reader: MetricReader) -> None:
    """Run ``reader``'s collections under its own key, so the training gauges it reads cover
    the steps since its own previous collection, not since any reader's.

    The provider hands each reader its collect function (``MetricReader._collect``, set by
    ``_set_collect_callback``); every path into a collection (a periodic export, a
    scrape, a flush, the final one) goes through it. Without it the reader shares the
    one window of readers we did not build.
    """
    inner = getattr(reader, "_collect", None)
    if not callable(inner):  # pragma: no cover - an SDK that collects differently
        _logger.debug("%s has no collect callback to key; it shares the training window", type(reader).__name__)
        return

    def collect(*args: Any, **kwargs: Any) -> Any:
        with collecting_for(reader):
            return inner(*args, **kwargs)

    reader._collect = collect  # type: ignore[method-assign]


class Hardware:
    """The GPU metrics (read through an NVML backend) and the host and process metrics of one
    ``Telemetry``; :meth:`stop` ends both."""

    def __init__(self) -> None:
        self.gpu: Any = None  # GpuMetrics
        self.host: Any = None  # HostMetrics
        self._nvml: Any = None

    def attach_gpu(self, meter: Meter, config: TelemetryConfig, backend: Any) -> None:
        """Register the GPU instruments on ``meter``, reading NVML through ``backend`` (already initialized)."""
        from openlora_otel.hardware.gpu import GpuCollector, GpuMetrics

        local_rank = config.resource_attributes.get(LOCAL_RANK_ATTRIBUTE)
        collector = GpuCollector(
            backend,
            devices=config.gpu_devices,
            cuda_visible_devices=config.cuda_visible_devices,
            local_rank=local_rank if isinstance(local_rank, int) else None,
            timeout_s=config.gpu_timeout_s,
        )
        self._nvml = backend
        self.gpu = GpuMetrics(meter, collector)

    def start_host(self, provider: MeterProvider, config: TelemetryConfig) -> None:
        """Start host and process metrics on ``provider``; a failure is logged and leaves them off."""
        if not config.host_metrics:
            return
        from openlora_otel.hardware.host import start_host_metrics

        try:
            self.host = start_host_metrics(
                provider,
                local_rank=config.resource_attributes.get(LOCAL_RANK_ATTRIBUTE),
                excluded=config.host_metrics_excluded,
            )
        except Exception:
            _logger.warning("host metrics off: starting them failed", exc_info=True)

    def stop(self) -> None:
        """Stop host metrics and shut NVML down (once); never raises."""
        if self.host is not None:
            # The provider is shut down: its callbacks no longer run; a later setup may instrument again.
            self.host.stop()
        if self._nvml is not None:
            try:
                if self.gpu is not None:
                    self.gpu.collector.close()  # the XID event set and GPM samples, before nvmlShutdown
                self._nvml.shutdown()
            except Exception:
                _logger.debug("nvmlShutdown failed", exc_info=True)
            self._nvml = None

"""`setup_telemetry()` and the `Telemetry` handle it returns.

One call builds one OpenTelemetry ``MeterProvider`` with the run's Resource and
the readers chosen by configuration, and registers it as the global provider
when none is set. Bad configuration fails here, before anything starts; once
running, export problems are logged and survived, and shutdown is bounded.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import Meter, MeterProvider, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from openlora_otel._version import __version__
from openlora_otel.config import SHUTDOWN_TIMEOUT_RANGE_MS, ConfigError, TelemetryConfig
from openlora_otel.exporters.readers import build_readers
from openlora_otel.inference.metrics import InferenceMetrics, inference_views
from openlora_otel.run.identity import decide_run_id, decided_run_id
from openlora_otel.run.info import RunInfo, normalize_hyperparameters
from openlora_otel.run.outcome import RunOutcome
from openlora_otel.run.resource import LOCAL_RANK_ATTRIBUTE, RUN_ID_ATTRIBUTE, build_resource
from openlora_otel.training.metrics import TrainingMetrics, collecting_for, step_duration_view
from openlora_otel.views import observed_total_views

__all__ = ["METER_NAME", "Telemetry", "setup_telemetry"]

_logger = logging.getLogger(__name__)

METER_NAME = "openlora_otel"

# The provider setup_telemetry() last made global, and whether its Telemetry is still open.
_global_lock = threading.Lock()
_global_owner: Telemetry | None = None


class Telemetry:
    """The handle returned by :func:`setup_telemetry`.

    ``meter`` is where instruments are created. ``shutdown()`` is idempotent,
    bounded by ``OPENLORA_SHUTDOWN_TIMEOUT`` and also runs at interpreter exit;
    the handle is a context manager that shuts down on exit.
    """

    def __init__(
        self,
        *,
        config: TelemetryConfig,
        meter_provider: MeterProvider,
        resource: Resource | None,
        owns_provider: bool,
        prometheus: Any = None,
        readers: Sequence[MetricReader] = (),
    ) -> None:
        self._config = config
        self._meter_provider = meter_provider
        self._resource = resource
        self._run_id = decided_run_id(config)
        self._owns_provider = owns_provider
        self._prometheus = prometheus
        self._readers = tuple(readers)  # each collects under its own key: its own training window
        self._meter = meter_provider.get_meter(METER_NAME, __version__)
        self._lock = threading.Lock()
        self._closed = False
        self._training: TrainingMetrics | None = None
        self._inference: Any = None
        self._gpu: Any = None
        self._nvml: Any = None
        self._host: Any = None
        self._sigterm: Any = None
        self._shutdown_done = threading.Event()
        self._shutdown_ok = True
        self._run = RunInfo(self._meter, config)
        self._outcome = RunOutcome(self._meter, config)
        # An exception printed before setup (an earlier one in a REPL) is not this run's.
        self._last_value_at_setup = getattr(sys, "last_value", None)
        atexit.register(self._shutdown_at_exit)

    # -- what it is ---------------------------------------------------------
    @property
    def config(self) -> TelemetryConfig:
        """The resolved configuration this handle was built from."""
        return self._config

    @property
    def meter_provider(self) -> MeterProvider:
        return self._meter_provider

    @property
    def meter(self) -> Meter:
        """The ``openlora_otel`` meter of :attr:`meter_provider`."""
        return self._meter

    @property
    def resource(self) -> Resource | None:
        """The Resource of our provider (None when disabled or reusing someone else's)."""
        return self._resource

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def history_path(self) -> str | None:
        """The run's history file (``OPENLORA_HISTORY_DIR``), or None when none is written."""
        if not (self._config.history_dir and self._owns_provider and self._resource is not None):
            return None
        from openlora_otel.exporters.history import history_path

        return str(history_path(self._config.history_dir, self._resource))

    @property
    def run_name(self) -> str:
        """The run's name: ``run_name`` / ``OPENLORA_RUN_NAME``, a callback's, else the run id."""
        return self._run.name

    @property
    def hyperparameters(self) -> dict[str, str]:
        """The hyperparameters on ``openlora.run.info``, as exported (normalized keys, text values)."""
        return self._run.hyperparameters

    def set_run_info(
        self, *, name: str | None = None, hyperparameters: Mapping[str, object] | None = None
    ) -> None:
        """Name the run and add hyperparameters to ``openlora.run.info`` (from the next collection on).

        Values set here override earlier ones, including those the Hugging Face and
        Lightning callbacks fill in. Keys become lowercase ``[a-z0-9_]`` (at most 40
        characters), values short text (at most 100 characters); at most 32 keys.
        The Resource keeps the name given at setup: it cannot change once built.
        """
        self._run.update(name=name, hyperparameters=hyperparameters, explicit=True)

    def fill_run_info(
        self, *, name: str | None = None, hyperparameters: Mapping[str, object] | None = None
    ) -> None:
        """What an integration found (a Trainer's run name, learning rate, LoRA rank): fills in,
        never overrides what the application gave."""
        self._run.update(name=name, hyperparameters=hyperparameters, explicit=False)

    @property
    def enabled(self) -> bool:
        """False for the no-op handle (``OTEL_SDK_DISABLED=true``)."""
        return not isinstance(self._meter_provider, NoOpMeterProvider)

    @property
    def owns_provider(self) -> bool:
        """False when an already-configured global provider was reused (see the README)."""
        return self._owns_provider

    @property
    def prometheus_url(self) -> str | None:
        """``http://host:port/metrics`` of the pull endpoint, or None when it is not enabled."""
        return self._prometheus.url if self._prometheus is not None else None

    def where_metrics_go(self) -> str:
        """Where the metrics go, in one phrase: ``served at http://localhost:9464/metrics and written to
        PATH every 5 s``. The one answer that setup's announcement, the demo and the server print."""
        config = self._config
        if not self.enabled:
            return "off (OTEL_SDK_DISABLED=true)"
        if not self._owns_provider:
            return "to the readers of the MeterProvider the application set up before (reused)"
        every = f"every {config.export_interval_ms / 1000:g} s"
        places = []
        if self.prometheus_url:
            places.append(f"served at {self.prometheus_url}")
        if "otlp" in config.enabled_exporters:
            places.append(f"pushed to {config.otlp.redacted_endpoint()} (OTLP {config.otlp.protocol}) {every}")
        if "console" in config.enabled_exporters:
            places.append(f"printed {every}")
        if self.history_path is not None:
            places.append(f"written to {self.history_path} every {config.history_interval_ms / 1000:g} s")
        return " and ".join(places) or "not exported (OTEL_METRICS_EXPORTER=none)"

    @property
    def training(self) -> TrainingMetrics:
        """The run's :class:`~openlora_otel.training.metrics.TrainingMetrics` (created on first use, one per handle)."""
        with self._lock:
            if self._training is None:
                # Our own provider has step_duration_view(): windows merge in O(buckets).
                self._training = TrainingMetrics(
                    self._meter,
                    window_histogram=self._owns_provider,
                    peak_flops=self._config.peak_flops,
                    readers=self._readers,
                    run_id=self.run_id,
                    attempt=self._config.run_attempt,
                )
                if self._closed:
                    self._training.close()
            return self._training

    @property
    def inference(self) -> InferenceMetrics:
        """The process's :class:`~openlora_otel.inference.InferenceMetrics` for a server (created on first use)."""
        with self._lock:
            if self._inference is None:
                # Our own provider has inference_views(): a request's end only bisects into windows.
                self._inference = InferenceMetrics(
                    self._meter,
                    max_adapters=self._config.inference_max_adapters,
                    window_histogram=self._owns_provider,
                )
            return self._inference

    @property
    def gpu(self) -> Any:
        """The :class:`~openlora_otel.hardware.gpu.GpuMetrics` when GPU metrics are on, else None."""
        return self._gpu

    def _attach_gpu(self, backend: Any) -> None:
        """Register the GPU instruments on our meter, reading NVML through ``backend`` (already initialized)."""
        from openlora_otel.hardware.gpu import GpuCollector, GpuMetrics

        config = self._config
        local_rank = config.resource_attributes.get(LOCAL_RANK_ATTRIBUTE)
        collector = GpuCollector(
            backend,
            devices=config.gpu_devices,
            cuda_visible_devices=config.cuda_visible_devices,
            local_rank=local_rank if isinstance(local_rank, int) else None,
            timeout_s=config.gpu_timeout_s,
        )
        self._nvml = backend
        self._gpu = GpuMetrics(self._meter, collector)

    @property
    def host(self) -> Any:
        """The :class:`~openlora_otel.hardware.host.HostMetrics` when host and process metrics run, else None."""
        return self._host

    def _attach_host(self) -> None:
        """Start host and process metrics on our provider; a failure is logged and leaves them off."""
        config = self._config
        if not config.host_metrics:
            return
        from openlora_otel.hardware.host import start_host_metrics

        try:
            self._host = start_host_metrics(
                self._meter_provider,
                local_rank=config.resource_attributes.get(LOCAL_RANK_ATTRIBUTE),
                excluded=config.host_metrics_excluded,
            )
        except Exception:
            _logger.warning("host metrics off: starting them failed", exc_info=True)

    @property
    def is_shutdown(self) -> bool:
        return self._closed

    @property
    def outcome(self) -> str:
        """How the run ended, as ``openlora.run.outcome`` reports it: ``running`` until ``shutdown()``
        begins, then ``finished``, ``stopped_by_guard``, ``terminated`` or ``failed``."""
        return self._outcome.outcome

    def _decide_outcome(self) -> None:
        """Settle ``openlora.run.outcome`` before the final collection (see :mod:`openlora_otel.run.outcome`)."""
        try:
            # A shutdown() called inside an `except` block: that exception ends the run.
            self._outcome.note_exception(sys.exc_info()[1])
            guard = getattr(self._training, "_guard", None) if self._training is not None else None
            outcome = self._outcome.decide(guard_tripped=bool(guard is not None and guard.tripped))
            _logger.debug("run %s outcome: %s", self._run_id, outcome)
        except Exception:  # pragma: no cover - nothing above raises; the shutdown matters more
            _logger.debug("deciding the run's outcome failed", exc_info=True)

    def __repr__(self) -> str:
        state = "shut down" if self._closed else ("enabled" if self.enabled else "disabled")
        return f"<Telemetry {state} run_id={self._run_id!r} exporters={self._config.enabled_exporters}>"

    # -- lifecycle ----------------------------------------------------------
    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Collect and export now; True when every reader finished within ``timeout_s``.

        Defaults to the shutdown bound. A no-op after shutdown. Raises only for a
        ``timeout_s`` that is not a number of seconds in (0, 600] (``TypeError``
        for a non-number, ``ValueError`` otherwise); export problems never raise.
        """
        timeout = _timeout_argument(timeout_s, self._config.shutdown_timeout_s)
        if self._closed or not self.enabled:
            return not self._closed
        return self._flush(timeout)

    def _flush(self, timeout: float) -> bool:
        flush = getattr(self._meter_provider, "force_flush", None)
        if flush is None:
            return True
        return _run_bounded(lambda: flush(timeout_millis=timeout * 1000), timeout, "force_flush")

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Final collect and export, then stop every reader and the pull endpoint.

        When the pull endpoint has been scraped (or, with
        ``OPENLORA_PROMETHEUS_EXPECT_SCRAPE=true``, even when it has not been yet), it
        first waits for one more scrape so the run's final values reach Prometheus (at
        most ``OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT``, and about 1.5 observed scrape
        intervals once two scrapes were seen). The rest returns within ``timeout_s`` (default
        ``OPENLORA_SHUTDOWN_TIMEOUT``) even when the OTLP endpoint hangs; True when
        everything finished in time. Idempotent and safe from any thread: a call
        while another thread is shutting down waits for it (within its own
        bound). Never raises, except for a ``timeout_s`` that is not a number of
        seconds in (0, 600] (``TypeError`` / ``ValueError``; then nothing is changed).

        It first settles :attr:`outcome` (``openlora.run.outcome``), so that the final
        collection says how the run ended; called inside an ``except`` block, that
        exception counts as the run's end (``failed``). Last, the progress file of
        ``training.track_progress()`` gets every step recorded, whatever the exporter.
        """
        timeout = _timeout_argument(timeout_s, self._config.shutdown_timeout_s)
        with self._lock:
            closing_elsewhere = self._closed
            self._closed = True
        if closing_elsewhere:
            self._shutdown_done.wait(timeout + self._config.final_scrape_timeout_s)
            return self._shutdown_ok and self._shutdown_done.is_set()
        atexit.unregister(self._shutdown_at_exit)
        self._decide_outcome()
        if self._sigterm is not None:
            # The main thread may now sit in the waits below: not a thread stuck in C code.
            self._sigterm.shutdown_started()
        ok = True
        deadline = time.monotonic() + timeout
        try:
            if self._training is not None:
                # No record after this point: the final collection below holds every accepted step.
                self._training.close()
                # The guard's thread ends now, not during interpreter exit (bounded: a check gives up
                # its read-back at once on close).
                self._training.join_guard(min(0.5, timeout * 0.25))
            # Keep a slice of the bound for closing the endpoint and joining its threads.
            reserve = min(0.25, timeout * 0.2)
            flush_first = self._will_wait_for_final_scrape() and self._config.enabled_exporters != (
                "prometheus",
            )
            if flush_first:
                # Push exporters deliver first: a SIGTERM grace period (10 s under docker stop)
                # may not outlast the wait for the scraper. The bound then covers both exports.
                ok = self._flush(max(0.001, timeout - reserve))
            self._wait_for_final_scrape()
            if not flush_first:
                deadline = time.monotonic() + timeout
            budget = max(0.001, deadline - time.monotonic() - reserve)
            if self._owns_provider and isinstance(self._meter_provider, SDKMeterProvider):
                provider = self._meter_provider
                ok = (
                    _run_bounded(lambda: provider.shutdown(timeout_millis=budget * 1000), budget, "shutdown")
                    and ok
                )
            elif self.enabled:
                # Someone else's provider: deliver what we recorded, leave its lifecycle alone.
                ok = self._flush(budget) and ok
            self._save_progress(deadline)
        except Exception:  # pragma: no cover - every step above is already guarded
            _logger.warning("telemetry shutdown failed part-way; releasing what it holds", exc_info=True)
            ok = False
        finally:
            ok = self._release(deadline) and ok
            self._shutdown_ok = ok
            self._shutdown_done.set()
        return ok

    def _save_progress(self, deadline: float) -> None:
        """The progress file (``training.track_progress``) gets every step, whatever the exporter: a pull
        endpoint nobody scraped at the end (or ever), or no exporter, collected none of the last ones."""
        if self._training is not None:
            self._training.save_progress(max(0.05, min(1.0, deadline - time.monotonic())))

    def _will_wait_for_final_scrape(self) -> bool:
        endpoint = self._prometheus
        return (
            endpoint is not None
            and self._config.final_scrape_timeout_s > 0
            and (endpoint.scrapes > 0 or self._config.expect_scrape)
        )

    def _wait_for_final_scrape(self) -> None:
        """Serve until the scraper that has been scraping us collected once more (bounded)."""
        endpoint = self._prometheus
        if endpoint is None or not self._will_wait_for_final_scrape():
            return
        limit = self._config.final_scrape_timeout_s
        interval = endpoint.scrape_interval()
        if interval is not None:
            limit = min(limit, 1.5 * interval + 0.5)
        started = time.monotonic()
        if endpoint.wait_for_scrape(after=started, timeout_s=limit):
            _logger.debug("final values scraped after %.2f s", time.monotonic() - started)
        else:
            _logger.info(
                "openlora-otel: no scrape within %.1f s of shutdown; the last %.1f s of the run may be missing "
                "in Prometheus (OPENLORA_PROMETHEUS_FINAL_SCRAPE_TIMEOUT)",
                limit,
                limit,
            )

    def _release(self, deadline: float) -> bool:
        """Stop host metrics, NVML, the endpoint and the SIGTERM guard, and free the global slot; never raises."""
        ok = True
        if self._host is not None:
            # The provider is shut down: its callbacks no longer run; a later setup may instrument again.
            self._host.stop()
        if self._nvml is not None:
            try:
                if self._gpu is not None:
                    self._gpu.collector.close()  # the XID event set and GPM samples, before nvmlShutdown
                self._nvml.shutdown()
            except Exception:
                _logger.debug("nvmlShutdown failed", exc_info=True)
            self._nvml = None
        if self._prometheus is not None:
            try:
                ok = self._prometheus.close(max(0.05, deadline - time.monotonic()))
            except Exception:  # pragma: no cover - close() never raises
                _logger.debug("closing the Prometheus endpoint failed", exc_info=True)
                ok = False
        if self._sigterm is not None:
            try:
                self._sigterm.uninstall()
            except Exception:  # pragma: no cover
                _logger.debug("removing the SIGTERM handler failed", exc_info=True)
        _release_global(self)
        return ok

    def _shutdown_at_exit(self) -> None:
        # An uncaught exception ended the script: Python printed it (setting sys.last_value) before
        # running atexit. Not in an interactive session, where an earlier error does not end it.
        last = getattr(sys, "last_value", None)
        if last is not None and last is not self._last_value_at_setup and not hasattr(sys, "ps1"):
            self._outcome.note_exception(last)
        self.shutdown()

    def _shutdown_on_sigterm(self) -> None:
        """What the SIGTERM guard runs before exiting with 143."""
        self._outcome.note_signal(signal.SIGTERM)
        self.shutdown()

    def _flush_on_chained_sigterm(self) -> None:
        """An application handler called ours: the run is being stopped by SIGTERM, its way."""
        self._outcome.note_signal(signal.SIGTERM)
        self.force_flush()
        if not self._closed:
            self._save_progress(time.monotonic() + self._config.shutdown_timeout_s)

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._outcome.note_exception(exc)
        self.shutdown()


# Longest bound shutdown()/force_flush() accept, as OPENLORA_SHUTDOWN_TIMEOUT: past it a wait is a hang.
MAX_TIMEOUT_S = SHUTDOWN_TIMEOUT_RANGE_MS[1] / 1000.0


def _timeout_argument(value: object, default: float) -> float:
    """``timeout_s`` as given, checked: a real number of seconds in (0, MAX_TIMEOUT_S]; None is ``default``.

    A Python int or float, or a NumPy integer or float scalar (``np.int64(2)``, what
    arithmetic on NumPy values gives); a bool, NumPy's included, is refused.
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        numpy = sys.modules.get("numpy")  # not imported: the value cannot be a NumPy scalar
        if numpy is None or not isinstance(value, (numpy.integer, numpy.floating)):  # np.bool_ is neither
            raise TypeError(
                f"timeout_s must be a number of seconds (a Python or NumPy int or float), got {type(value).__name__}"
            )
        value = float(value)
    if not 0.0 < value <= MAX_TIMEOUT_S:  # also refuses NaN
        raise ValueError(f"timeout_s must be > 0 and <= {MAX_TIMEOUT_S:g} seconds, got {value!r}")
    return float(value)


def _run_bounded(fn: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout_s``; True if it finished and did not fail."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(fn())
        except Exception:
            _logger.warning("telemetry %s raised; ignored", what, exc_info=True)
            outcome.append(False)

    worker = threading.Thread(target=target, name=f"openlora-otel-{what}", daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        _logger.warning(
            "telemetry %s did not finish within %.1f s (export endpoint unreachable or slow?); "
            "giving up on it so the program can go on",
            what,
            timeout_s,
        )
        return False
    _logger.debug("telemetry %s took %.3f s", what, time.monotonic() - started)
    return outcome[0] is not False


def _current_global_provider() -> MeterProvider | None:
    """The provider set with ``set_meter_provider``, or None while only the default proxy is there."""
    provider = metrics.get_meter_provider()
    # The API hands out a proxy until a real provider is set; it is private, so
    # recognise it by module rather than importing it.
    if type(provider).__name__ == "_ProxyMeterProvider":
        return None
    return provider


def _release_global(telemetry: Telemetry) -> None:
    global _global_owner
    with _global_lock:
        if _global_owner is telemetry:
            _global_owner = None


def setup_telemetry(
    service_name: str | None = None,
    *,
    run_id: str | None = None,
    run_name: str | None = None,
    hyperparameters: Mapping[str, object] | None = None,
    resource_attributes: Mapping[str, str | int | float | bool] | None = None,
    config: TelemetryConfig | None = None,
    metric_readers: Sequence[MetricReader] = (),
) -> Telemetry:
    """Build the run's MeterProvider from configuration and return its :class:`Telemetry` handle.

    ``config`` defaults to :meth:`TelemetryConfig.from_env`; explicit
    ``service_name``, ``run_id`` and ``run_name`` win over it, and ``resource_attributes``
    are added to the Resource on top of ``OTEL_RESOURCE_ATTRIBUTES``.
    ``run_name`` and ``hyperparameters`` (a mapping of names to numbers, strings,
    booleans or lists) label the run on the ``openlora.run.info`` series (see
    :meth:`Telemetry.set_run_info`); the name is also the Resource's ``openlora.run.name``.
    ``metric_readers`` are extra readers attached next to the configured ones
    (an ``InMemoryMetricReader`` in tests, a custom exporter's reader).

    Raises :class:`~openlora_otel.config.ConfigError` for invalid configuration
    (including a Prometheus port that cannot be bound) and
    :class:`~openlora_otel._deps.MissingDependencyError` when the chosen exporter's
    package is missing; nothing is left running in either case. Raises
    ``RuntimeError`` if an earlier ``Telemetry`` of this process is still open.

    When another global MeterProvider is already set (for example by
    ``opentelemetry-instrument``), it is reused: our meter comes from it, no
    second provider is built, and ``shutdown()`` only flushes it.
    """
    global _global_owner
    config = config if config is not None else TelemetryConfig.from_env()
    if service_name is not None:
        if not service_name:
            raise ConfigError("service_name", service_name, "a non-empty string")
        config = config.replace(service_name=service_name)
    if run_id is not None and not run_id:
        raise ConfigError("run_id", run_id, "a non-empty string")
    if run_name is not None:
        config = config.replace(run_name=run_name)
    hyperparameters = normalize_hyperparameters(hyperparameters)  # a TypeError now, before anything starts
    config = decide_run_id(config, run_id)

    if config.sdk_disabled:
        _logger.info("OTEL_SDK_DISABLED=true: telemetry is a no-op")
        telemetry = Telemetry(
            config=config,
            meter_provider=NoOpMeterProvider(),
            resource=None,
            owns_provider=False,
        )
        telemetry.set_run_info(hyperparameters=hyperparameters)
        return telemetry

    with _global_lock:
        if _global_owner is not None and not _global_owner.is_shutdown:
            raise RuntimeError(
                "setup_telemetry() was already called in this process and that Telemetry is still open; "
                "use it (telemetry.meter, telemetry.training) or call its shutdown() first"
            )
        existing = _current_global_provider()
        # NVML first: with OPENLORA_GPU_METRICS=on a missing driver fails here, before anything runs.
        nvml = _start_nvml(config)
        ours_before = existing is not None and getattr(existing, "_openlora_otel", False)
        if existing is not None and not ours_before:
            _logger.info(
                "a global MeterProvider (%s) is already configured, probably by opentelemetry-instrument; "
                "openlora-otel records into it and does not build its own exporters",
                type(existing).__name__,
            )
            telemetry = Telemetry(
                config=config,
                meter_provider=existing,
                resource=getattr(existing, "_sdk_config", None) and existing._sdk_config.resource,  # type: ignore[attr-defined]
                owns_provider=False,
            )
            if nvml is not None:
                telemetry._attach_gpu(nvml)
            if config.host_metrics:
                _logger.info(
                    "host metrics are not added to a MeterProvider openlora-otel does not own "
                    "(opentelemetry-instrument starts opentelemetry-instrumentation-system-metrics on it, when installed)"
                )
            if config.history_dir:
                _logger.warning(
                    "OPENLORA_HISTORY_DIR is set but no history file is written: the SDK cannot add a reader "
                    "to a MeterProvider that is already built (%s)",
                    type(existing).__name__,
                )
            telemetry.set_run_info(hyperparameters=hyperparameters)
            _global_owner = telemetry
            _install_sigterm(telemetry)
            return telemetry

        try:
            provider, prometheus, readers = _build_provider(config, resource_attributes, metric_readers)
        except BaseException:
            if nvml is not None:
                nvml.shutdown()
            raise
        if existing is None:
            metrics.set_meter_provider(provider)
        else:
            # The SDK refuses to replace a global provider; an earlier, already shut
            # down openlora-otel provider stays global. Ours is still fully usable
            # through telemetry.meter.
            _logger.debug("an earlier openlora-otel provider stays the global one")
        telemetry = Telemetry(
            config=config,
            meter_provider=provider,
            resource=provider._sdk_config.resource,
            owns_provider=True,
            prometheus=prometheus,
            readers=readers,
        )
        if nvml is not None:
            telemetry._attach_gpu(nvml)
        telemetry._attach_host()
        telemetry.set_run_info(hyperparameters=hyperparameters)
        _global_owner = telemetry
    _install_sigterm(telemetry)
    _announce(telemetry)
    return telemetry


def _install_sigterm(telemetry: Telemetry) -> None:
    if not telemetry.config.handle_sigterm:
        return
    from openlora_otel.run.sigterm import SigtermGuard

    telemetry._sigterm = SigtermGuard.install(telemetry._shutdown_on_sigterm, telemetry._flush_on_chained_sigterm)


def _announce(telemetry: Telemetry) -> None:
    """Say once where the metrics go: through logging when it shows INFO, else on standard error."""
    config = telemetry.config
    message = f"openlora-otel: run {telemetry.run_id}: metrics {telemetry.where_metrics_go()}"
    if _logger.isEnabledFor(logging.INFO) and _logger.hasHandlers():
        _logger.info("%s", message)
    elif not config.quiet:
        try:
            sys.stderr.write(message + " (OPENLORA_QUIET=true hides this line)\n")
            sys.stderr.flush()
        except Exception:  # a closed or broken stderr must not fail setup
            pass


def _start_nvml(config: TelemetryConfig) -> Any:
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


def _build_provider(
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
            views=[step_duration_view(), *inference_views(), *observed_total_views()],
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

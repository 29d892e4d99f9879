"""`setup_telemetry()` and the `Telemetry` handle it returns.

One call builds one OpenTelemetry ``MeterProvider`` with the run's Resource and
the readers chosen by configuration, and registers it as the global provider
when none is set. Bad configuration fails here, before anything starts; once
running, export problems are logged and survived, and shutdown is bounded.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import Meter, MeterProvider, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from openlora_otel._version import __version__
from openlora_otel.config import ConfigError, TelemetryConfig
from openlora_otel.inference.metrics import InferenceMetrics
from openlora_otel.provider import Hardware, build_provider, current_global_provider, start_nvml
from openlora_otel.run.identity import decide_run_id, decided_run_id
from openlora_otel.run.info import RunInfo, normalize_hyperparameters
from openlora_otel.run.outcome import RunOutcome
from openlora_otel.shutdown import (
    run_bounded,
    timeout_argument,
    wait_for_final_scrape,
    will_wait_for_final_scrape,
)
from openlora_otel.training.metrics import TrainingMetrics

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
        nvml: Any = None,
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
        self._pid = os.getpid()  # the process whose readers export; a forked child's records are lost
        self._training: TrainingMetrics | None = None
        self._inference: Any = None
        self._hardware = Hardware()
        self._sigterm: Any = None
        self._shutdown_done = threading.Event()
        self._shutdown_ok = True
        self._run = RunInfo(self._meter, config)
        self._outcome = RunOutcome(self._meter, config)
        if nvml is not None:  # an initialized NVML backend: GPU metrics on our meter
            self._hardware.attach_gpu(self._meter, config, nvml)
        if owns_provider:
            self._hardware.start_host(meter_provider, config)
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
        from openlora_otel.exporters.history_writer import history_path

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
                    exponential_histograms=self._owns_provider and self._config.exponential_histograms,
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
                    exponential_histograms=self._owns_provider and self._config.exponential_histograms,
                    exporting_pid=self._pid,
                )
            return self._inference

    @property
    def gpu(self) -> Any:
        """The :class:`~openlora_otel.hardware.gpu.GpuMetrics` when GPU metrics are on, else None."""
        return self._hardware.gpu

    @property
    def host(self) -> Any:
        """The :class:`~openlora_otel.hardware.host.HostMetrics` when host and process metrics run, else None."""
        return self._hardware.host

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
        timeout = timeout_argument(timeout_s, self._config.shutdown_timeout_s)
        if self._closed or not self.enabled:
            return not self._closed
        return self._flush(timeout)

    def _flush(self, timeout: float) -> bool:
        flush = getattr(self._meter_provider, "force_flush", None)
        if flush is None:
            return True
        return run_bounded(lambda: flush(timeout_millis=timeout * 1000), timeout, "force_flush")

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
        timeout = timeout_argument(timeout_s, self._config.shutdown_timeout_s)
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
            flush_first = will_wait_for_final_scrape(self._prometheus, self._config) and (
                self._config.enabled_exporters != ("prometheus",)
            )
            if flush_first:
                # Push exporters deliver first: a SIGTERM grace period (10 s under docker stop)
                # may not outlast the wait for the scraper. The bound then covers both exports.
                ok = self._flush(max(0.001, timeout - reserve))
            wait_for_final_scrape(self._prometheus, self._config)
            if not flush_first:
                deadline = time.monotonic() + timeout
            budget = max(0.001, deadline - time.monotonic() - reserve)
            if self._owns_provider and isinstance(self._meter_provider, SDKMeterProvider):
                provider = self._meter_provider
                ok = (
                    run_bounded(lambda: provider.shutdown(timeout_millis=budget * 1000), budget, "shutdown")
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

    def _release(self, deadline: float) -> bool:
        """Stop host metrics, NVML, the endpoint and the SIGTERM guard, and free the global slot; never raises."""
        ok = True
        self._hardware.stop()
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
        existing = current_global_provider()
        # NVML first: with OPENLORA_GPU_METRICS=on a missing driver fails here, before anything runs.
        nvml = start_nvml(config)
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
                nvml=nvml,
            )
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
            provider, prometheus, readers = build_provider(config, resource_attributes, metric_readers)
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
            nvml=nvml,
        )
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

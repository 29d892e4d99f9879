"""The bounds of ``Telemetry.force_flush()`` and ``shutdown()``: checked timeouts, each wait on a
thread of its own, and the wait for the final scrape.

A flush or a shutdown must return in time even when an export endpoint hangs, so that a
stopped job ends before its launcher kills it; everything here gives up rather than wait longer.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from openlora_otel.config import SHUTDOWN_TIMEOUT_RANGE_MS, TelemetryConfig

__all__ = ["MAX_TIMEOUT_S", "run_bounded", "timeout_argument", "wait_for_final_scrape", "will_wait_for_final_scrape"]

# The messages keep the logger they always had.
_logger = logging.getLogger("openlora_otel.telemetry")

# Longest bound shutdown()/force_flush() accept, as OPENLORA_SHUTDOWN_TIMEOUT: past it a wait is a hang.
MAX_TIMEOUT_S = SHUTDOWN_TIMEOUT_RANGE_MS[1] / 1000.0


def timeout_argument(value: object, default: float) -> float:
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


def run_bounded(fn: Callable[[], object], timeout_s: float, what: str) -> bool:
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


def will_wait_for_final_scrape(endpoint: Any, config: TelemetryConfig) -> bool:
    """Whether the shutdown waits for one more scrape of the pull ``endpoint`` (None when there is none)."""
    return (
        endpoint is not None
        and config.final_scrape_timeout_s > 0
        and (endpoint.scrapes > 0 or config.expect_scrape)
    )


def wait_for_final_scrape(endpoint: Any, config: TelemetryConfig) -> None:
    """Serve until the scraper that has been scraping us collected once more (bounded)."""
    if endpoint is None or not will_wait_for_final_scrape(endpoint, config):
        return
    limit = config.final_scrape_timeout_s
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

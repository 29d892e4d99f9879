"""Reading what was collected: points and values of an in-memory collection, the series a Prometheus
endpoint serves, and a gauge that makes a collection run past its deadline."""

from __future__ import annotations

import time

from opentelemetry.sdk.metrics.export import MetricsData


def points(data: MetricsData | None, name: str) -> list:
    """All data points of the metric called ``name`` in ``data``."""
    found = []
    if data is None:
        return found
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


def value(data: MetricsData | None, name: str, **attributes: object) -> float | None:
    """The value of the one point of ``name`` whose attributes are exactly ``attributes`` (None if absent)."""
    found = [p for p in points(data, name) if dict(p.attributes) == attributes]
    return found[0].value if found else None


def served_series(url: str) -> set[str]:
    """Names of the series a Prometheus /metrics endpoint serves right now."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read().decode()
    return {
        line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")
    }


class SlowOnce:
    """An observable gauge whose first callback is slow, registered after the instruments under test.

    The SDK checks its collect deadline before each instrument's callback, so the
    instrument after it raises MetricsTimeoutError: the collection is aborted after
    the earlier callbacks ran, as a slow NVML call or a user's slow callback would do.
    """

    def __init__(self, meter, seconds: float = 0.3) -> None:
        self.left = 1
        self.seconds = seconds
        meter.create_observable_gauge("test.slow", callbacks=[self])
        meter.create_observable_gauge("test.after", callbacks=[lambda options: []])

    def __call__(self, options):
        if self.left:
            self.left -= 1
            time.sleep(self.seconds)
        return []

"""What the whole catalogue shares: :class:`MetricSpec`, the Prometheus series name of a metric on
each path (:func:`prometheus_name`), and the attribute keys more than one domain uses.

Names follow the OpenTelemetry conventions (``openlora.*`` where none exists), with units chosen
so the Prometheus name is the same pulled or pushed over OTLP: dimensionless gauges have an empty
unit (``1`` gets ``_ratio`` on the push path alone), counts a ``{annotation}``. See docs/concepts/names.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["ATTR_ERROR_TYPE", "Kind", "MetricSpec", "histogram_quantile", "prometheus_name"]

Kind = Literal["gauge", "counter", "histogram", "updowncounter"]

# The semantic conventions' `error.type`: the exception's type on a failed run (openlora.run.outcome),
# request or adapter load (openlora_otel.inference).
ATTR_ERROR_TYPE = "error.type"


@dataclass(frozen=True)
class MetricSpec:
    """One instrument: OpenTelemetry name, kind, unit, meaning, and the seeds' name it replaces (if any)."""

    name: str
    kind: Kind
    unit: str
    description: str
    seed_name: str = ""

    @property
    def prometheus(self) -> str:
        """The Prometheus series name (histograms: the base of ``_bucket``/``_sum``/``_count``)."""
        return prometheus_name(self.name, self.unit, self.kind, path="pull")

    @property
    def prometheus_collector(self) -> str:
        """The series name when it arrives through the Collector's Prometheus exporter."""
        return prometheus_name(self.name, self.unit, self.kind, path="collector")


_UNITS = {
    "s": "seconds", "ms": "milliseconds", "By": "bytes", "W": "watts", "J": "joules",
    "Cel": "celsius", "Hz": "hertz", "%": "percent", "1": "",
}  # fmt: skip
_PER = {"s": "second", "m": "minute", "h": "hour", "d": "day"}


def histogram_quantile(q: float | str, histogram: str, by: Sequence[str], inner: Callable[[str], str]) -> str:
    """PromQL for the ``q``-quantile of ``histogram`` (its Prometheus base name) summed ``by`` these labels,
    whether it is stored as classic buckets (``<histogram>_bucket`` with ``le``: pulled, or pushed with
    explicit buckets) or as native histograms (``<histogram>``: exponential ones through Prometheus 3).

    ``inner(series)`` writes the vector to sum around a series name (``rate(...)`` and any join). The two
    forms are joined with ``or``: each store holds one of them, and VictoriaMetrics, which has no native
    histograms, parses this too.
    """
    labels = ", ".join(by)
    classic = f"sum by (le{', ' + labels if labels else ''}) ({inner(histogram + '_bucket')})"
    native = f"sum by ({labels}) ({inner(histogram)})" if labels else f"sum ({inner(histogram)})"
    return f"histogram_quantile({q}, {classic} or {native})"


def prometheus_name(name: str, unit: str, kind: Kind, *, path: Literal["pull", "collector"] = "pull") -> str:
    """Translate an OpenTelemetry metric to its Prometheus series name on one of the two paths.

    ``pull``: opentelemetry-exporter-prometheus (unit ``1`` adds nothing).
    ``collector``: pushed over OTLP (unit ``1`` on a gauge adds ``_ratio``): the Collector's
    prometheus and prometheus_remote_write exporters, and Prometheus 3's OTLP receiver, name alike
    (the tests check every name against each of them).
    Both drop ``{annotations}``, map ``s``/``By``/... to words, ``X/s`` to ``X_per_second``,
    and add ``_total`` to monotonic counters.
    """
    base = re.sub(r"[^a-zA-Z0-9:]+", "_", name)
    stripped = re.sub(r"\{.*?\}", "", unit)
    if stripped in _UNITS:
        suffix = _UNITS[stripped]
    elif "/" in stripped:
        top, _, bottom = stripped.partition("/")
        top = _UNITS.get(top, top)
        bottom = _PER.get(bottom, bottom)
        suffix = f"{top}_per_{bottom}" if top else f"per_{bottom}"
    else:
        suffix = re.sub(r"[^a-zA-Z0-9:]+", "_", stripped)
    if path == "collector" and unit == "1" and kind == "gauge":
        suffix = "ratio"
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if kind == "counter" and not base.endswith("_total"):
        base += "_total"
    return base

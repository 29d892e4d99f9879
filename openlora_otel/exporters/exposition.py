"""The pull endpoint's reader and its text exposition: the SDK's collection written straight as the
Prometheus text format (0.0.4) or OpenMetrics, with each series' label text kept between scrapes.

Byte for byte what ``opentelemetry-exporter-prometheus`` and ``prometheus_client`` together write for
the same collection (``PrometheusMetricReader`` translating into client families, ``generate_latest``
encoding them), in the formats and escapings that Prometheus 2 and 3 ask for; a differential property
test holds the two side by side (tests/exporters/test_exposition.py). The names are theirs
(``sanitize_full_name``, ``sanitize_attribute``, ``map_unit``) and so is the number formatting
(``floatToGoString``); what is ours is the path between them. That path, rebuilt per scrape as
client families, then validated, escaped and sorted label by label, cost more than the collection
itself (docs/reference/benchmarks.md, the scrape benchmark). Here a series' label text is built once,
when it first appears, and each scrape writes only names, cached label text and numbers.

Three things differ from that pair, as the endpoint used it, on purpose:

- ``force_flush`` collects nothing: a pull reader has nothing to push, and the upstream reader queued
  a flush's collection to be written out beside the next scrape's, which then held every series twice
  (Prometheus keeps the first, older value, and the flush took the training window from the scrape).
- ``?name[]=`` filters: the client registry left the exporter's collector, which declares no names,
  out of a filtered scrape, which then answered nothing at all.
- A scraper that asks for the ``dots`` or ``values`` escaping gets ``underscores``, said so in the
  Content-Type: every name written here is already a legacy Prometheus name, which those escapings
  would only rewrite (and prometheus_client writes ``values`` sample names unlike their family's).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.exporter.prometheus._mapping import map_unit, sanitize_attribute, sanitize_full_name
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricReader,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from prometheus_client.utils import floatToGoString

from openlora_otel.exporters.otlp import temporality_for

__all__ = ["Format", "PullReader", "negotiate", "render"]

_logger = logging.getLogger(__name__)

UNDERSCORES = "underscores"
ALLOW_UTF8 = "allow-utf-8"
_ESCAPINGS = ("allow-utf-8", "underscores", "dots", "values")

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TEXT_1_0_0 = "text/plain; version=1.0.0; charset=utf-8"
_OPENMETRICS_1_0_0 = "application/openmetrics-text; version=1.0.0; charset=utf-8"

# Past this many series' label texts the cache starts again: series come and go (a serving process's
# routes, a run's phases), and the cardinality limits bound each instrument, not the process.
_MAX_LABEL_TEXTS = 20_000


@dataclass(frozen=True)
class Format:
    """What a scrape asked for: OpenMetrics or the text format, and the name escaping the answer says."""

    openmetrics: bool
    escaping: str
    content_type: str


TEXT = Format(False, UNDERSCORES, TEXT_CONTENT_TYPE)


def _parameter(tokens: Sequence[str], key: str) -> str | None:
    for token in tokens:
        if "=" in token:
            name, value = token.strip().split("=", 1)
            if name == key:
                return value
    return None


def _version_at_least_1(version: str) -> bool:
    parts: list[int] = []
    for part in version.split("."):
        try:
            parts.append(int(part))
        except ValueError:
            return False  # prometheus_client answers HTTP 500 to such a version; it is simply not offered here
    return tuple(parts) >= (1, 0, 0)


def negotiate(accept: str | None) -> Format:
    """The format for a request's ``Accept`` header, chosen as ``prometheus_client.exposition.choose_encoder``
    chooses (the first acceptable media type, in the header's order), ``dots``/``values`` answered as ``underscores``."""
    for accepted in (accept or "").split(","):
        tokens = accepted.split(";")
        media = tokens[0].strip()
        if media not in ("application/openmetrics-text", "text/plain"):
            continue
        version = _parameter(tokens, "version") or ""
        escaping = _parameter(tokens, "escaping")
        escaping = escaping if escaping in _ESCAPINGS else UNDERSCORES
        if escaping not in (ALLOW_UTF8, UNDERSCORES):
            escaping = UNDERSCORES
        if media == "application/openmetrics-text":
            if not version:
                return Format(True, UNDERSCORES, _OPENMETRICS_1_0_0)
            if _version_at_least_1(version):
                content_type = f"application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}"
                return Format(True, escaping, content_type)
        elif version and _version_at_least_1(version):
            return Format(False, escaping, f"{_TEXT_1_0_0}; escaping={escaping}")
    return TEXT


def _typed(attributes: Mapping[str, Any]) -> tuple[Any, ...]:
    """Attributes as a key that tells 1, 1.0 and True apart (equal, and equally hashed, in a dict key),
    which are written as different label values; strings, the usual values, as they are."""
    return tuple(item if item[1].__class__ is str else (item[0], repr(item[1])) for item in attributes.items())


def _label_value(value: object) -> str:
    """An attribute value as a label value: strings as they are, anything else as JSON (as upstream)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels_text(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{name}="{_escape_value(value)}"' for name, value in pairs)


class _Family:
    """One Prometheus metric family's names and header lines, per format (kept between scrapes)."""

    __slots__ = ("merge_key", "name", "om_header", "sample", "text_header", "unit")

    def __init__(self, name: str, documentation: str, kind: str, unit: str) -> None:
        # Upstream merges the metrics whose sanitized name (before the suffixes below), description,
        # mapped unit and kind agree into one family.
        self.merge_key = (name, documentation, unit, kind)
        counter = kind == "counter"
        if counter and name.endswith("_total"):
            name = name[:-6]
        if unit and not name.endswith("_" + unit):
            name += "_" + unit
        self.name = name
        self.unit = unit
        self.sample = name + "_total" if counter else name
        text_name = self.sample
        help_text = documentation.replace("\\", r"\\").replace("\n", r"\n")
        self.text_header = f"# HELP {text_name} {help_text}\n# TYPE {text_name} {kind}\n"
        om_help = help_text.replace('"', r"\"")
        self.om_header = f"# HELP {name} {om_help}\n# TYPE {name} {kind}\n"


class _Info:
    """``target_info``: the Resource as one series (the first collection's, as upstream)."""

    def __init__(self, attributes: Mapping[str, Any]) -> None:
        labels = {sanitize_attribute(key): _label_value(value) for key, value in attributes.items()}
        text = _labels_text(sorted(labels.items()))
        self.sample = f"target_info{{{text}}} 1.0\n" if text else "target_info 1.0\n"
        self.text = "# HELP target_info Target metadata\n# TYPE target_info gauge\n" + self.sample
        self.openmetrics = "# HELP target Target metadata\n# TYPE target info\n" + self.sample


class _Series:
    """A series' label text, as written after a sample name: plain, and around each histogram bucket's ``le``."""

    __slots__ = ("after_le", "before_le", "buckets", "plain")

    def __init__(self, pairs: dict[str, str]) -> None:
        ordered = sorted(pairs.items())
        text = _labels_text(ordered)
        self.plain = "{" + text + "} " if text else " "
        before = _labels_text(p for p in ordered if p[0] < "le")
        after = _labels_text(p for p in ordered if p[0] > "le")
        self.before_le = "{" + before + "," if before else "{"
        self.after_le = "," + after + "} " if after else "} "
        # Explicit bounds -> each bucket's text up to its count.
        self.buckets: dict[tuple[float, ...], tuple[str, ...]] = {}

    def bucket_texts(self, bounds: tuple[float, ...]) -> tuple[str, ...]:
        texts = self.buckets.get(bounds)
        if texts is None:
            # Upstream writes each bound as Python's str() of it, and "+Inf" last.
            texts = self.buckets[bounds] = tuple(
                f'{self.before_le}le="{le}"{self.after_le}' for le in (*(f"{bound}" for bound in bounds), "+Inf")
            )
        return texts


def _number(value: float) -> str:
    """``floatToGoString``, without its conversions for the integers that most samples are."""
    if value.__class__ is int and -1_000_000_000_000_000 < value < 1_000_000:
        return f"{value}.0"  # what repr(float(value)) gives; below 1e6 Go writes no exponent either
    return floatToGoString(value)


# A scrape's families: key -> (names and headers, label names, [(sample name, rest of its line)]).
_Scraped = tuple[_Family, tuple[str, ...], list[tuple[str, str]]]


class Exposition:
    """Writes collections as the text exposition formats; keeps names and label texts between scrapes."""

    def __init__(self) -> None:
        self._families: dict[tuple[str, str, str, str], _Family] = {}
        self._scopes: dict[Any, tuple[tuple[str, str], ...]] = {}
        self._label_keys: dict[tuple[Any, ...], tuple[str, ...]] = {}
        self._series: dict[tuple[Any, ...], _Series] = {}
        self._info: _Info | None = None
        self._warned: set[str] = set()

    def render(self, data: MetricsData | None, fmt: Format = TEXT, names: Iterable[str] | None = None) -> bytes:
        """``data`` in ``fmt``; with ``names``, only the samples so named (as ``?name[]=`` asks)."""
        wanted = None if names is None else set(names)
        out: list[str] = []
        if data is not None:
            if self._info is None:
                attributes: dict[str, Any] = {}
                for resource_metrics in data.resource_metrics:
                    attributes = {**attributes, **resource_metrics.resource.attributes}
                self._info = _Info(attributes)
            if wanted is None or "target_info" in wanted:
                out.append(self._info.openmetrics if fmt.openmetrics else self._info.text)
            scraped: dict[tuple[str, str, str, str], _Scraped] = {}
            for resource_metrics in data.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    scope = self._scope_labels(scope_metrics.scope)
                    for metric in scope_metrics.metrics:
                        self._translate(metric, scope, scraped)
            self._write(scraped.values(), fmt, wanted, out)
        if fmt.openmetrics:
            out.append("# EOF\n")
        return "".join(out).encode("utf-8")

    # -- translation -----------------------------------------------------------------------
    def _scope_labels(self, scope: Any) -> tuple[tuple[str, str], ...]:
        key = (scope.name, scope.version, scope.schema_url, _typed(scope.attributes or {}))
        labels = self._scopes.get(key)
        if labels is None:
            attributes: dict[str, Any] = {}
            for name, value in (scope.attributes or {}).items():
                attributes["otel_scope_" + name] = value
            attributes["otel_scope_name"] = scope.name or ""
            attributes["otel_scope_version"] = scope.version or ""
            attributes["otel_scope_schema_url"] = scope.schema_url or ""
            labels = self._scopes[key] = tuple(attributes.items())
        return labels

    def _kind(self, metric: Metric) -> str | None:
        data = metric.data
        if isinstance(data, Sum):
            # Cumulative non-monotonic sums are gauges (the Prometheus compatibility specification).
            gauge = not data.is_monotonic and data.aggregation_temporality == AggregationTemporality.CUMULATIVE
            return "gauge" if gauge else "counter"
        if isinstance(data, Gauge):
            return "gauge"
        if isinstance(data, HistogramData):
            return "histogram"
        kind = type(data).__name__
        if kind not in self._warned:
            self._warned.add(kind)
            _logger.warning("the Prometheus endpoint does not write %s metrics (%s)", kind, metric.name)
        return None

    def _family(self, metric: Metric, kind: str) -> tuple[tuple[str, str, str, str], _Family]:
        key = (metric.name, metric.description or "", metric.unit or "", kind)
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = _Family(
                sanitize_full_name(metric.name), key[1], kind, map_unit(metric.unit or "")
            )
        return family.merge_key, family

    def _translate(self, metric: Metric, scope: tuple[tuple[str, str], ...], scraped: dict[Any, _Scraped]) -> None:
        kind = self._kind(metric)
        if kind is None:
            return
        merge_key, family = self._family(metric, kind)
        points = metric.data.data_points
        # The metric's label names: the union over its points, sorted (as upstream, which fills the gaps with "").
        shapes = {tuple(point.attributes) for point in points}
        keys_key = (scope, *sorted(shapes))
        label_keys = self._label_keys.get(keys_key)
        if label_keys is None:
            # Scope labels go on each point: a metric without points has no label names (as upstream).
            union = {sanitize_attribute(name) for name, _ in scope} if shapes else set()
            for shape in shapes:
                union.update(sanitize_attribute(name) for name in shape)
            label_keys = self._label_keys[keys_key] = tuple(sorted(union))
        entry = scraped.get(merge_key)
        if entry is None:
            entry = scraped[merge_key] = (family, label_keys, [])
        labelnames, lines = entry[1], entry[2]
        if kind == "histogram":
            bucket, count, total = family.name + "_bucket", family.name + "_count", family.name + "_sum"
            for point in points:
                series = self._series_of(scope, point.attributes, label_keys, labelnames)
                bounds = tuple(point.explicit_bounds)
                cumulative = 0
                for text, number in zip(series.bucket_texts(bounds), point.bucket_counts, strict=False):
                    cumulative += number
                    lines.append((bucket, text + _number(cumulative) + "\n"))
                # Upstream writes no _count and _sum when the first bucket's bound is negative.
                if not bounds or bounds[0] >= 0:
                    lines.append((count, series.plain + _number(cumulative) + "\n"))
                    lines.append((total, series.plain + _number(point.sum) + "\n"))
            return
        sample = family.sample
        for point in points:
            series = self._series_of(scope, point.attributes, label_keys, labelnames)
            lines.append((sample, series.plain + _number(point.value) + "\n"))

    def _series_of(
        self,
        scope: tuple[tuple[str, str], ...],
        attributes: Mapping[str, Any],
        label_keys: tuple[str, ...],
        labelnames: tuple[str, ...],
    ) -> _Series:
        try:
            key: tuple[Any, ...] = (scope, label_keys, labelnames, _typed(attributes))
            series = self._series.get(key)
        except TypeError:  # an unhashable attribute value: written, not kept
            key, series = (), None
        if series is None:
            labels: dict[str, str] = {}
            for name, value in scope:
                labels[sanitize_attribute(name)] = _label_value(value)
            for name, value in attributes.items():
                labels[sanitize_attribute(name)] = _label_value(value)
            # The family's label names over this metric's values, in order (upstream zips the two).
            series = _Series(dict(zip(labelnames, [labels.get(k, "") for k in label_keys], strict=False)))
            if key:
                if len(self._series) >= _MAX_LABEL_TEXTS:
                    self._series.clear()
                self._series[key] = series
        return series

    # -- writing ---------------------------------------------------------------------------
    @staticmethod
    def _write(scraped: Iterable[_Scraped], fmt: Format, wanted: set[str] | None, out: list[str]) -> None:
        openmetrics = fmt.openmetrics
        for family, _, lines in scraped:
            if wanted is not None:
                lines = [line for line in lines if line[0] in wanted]
                if not lines:
                    continue
            if openmetrics:
                out.append(family.om_header)
                if family.unit and wanted is None:
                    out.append(f"# UNIT {family.name} {family.unit}\n")
            else:
                out.append(family.text_header)
            out.extend(sample + rest for sample, rest in lines)


class PullReader(MetricReader):
    """A reader that collects when scraped (:meth:`scrape`) and answers in the format asked for.

    Scrapes are taken one at a time: each collection covers the training window since the previous
    one, and two at once would split it.
    """

    def __init__(self) -> None:
        super().__init__(preferred_temporality=temporality_for("cumulative"))
        self._scrape_lock = threading.Lock()
        self._received: MetricsData | None = None
        self._exposition = Exposition()
        self._shut_down = False

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        self._received = metrics_data

    def scrape(self, accept: str | None = None, names: Iterable[str] | None = None) -> tuple[bytes, str]:
        """Collect now and write the collection as ``accept`` asks; (body, Content-Type). Raises what the
        collection raises (the endpoint answers 500)."""
        fmt = negotiate(accept)
        with self._scrape_lock:
            if self._shut_down:
                return render(None, fmt), fmt.content_type
            self._received = None
            self.collect()
            data, self._received = self._received, None
            return self._exposition.render(data, fmt, names), fmt.content_type

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Nothing to push: the endpoint reads the SDK when it is scraped."""
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._shut_down = True


def render(data: MetricsData | None, fmt: Format = TEXT, names: Iterable[str] | None = None) -> bytes:
    """``data`` written in ``fmt`` by a fresh :class:`Exposition` (nothing kept from earlier collections)."""
    return Exposition().render(data, fmt, names)

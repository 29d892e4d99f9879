"""The pull endpoint's own exposition writes what opentelemetry-exporter-prometheus and prometheus_client write.

Property-based and differential: random collections (names, units, descriptions, attribute keys and
values with quotes, backslashes, newlines and non-ASCII, colliding names, negative bucket bounds,
NaN and infinities) are written by :class:`Exposition` and by the upstream pair (the exporter's
collector translating into client families, ``prometheus_client`` encoding them), in each format a
scraper can negotiate, whole and with ``name[]``; the bytes must be the same. The Accept header
parser is held against ``choose_encoder`` the same way.
"""

from __future__ import annotations

import math
import random
import urllib.request

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from opentelemetry.exporter.prometheus import _CustomCollector
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.exporters.exposition import Exposition, PullReader, negotiate
from tests.support.fuzz import fuzz

# What Prometheus 2.42 and 3.16 send, and the other shapes choose_encoder tells apart.
ACCEPTS = [
    None,
    "",
    "*/*",
    "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "application/openmetrics-text",
    "application/openmetrics-text;version=0.0.1",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=underscores",
    "text/plain;version=1.0.0",
    "application/openmetrics-text;version=2.0.0;escaping=underscores",
]

_NAME = st.from_regex(r"\A[a-zA-Z][-_./a-zA-Z0-9]{0,12}\Z")  # what the SDK accepts as an instrument name
_UNIT = st.sampled_from(["", "1", "s", "ms", "By", "By/s", "{token}", "{request}/s", "%", "Cel", "W", "m/s", "x-y", "1/h"])
_TEXT = st.text(alphabet=st.sampled_from('ab Z_.-:0é"\\\n\u2603'), max_size=8)
_KEY = st.text(alphabet=st.sampled_from("abz_.-0 9é\u2603LE"), min_size=1, max_size=6) | st.sampled_from(
    ["le", "otel_scope_name", "otel.scope.name", "host.name", "quantile"]
)
_VALUE = st.one_of(
    _TEXT,
    st.booleans(),
    st.integers(-(10**18), 10**18),
    st.floats(allow_nan=True, allow_infinity=True),
    st.tuples(_TEXT, _TEXT),
    st.tuples(st.integers(-5, 5)),
)
_ATTRIBUTES = st.dictionaries(_KEY, _VALUE, max_size=3)
_NUMBER = st.one_of(
    st.integers(-(10**17), 10**17),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 999_999, 1_000_000, 1_000_000.0, 1e6 - 0.5, -1_000_000, 1e16, 1e22, 5e-324]),
)


@st.composite
def _points(draw, histogram: bool):
    attributes = draw(st.lists(_ATTRIBUTES, min_size=0, max_size=3, unique_by=lambda a: tuple(sorted(a))))
    points = []
    if histogram:
        bounds = sorted(draw(st.lists(st.floats(-1e3, 1e6, allow_nan=False) | st.integers(-5, 100), max_size=4)))
        for attrs in attributes:
            counts = draw(st.lists(st.integers(0, 10**7), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
            points.append(
                HistogramDataPoint(
                    attributes=attrs,
                    start_time_unix_nano=0,
                    time_unix_nano=1,
                    count=sum(counts),
                    sum=draw(_NUMBER),
                    bucket_counts=counts,
                    explicit_bounds=bounds,
                    min=0,
                    max=0,
                )
            )
        return points
    for attrs in attributes:
        points.append(NumberDataPoint(attributes=attrs, start_time_unix_nano=0, time_unix_nano=1, value=draw(_NUMBER)))
    return points


@st.composite
def _metric(draw, names):
    kind = draw(st.sampled_from(["counter", "updown", "delta_updown", "gauge", "histogram"]))
    points = draw(_points(kind == "histogram"))
    if kind == "gauge":
        data = Gauge(data_points=points)
    elif kind == "histogram":
        data = Histogram(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)
    else:
        temporality = AggregationTemporality.DELTA if kind == "delta_updown" else AggregationTemporality.CUMULATIVE
        data = Sum(data_points=points, aggregation_temporality=temporality, is_monotonic=kind == "counter")
    return Metric(name=draw(names), description=draw(_TEXT), unit=draw(_UNIT), data=data)


@st.composite
def collections(draw):
    # A few names, reused: metrics that collide (same name, other kinds or units) are drawn often.
    names = st.sampled_from(draw(st.lists(_NAME, min_size=1, max_size=3)))
    scopes = []
    for _ in range(draw(st.integers(1, 2))):
        scope = InstrumentationScope(
            draw(st.sampled_from(["openlora_otel", "openlora_otel.host", "x.y"])),
            draw(st.sampled_from([None, "", "0.1.0"])),
            draw(st.sampled_from([None, "https://opentelemetry.io/schemas/1.26.0"])),
            draw(st.sampled_from([None, {}, {"a.b": "c"}])),
        )
        scopes.append(ScopeMetrics(scope=scope, metrics=draw(st.lists(_metric(names), max_size=4)), schema_url=""))
    resource = Resource(draw(st.dictionaries(_KEY, _VALUE, max_size=4)))
    return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=scopes, schema_url="")])


def _upstream(data: MetricsData, accept: str | None, names: list[str] | None) -> bytes | None:
    collector = _CustomCollector()
    collector.add_metrics_data(data)
    try:
        families = list(collector.collect())
    except ValueError:  # a family prometheus_client refuses (see test_upstream_refusals_are_written_here)
        return None

    class Fixed:
        def collect(self):
            return families

    # Collectors that declare no names take part in a name[] filter only with this flag: without it
    # (as the endpoint built its registry before) a filtered scrape answered nothing at all.
    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(Fixed())
    encoder, _ = choose_encoder(accept)
    return encoder(registry if names is None else registry.restricted_registry(names))


def _pointless_then_one() -> MetricsData:
    """Found by this test: a metric without points has no label names, not its scope's, and a metric merged
    into its family takes the family's (none) over its own values: ``A_total 0.0``, no labels."""

    def counter(points):
        return Metric("A", "", "", Sum(points, AggregationTemporality.CUMULATIVE, True))

    point = NumberDataPoint(attributes={}, start_time_unix_nano=0, time_unix_nano=1, value=0)
    scope = ScopeMetrics(InstrumentationScope("openlora_otel", None, "", {}), [counter([]), counter([point])], "")
    return MetricsData([ResourceMetrics(Resource({}), [scope], "")])


def _equal_values_of_other_types() -> MetricsData:
    """Found in review: 1, 1.0 and True are one dict key, so a kept label text was written for the others
    (``x="1"`` three times; upstream writes "1", "1.0" and "true")."""
    metrics = [
        Metric(name, "", "", Gauge([NumberDataPoint({"x": value}, 0, 1, 2)]))
        for name, value in (("a", 1), ("b", True), ("c", 1.0))
    ]
    return MetricsData([ResourceMetrics(Resource({}), [ScopeMetrics(InstrumentationScope("s"), metrics, "")], "")])


def _total_and_not() -> MetricsData:
    """Found in review: counters `foo_total` and `foo` are two families upstream (it merges on the name
    before `_total` is dropped); merged here, the second's values went under the first's label names."""

    def counter(name: str, attributes: dict) -> Metric:
        points = [NumberDataPoint(attributes, 0, 1, 3)]
        return Metric(name, "", "", Sum(points, AggregationTemporality.CUMULATIVE, True))

    metrics = [counter("foo_total", {"a": "1"}), counter("foo", {"zz": "2", "b": "3"})]
    return MetricsData([ResourceMetrics(Resource({}), [ScopeMetrics(InstrumentationScope("s"), metrics, "")], "")])


@fuzz
@given(data=collections(), accept=st.sampled_from(ACCEPTS), filtered=st.booleans(), seed=st.randoms())
@example(data=_pointless_then_one(), accept=None, filtered=False, seed=random.Random(0))
@example(data=_equal_values_of_other_types(), accept=None, filtered=False, seed=random.Random(0))
@example(data=_total_and_not(), accept=None, filtered=False, seed=random.Random(0))
def test_fuzz_the_exposition_is_byte_for_byte_upstreams(data, accept, filtered, seed) -> None:
    exposition = Exposition()
    whole = exposition.render(data, negotiate(accept))
    names = None
    if filtered:
        samples = {line.split("{")[0].split(" ")[0] for line in whole.decode().splitlines() if line[:1] != "#"}
        names = [*seed.sample(sorted(samples), k=min(len(samples), 2)), "not_there"]
    expected = _upstream(data, accept, names)
    assume(expected is not None)
    assert exposition.render(data, negotiate(accept), names) == expected
    # Again from the kept names and label texts.
    assert exposition.render(data, negotiate(accept), names) == expected


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_content_type_is_choose_encoders(accept) -> None:
    assert negotiate(accept).content_type == choose_encoder(accept)[1]


_MEDIA = st.sampled_from(["application/openmetrics-text", "text/plain", "*/*", "application/json", " text/plain "])
_PARAMETER = st.sampled_from(
    ["version=1.0.0", "version=0.0.4", "version=0.0.1", "version=2.0.0", "version=1", "version=", "q=0.5",
     "escaping=allow-utf-8", "escaping=underscores", "escaping=bogus", "charset=utf-8", " version=1.0.0", "x"]
)  # fmt: skip


@fuzz
@given(st.lists(st.tuples(_MEDIA, st.lists(_PARAMETER, max_size=3)), max_size=4))
def test_fuzz_negotiation_is_choose_encoders(parts) -> None:
    accept = ",".join(";".join([media, *parameters]) for media, parameters in parts)
    assert negotiate(accept).content_type == choose_encoder(accept)[1]


@pytest.mark.parametrize("escaping", ["dots", "values"])
def test_dots_and_values_are_answered_with_underscores(escaping) -> None:
    fmt = negotiate(f"application/openmetrics-text;version=1.0.0;escaping={escaping}")
    assert fmt.openmetrics and fmt.escaping == "underscores"
    assert fmt.content_type.endswith("escaping=underscores")
    text = negotiate(f"text/plain;version=1.0.0;escaping={escaping}")
    assert not text.openmetrics and text.content_type.endswith("escaping=underscores")


def test_a_version_that_is_not_a_number_is_passed_over() -> None:
    # prometheus_client answers 500 here (it compares 'x' with 1); the next acceptable type is taken.
    assert negotiate("application/openmetrics-text;version=x.y,text/plain;version=1.0.0").content_type == (
        "text/plain; version=1.0.0; charset=utf-8; escaping=underscores"
    )


def _endpoint():
    return setup_telemetry(
        config=TelemetryConfig(
            prometheus_host="127.0.0.1",
            prometheus_port=0,
            handle_sigterm=False,
            gpu_metrics="off",
            host_metrics=False,
            final_scrape_timeout_s=0.0,
            quiet=True,
        )
    )


def _scrape(telemetry) -> str:
    with urllib.request.urlopen(telemetry.prometheus_url, timeout=10) as response:
        return response.read().decode()


def test_a_flush_between_scrapes_leaves_each_series_once() -> None:
    # The upstream reader queued a flush's collection and wrote it beside the next scrape's: every series
    # twice, the older first (the one Prometheus keeps).
    telemetry = _endpoint()
    try:
        telemetry.training.record_step(loss=2.0, grad_norm=1.0, learning_rate=1e-4, tokens=8, samples=1, step_time_s=0.1)
        assert telemetry.force_flush()
        telemetry.training.record_step(loss=1.0, grad_norm=1.0, learning_rate=1e-4, tokens=8, samples=1, step_time_s=0.1)
        body = _scrape(telemetry)
        series = [line.rsplit(" ", 1)[0] for line in body.splitlines() if line and not line.startswith("#")]
        assert len(series) == len(set(series)), [s for s in series if series.count(s) > 1][:3]
        # The window the flush did not take: both steps.
        assert "openlora_training_loss_max{" in body
        (loss_max,) = [line for line in body.splitlines() if line.startswith("openlora_training_loss_max{")]
        assert loss_max.endswith(" 2.0"), loss_max
    finally:
        telemetry.shutdown()


def test_after_shutdown_a_scrape_is_empty() -> None:
    reader = PullReader()
    reader.shutdown()
    assert reader.scrape() == (b"", "text/plain; version=0.0.4; charset=utf-8")
    body, content_type = reader.scrape("application/openmetrics-text;version=1.0.0")
    assert body == b"# EOF\n" and content_type.startswith("application/openmetrics-text; version=1.0.0")


def test_the_label_texts_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from openlora_otel.exporters import exposition

    monkeypatch.setattr(exposition, "_MAX_LABEL_TEXTS", 5)
    writer = Exposition()
    scope = InstrumentationScope("s")
    for batch in range(4):
        points = [
            NumberDataPoint(attributes={"i": f"{batch}-{i}"}, start_time_unix_nano=0, time_unix_nano=1, value=i)
            for i in range(4)
        ]
        metric = Metric(name="g", description="", unit="", data=Gauge(data_points=points))
        data = MetricsData([ResourceMetrics(Resource({}), [ScopeMetrics(scope, [metric], "")], "")])
        text = writer.render(data).decode()
        assert text.count('g{i="') == 4
        assert len(writer._series) <= 5


def test_list_attribute_values_are_written_as_upstream_writes_them() -> None:
    scope = InstrumentationScope("s", attributes={"list": ["a"]})
    point = NumberDataPoint(attributes={"v": ["x", "y"]}, start_time_unix_nano=0, time_unix_nano=1, value=math.pi)
    metric = Metric(name="g", description="", unit="", data=Gauge(data_points=[point]))
    data = MetricsData([ResourceMetrics(Resource({}), [ScopeMetrics(scope, [metric], "")], "")])
    writer = Exposition()
    for _ in range(2):
        assert writer.render(data) == _upstream(data, None, None)

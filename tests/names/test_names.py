"""Metric names: the documented Prometheus names are what the exporters really produce, on both paths."""

from __future__ import annotations

import math

import pytest

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.names import ADAPTER_METRICS, RUN_METRICS, TRAINING_METRICS, prometheus_name
from openlora_otel.training.guard import DivergenceGuard
from tests.support import docs_text
from tests.support.readings import served_series

ALL = (*RUN_METRICS, *TRAINING_METRICS, *ADAPTER_METRICS)


def test_names_follow_the_conventions() -> None:
    names = [spec.name for spec in ALL]
    assert len(names) == len(set(names))
    for spec in ALL:
        assert spec.name.startswith("openlora."), spec.name
        assert not spec.name.endswith("_total")
        assert spec.name == spec.name.lower()
        # The unit-"1" trap: such a gauge would be named differently through the Collector.
        assert spec.unit != "1", spec.name
        assert spec.prometheus == spec.prometheus_collector, spec.name
        if spec.kind == "gauge":
            assert not spec.prometheus.endswith("_total"), spec.name


@pytest.mark.parametrize(
    ("name", "unit", "kind", "pull", "collector"),
    [
        ("hw.gpu.utilization", "1", "gauge", "hw_gpu_utilization", "hw_gpu_utilization_ratio"),
        (
            "hw.gpu.memory.usage",
            "By",
            "updowncounter",
            "hw_gpu_memory_usage_bytes",
            "hw_gpu_memory_usage_bytes",
        ),
        ("hw.energy", "J", "counter", "hw_energy_joules_total", "hw_energy_joules_total"),
        ("a.tokens", "{token}", "counter", "a_tokens_total", "a_tokens_total"),
        ("a.rate", "{token}/s", "gauge", "a_rate_per_second", "a_rate_per_second"),
        ("a.step.duration", "s", "histogram", "a_step_duration_seconds", "a_step_duration_seconds"),
    ],
)
def test_translation_rules_from_the_facts_sheet(name, unit, kind, pull, collector) -> None:
    assert prometheus_name(name, unit, kind, path="pull") == pull
    assert prometheus_name(name, unit, kind, path="collector") == collector


def test_pull_endpoint_serves_exactly_the_documented_names() -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0))
    training = telemetry.training
    training.record_step(loss=1.0, grad_norm=1.0, learning_rate=0.1, tokens=5, samples=1, step_time_s=0.1)
    training.record_step(loss=1.0, tokens=5, data_time_s=0.01)
    training.record_epoch(1)
    training.record_eval(loss=1.0, accuracy=0.5)
    training.record_eval(perplexity=math.inf)
    training.set_model_flops(1e6, peak_flops=1e12)
    training.attach_guard(DivergenceGuard())
    training.set_adapter(r=8, alpha=16, dropout=0.1, target_modules=2, trainable_params=1, total_params=10)
    served = served_series(telemetry.prometheus_url)
    telemetry.shutdown()
    for spec in ALL:
        expected = spec.prometheus + ("_count" if spec.kind == "histogram" else "")
        assert expected in served, (spec.name, expected, sorted(served))


def test_the_documented_table_lists_every_name_that_differs_between_the_paths() -> None:

    from openlora_otel.names import GPU_METRICS, HOST_METRICS, INFERENCE_METRICS

    table = docs_text.marked("docs/concepts/names.md", "names-table")
    rows = [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in table.splitlines()]
    specs = (*ALL, *GPU_METRICS, *HOST_METRICS, *INFERENCE_METRICS)
    differ = [[s.name, s.prometheus, s.prometheus_collector] for s in specs if s.prometheus != s.prometheus_collector]
    assert differ and rows == differ

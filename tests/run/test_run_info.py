"""The run's name and hyperparameters: one bounded info-style series, the name in the Resource."""

from __future__ import annotations

import enum
import logging
import urllib.request

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from openlora_otel import ConfigError, TelemetryConfig, setup_telemetry
from openlora_otel.run.info import (
    MAX_HYPERPARAMETERS,
    MAX_VALUE_LENGTH,
    hyperparameter_key,
    hyperparameter_value,
)
from tests.support.readings import points


def _info(reader: InMemoryMetricReader) -> dict[str, object]:
    (point,) = points(reader.get_metrics_data(), "openlora.run.info")
    assert point.value == 1
    return dict(point.attributes)


def _setup(reader: InMemoryMetricReader, **kwargs: object):
    config = kwargs.pop("config", TelemetryConfig(exporters=("none",)))
    return setup_telemetry(config=config, metric_readers=[reader], **kwargs)


def test_name_and_hyperparameters_are_one_series_and_the_name_is_in_the_resource() -> None:
    reader = InMemoryMetricReader()
    telemetry = _setup(
        reader,
        run_id="r1",
        run_name="lr-sweep 2e-4",
        hyperparameters={
            "learning_rate": 2e-4,
            "LoRA r": 8,
            "target_modules": ["q_proj", "v_proj"],
            "bf16": True,
        },
    )
    try:
        telemetry.training.record_step(loss=1.0, tokens=3)
        assert _info(reader) == {
            "openlora.run.name": "lr-sweep 2e-4",
            "openlora.hparam.learning_rate": "0.0002",
            "openlora.hparam.lora_r": "8",
            "openlora.hparam.target_modules": "q_proj,v_proj",
            "openlora.hparam.bf16": "true",
        }
        assert telemetry.resource.attributes["openlora.run.name"] == "lr-sweep 2e-4"
        assert telemetry.run_name == "lr-sweep 2e-4"
        # No other series carries any of it.
        data = reader.get_metrics_data()
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "openlora.run.info":
                        continue
                    if metric.name == "openlora.run.outcome":
                        # It outlives its target, so it names its run by id and attempt, and by nothing else of it.
                        (point,) = metric.data.data_points
                        assert set(point.attributes) == {"openlora.run.id", "openlora.run.attempt", "openlora.run.outcome"}
                        continue
                    for point in metric.data.data_points:
                        assert not any(
                            k.startswith(("openlora.run", "openlora.hparam")) for k in point.attributes
                        )
    finally:
        telemetry.shutdown()


def test_without_a_name_the_series_is_named_by_the_run_id_and_the_resource_has_no_name() -> None:
    reader = InMemoryMetricReader()
    telemetry = _setup(reader, run_id="abc123")
    try:
        assert _info(reader) == {"openlora.run.name": "abc123"}
        assert "openlora.run.name" not in telemetry.resource.attributes
    finally:
        telemetry.shutdown()


def test_the_name_from_the_environment_and_the_argument_wins() -> None:
    config = TelemetryConfig.from_env({"OPENLORA_RUN_NAME": "  from-env ", "OTEL_METRICS_EXPORTER": "none"})
    assert config.run_name == "from-env"
    reader = InMemoryMetricReader()
    telemetry = _setup(reader, config=config)
    try:
        assert _info(reader)["openlora.run.name"] == "from-env"
    finally:
        telemetry.shutdown()
    reader = InMemoryMetricReader()
    telemetry = _setup(reader, config=config, run_name="from-code")
    try:
        assert _info(reader)["openlora.run.name"] == "from-code"
        assert telemetry.resource.attributes["openlora.run.name"] == "from-code"
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize(
    ("value", "problem"),
    [("x" * 101, "101 characters"), ("a\tb", "control character"), ("   ", "empty")],
)
def test_a_bad_run_name_fails_at_setup_naming_the_variable(value: str, problem: str) -> None:
    if value.strip():  # a blank variable is an unset one, as for every other variable
        with pytest.raises(ConfigError) as raised:
            TelemetryConfig.from_env({"OPENLORA_RUN_NAME": value})
        assert raised.value.variable == "OPENLORA_RUN_NAME"
        assert problem in str(raised.value) and "1 to 100 printable characters" in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        setup_telemetry(config=TelemetryConfig(exporters=("none",)), run_name=value)
    assert raised.value.variable == "run_name"


def test_hyperparameters_that_are_not_a_mapping_fail_before_anything_starts() -> None:
    with pytest.raises(TypeError, match="mapping"):
        setup_telemetry(config=TelemetryConfig(exporters=("none",)), hyperparameters=[("lr", 1)])  # type: ignore[arg-type]
    # Nothing was left open: a second setup works.
    setup_telemetry(config=TelemetryConfig(exporters=("none",))).shutdown()


def test_the_application_wins_over_what_an_integration_fills_in() -> None:
    reader = InMemoryMetricReader()
    telemetry = _setup(reader, run_id="r", hyperparameters={"learning_rate": 1e-3})
    try:
        telemetry.fill_run_info(name="hf-run", hyperparameters={"learning_rate": 5e-5, "lora_r": 16})
        assert _info(reader) == {
            "openlora.run.name": "hf-run",  # no name was given: the integration's is taken
            "openlora.hparam.learning_rate": "0.001",
            "openlora.hparam.lora_r": "16",
        }
        telemetry.set_run_info(name="mine", hyperparameters={"lora_r": 4})
        telemetry.fill_run_info(name="hf-again", hyperparameters={"lora_r": 32, "seed": 7})
        assert _info(reader) == {
            "openlora.run.name": "mine",
            "openlora.hparam.learning_rate": "0.001",
            "openlora.hparam.lora_r": "4",
            "openlora.hparam.seed": "7",
        }
        assert telemetry.hyperparameters == {"learning_rate": "0.001", "lora_r": "4", "seed": "7"}
    finally:
        telemetry.shutdown()


def test_the_series_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    many = {f"p{i}": i for i in range(MAX_HYPERPARAMETERS + 5)}
    reader = InMemoryMetricReader()
    telemetry = _setup(reader, hyperparameters={"long": "v" * 500, **many})
    try:
        info = _info(reader)
        assert len(info) == 1 + MAX_HYPERPARAMETERS
        assert len(info["openlora.hparam.long"]) == MAX_VALUE_LENGTH
        assert str(info["openlora.hparam.long"]).endswith("…")
        warnings = [
            r.getMessage() for r in caplog.records if "left out of openlora.run.info" in r.getMessage()
        ]
        assert warnings == [
            f"openlora-otel: 6 hyperparameters beyond the first {MAX_HYPERPARAMETERS} were left out of openlora.run.info"
        ]
        # An integration's keys never push out the application's.
        telemetry.fill_run_info(hyperparameters={"zz_from_callback": 1})
        assert "openlora.hparam.zz_from_callback" not in _info(reader)
        assert "openlora.hparam.long" in _info(reader)
    finally:
        telemetry.shutdown()


class _Scheduler(str, enum.Enum):  # noqa: UP042 - transformers' enums are built this way
    COSINE = "cosine"


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (0.0002, "0.0002"),
        (3e-05, "3e-05"),
        (1.0, "1"),
        (16, "16"),
        (False, "false"),
        (float("nan"), "NaN"),
        ({"v_proj", "q_proj"}, "q_proj,v_proj"),
        ((1, 2.5), "1,2.5"),
        (_Scheduler.COSINE, "cosine"),
        ("two\nlines  here", "two lines here"),
        ("", None),
        (None, None),
    ],
)
def test_values_are_short_readable_text(raw: object, text: str | None) -> None:
    assert hyperparameter_value(raw) == text


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("LoRA r", "lora_r"),
        ("per_device_train_batch_size", "per_device_train_batch_size"),
        ("--x--", "x"),
        ("é", ""),
        ("a" * 60, "a" * 40),
    ],
)
def test_keys_are_label_safe(raw: str, key: str) -> None:
    assert hyperparameter_key(raw) == key


def test_the_pull_endpoint_serves_the_info_series_with_its_labels() -> None:
    telemetry = setup_telemetry(
        config=TelemetryConfig(prometheus_host="127.0.0.1", prometheus_port=0),
        run_name="sweep-a",
        hyperparameters={"learning_rate": 2e-4, "lora_r": 8},
    )
    try:
        assert telemetry.prometheus_url is not None
        with urllib.request.urlopen(telemetry.prometheus_url, timeout=5) as response:
            body = response.read().decode()
    finally:
        telemetry.shutdown()
    (line,) = [line for line in body.splitlines() if line.startswith("openlora_run_info{")]
    assert 'openlora_run_name="sweep-a"' in line
    assert 'openlora_hparam_learning_rate="0.0002"' in line and 'openlora_hparam_lora_r="8"' in line
    assert line.endswith(" 1.0")
    (target,) = [line for line in body.splitlines() if line.startswith("target_info{")]
    assert 'openlora_run_name="sweep-a"' in target


def test_a_disabled_sdk_still_answers_the_name() -> None:
    telemetry = setup_telemetry(
        config=TelemetryConfig(sdk_disabled=True), run_name="off", hyperparameters={"lr": 1}
    )
    assert telemetry.run_name == "off"
    assert telemetry.hyperparameters == {"lr": "1"}
    telemetry.shutdown()


def test_the_resource_and_the_run_info_carry_the_same_name_when_it_has_spaces_around_it() -> None:
    # target_info's openlora_run_name and openlora_run_info's must be equal: the report and the rules
    # find a run by either one.
    reader = InMemoryMetricReader()
    telemetry = _setup(reader, run_id="r-sp", run_name="  lr 3e-4 ")
    try:
        assert _info(reader)["openlora.run.name"] == "lr 3e-4"
        assert telemetry.resource.attributes["openlora.run.name"] == "lr 3e-4"
    finally:
        telemetry.shutdown()

"""A real transformers.Trainer run on CPU with a tiny LoRA model and the callback attached."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from transformers import Trainer, TrainerCallback, TrainingArguments

from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.integrations.hf import TelemetryCallback
from tests.conftest import points, value
from tests.tiny_lm import CountingCorpus, tiny_llama, with_lora


class LogKeeper(TrainerCallback):
    """Another reporter next to ours."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_trainer_metrics_match_what_the_trainer_logged(tmp_path, memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    model = with_lora(tiny_llama())
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=24,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=12,
        per_device_eval_batch_size=8,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
        seed=0,
        dataloader_num_workers=0,
    )
    keeper = LogKeeper()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=CountingCorpus(256),
        eval_dataset=CountingCorpus(32, seed=1),
        callbacks=[TelemetryCallback(telemetry), keeper],
    )
    trainer.train()
    data = memory_reader.get_metrics_data()
    state = trainer.state
    history = [entry for entry in state.log_history if "loss" in entry and "eval_loss" not in entry]
    evals = [entry for entry in state.log_history if "eval_loss" in entry]

    assert value(data, "openlora.training.steps") == state.global_step == 24
    assert value(data, "openlora.training.samples") == 24 * 4
    assert state.num_input_tokens_seen > 0
    assert value(data, "openlora.training.tokens") == state.num_input_tokens_seen
    assert value(data, "openlora.training.loss") == pytest.approx(
        statistics.fmean(e["loss"] for e in history)
    )
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(
        statistics.fmean(e["grad_norm"] for e in history)
    )
    assert value(data, "openlora.training.learning_rate") == pytest.approx(history[-1]["learning_rate"])
    assert value(data, "openlora.training.epoch") == pytest.approx(state.epoch)
    assert len(evals) == 2
    assert value(data, "openlora.training.eval.loss") == pytest.approx(evals[-1]["eval_loss"])
    [duration] = points(data, "openlora.training.step.duration")
    assert duration.count == 24 and duration.sum > 0

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert value(data, "openlora.adapter.rank") == 4
    assert value(data, "openlora.adapter.alpha") == 8
    assert value(data, "openlora.adapter.target_modules") == 2
    assert value(data, "openlora.adapter.parameters.trainable") == trainable
    assert value(data, "openlora.model.parameters") == total
    assert value(data, "openlora.adapter.trainable.ratio") == pytest.approx(trainable / total)
    # The other reporter saw the same logs; the loss fell over the run.
    assert len([log for log in keeper.logs if "loss" in log]) == len(history)
    assert history[-1]["loss"] < history[0]["loss"]
    telemetry.shutdown()


def test_callback_failures_never_reach_the_trainer(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    callback = TelemetryCallback(telemetry)

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("boom")

    callback.on_step_end(Broken(), Broken(), None)
    callback.on_step_end(Broken(), Broken(), None)
    assert sum("on_step_end failed" in r.getMessage() for r in caplog.records) == 1
    telemetry.shutdown()


def test_callback_sets_up_and_shuts_down_its_own_telemetry(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    callback = TelemetryCallback()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, report_to="none", use_cpu=True
    )

    class State:
        num_input_tokens_seen = 0
        epoch = 0.0

    callback.on_train_begin(args, State(), None, model=None)
    owned = callback._owner._telemetry
    assert owned is not None and owned.enabled
    callback.on_train_end(args, State(), None)
    assert owned.is_shutdown

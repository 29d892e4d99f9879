"""A real transformers.Trainer run on CPU with a tiny LoRA model and the callback attached."""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from transformers import Trainer, TrainerCallback, default_data_collator  # noqa: E402

import openlora_otel.integrations  # noqa: E402
from openlora_otel import TelemetryConfig, setup_telemetry  # noqa: E402
from openlora_otel.integrations.hf import TelemetryCallback  # noqa: E402
from tests.support.host_reads import HOST_READS  # noqa: E402
from tests.support.readings import points, value  # noqa: E402
from tests.support.tiny_lm import SEQ, CountingCorpus, tiny_llama, with_lora  # noqa: E402
from tests.support.trainers import hf_args  # noqa: E402

# Tensor methods that bring a value to the host (and so wait for the device that computes it).
READS = HOST_READS | {"__repr__", "__str__", "__format__", "__array__", "to", "copy_"}
INTEGRATIONS = str(Path(openlora_otel.integrations.__file__).parent)


class HostReads(TorchFunctionMode):
    """Every host read of a tensor during training: the ones made under an openlora-otel hook, and the others."""

    def __init__(self) -> None:
        super().__init__()
        self.ours: list[str] = []
        self.others = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(INTEGRATIONS):
                frame = frame.f_back
            if frame is None:
                self.others += 1
            else:
                self.ours.append(name)
        return func(*args, **(kwargs or {}))


class KeepingTrainer(Trainer):
    """The Trainer, keeping what its own training_step returns: the reference for each step's loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[tuple[int, float]] = []  # (steps done before it, micro-batch loss)
        self.scaled: list[bool] = []  # whether the Trainer passed num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.kept.append((self.state.global_step, loss.detach().clone()))
        self.scaled.append(num_items_in_batch is not None)
        return loss


class Collector(TrainerCallback):
    """Collects the metrics every ``every`` steps, as a scrape would, keeping what each collection showed."""

    def __init__(self, reader: InMemoryMetricReader, every: int) -> None:
        self.reader = reader
        self.every = every
        self.seen: list[tuple[int, object]] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.seen.append((state.global_step, self.reader.get_metrics_data()))


class LogKeeper(TrainerCallback):
    """Another reporter next to ours."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_trainer_metrics_match_what_the_trainer_logged(tmp_path, memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    model = with_lora(tiny_llama())
    args = hf_args(
        tmp_path,
        max_steps=24,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=12,
        per_device_eval_batch_size=8,
        save_strategy="no",
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
    # The run's settings, from TrainingArguments and the PEFT config, on openlora.run.info.
    (info,) = points(data, "openlora.run.info")
    assert dict(info.attributes) == {
        "openlora.run.name": telemetry.run_id,  # run_name defaulted to output_dir: not a name anyone chose
        "openlora.hparam.learning_rate": "0.01",
        "openlora.hparam.batch_size": "4",
        "openlora.hparam.gradient_accumulation_steps": "1",
        "openlora.hparam.max_steps": "24",
        "openlora.hparam.seed": "0",
        "openlora.hparam.weight_decay": "0",
        "openlora.hparam.lr_scheduler": "linear",
        "openlora.hparam.optimizer": args.optim.value,
        "openlora.hparam.max_grad_norm": "1",
        "openlora.hparam.precision": "fp32",
        "openlora.hparam.world_size": "1",
        "openlora.hparam.lora_r": "4",
        "openlora.hparam.lora_alpha": "8",
        "openlora.hparam.lora_dropout": "0",
        "openlora.hparam.lora_target_modules": "q_proj,v_proj",
    }
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
    args = hf_args(tmp_path, per_device_train_batch_size=2)

    class State:
        num_input_tokens_seen = 0
        epoch = 0.0

    callback.on_train_begin(args, State(), None, model=None)
    owned = callback._owner._telemetry
    assert owned is not None and owned.enabled
    callback.on_train_end(args, State(), None)
    assert owned.is_shutdown


@pytest.mark.usefixtures("defer_cpu_tensors")  # the CPU loss stands in for a device tensor: never read
@pytest.mark.parametrize(
    ("accumulation", "model_scales_loss"),
    [(1, True), (2, True), (2, False)],
    ids=["no-accumulation", "accumulation-loss-over-step-tokens", "accumulation-mean-loss"],
)
def test_default_arguments_report_loss_tokens_and_learning_rate_every_step(
    tmp_path,
    memory_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
    accumulation: int,
    model_scales_loss: bool,
) -> None:
    """Trainer defaults (logging_steps=500, no token counting): every collection has loss, tokens and
    learning rate, equal to what the Trainer computed, and no openlora-otel hook read a tensor."""
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    handed: list[object] = []
    record_step = telemetry.training.record_step

    def spy(**kwargs):
        handed.append(kwargs.get("loss"))
        record_step(**kwargs)

    telemetry.training.record_step = spy
    max_steps, batch, every = 20, 4, 5
    args = hf_args(
        tmp_path,
        max_steps=max_steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        save_strategy="no",
    )
    assert args.logging_steps == 500 and args.include_num_input_tokens_seen == "no"
    collector = Collector(memory_reader, every)
    trainer = KeepingTrainer(
        model=with_lora(tiny_llama()),
        args=args,
        train_dataset=CountingCorpus(256),
        callbacks=[TelemetryCallback(telemetry), collector],
    )
    # False: the model returns a per-micro-batch mean and the Trainer divides it by the accumulation.
    trainer.model_accepts_loss_kwargs = model_scales_loss
    reads = HostReads()
    with caplog.at_level(logging.WARNING, logger="openlora_otel.integrations"), reads:
        trainer.train()

    # The Trainer's own loss for each step: the sum of what its training_step returned for the step.
    step_loss = [0.0] * max_steps
    for done, loss in trainer.kept:
        step_loss[done] += float(loss)
    assert len(trainer.kept) == max_steps * accumulation
    assert set(trainer.scaled) == {model_scales_loss}
    assert [step for step, _ in collector.seen] == list(range(every, max_steps + 1, every))
    for step, data in collector.seen:
        window = step_loss[step - every : step]
        assert value(data, "openlora.training.loss") == pytest.approx(statistics.fmean(window), rel=1e-5)
        assert value(data, "openlora.training.loss.max") == pytest.approx(max(window), rel=1e-5)
        assert value(data, "openlora.training.tokens") == step * batch * accumulation * SEQ
        assert value(data, "openlora.training.samples") == step * batch * accumulation
        # linear decay from 5e-5 without warmup; the step's rate is the one before the scheduler steps
        assert value(data, "openlora.training.learning_rate") == pytest.approx(
            5e-5 * (max_steps - step + 1) / max_steps
        )
        assert value(data, "openlora.training.gradient_norm") is None  # the Trainer never logged one
    # Said once, at train start: what these settings cannot give.
    said = [r.getMessage() for r in caplog.records if "gradient norm is reported" in r.getMessage()]
    assert len(said) == 1 and "logging_steps=500" in said[0]
    # No host read under any openlora-otel hook; the detector does see the Trainer's own reads.
    assert reads.ours == []
    assert reads.others > 0
    assert len(handed) == max_steps and all(isinstance(loss, torch.Tensor) for loss in handed)
    telemetry.shutdown()


def test_eval_forwards_are_not_counted_and_trainer_logs_are_not_added_twice(
    tmp_path, memory_reader: InMemoryMetricReader
) -> None:
    """With logging every step, the per-step values win: loss and learning rate reach the window once
    per step (the Trainer's logged copies are dropped), the gradient norm once per log."""
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    training = telemetry.training
    handed: dict[str, int] = {"loss": 0, "grad_norm": 0, "learning_rate": 0}

    def counting(method):
        def call(**kwargs):
            for key in handed:
                handed[key] += kwargs.get(key) is not None
            method(**kwargs)

        return call

    training.record_step = counting(training.record_step)
    training.record_values = counting(training.record_values)
    args = hf_args(
        tmp_path,
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=8,
        save_strategy="no",
    )
    trainer = KeepingTrainer(
        model=with_lora(tiny_llama()),
        args=args,
        train_dataset=CountingCorpus(64),
        eval_dataset=CountingCorpus(32, seed=1),
        callbacks=[TelemetryCallback(telemetry)],
    )
    trainer.train()
    data = memory_reader.get_metrics_data()
    logged = [e for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]
    assert len(logged) == 6 and sum("eval_loss" in e for e in trainer.state.log_history) == 2
    assert handed == {"loss": 6, "grad_norm": 6, "learning_rate": 6}
    # Evaluation forwards (32 rows in 4 batches, twice) add neither tokens nor losses.
    assert value(data, "openlora.training.tokens") == 6 * 4 * SEQ
    assert value(data, "openlora.training.loss") == pytest.approx(statistics.fmean(e["loss"] for e in logged))
    telemetry.shutdown()


class SlowCollator:
    """The Trainer's default collator, sleeping a known time per batch of ``size`` rows (``eval_s`` for others)."""

    def __init__(self, size: int, seconds: float, eval_s: float) -> None:
        self.size, self.seconds, self.eval_s = size, seconds, eval_s

    def __call__(self, features):
        time.sleep(self.seconds if len(features) == self.size else self.eval_s)
        return default_data_collator(features)


def test_data_wait_is_the_time_the_steps_waited_for_their_batches(
    tmp_path, memory_reader: InMemoryMetricReader
) -> None:
    """A collator sleeping 50 ms per training batch, two micro-batches per step: 100 ms of waiting per step;
    evaluations (slow on purpose) are neither waiting nor step time."""
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    sleep, accumulation, steps = 0.05, 2, 8
    args = hf_args(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        eval_strategy="steps",
        eval_steps=4,
        per_device_eval_batch_size=8,
        save_strategy="no",
    )
    trainer = Trainer(
        model=with_lora(tiny_llama()),
        args=args,
        train_dataset=CountingCorpus(256),
        eval_dataset=CountingCorpus(16, seed=1),
        data_collator=SlowCollator(4, sleep, eval_s=0.5),
        callbacks=[TelemetryCallback(telemetry)],
    )
    trainer.train()
    data = memory_reader.get_metrics_data()
    wait = value(data, "openlora.training.data_wait.duration")
    [duration] = points(data, "openlora.training.step.duration")
    assert duration.count == steps
    step_mean = duration.sum / duration.count
    # At least the sleeps; at most a little more (the fetch's own work: 0.1 s more seen on a 2-core
    # machine loaded past its cores), never an evaluation (its collator sleeps 0.5 s a batch).
    assert accumulation * sleep <= wait < accumulation * sleep + 0.4
    # Step time holds the wait and the compute, not the evaluations.
    assert wait < step_mean < wait + 1.0
    assert step_mean - wait > 0.005
    fraction = value(data, "openlora.training.data_wait.fraction")
    assert 0.0 < fraction < 1.0
    telemetry.shutdown()


class StepTimes(TrainerCallback):
    """When each optimizer step ended (the Trainer's step count at that moment)."""

    def __init__(self) -> None:
        self.ended: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.ended[state.global_step] = time.perf_counter()


def poisoned_model(times: StepTimes, bad_from: int):
    """A tiny LoRA model whose training loss is NaN once ``bad_from`` optimizer steps ended (its NaN
    gradients turn the weights NaN too). The hook comes before the callback's: that one sees the NaN."""
    model = with_lora(tiny_llama())

    def poison(module, args, kwargs, output):
        if times.ended and max(times.ended) >= bad_from:
            output.loss = output.loss * math.nan
        return output

    model.register_forward_hook(poison, with_kwargs=True)
    return model


def test_a_loss_gone_nan_stops_the_trainer_within_the_guard_lag(
    tmp_path, memory_reader: InMemoryMetricReader
) -> None:
    from openlora_otel.training.guard import DivergenceGuard

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    times = StepTimes()
    bad_from = 10  # the forward of optimizer step 10 (0-based count of steps done) returns NaN
    model = poisoned_model(times, bad_from)
    guard = DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05)
    args = hf_args(
        tmp_path,
        max_steps=2000,
        per_device_train_batch_size=2,
        save_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=CountingCorpus(8000),
        callbacks=[times, TelemetryCallback(telemetry, guard=guard)],
    )
    trainer.train()
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    stopped = trainer.state.global_step
    assert guard.trip is not None and guard.trip.reason == "nonfinite_loss"
    third_bad = bad_from + 3  # steps 11, 12, 13 carried NaN losses
    assert third_bad <= stopped < 2000
    # The documented lag: the guard's check interval plus a read-back (here a CPU one), with slack
    # for a loaded machine; the step that saw the trip is the last.
    assert times.ended[stopped] - times.ended[third_bad] < 0.05 + 2.0
    assert value(data, "openlora.training.loss.nonfinite") == stopped - bad_from
    assert value(data, "openlora.training.guard.trips", **{"openlora.guard.reason": "nonfinite_loss"}) == 1
    assert telemetry.outcome == "stopped_by_guard"


def test_a_tripped_guard_saves_no_checkpoint_over_the_last_good_one(tmp_path) -> None:
    """save_strategy="epoch" with save_total_limit=1: the epoch end after the stop would save the
    NaN weights and rotate the good checkpoint away. After a trip nothing is saved."""
    from safetensors.torch import load_file

    from openlora_otel.training.guard import DivergenceGuard

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    times = StepTimes()
    per_epoch = 300  # the trip (three NaN steps and the guard's lag) comes well inside epoch 2
    bad_from = per_epoch + 5
    model = poisoned_model(times, bad_from)
    guard = DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05)
    args = hf_args(
        tmp_path,
        num_train_epochs=3,
        per_device_train_batch_size=2,
        save_strategy="epoch",
        save_total_limit=1,
        eval_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=CountingCorpus(2 * per_epoch),
        callbacks=[times, TelemetryCallback(telemetry, guard=guard)],
    )
    trainer.train()
    telemetry.shutdown()
    stopped = trainer.state.global_step
    assert guard.trip is not None and bad_from + 3 <= stopped < 2 * per_epoch
    checkpoints = sorted(path.name for path in tmp_path.glob("checkpoint-*"))
    assert checkpoints == [f"checkpoint-{per_epoch}"], checkpoints
    weights = load_file(str(tmp_path / checkpoints[0] / "adapter_model.safetensors"))
    assert weights and all(bool(torch.isfinite(tensor).all()) for tensor in weights.values())
    # The model the run ended with did diverge: that is what was not saved.
    assert not all(
        bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad
    )


def test_model_flops_and_mfu_from_the_first_step(tmp_path, memory_reader, monkeypatch) -> None:
    from openlora_otel.training.flops import training_flops_per_token

    monkeypatch.setenv("OPENLORA_PEAK_FLOPS", "1e12")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry(metric_readers=[memory_reader])
    model = with_lora(tiny_llama())
    args = hf_args(
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=2,
        save_strategy="no",
        dataloader_num_workers=0,
    )
    Trainer(
        model=model, args=args, train_dataset=CountingCorpus(64), callbacks=[TelemetryCallback(telemetry)]
    ).train()
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    per_token = training_flops_per_token(model, seq_len=SEQ).per_token
    assert value(data, "openlora.model.flops_per_token") == per_token
    assert value(data, "openlora.training.model_flops.utilization") == pytest.approx(
        value(data, "openlora.training.throughput.tokens") * per_token / 1e12
    )


def test_a_chosen_run_name_and_an_epoch_count_reach_the_run_info(tmp_path) -> None:
    from openlora_otel.integrations.hf import _run_name, trainer_hyperparameters

    args = hf_args(tmp_path, run_name="lr-3e-4", num_train_epochs=2, bf16=False)
    assert _run_name(args) == "lr-3e-4"
    values = trainer_hyperparameters(args)
    assert values["epochs"] == 2 and values["max_steps"] is None
    assert _run_name(hf_args(tmp_path)) is None


def test_a_run_name_with_a_tab_or_newline_is_kept_and_the_callback_still_sets_up(tmp_path, memory_reader) -> None:
    # A name typed with a tab or pasted with a newline is still the user's name: it must neither be
    # refused (a ConfigError inside on_train_begin) nor cost the rest of the set-up after it.
    telemetry = setup_telemetry(
        config=TelemetryConfig(exporters=("none",), host_metrics=False, quiet=True),
        metric_readers=[memory_reader],
        run_id="r-tab",
    )
    try:
        callback = TelemetryCallback(telemetry=telemetry)
        args = hf_args(tmp_path, run_name="sweep\tlr 3e-4\n", per_device_train_batch_size=4)

        class State:
            num_input_tokens_seen = 0
            logging_steps = 1

        callback.on_train_begin(args, State(), None, model=None)
        assert telemetry.run_name == "sweep lr 3e-4"
        assert callback._samples_per_step == 4  # set after the run info: the hook went on
    finally:
        telemetry.shutdown()


def test_a_run_that_raised_leaves_no_second_forward_hook(tmp_path) -> None:
    """A Trainer run that raises never reaches on_train_end, so its forward hook stays on the model.
    The next run on that model (any callback instance) replaces it instead of adding a second."""
    from transformers import TrainerControl, TrainerState

    from openlora_otel.integrations.hf import _ForwardTap

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    model = with_lora(tiny_llama())
    args = hf_args(tmp_path)

    def taps() -> int:
        return sum(isinstance(hook, _ForwardTap) for hook in model._forward_hooks.values())

    try:
        TelemetryCallback(telemetry).on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        assert taps() == 1  # and the run raises: no on_train_end
        second = TelemetryCallback(telemetry)
        second.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        assert taps() == 1
        second.on_train_end(args, TrainerState(), TrainerControl(), model=model)
        assert taps() == 0
    finally:
        telemetry.shutdown()

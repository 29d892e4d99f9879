"""A real Lightning Trainer run on CPU with a tiny LoRA model and the callback attached."""

from __future__ import annotations

import logging
import math
import statistics
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("peft")

import lightning.pytorch as pl  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from openlora_otel import TelemetryConfig, setup_telemetry  # noqa: E402
from openlora_otel.integrations.lightning import TelemetryCallback  # noqa: E402
from tests.support.host_reads import HOST_READS  # noqa: E402
from tests.support.readings import points, value  # noqa: E402
from tests.support.tiny_lm import SEQ, CountingCorpus, tiny_llama, with_lora  # noqa: E402
from tests.support.trainers import quiet_trainer  # noqa: E402


class LoraModule(pl.LightningModule):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = with_lora(tiny_llama())
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.norm(2) for p in self.parameters() if p.requires_grad and p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack(grads))))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, prog_bar=False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def test_lightning_metrics_match_the_run(memory_reader: InMemoryMetricReader) -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    module = LoraModule()
    loader = torch.utils.data.DataLoader(CountingCorpus(256), batch_size=4, shuffle=True)
    val_loader = torch.utils.data.DataLoader(CountingCorpus(16, seed=1), batch_size=8)
    trainer = quiet_trainer(
        max_steps=20,
        val_check_interval=10,
        num_sanity_val_steps=0,
        callbacks=[TelemetryCallback(telemetry)],
    )
    trainer.fit(module, loader, val_loader)
    data = memory_reader.get_metrics_data()
    losses = [float(x) for x in module.losses]

    assert value(data, "openlora.training.steps") == trainer.global_step == 20
    assert value(data, "openlora.training.samples") == 20 * 4
    assert value(data, "openlora.training.tokens") == 20 * 4 * SEQ
    assert value(data, "openlora.training.loss") == pytest.approx(statistics.fmean(losses), rel=1e-5)
    assert value(data, "openlora.training.gradient_norm") == pytest.approx(
        statistics.fmean(module.grad_norms), rel=1e-5
    )
    assert value(data, "openlora.training.learning_rate") == pytest.approx(1e-2)
    assert value(data, "openlora.training.eval.loss") == pytest.approx(
        float(trainer.callback_metrics["val_loss"])
    )
    assert value(data, "openlora.adapter.rank") == 4
    [duration] = points(data, "openlora.training.step.duration")
    assert duration.count == 20
    (info,) = points(data, "openlora.run.info")
    assert {k: v for k, v in info.attributes.items() if k != "openlora.hparam.precision"} == {
        "openlora.run.name": telemetry.run_id,
        "openlora.hparam.learning_rate": "0.01",
        "openlora.hparam.optimizer": "AdamW",
        "openlora.hparam.gradient_accumulation_steps": "1",
        "openlora.hparam.max_steps": "20",
        "openlora.hparam.world_size": "1",
        "openlora.hparam.hidden": "32",  # the module's save_hyperparameters()
        "openlora.hparam.lora_r": "4",
        "openlora.hparam.lora_alpha": "8",
        "openlora.hparam.lora_dropout": "0",
        "openlora.hparam.lora_target_modules": "q_proj,v_proj",
    }
    assert losses[-1] < losses[0]
    telemetry.shutdown()


@pytest.mark.usefixtures("defer_cpu_tensors")  # the CPU loss stands in for a device tensor: never read
def test_no_host_read_of_the_loss_in_the_callback(memory_reader: InMemoryMetricReader) -> None:
    """The callback hands the loss tensor over without reading it (Lightning itself may read others)."""
    from tests.support.host_reads import NoHostRead

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    callback = TelemetryCallback(telemetry, grad_norm=False)

    class FakeTrainer:
        global_step = 0
        optimizers: list = []
        current_epoch = 0

    trainer = FakeTrainer()
    batch = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}
    NoHostRead.allow, NoHostRead.blocked = False, []
    for step in range(1, 6):
        callback.on_train_batch_start(trainer, None, batch, step)
        trainer.global_step = step
        loss = torch.tensor(float(step)).as_subclass(NoHostRead)
        callback.on_train_batch_end(trainer, None, {"loss": loss}, batch, step)
    assert NoHostRead.blocked == [] and HOST_READS
    NoHostRead.allow = True
    try:
        data = memory_reader.get_metrics_data()
    finally:
        NoHostRead.allow = False
    assert value(data, "openlora.training.loss") == pytest.approx(3.0)
    assert value(data, "openlora.training.steps") == 5
    assert value(data, "openlora.training.tokens") == 5 * 2 * SEQ
    telemetry.shutdown()


class SlowCollate:
    """torch's default collate, sleeping a known time per batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, rows):
        time.sleep(self.seconds)
        return torch.utils.data.default_collate(rows)


class Span(pl.Callback):
    """When training started and ended, and how many validations ran in between."""

    def __init__(self) -> None:
        self.started = self.ended = 0.0
        self.validations = 0

    def on_train_start(self, trainer, pl_module):
        self.started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        self.validations += not trainer.sanity_checking

    def on_train_end(self, trainer, pl_module):
        self.ended = time.perf_counter()


def test_data_wait_is_the_time_the_steps_waited_for_their_batches(memory_reader: InMemoryMetricReader) -> None:
    """A loader sleeping 50 ms per batch, two micro-batches per optimizer step: 100 ms of waiting per step.
    Validations (slow on purpose, one of them between a step's micro-batches) are neither waiting nor step time."""
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    sleep, accumulation, steps, val_sleep = 0.05, 2, 8, 0.3
    loader = torch.utils.data.DataLoader(CountingCorpus(256), batch_size=4, collate_fn=SlowCollate(sleep))
    val_loader = torch.utils.data.DataLoader(
        CountingCorpus(16, seed=1), batch_size=8, collate_fn=SlowCollate(val_sleep)
    )
    span = Span()
    trainer = quiet_trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulation,
        val_check_interval=5,  # batches 5 and 15 are the first micro-batch of a step, 10 the last
        num_sanity_val_steps=0,
        callbacks=[TelemetryCallback(telemetry), span],
    )
    trainer.fit(LoraModule(), loader, val_loader)
    data = memory_reader.get_metrics_data()
    wait = value(data, "openlora.training.data_wait.duration")
    [duration] = points(data, "openlora.training.step.duration")
    assert duration.count == steps and span.validations == 3
    # At least the sleeps; at most a little more (the fetch's own work), never a validation (2 x 0.3 s).
    assert accumulation * sleep <= wait < accumulation * sleep + 0.05
    assert duration.sum / steps - wait > 0.005  # the step holds compute as well as the wait
    # Step time leaves the validations out, also the ones in the middle of a step.
    assert duration.sum < (span.ended - span.started) - span.validations * 2 * val_sleep
    assert 0.0 < value(data, "openlora.training.data_wait.fraction") < 1.0
    telemetry.shutdown()


class DivergingModule(LoraModule):
    """The loss goes NaN from optimizer step ``bad_from`` on."""

    bad_from = 10

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        if self.trainer.global_step >= self.bad_from:
            loss = loss * math.nan
        return loss


def test_a_loss_gone_nan_stops_the_trainer_within_the_guard_lag(memory_reader: InMemoryMetricReader) -> None:
    from openlora_otel.training.guard import DivergenceGuard

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    guard = DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05)
    module = DivergingModule()
    ended: dict[int, float] = {}

    class StepTimes(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ended[trainer.global_step] = time.perf_counter()

    trainer = quiet_trainer(
        max_steps=3000,
        callbacks=[StepTimes(), TelemetryCallback(telemetry, guard=guard)],
    )
    loader = torch.utils.data.DataLoader(CountingCorpus(12000), batch_size=2)
    trainer.fit(module, loader)
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    stopped = trainer.global_step
    assert guard.trip is not None and guard.trip.reason == "nonfinite_loss"
    third_bad = DivergingModule.bad_from + 3
    assert third_bad <= stopped < 3000
    assert ended[stopped] - ended[third_bad] < 0.05 + 2.0
    assert value(data, "openlora.training.loss.nonfinite") >= 3
    assert value(data, "openlora.training.guard.trips", **{"openlora.guard.reason": "nonfinite_loss"}) == 1
    assert telemetry.outcome == "stopped_by_guard"


class FailsAtStep(LoraModule):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise ValueError("a bad batch (this text is never exported)")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raises_is_failed_even_when_the_script_shuts_down_later() -> None:
    # Lightning calls on_exception, then re-raises; the script's shutdown() runs outside any except block.
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    trainer = quiet_trainer(max_steps=5, callbacks=[TelemetryCallback(telemetry)])
    loader = torch.utils.data.DataLoader(CountingCorpus(40), batch_size=2)
    with pytest.raises(ValueError):
        trainer.fit(FailsAtStep(), loader)
    telemetry.shutdown()
    assert telemetry.outcome == "failed"
    assert telemetry._outcome.attributes["error.type"] == "ValueError"


def test_a_new_fit_after_one_that_raised_can_finish() -> None:
    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    loader = torch.utils.data.DataLoader(CountingCorpus(40), batch_size=2)
    with pytest.raises(ValueError):
        quiet_trainer(max_steps=5, callbacks=[TelemetryCallback(telemetry)]).fit(FailsAtStep(), loader)
    quiet_trainer(max_steps=3, callbacks=[TelemetryCallback(telemetry)]).fit(LoraModule(), loader)
    telemetry.shutdown()
    assert telemetry.outcome == "finished"


class NanAtStep(LoraModule):
    """The loss of every micro-batch of optimizer step ``bad_step`` (0-based) is NaN (the last
    step here: the NaN gradients it makes would turn every later loss NaN)."""

    bad_step = 3

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        if self.trainer.global_step == self.bad_step:
            loss = loss * math.nan
        self.losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("scheduled", [False, True], ids=["argument", "scheduler"])
def test_under_gradient_accumulation_the_loss_is_one_value_per_optimizer_step(
    memory_reader: InMemoryMetricReader, scheduled: bool
) -> None:
    """Lightning hands on_train_batch_end each micro-batch's loss divided by accumulate_grad_batches.
    The callback records the step's mean micro-batch loss once per optimizer step, also for an
    epoch's last step with fewer micro-batches; a NaN step counts once, however many micro-batches.
    A GradientAccumulationScheduler sets the count only at the epoch's start, after train start."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    module = NanAtStep()
    accumulation = (
        {"callbacks": [GradientAccumulationScheduler({0: 3})]} if scheduled else {"accumulate_grad_batches": 3}
    )
    trainer = quiet_trainer(
        max_steps=4,
        **accumulation,
    )
    trainer.callbacks.append(TelemetryCallback(telemetry, grad_norm=False))
    # 5 batches an epoch: steps of 3 and 2 micro-batches (the epoch's last step is short).
    trainer.fit(module, torch.utils.data.DataLoader(CountingCorpus(20), batch_size=4))
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    losses = [float(x) for x in module.losses]
    assert trainer.global_step == 4 and len(losses) == 10
    steps = [losses[0:3], losses[3:5], losses[5:8], losses[8:10]]
    assert all(math.isnan(x) for x in steps[3]) and not any(math.isnan(x) for s in steps[:3] for x in s)
    finite = [statistics.fmean(s) for s in steps[:3]]
    assert value(data, "openlora.training.loss") == pytest.approx(statistics.fmean(finite), rel=1e-5)
    assert value(data, "openlora.training.loss.max") == pytest.approx(max(finite), rel=1e-5)
    assert value(data, "openlora.training.loss.min") == pytest.approx(min(finite), rel=1e-5)
    assert value(data, "openlora.training.loss.nonfinite") == 1


def test_a_tripped_guard_keeps_the_last_good_checkpoint(tmp_path) -> None:
    """Lightning's default ModelCheckpoint (save_top_k=1, at each epoch end) would save the diverged
    weights at the epoch end after the stop and delete the good one. After a trip it saves nothing."""
    from openlora_otel.training.guard import DivergenceGuard

    per_epoch = 300  # the trip (three NaN steps and the guard's lag) comes well inside epoch 2

    class Diverging(LoraModule):
        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            if self.trainer.global_step >= per_epoch + 5:
                loss = loss * math.nan  # NaN gradients: the weights go NaN too
            return loss

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    guard = DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05)
    module = Diverging()
    trainer = quiet_trainer(
        max_epochs=3,
        enable_checkpointing=True,
        default_root_dir=str(tmp_path),
        callbacks=[TelemetryCallback(telemetry, guard=guard)],
    )
    trainer.fit(module, torch.utils.data.DataLoader(CountingCorpus(2 * per_epoch), batch_size=2))
    telemetry.shutdown()
    assert guard.trip is not None and per_epoch + 8 <= trainer.global_step < 2 * per_epoch
    saved = sorted(path.name for path in tmp_path.rglob("*.ckpt"))
    assert saved == [f"epoch=0-step={per_epoch}.ckpt"], saved
    state = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=False)["state_dict"]
    assert all(bool(torch.isfinite(tensor).all()) for tensor in state.values())
    assert trainer.checkpoint_callback.best_model_path.endswith(saved[0])
    assert not all(bool(torch.isfinite(p).all()) for p in module.parameters() if p.requires_grad)
    # The checkpoint callback has its own hooks back once the fit is over.
    assert "on_train_epoch_end" not in vars(trainer.checkpoint_callback)


def test_a_trip_before_min_steps_warns_once(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Lightning ignores should_stop until min_steps: the guard trips again every step. The
    checkpoint callbacks are muted, and that is said, once."""
    from openlora_otel.training.guard import DivergenceGuard

    class Diverging(LoraModule):
        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            return loss * math.nan if self.trainer.global_step >= 3 else loss

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
    guard = DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05)
    trainer = quiet_trainer(
        min_steps=60,
        max_steps=60,
        enable_checkpointing=True,
        default_root_dir=str(tmp_path),
        callbacks=[TelemetryCallback(telemetry, guard=guard)],
    )
    with caplog.at_level(logging.WARNING, logger="openlora_otel.integrations"):
        trainer.fit(Diverging(), torch.utils.data.DataLoader(CountingCorpus(400), batch_size=2))
    telemetry.shutdown()
    assert guard.trip is not None and trainer.global_step == 60
    said = [r for r in caplog.records if "will not save" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_model_flops_from_the_first_step(memory_reader: InMemoryMetricReader) -> None:
    from openlora_otel.training.flops import training_flops_per_token

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)), metric_readers=[memory_reader])
    module = LoraModule()
    trainer = quiet_trainer(
        max_steps=3,
        callbacks=[TelemetryCallback(telemetry)],
    )
    trainer.fit(module, torch.utils.data.DataLoader(CountingCorpus(32), batch_size=4))
    data = memory_reader.get_metrics_data()
    telemetry.shutdown()
    assert value(data, "openlora.model.flops_per_token") == training_flops_per_token(module, seq_len=SEQ).per_token
    assert value(data, "openlora.training.model_flops.utilization") is None  # a CPU, no peak configured


_DDP_SCRIPT = """
import math, sys
import lightning.pytorch as pl
import torch
from openlora_otel import TelemetryConfig, setup_telemetry
from openlora_otel.training.guard import DivergenceGuard
from openlora_otel.integrations.lightning import TelemetryCallback

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        loss = self.lin(batch).square().mean()
        if self.global_rank == 0 and self.global_step >= 10:
            loss = loss * math.nan  # rank 0 only; the all-reduced gradients spread it
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

class Where(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        print(f"RANK {trainer.global_rank} STOPPED {trainer.global_step}", flush=True)

telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",)))
guard = DivergenceGuard(nonfinite_losses=3, check_interval_s=0.05)
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_steps=800, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    callbacks=[TelemetryCallback(telemetry, guard=guard), Where()],
)
trainer.fit(Model(), torch.utils.data.DataLoader(torch.randn(4000, 8), batch_size=4))
telemetry.shutdown()
"""


@pytest.mark.process
def test_under_ddp_every_rank_stops_at_the_same_step(tmp_path) -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    from openlora_otel.integrations.common import GUARD_SYNC_EVERY
    from tests.support.processes import child_env

    script = tmp_path / "ddp_guard.py"
    script.write_text(_DDP_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)],
        env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stopped = {int(rank): int(step) for rank, step in re.findall(r"RANK (\d) STOPPED (\d+)", result.stdout)}
    assert set(stopped) == {0, 1}, result.stdout
    assert stopped[0] == stopped[1], stopped  # together, at an agreement step
    assert stopped[0] % GUARD_SYNC_EVERY == 0 and 13 <= stopped[0] < 800, stopped


def test_the_modules_own_seed_and_epochs_fill_what_the_trainer_does_not_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without seed_everything() the trainer knows no seed; the module's save_hyperparameters() does.
    # A key the trainer left empty must not hide the module's value for it.
    from types import SimpleNamespace

    from openlora_otel.integrations.lightning import trainer_hyperparameters

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    trainer = SimpleNamespace(
        optimizers=[], accumulate_grad_batches=1, max_steps=-1, max_epochs=None, precision="32-true", world_size=1
    )
    module = SimpleNamespace(hparams={"seed": 1234, "epochs": 3, "hidden": 32})
    values = trainer_hyperparameters(trainer, module)  # type: ignore[arg-type]
    assert values["seed"] == 1234
    assert values["epochs"] == 3
    assert values["hidden"] == 32

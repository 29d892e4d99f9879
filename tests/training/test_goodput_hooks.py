"""Goodput from the framework callbacks: evaluation and checkpoint saves marked, a resumed fit's lost steps."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("peft")

import lightning.pytorch as pl  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from transformers import Trainer  # noqa: E402

from openlora_otel import TelemetryConfig, setup_telemetry  # noqa: E402
from openlora_otel.integrations import hf, lightning  # noqa: E402
from openlora_otel.training.goodput import ProgressFile  # noqa: E402
from tests.support.readings import value  # noqa: E402
from tests.support.tiny_lm import CountingCorpus, tiny_llama, with_lora  # noqa: E402
from tests.support.trainers import hf_args, quiet_trainer  # noqa: E402


def spent(data, phase: str) -> float:
    return value(data, "openlora.training.time", **{"openlora.training.phase": phase}) or 0.0


def _telemetry(reader: InMemoryMetricReader, run_id: str = "run-1"):
    return setup_telemetry(
        config=TelemetryConfig(exporters=("none",), run_id=run_id), metric_readers=[reader]
    )


# -- Hugging Face ------------------------------------------------------------------------------


def _hf_trainer(output_dir, telemetry, max_steps: int) -> Trainer:
    args = hf_args(
        output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=6,
        per_device_eval_batch_size=8,
        save_strategy="steps",
        save_steps=6,
        seed=0,
        dataloader_num_workers=0,
    )
    return Trainer(
        model=with_lora(tiny_llama()),
        args=args,
        train_dataset=CountingCorpus(256),
        eval_dataset=CountingCorpus(32, seed=1),
        callbacks=[hf.TelemetryCallback(telemetry)],
    )


def test_hf_marks_evaluation_and_saves_and_a_resumed_trainer_counts_the_lost_steps(tmp_path) -> None:
    first = InMemoryMetricReader()
    telemetry = _telemetry(first)
    _hf_trainer(tmp_path, telemetry, max_steps=12).train()
    data = first.get_metrics_data()
    assert spent(data, "evaluation") > 0 and spent(data, "checkpoint_save") > 0
    assert spent(data, "lost_progress") == 0
    telemetry.shutdown()
    assert json.loads((tmp_path / ProgressFile.NAME).read_text())["step"] == 12
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]

    # The run crashed after step 12 but only checkpoint-6 survived: 6 steps are done again.
    for path in (tmp_path / "checkpoint-12").rglob("*"):
        if path.is_file():
            path.unlink()
    (tmp_path / "checkpoint-12").rename(tmp_path / "gone")
    second = InMemoryMetricReader()
    telemetry = _telemetry(second)
    trainer = _hf_trainer(tmp_path, telemetry, max_steps=14)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    data = second.get_metrics_data()
    assert trainer.state.global_step == 14
    assert value(data, "openlora.training.steps.lost") == 6
    assert spent(data, "lost_progress") > 0 and spent(data, "productive") > 0
    assert value(data, "openlora.training.steps") == 8  # this attempt's steps
    telemetry.shutdown()
    assert json.loads((tmp_path / ProgressFile.NAME).read_text())["step"] == 14


def test_hf_a_new_run_into_the_same_directory_replaces_the_old_progress(tmp_path) -> None:
    (tmp_path / ProgressFile.NAME).write_text(json.dumps({"run_id": "old", "step": 500, "attempt": 1}))
    reader = InMemoryMetricReader()
    telemetry = _telemetry(reader, run_id="new")
    trainer = _hf_trainer(tmp_path, telemetry, max_steps=3)
    trainer.args.eval_strategy = "no"
    trainer.args.save_strategy = "no"
    trainer.train()
    data = reader.get_metrics_data()
    telemetry.shutdown()
    assert value(data, "openlora.training.steps.lost") == 0 and spent(data, "lost_progress") == 0
    assert json.loads((tmp_path / ProgressFile.NAME).read_text())["step"] == 3


# -- Lightning ---------------------------------------------------------------------------------


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = with_lora(tiny_llama())

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(tmp_path, telemetry, max_steps: int, ckpt_path=None):
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1
    )
    trainer = quiet_trainer(
        max_steps=max_steps,
        enable_checkpointing=True,
        default_root_dir=str(tmp_path),
        val_check_interval=5,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[lightning.TelemetryCallback(telemetry), checkpoints],
    )
    loader = torch.utils.data.DataLoader(CountingCorpus(64), batch_size=4)
    trainer.fit(
        _Module(),
        loader,
        torch.utils.data.DataLoader(CountingCorpus(16, seed=1), batch_size=8),
        ckpt_path=ckpt_path,
    )
    return trainer


def test_lightning_marks_validation_saves_and_loads_and_a_resumed_fit_counts_the_lost_steps(tmp_path) -> None:
    first = InMemoryMetricReader()
    telemetry = _telemetry(first)
    trainer = _fit(tmp_path, telemetry, max_steps=12)
    data = first.get_metrics_data()
    assert spent(data, "evaluation") > 0 and spent(data, "checkpoint_save") > 0
    assert spent(data, "checkpoint_load") == 0
    assert "save_checkpoint" not in vars(trainer)  # the wrapper is gone after the fit
    assert "load_checkpoint" not in vars(trainer.strategy)
    telemetry.shutdown()
    assert json.loads((tmp_path / "ckpt" / ProgressFile.NAME).read_text())["step"] == 12

    [at_5] = (tmp_path / "ckpt").glob("*step=5.ckpt")
    second = InMemoryMetricReader()
    telemetry = _telemetry(second)
    trainer = _fit(tmp_path, telemetry, max_steps=14, ckpt_path=str(at_5))
    data = second.get_metrics_data()
    assert trainer.global_step == 14
    assert spent(data, "checkpoint_load") > 0
    assert value(data, "openlora.training.steps.lost") == 12 - 5
    assert spent(data, "lost_progress") > 0
    telemetry.shutdown()
    assert json.loads((tmp_path / "ckpt" / ProgressFile.NAME).read_text())["step"] == 14

"""`--device` for `demo` and `serve`: the choice parsed, `auto` falling back to the CPU, clear errors for a device
that is not there. CI has no GPU: the CUDA branches are driven by a stand-in for ``torch.cuda``; tests/hardware/test_cuda.py
and benchmarks/gpu_check.py run the real thing on a GPU."""

from __future__ import annotations

import argparse
import types

import pytest

from openlora_otel.model.device import DeviceError, Placement, device_choice, resolve_device


class _Cuda:
    def __init__(self, count: int, capability: tuple[int, int] = (9, 0)) -> None:
        self.count = count
        self.capability = capability

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_capability(self, index: int) -> tuple[int, int]:
        assert 0 <= index < self.count
        return self.capability


def fake_torch(count: int, *, capability: tuple[int, int] = (9, 0), cuda_build: str | None = "13.0"):
    """Enough of torch for resolve_device: devices are (type, index) tuples, dtypes strings."""

    class Device(tuple):
        def __new__(cls, kind: str, index: int | None = None):
            return super().__new__(cls, (kind, index))

        type = property(lambda self: self[0])
        index = property(lambda self: self[1])

        def __str__(self) -> str:
            return self.type if self.index is None else f"{self.type}:{self.index}"

    return types.SimpleNamespace(
        __version__="2.13.0",
        version=types.SimpleNamespace(cuda=cuda_build),
        cuda=_Cuda(count, capability),
        device=Device,
        bfloat16="bfloat16",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", "auto"), ("CPU", "cpu"), (" cuda ", "cuda"), ("cuda:0", "cuda:0"), ("cuda:12", "cuda:12")],
)
def test_device_choices_are_parsed_and_normalised(text: str, expected: str) -> None:
    assert device_choice(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cuda:x", "mps", "cuda:0,1", "", "cpu:0"])
def test_other_device_names_are_refused_naming_what_is_accepted(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected auto, cpu, cuda or cuda:N, got"):
        device_choice(text)


def test_auto_is_the_cpu_without_cuda_and_the_first_gpu_with_it() -> None:
    assert resolve_device("auto", fake_torch(0)).name == "cpu"
    placement = resolve_device("auto", fake_torch(2))
    assert placement.name == "cuda:0" and placement.is_cuda
    assert resolve_device("cpu", fake_torch(2)).name == "cpu"


def test_bf16_autocast_on_gpus_that_compute_in_bf16_only() -> None:
    assert resolve_device("cuda", fake_torch(1, capability=(9, 0))).precision == "bf16 autocast"
    assert resolve_device("cuda", fake_torch(1, capability=(8, 0))).autocast_dtype == "bfloat16"
    assert resolve_device("cuda", fake_torch(1, capability=(7, 5))).precision == "fp32"  # a T4
    assert resolve_device("cpu", fake_torch(1)).precision == "fp32"


def test_a_gpu_that_is_not_there_names_what_the_machine_has() -> None:
    with pytest.raises(DeviceError, match=r"--device cuda:2: this machine has 2 CUDA devices \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2", fake_torch(2))
    with pytest.raises(DeviceError, match=r"--device cuda:1: this machine has 1 CUDA device \(cuda:0\)"):
        resolve_device("cuda:1", fake_torch(1))
    assert resolve_device("cuda:1", fake_torch(2)).name == "cuda:1"


def test_no_cuda_says_whether_the_build_or_the_machine_lacks_it() -> None:
    with pytest.raises(DeviceError, match=r"has no CUDA support.*use --device cpu or auto"):
        resolve_device("cuda", fake_torch(0, cuda_build=None))
    with pytest.raises(DeviceError, match=r"sees no CUDA device: check the driver"):
        resolve_device("cuda:0", fake_torch(0))


def test_the_cpu_placement_runs_without_autocast() -> None:
    torch = pytest.importorskip("torch")
    placement = resolve_device("cpu", torch)
    assert placement == Placement(torch.device("cpu"))
    with placement.autocast(torch):
        assert not torch.is_autocast_enabled("cpu")


# -- the commands -----------------------------------------------------------------------------


def _no_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")


def test_demo_refuses_a_missing_gpu_before_training(capsys) -> None:
    pytest.importorskip("peft")
    _no_cuda()
    from openlora_otel.cli import main

    assert main(["demo", "--device", "cuda", "--steps", "1", "--exporter", "none"]) == 2
    err = capsys.readouterr().err
    assert "openlora-otel demo: --device cuda: CUDA is not available here" in err
    assert "step 1/1" not in err


def test_demo_device_name_is_a_usage_error(capsys) -> None:
    from openlora_otel.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--device", "gpu"])
    assert exit_.value.code == 2
    assert "argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


def test_demo_under_torchrun_trains_on_cpu_only(monkeypatch, capsys) -> None:
    pytest.importorskip("peft")
    from openlora_otel.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--device", "cuda:0", "--exporter", "none"])
    assert exit_.value.code == 2
    assert "--device cuda:0: under torchrun the demo trains data-parallel on CPU" in capsys.readouterr().err


def test_demo_hf_trainer_on_another_gpu_points_at_cuda_visible_devices(capsys) -> None:
    from openlora_otel.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--hf-trainer", "--device", "cuda:1"])
    assert exit_.value.code == 2
    assert "use CUDA_VISIBLE_DEVICES=1 with --device cuda" in capsys.readouterr().err


def test_run_demo_refuses_a_gpu_for_a_distributed_run() -> None:
    pytest.importorskip("peft")
    from openlora_otel import TelemetryConfig, setup_telemetry
    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.demo.train import run_demo

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), handle_sigterm=False))
    try:
        with pytest.raises(ValueError, match="under torchrun the demo trains on CPU"):
            run_demo(DemoOptions(steps=1, distributed=True, device="cuda"), telemetry, where="memory")
    finally:
        telemetry.shutdown()


def test_the_demo_on_cpu_says_where_it_trained_and_learns(capsys) -> None:
    pytest.importorskip("peft")
    from openlora_otel import TelemetryConfig, setup_telemetry
    from openlora_otel.demo.options import DemoOptions
    from openlora_otel.demo.train import run_demo

    telemetry = setup_telemetry(config=TelemetryConfig(exporters=("none",), handle_sigterm=False))
    try:
        import io

        out = io.StringIO()
        result = run_demo(
            DemoOptions(steps=30, batch_size=4, eval_every=0, device="cpu"), telemetry, where="memory", out=out
        )
    finally:
        telemetry.shutdown()
    assert ", on cpu (fp32)\n" in out.getvalue()
    assert result.final_eval_loss < result.first_eval_loss


def test_serve_refuses_a_missing_gpu_before_loading(tmp_path, capsys) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("peft")
    _no_cuda()
    from openlora_otel.cli import main

    # The device is checked before the directory is read: any DIR gives the same answer.
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(tmp_path), "--device", "cuda:0"])
    assert exit_.value.code == 2
    assert "--device cuda:0: CUDA is not available here" in capsys.readouterr().err

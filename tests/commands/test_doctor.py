"""`openlora-otel doctor` and `env`: what they print and their exit status."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from openlora_otel.cli import main
from openlora_otel.commands.doctor import run_doctor
from openlora_otel.commands.env import variables_markdown
from tests.support.otlp_receiver import HttpReceiver
from tests.support.processes import free_port


def doctor(env: dict[str, str]) -> tuple[int, str]:
    lines: list[str] = []
    code = run_doctor(env, timeout_s=1.0, out=lines.append)
    return code, "\n".join(lines)


def test_all_good_with_free_port_and_live_collector() -> None:
    server = HttpReceiver()
    try:
        code, text = doctor(
            {
                "OTEL_METRICS_EXPORTER": "prometheus,otlp",
                "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(free_port()),
                "OTEL_EXPORTER_OTLP_ENDPOINT": server.http_endpoint,
                "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20sup3rs3cret",
            }
        )
    finally:
        server.close()
    assert code == 0, text
    assert "All checks passed." in text
    assert "answered HTTP 200" in text
    assert "sup3rs3cret" not in text
    assert "'authorization': '<redacted>'" in text


def test_port_in_use_and_dead_collector_are_reported_with_fixes() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, text = doctor(
            {
                "OTEL_METRICS_EXPORTER": "prometheus,otlp",
                "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            }
        )
    assert code == 1
    assert f"cannot bind 127.0.0.1:{port}" in text
    assert "OTEL_EXPORTER_PROMETHEUS_PORT" in text
    assert "nothing answers" in text
    assert "2 problem(s) found." in text


def test_wrong_path_gets_a_plain_hint() -> None:
    server = HttpReceiver()
    try:
        code, text = doctor(
            {
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": server.http_endpoint + "/wrong",
            }
        )
    finally:
        server.close()
    assert code == 1
    assert "HTTP 404" in text and "must end in /v1/metrics" in text


def test_invalid_configuration_exits_2_and_names_the_variable() -> None:
    code, text = doctor({"OTEL_EXPORTER_PROMETHEUS_PORT": "abc"})
    assert code == 2
    assert "OTEL_EXPORTER_PROMETHEUS_PORT='abc'" in text
    assert "fix: set OTEL_EXPORTER_PROMETHEUS_PORT" in text


def test_credentials_in_endpoint_are_redacted() -> None:
    code, text = doctor(
        {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:pw@127.0.0.1:{free_port()}",
        }
    )
    assert code == 1  # nothing listens there
    assert ":pw@" not in text
    assert "<redacted>@127.0.0.1" in text


def test_lists_optional_packages_with_extras() -> None:
    _, text = doctor({"OTEL_METRICS_EXPORTER": "none"})
    for distribution, extra in (("nvidia-ml-py", "gpu"), ("transformers", "hf"), ("lightning", "lightning")):
        assert (
            f"package {distribution}: installed" in text
            or f"package {distribution}: not installed (extra [{extra}])" in text
        )
    assert "metrics are recorded but not exported" in text


def test_env_command_prints_the_table(capsys) -> None:
    assert main(["env"]) == 0
    assert capsys.readouterr().out.strip() == variables_markdown()


@pytest.mark.process
def test_module_entry_point_and_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "doctor", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "Exit status" in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "openlora_otel", "doctor", "--timeout", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--timeout must be > 0" in bad.stderr


def test_gpu_check_with_and_without_nvml(monkeypatch) -> None:
    from openlora_otel.hardware import nvml
    from tests.support.fake_nvml import FakeNvml, h100s

    fake = FakeNvml(h100s(2))
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: fake)
    code, text = doctor({"OTEL_METRICS_EXPORTER": "none", "OPENLORA_GPU_METRICS": "on"})
    assert code == 0 and "NVML works: 2 GPU(s), driver 550.54.15" in text
    fake.init_error = "Driver Not Loaded"
    code, text = doctor({"OTEL_METRICS_EXPORTER": "none", "OPENLORA_GPU_METRICS": "on"})
    assert (
        code == 1
        and "NVML did not start (Driver Not Loaded)" in text
        and "OPENLORA_GPU_METRICS=auto" in text
    )
    code, text = doctor({"OTEL_METRICS_EXPORTER": "none"})  # auto: information, not a failure
    assert code == 0 and "[info] gpu metrics: NVML did not start" in text


def test_doctor_and_setup_give_the_same_reason_for_no_gpu_metrics(monkeypatch, caplog) -> None:
    """Both start NVML through nvml.start_backend(): what doctor says is what setup_telemetry() does."""
    import logging

    from openlora_otel import TelemetryConfig, setup_telemetry
    from openlora_otel._deps import MissingDependencyError
    from openlora_otel.config import ConfigError
    from openlora_otel.hardware import nvml
    from tests.support.fake_nvml import FakeNvml, h100s

    fake = FakeNvml(h100s(1))
    fake.init_error = "Driver Not Loaded"
    monkeypatch.setattr(nvml, "load_pynvml_backend", lambda: fake)
    _, text = doctor({"OTEL_METRICS_EXPORTER": "none", "OPENLORA_GPU_METRICS": "on"})
    reason = "NVML did not start (Driver Not Loaded)"
    assert reason in text
    with pytest.raises(ConfigError, match=re.escape(reason)):
        setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="on"))
    caplog.set_level(logging.INFO)
    setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="auto")).shutdown()
    assert f"GPU metrics off: {reason}" in caplog.text

    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml, "load_pynvml_backend", missing)
    _, text = doctor({"OTEL_METRICS_EXPORTER": "none", "OPENLORA_GPU_METRICS": "on"})
    assert "nvidia-ml-py is not installed, so no GPU metrics" in text and "openlora-otel[gpu]" in text
    with pytest.raises(MissingDependencyError, match=r"nvidia-ml-py.*openlora-otel\[gpu\]"):
        setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="on"))
    caplog.clear()
    setup_telemetry(config=TelemetryConfig(exporters=("none",), gpu_metrics="auto")).shutdown()
    assert "GPU metrics off: nvidia-ml-py is not installed (pip install 'openlora-otel[gpu]')" in caplog.text


def test_the_otlp_endpoint_says_where_it_came_from() -> None:
    base = {"OTEL_METRICS_EXPORTER": "none"}
    _, text = doctor(base)
    assert (
        "otlp endpoint:       http://localhost:4318/v1/metrics (http/protobuf, the default: "
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT and OTEL_EXPORTER_OTLP_ENDPOINT are unset)" in text
    )
    _, text = doctor({**base, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert "(grpc, the default: " in text
    _, text = doctor({**base, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert "(http/protobuf, from OTEL_EXPORTER_OTLP_ENDPOINT)" in text
    _, text = doctor({**base, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318/v1/metrics"})
    assert "(http/protobuf, from OTEL_EXPORTER_OTLP_METRICS_ENDPOINT)" in text

"""Shutdown time with an unreachable OTLP endpoint: openlora-otel vs a plain SDK setup, side by side.

Two kinds of unreachable, both on loopback: "refused" (nothing listens) and
"hanging" (the port accepts connections but never answers, like a stuck
collector). Each case records one value and then times shutdown. The plain
setup is what the OpenTelemetry docs show: PeriodicExportingMetricReader over
the OTLP exporter with default settings, then MeterProvider.shutdown().

    python benchmarks/bench_shutdown.py [--repeat N]
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import time
from collections.abc import Callable

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from openlora_otel import TelemetryConfig, setup_telemetry


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Endpoint:
    def __init__(self, kind: str) -> None:
        self.sock = None
        if kind == "hanging":
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(64)
            self.port = self.sock.getsockname()[1]
        else:
            self.port = free_port()

    def close(self) -> None:
        if self.sock:
            self.sock.close()


def plain_sdk(protocol: str, port: int) -> float:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{port}", insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{port}/v1/metrics")
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(exporter)], shutdown_on_exit=False)
    provider.get_meter("bench").create_counter("c").add(1)
    started = time.perf_counter()
    provider.shutdown()
    return time.perf_counter() - started


def ours(protocol: str, port: int) -> float:
    env = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
    }
    telemetry = setup_telemetry(config=TelemetryConfig.from_env(env))
    telemetry.meter.create_counter("c").add(1)
    started = time.perf_counter()
    telemetry.shutdown()
    return time.perf_counter() - started


def measure(fn: Callable[[str, int], float], protocol: str, kind: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        endpoint = Endpoint(kind)
        try:
            times.append(fn(protocol, endpoint.port))
        finally:
            endpoint.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the median is shown")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the SDK logs every failed attempt; we only time here
    print(f"{'protocol':<14}{'endpoint':<10}{'plain SDK s':>12}{'openlora s':>12}{'ratio':>8}")
    for protocol in ("http/protobuf", "grpc"):
        for kind in ("refused", "hanging"):
            plain = measure(plain_sdk, protocol, kind, args.repeat)
            mine = measure(ours, protocol, kind, args.repeat)
            print(f"{protocol:<14}{kind:<10}{plain:>12.2f}{mine:>12.2f}{plain / mine:>7.1f}x")
    print("bound: OPENLORA_SHUTDOWN_TIMEOUT default 2000 ms")


if __name__ == "__main__":
    main()

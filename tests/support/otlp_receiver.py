"""Test receivers that decode real OTLP metric requests (http/protobuf and gRPC) on loopback.

They stand in for the Collector at the protocol level: whatever the SDK sends is
parsed with opentelemetry-proto, so names, units, values and resource
attributes can be asserted exactly as a Collector would see them.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Received:
    request: metrics_service_pb2.ExportMetricsServiceRequest
    headers: dict[str, str]


@dataclass
class Receiver:
    """Common store and query helpers."""

    port: int
    received: list[Received] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, item: Received) -> None:
        with self._cond:
            self.received.append(item)
            self._cond.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        """Wait (bounded) until ``predicate(self)`` holds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def metrics(self) -> dict[str, list[tuple[object, object]]]:
        """name -> [(metric, data point)] across every request received so far."""
        found: dict[str, list[tuple[object, object]]] = {}
        for item in list(self.received):
            for rm in item.request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        for point in getattr(metric, kind).data_points:
                            found.setdefault(metric.name, []).append((metric, point))
        return found

    def resource_attributes(self) -> dict[str, object]:
        attributes: dict[str, object] = {}
        for item in self.received:
            for rm in item.request.resource_metrics:
                for kv in rm.resource.attributes:
                    attributes[kv.key] = any_value(kv.value)
        return attributes


def any_value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class HttpReceiver(Receiver):
    """OTLP/HTTP protobuf receiver on ``/v1/metrics`` (or any path given)."""

    def __init__(self, port: int = 0, path: str = "/v1/metrics") -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != path:
                    self.send_response(404)
                    self.end_headers()
                    return
                request = metrics_service_pb2.ExportMetricsServiceRequest()
                request.ParseFromString(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver.add(Received(request, headers))
                payload = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        super().__init__(port=self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class GrpcReceiver(Receiver):
    """OTLP/gRPC receiver implementing the real MetricsService."""

    def __init__(self, port: int = 0) -> None:
        import grpc

        receiver = self

        class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                headers = {k: v for k, v in context.invocation_metadata()}
                receiver.add(Received(request, headers))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), self._server)
        bound = self._server.add_insecure_port(f"127.0.0.1:{port}")
        super().__init__(port=bound)
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None).wait(5)


class HangingEndpoint:
    """A port that accepts TCP connections (kernel backlog) but never answers: a stuck collector."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()

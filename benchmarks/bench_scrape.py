"""What one scrape of our endpoint costs the serving process, side by side with prometheus_client serving the same families.

Two server processes:

- ours: ``setup_telemetry()`` (GPU metrics off, host metrics on or off) after 200 training steps and
  one evaluation, serving its pull endpoint; nothing else runs in it.
- reference: the very same families, parsed from ours' exposition (taken once, before timing), served
  from a plain collector through ``prometheus_client``'s registry and ``start_http_server``.

The client (this process) scrapes each server ``--scrapes`` times a round, the two alternating which
goes first, for ``--rounds`` rounds; each server's process CPU time (user + system, from psutil) is
read before and after each batch. Process CPU, not wall time, so that other load on the machine
matters less. Printed: samples and bytes per scrape, median per-scrape CPU of each server, and the
ratio ours / reference (target: at most 1.0), with and without host metrics
(``OPENLORA_HOST_METRICS``). ``--openmetrics`` scrapes with Prometheus's OpenMetrics Accept header.

``--connection``: ``new`` opens a connection per scrape; ``kept`` keeps one open per server, as
Prometheus 2 and 3 and vmagent do where the target allows it (ours answers HTTP/1.1 and keeps it;
prometheus_client's server answers HTTP/1.0 and closes it, so its scrapes connect anew either way).

    python benchmarks/bench_scrape.py [--rounds 5] [--scrapes 200] [--host both|on|off] [--openmetrics]
                                      [--connection both|new|kept]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OPENMETRICS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
)
STEPS = 200


def serve_ours(host: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from openlora_otel import TelemetryConfig, setup_telemetry

    config = TelemetryConfig(
        gpu_metrics="off",
        host_metrics=host,
        quiet=True,
        handle_sigterm=False,
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        final_scrape_timeout_s=0.0,
    )
    telemetry = setup_telemetry(config=config)
    for step in range(STEPS):
        telemetry.training.record_step(
            loss=2.0 - step * 0.005, grad_norm=1.0, learning_rate=1e-4, tokens=512, samples=4, step_time_s=0.1
        )
    telemetry.training.record_eval(loss=1.5, accuracy=0.75)
    url = telemetry.prometheus_url
    assert url is not None
    print(url.rsplit(":", 1)[1].split("/")[0], flush=True)
    sys.stdin.read()  # until the client closes our stdin
    telemetry.shutdown()


def serve_reference(exposition_file: str) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(Path(exposition_file).read_text()))

    class Fixed:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()


def _start(args: list[str]) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _get(port: int, openmetrics: bool, kept: dict[int, http.client.HTTPConnection] | None = None) -> bytes:
    """One scrape; with ``kept``, on the connection kept for ``port`` (reopened when the server closed it)."""
    connection = kept.get(port) if kept is not None else None
    if connection is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        if kept is not None:
            kept[port] = connection
    headers = {"Accept": OPENMETRICS_ACCEPT} if openmetrics else {}
    connection.request("GET", "/metrics", headers=headers)
    response = connection.getresponse()
    body = response.read()
    if kept is None or response.will_close:
        connection.close()  # http.client reconnects on the next request
    return body


def _cpu(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _samples(text: bytes) -> int:
    return sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))


def compare(host: bool, rounds: int, scrapes: int, openmetrics: bool, keep: bool = False) -> dict:
    import psutil

    ours, ours_port = _start(["--serve", "ours", "--host", "on" if host else "off"])
    reference = None
    try:
        _get(ours_port, False)  # the first collection registers every stream
        text = _get(ours_port, False)
        with tempfile.NamedTemporaryFile("wb", suffix=".prom", delete=False) as handle:
            handle.write(text)
        reference, reference_port = _start(["--serve", "reference", "--exposition", handle.name])
        os.unlink(handle.name)
        servers = {"ours": (psutil.Process(ours.pid), ours_port), "reference": (psutil.Process(reference.pid), reference_port)}
        sizes = {name: len(_get(port, openmetrics)) for name, (_, port) in servers.items()}
        per_scrape: dict[str, list[float]] = {"ours": [], "reference": []}
        kept: dict[int, http.client.HTTPConnection] | None = {} if keep else None
        for round_ in range(rounds):
            order = ["ours", "reference"] if round_ % 2 == 0 else ["reference", "ours"]
            for name in order:
                process, port = servers[name]
                _get(port, openmetrics, kept)  # a kept connection is open before the batch, as between scrapes
                before = _cpu(process)
                for _ in range(scrapes):
                    _get(port, openmetrics, kept)
                per_scrape[name].append((_cpu(process) - before) / scrapes)
        for connection in (kept or {}).values():
            connection.close()
        ours_ms = statistics.median(per_scrape["ours"]) * 1e3
        reference_ms = statistics.median(per_scrape["reference"]) * 1e3
        return {
            "host": host,
            "connection": "kept" if keep else "new",
            "samples": _samples(text),
            "kib": sizes["ours"] / 1024,
            "reference_kib": sizes["reference"] / 1024,
            "ours_ms": ours_ms,
            "reference_ms": reference_ms,
            "ratio": ours_ms / reference_ms,
            "ours_rounds": [round(x * 1e3, 3) for x in per_scrape["ours"]],
            "reference_rounds": [round(x * 1e3, 3) for x in per_scrape["reference"]],
        }
    finally:
        for process in (ours, reference):
            if process is not None:
                process.stdin.close()
                process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of scrapes per server, alternating (default 5)")
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes per round (default 200)")
    parser.add_argument(
        "--host", choices=("both", "on", "off"), default="both", help="host metrics on, off, or both cases (default both)"
    )
    parser.add_argument("--openmetrics", action="store_true", help="scrape with Prometheus's OpenMetrics Accept header")
    parser.add_argument(
        "--connection",
        choices=("both", "new", "kept"),
        default="both",
        help="a new connection per scrape, one kept open per server (as Prometheus scrapes), or both (default)",
    )
    parser.add_argument("--json", action="store_true", help="also print each case as a JSON line")
    parser.add_argument("--serve", choices=("ours", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--exposition", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "ours":
        serve_ours(args.host == "on")
        return
    if args.serve == "reference":
        serve_reference(args.exposition)
        return
    cases = {"both": (False, True), "on": (True,), "off": (False,)}[args.host]
    connections = {"both": (False, True), "new": (False,), "kept": (True,)}[args.connection]
    fmt = "OpenMetrics" if args.openmetrics else "text 0.0.4"
    print(f"{args.rounds} rounds x {args.scrapes} scrapes per server, {fmt}, server process CPU per scrape (median of rounds)")
    print(f"{'connection':<11} {'host metrics':<13} {'samples':>7} {'KiB':>6} {'ours ms':>8} {'prom_client ms':>14} {'ratio':>6}")
    for keep in connections:
        for host in cases:
            result = compare(host, args.rounds, args.scrapes, args.openmetrics, keep)
            print(
                f"{result['connection']:<11} {'on' if host else 'off':<13} {result['samples']:>7} {result['kib']:>6.1f} "
                f"{result['ours_ms']:>8.3f} {result['reference_ms']:>14.3f} {result['ratio']:>6.2f}"
            )
        if args.json:
            print(json.dumps(result))


if __name__ == "__main__":
    main()

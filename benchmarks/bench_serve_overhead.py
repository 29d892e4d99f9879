"""Requests per second served by `openlora-otel serve`, telemetry on vs OTEL_SDK_DISABLED=true.

Two tiny adapters are trained once with ``openlora-otel demo --save``. Each pair
then starts ``openlora-otel serve`` twice on the same directory: once with
telemetry on (Prometheus pull endpoint scraped by this script every 5 s, the
interval of collector/prometheus.yml, or ``--scrape-interval``; host metrics on; the FastAPI instrumentation's HTTP metrics;
every request through ``telemetry.inference``), once with the SDK disabled.
A closed loop of client threads (one more than the server's generation slots,
so its queue is never empty) sends completions back to back for a fixed time,
cycling adapter a1, adapter a2 and the base model, every other one streamed.
Completed requests per second are counted after a warm-up; pairs alternate
which side goes first, and the median of the per-pair ratios is the figure
(target >= 0.98). The server's CPU time per completed request (from /proc) is
printed too: on a shared machine it moves less with other load than req/s.

``--api chat`` sends ``POST /v1/chat/completions`` (one user message) instead of
``POST /v1/completions``; ``--stream always`` or ``never`` streams every request
or none instead of every other one. A request counts as completed only with
status 200 and, when streamed, once the ``data: [DONE]`` line has arrived.
``--control`` runs both sides of every pair with telemetry off (an A/A run): the
spread of its ratios is the noise floor of the machine, to set beside a real run.
``--device`` trains the adapters and serves them there (default cpu).

    python benchmarks/bench_serve_overhead.py [--pairs 5] [--seconds 20] [--warmup 3] [--max-tokens 8] [--slots 2]
        [--scrape-interval 5] [--device cpu] [--api completions|chat] [--stream mixed|always|never] [--control]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("a1", "a2", "tiny-llama")
PROMPT = "the cat sat on the mat. "
CHAT_MESSAGES = [{"role": "user", "content": "the cat sat on the mat."}]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENLORA_"))}
    # The checkout first, then whatever the caller had (benchmarks/gpu_check.sh puts carried wheels there).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "OPENLORA_QUIET": "true", **extra}


def save(directory: Path, device: str = "cpu") -> None:
    for seed, name in enumerate(("a1", "a2")):
        subprocess.run(
            [
                sys.executable, "-m", "openlora_otel", "demo", "--steps", "4", "--batch-size", "2",
                "--eval-every", "0", "--exporter", "none", "-q", "--save", str(directory),
                "--run-name", name, "--seed", str(seed), "--device", device,
            ],
            env=env(), cwd=ROOT, check=True, capture_output=True, timeout=600,
        )  # fmt: skip


def wait_ready(port: int, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("serve not ready in time")


def one_request(
    connection: http.client.HTTPConnection,
    model: str,
    max_tokens: int,
    stream: bool,
    api: str = "completions",
) -> bool:
    """Send one request and read its whole answer; True if it completed (200 and, streamed, ``data: [DONE]`` seen)."""
    payload: dict[str, object] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if api == "chat":
        payload["messages"] = CHAT_MESSAGES
    else:
        payload["prompt"] = PROMPT
    headers = {"Content-Type": "application/json"}
    connection.request("POST", PATHS[api], body=json.dumps(payload), headers=headers)
    response = connection.getresponse()
    body = response.read()  # a stream is read to its end (the server closes the chunked body after [DONE])
    if response.status != 200:
        return False
    # A stream that failed midway still has status 200 but ends with an error event instead of [DONE].
    return not stream or any(line.strip() == b"data: [DONE]" for line in body.splitlines())


def streamed(mode: str, i: int) -> bool:
    """Whether request number ``i`` of a client is streamed under ``--stream mode``."""
    return mode == "always" or (mode == "mixed" and bool(i % 2))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def closed_loop(
    port: int,
    clients: int,
    seconds: float,
    warmup: float,
    max_tokens: int,
    pid: int,
    api: str = "completions",
    stream: str = "mixed",
) -> tuple[float, float]:
    """Completed requests per second over ``seconds`` (after ``warmup`` seconds not counted), and
    the server's CPU milliseconds per completed request over the same span."""
    start = time.monotonic()
    counting_from = start + warmup
    stop_at = counting_from + seconds
    counts = [0] * clients
    cpu_marks: list[float] = []

    def mark_cpu() -> None:
        time.sleep(max(0.0, counting_from - time.monotonic()))
        cpu_marks.append(cpu_seconds(pid))
        time.sleep(max(0.0, stop_at - time.monotonic()))
        cpu_marks.append(cpu_seconds(pid))

    def client(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        i = index
        while time.monotonic() < stop_at:
            ok = one_request(connection, MODELS[i % 3], max_tokens, stream=streamed(stream, i), api=api)
            if ok and counting_from <= time.monotonic() <= stop_at:
                counts[index] += 1
            i += 1
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    threads.append(threading.Thread(target=mark_cpu))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + warmup + 120)
    done = sum(counts)
    return done / seconds, 1000 * (cpu_marks[1] - cpu_marks[0]) / max(done, 1)


def scrape_every(interval: float, url: str, stop: threading.Event) -> None:
    while not stop.wait(interval):
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=5).read()


def run_side(directory: Path, telemetry_on: bool, args: argparse.Namespace) -> tuple[float, float]:
    port, metrics_port = free_port(), free_port()
    extra = (
        {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(metrics_port)}
        if telemetry_on
        else {"OTEL_SDK_DISABLED": "true"}
    )
    process = subprocess.Popen(
        [
            sys.executable, "-m", "openlora_otel", "serve", str(directory), "--port", str(port),
            "--max-concurrency", str(args.slots), "--max-queue", "64", "--device", args.device,
        ],
        env=env(**extra), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stop = threading.Event()
    try:
        wait_ready(port, process)
        if telemetry_on:
            threading.Thread(
                target=scrape_every,
                args=(args.scrape_interval, f"http://127.0.0.1:{metrics_port}/metrics", stop),
                daemon=True,
            ).start()
        clients = args.slots + 1
        return closed_loop(
            port, clients, args.seconds, args.warmup, args.max_tokens, process.pid, args.api, args.stream
        )
    finally:
        stop.set()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=20.0, help="counted seconds per side")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of requests not counted first")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2, help="serve --max-concurrency")
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="seconds between two scrapes")
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--api", choices=sorted(PATHS), default="completions",
        help="POST /v1/completions or /v1/chat/completions (default completions)",
    )  # fmt: skip
    parser.add_argument(
        "--stream", choices=("mixed", "always", "never"), default="mixed",
        help="stream every other request (mixed, the default), every request, or none",
    )  # fmt: skip
    parser.add_argument(
        "--control", action="store_true",
        help="A/A run: telemetry off on both sides of every pair, so the ratios show the machine's noise",
    )  # fmt: skip
    return parser


def describe(args: argparse.Namespace) -> str:
    """One line saying what this run measures."""
    sides = (
        "CONTROL run (A/A): telemetry OFF on both sides of every pair; the ratios are this machine's noise floor"
        if args.control
        else f"telemetry on (scraped every {args.scrape_interval:g} s) vs OTEL_SDK_DISABLED=true"
    )
    return (
        f"POST {PATHS[args.api]}, streamed: {args.stream}, max_tokens {args.max_tokens}, {args.slots} slots, "
        f"{args.slots + 1} clients, {args.pairs} pairs of {args.seconds:g} s (+{args.warmup:g} s warm-up) "
        f"on {args.device}; {sides}"
    )


def measure(args: argparse.Namespace, report=print) -> list[tuple[float, float, float, float]]:
    """Per pair: (req/s on, server CPU ms per request on, req/s off, CPU ms off); ``report`` gets a line per pair.

    With ``args.control`` both sides run with telemetry off: the tuple is then (side A, side B), A being
    the side that a real run would have had telemetry on (first in even pairs, second in odd ones)."""
    control = getattr(args, "control", False)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "saved"
        save(directory, args.device)
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            results = {side: run_side(directory, side and not control, args) for side in order}
            (on_rate, on_cpu), (off_rate, off_cpu) = results[True], results[False]
            pairs.append((on_rate, on_cpu, off_rate, off_cpu))
            ratio = f"{on_rate / off_rate:.3f}" if off_rate else "n/a (no request completed)"
            if control:
                report(
                    f"pair {pair + 1} (control, telemetry off on both sides): A {on_rate:.2f} req/s "
                    f"({on_cpu:.1f} ms server CPU per request), B {off_rate:.2f} req/s ({off_cpu:.1f} ms), "
                    f"ratio A/B {ratio}"
                )
            else:
                report(
                    f"pair {pair + 1}: telemetry on {on_rate:.2f} req/s ({on_cpu:.1f} ms server CPU per request), "
                    f"off {off_rate:.2f} req/s ({off_cpu:.1f} ms), ratio {ratio}"
                )
    return pairs


def main() -> None:
    args = parser().parse_args()
    print(describe(args), flush=True)
    pairs = measure(args, report=lambda line: print(line, flush=True))
    ratios = [on / off for on, _, off, _ in pairs if off]
    cpu_ratios = [on_cpu / off_cpu for _, on_cpu, _, off_cpu in pairs if off_cpu]
    if not ratios or not cpu_ratios:
        sys.exit("no request completed on one side of every pair: no ratio to report")
    if args.control:
        name, tail = "A/B", "CONTROL run, telemetry off on both sides: this spread is the noise floor"
    else:
        name, tail = "on/off", "target >= 0.98"
    print(
        f"median ratio {name} over {len(ratios)} pairs: {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f} to {max(ratios):.3f}; {tail})"
    )
    print(
        f"median server CPU per request, {name}: {statistics.median(cpu_ratios):.3f} "
        f"(range {min(cpu_ratios):.3f} to {max(cpu_ratios):.3f}): less sensitive to other load on the machine"
    )


if __name__ == "__main__":
    main()

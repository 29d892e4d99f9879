"""``openlora-otel load``: its parser and the run it prints (:mod:`openlora_otel.serving.load` is the load
generator)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from openlora_otel.commands._args import command_parser, number, usage_error
from openlora_otel.serving.load import (
    DEFAULT_PROMPT,
    DEFAULT_URL,
    LoadOptions,
    LoadUsageError,
    Unreachable,
    check_options,
    parse_mix,
    render,
    run_load,
)


def register(commands: Any) -> None:
    add_parser(commands).set_defaults(func=run)


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    try:
        return parse_mix(text)
    except LoadUsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``load`` subcommand to ``openlora-otel``'s subparsers."""
    parser = command_parser(
        subparsers,
        "load",
        help="send a bounded load of completions to `openlora-otel serve` and print client-side latencies",
        description="Send POST /v1/completions to URL on a fixed schedule (open loop: request i starts "
        "i/RATE s after the start whatever the earlier ones do), with the model of each request drawn from "
        "a weighted mix (seeded: repeatable). At most CONCURRENCY are in flight: a request whose slot comes "
        "while the cap is reached is not sent, and counted. Prints, per model and overall: sent, not sent, "
        "answers by HTTP status and failures by error type, whole-request latency and time to first token "
        "(streaming) p50/p95/p99, output tokens/s. The run stops by itself after its schedule plus at most "
        "one --timeout. Exit status: 0 it ran (HTTP errors are reported, not fatal), 1 the server cannot "
        "be reached, 2 usage error, 130 interrupted.",
    )
    parser.add_argument("--url", default=DEFAULT_URL, help="the server (default %(default)s)")
    parser.add_argument(
        "--rate",
        type=number(float),
        default=1.0,
        metavar="PER_S",
        help="requests per second (default %(default)s)",
    )
    parser.add_argument(
        "--duration",
        type=number(float),
        metavar="SECONDS",
        help="schedule requests for this long (default 10 unless --requests is given)",
    )
    parser.add_argument(
        "--requests",
        type=number(int),
        metavar="N",
        help="send at most N requests (with --duration: whichever ends first)",
    )
    parser.add_argument(
        "--concurrency",
        type=number(int),
        default=32,
        metavar="N",
        help="at most N requests in flight; the ones whose slot finds N in flight are not sent (default %(default)s)",
    )
    parser.add_argument(
        "--adapters",
        type=_mix,
        metavar="MIX",
        help="model names to send to, with weights: a1=3,a2=1,tiny-llama=1 (the base model by its name; a name "
        "alone weighs 1); default: every model GET /v1/models lists, equally",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the mix's draws (default %(default)s)")
    parser.add_argument(
        "--max-tokens",
        type=number(int),
        default=16,
        metavar="N",
        help="max_tokens of each request (default %(default)s)",
    )
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the answers (SSE) and measure the time to first token (default: stream)",
    )
    parser.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="the prompt of every request (default %(default)r)"
    )
    parser.add_argument(
        "--timeout",
        type=number(float),
        default=30.0,
        metavar="SECONDS",
        help="per request, all of it (default %(default)s)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Carry out ``openlora-otel load`` for parsed ``args``."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    options = LoadOptions(
        url=args.url,
        rate=args.rate,
        duration=args.duration if args.duration is not None or args.requests is not None else 10.0,
        requests=args.requests,
        concurrency=args.concurrency,
        mix=args.adapters or (),
        seed=args.seed,
        max_tokens=args.max_tokens,
        stream=args.stream,
        prompt=args.prompt,
        timeout=args.timeout,
    )
    try:
        check_options(options)
    except LoadUsageError as exc:
        usage_error(args, str(exc))
    # Opened first: a run is not thrown away for a path that cannot be written.
    try:
        json_file = open(args.json, "w", encoding="utf-8") if args.json else None  # noqa: SIM115
    except OSError as exc:
        usage_error(args, f"--json {args.json}: {exc.strerror or exc}")
    try:
        try:
            result = run_load(options, log=err)
        except (Unreachable, LoadUsageError) as exc:
            print(f"openlora-otel load: {exc}", file=err)
            if json_file is not None:  # a reader of the file learns why there are no results
                json.dump({"options": options.as_json(), "error": str(exc)}, json_file, indent=2)
                json_file.write("\n")
            return 1 if isinstance(exc, Unreachable) else 2
        print(render(result), file=out)
        if json_file is not None:
            json.dump(result.as_json(), json_file, indent=2)
            json_file.write("\n")
    finally:
        if json_file is not None:
            json_file.close()
    if not result.reached:
        print(f"openlora-otel load: no request could connect to {options.shown_url}", file=err)
        return 1
    return 130 if result.interrupted else 0

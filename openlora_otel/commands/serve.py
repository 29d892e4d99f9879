"""``openlora-otel serve``: its parser, the checks of DIR and --adapter, and the server's start."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from openlora_otel.commands._args import (
    command_parser,
    fail,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    usage_error,
)
from openlora_otel.config import DEFAULT_PROMETHEUS_PORT
from openlora_otel.model.device import add_device_argument, device_problem


def register(commands: Any) -> None:
    from openlora_otel.model.layout import ADAPTER_NAME_RULE

    serve = command_parser(
        commands,
        "serve",
        help="serve a model saved by `demo --save` and its LoRA adapters over HTTP (needs the serve extra)",
        description="Serve the base model and adapters saved by `openlora-otel demo --save DIR` over HTTP "
        "(FastAPI + uvicorn; on the first CUDA device when torch sees one, else on CPU: --device; greedy "
        "decoding, streaming): POST /v1/completions with "
        '{"model": ADAPTER or the base model\'s name, "prompt": ..., "max_tokens": N, "stream": BOOL}, '
        "GET /v1/models, GET /health. At most --max-concurrency requests generate at once, --max-queue "
        "more wait, the rest get 503. Every request is measured (gen_ai.server.* and openlora.inference.*, "
        "per adapter) and served with the HTTP server metrics at the telemetry's endpoint (Prometheus "
        f"on OTEL_EXPORTER_PROMETHEUS_PORT, {DEFAULT_PROMETHEUS_PORT} by default). SIGINT / SIGTERM: stop accepting, let "
        "in-flight requests finish within --shutdown-timeout (then cancel them), deliver the final "
        "metrics. Exit status: 0 stopped, 2 usage or configuration error.",
    )
    serve.set_defaults(func=run)
    serve.add_argument("directory", metavar="DIR", help="a directory written by `openlora-otel demo --save DIR`")
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also serve the PEFT adapter directory PATH as NAME (repeatable; NAME: "
        f"{ADAPTER_NAME_RULE}); DIR/adapters/* are served under their directory names",
    )
    add_device_argument(serve, "run the models on", "auto")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument(
        "--port", type=non_negative_int, default=8000, help="HTTP port (default %(default)s; 0: any free port)"
    )
    serve.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=4,
        metavar="N",
        help="requests generating at once, each on its own thread (default %(default)s)",
    )
    serve.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=64,
        metavar="N",
        help="requests waiting for a slot; more get 503 overloaded (default %(default)s)",
    )
    serve.add_argument(
        "--max-new-tokens-limit",
        type=positive_int,
        default=512,
        metavar="N",
        help="the largest max_tokens a request may ask for, at most 512 (default %(default)s)",
    )
    serve.add_argument(
        "--chat-default-max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="max_tokens of a chat request that gives none (default: --max-new-tokens-limit, as OpenAI's"
        " default is the model's limit; a completion's default is 16)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="after SIGINT / SIGTERM, how long in-flight requests may take before they are cancelled "
        "(default %(default)s)",
    )
    add_limit_arguments(serve)
    serve.add_argument(
        "--exporter",
        metavar="LIST",
        help="overrides OTEL_METRICS_EXPORTER: prometheus, otlp, console, none, or a comma list",
    )


def add_limit_arguments(serve: argparse.ArgumentParser) -> None:
    """The limits of a public endpoint (serving/limits.py); 0 turns one off."""
    from openlora_otel.serving import limits

    group = serve.add_argument_group("limits", "what a request and a connection may take; 0 turns a limit off")
    group.add_argument(
        "--max-body-bytes",
        type=non_negative_int,
        default=limits.DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help="a larger request body gets 413 before it is read, by its Content-Length or as it arrives "
        "(default %(default)s: 1 MiB)",
    )
    group.add_argument(
        "--max-json-depth",
        type=non_negative_int,
        default=limits.DEFAULT_MAX_JSON_DEPTH,
        metavar="N",
        help="a body nesting JSON arrays and objects deeper gets 400 before it is parsed (default %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=non_negative_float,
        default=limits.DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a request body not complete this long after its headers gets 408 (default %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=non_negative_float,
        default=limits.DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection that has not sent a request's headers this long after it opened (or after its "
        "previous response) is closed (default %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=non_negative_int,
        default=limits.DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="open connections at most (lowered to the open-files limit less 64); past it the connection "
        "that has waited longest for its request headers is closed (default %(default)s)",
    )


def limits_from(args: argparse.Namespace) -> Any:
    """The :class:`~openlora_otel.serving.limits.Limits` of the parsed flags (0: off)."""
    from openlora_otel.serving.limits import Limits

    return Limits(
        max_body_bytes=args.max_body_bytes or None,
        max_json_depth=args.max_json_depth or None,
        body_timeout_s=args.body_timeout or None,
        header_timeout_s=args.header_timeout or None,
        max_connections=args.max_connections or None,
    )


def _serve_problem(args: argparse.Namespace) -> tuple[Any, list[Any]] | str:
    """The saved base and the adapters to serve, or what is wrong with DIR / --adapter."""
    from openlora_otel.model.layout import LayoutError, adapter_name_problem, read_adapter, read_saved
    from openlora_otel.serving.server import MAX_TOKENS_LIMIT

    if not 0 <= args.port <= 65535:
        return f"--port: {args.port} is not a TCP port (0 to 65535)"
    import torch

    unusable = device_problem(args.device, torch)
    if unusable:
        return unusable
    if args.max_new_tokens_limit > MAX_TOKENS_LIMIT:
        return f"--max-new-tokens-limit: at most {MAX_TOKENS_LIMIT}, got {args.max_new_tokens_limit}"
    if args.chat_default_max_tokens is not None and args.chat_default_max_tokens > args.max_new_tokens_limit:
        return (
            f"--chat-default-max-tokens: at most --max-new-tokens-limit ({args.max_new_tokens_limit}),"
            f" got {args.chat_default_max_tokens}"
        )
    try:
        base, adapters = read_saved(args.directory)
    except LayoutError as exc:
        return f"DIR: {exc}"
    names = {adapter.name for adapter in adapters}
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            return f"--adapter: expected NAME=PATH, got {spec!r}"
        problem = adapter_name_problem(name, base.base_model)
        if problem:
            return f"--adapter {spec}: {problem}"
        if name in names:
            return f"--adapter {spec}: an adapter named {name!r} is already served (from {args.directory} or an earlier --adapter)"
        try:
            adapters.append(read_adapter(name, path))
        except LayoutError as exc:
            return f"--adapter {spec}: {exc}"
        names.add(name)
    return base, adapters


def run(args: argparse.Namespace) -> int:
    import os

    from openlora_otel._deps import MissingDependencyError, require
    from openlora_otel.config import DEFAULT_SERVICE_NAME, ConfigError, TelemetryConfig

    try:
        for module in ("fastapi", "uvicorn", "opentelemetry.instrumentation.fastapi", "torch", "transformers", "peft"):
            require(module, "openlora-otel serve", extra="serve")
    except MissingDependencyError as exc:
        return fail("serve", exc)
    found = _serve_problem(args)
    if isinstance(found, str):
        usage_error(args, found)
    base, adapters = found
    environ = dict(os.environ)
    if args.exporter is not None:
        environ["OTEL_METRICS_EXPORTER"] = args.exporter
    try:
        config = TelemetryConfig.from_env(environ)
    except ConfigError as exc:
        return fail("serve", exc)
    from openlora_otel.serving import server as _server
    from openlora_otel.telemetry import setup_telemetry

    options = _server.ServeOptions(
        host=args.host,
        port=args.port,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_new_tokens_limit=args.max_new_tokens_limit,
        chat_default_max_tokens=args.chat_default_max_tokens,
        shutdown_timeout_s=args.shutdown_timeout,
        limits=limits_from(args),
    )
    try:
        sock = _server.listen(options.host, options.port)
    except OSError as exc:
        print(
            f"openlora-otel serve: cannot listen on {options.host}:{options.port} ({exc.strerror or exc})",
            file=sys.stderr,
        )
        return 2
    # The HTTP instrumentation reads this variable itself; unless the user chose, the stable HTTP
    # conventions (seconds, the route, no client-sent Host header in the labels). See docs/how-to/serving.md.
    os.environ.setdefault(_server.HTTP_SEMCONV_VARIABLE, _server.HTTP_SEMCONV_DEFAULT)
    # service.name is openlora-serve unless the environment names the service.
    named = config.service_name != DEFAULT_SERVICE_NAME or bool(environ.get("OTEL_SERVICE_NAME"))
    try:
        try:
            telemetry = setup_telemetry(None if named else "openlora-serve", config=config.replace(quiet=True))
        except (ConfigError, MissingDependencyError) as exc:
            return fail("serve", exc)
        try:
            return _server.serve(base, adapters, telemetry, options, sock, device=args.device)
        finally:
            telemetry.shutdown()
    finally:
        sock.close()

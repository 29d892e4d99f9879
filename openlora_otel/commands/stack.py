"""``openlora-otel stack``: its parser, the checks of its arguments, and the plan it writes and starts
(:mod:`openlora_otel.stack.servers` holds the configs, the servers and the alert printer)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from openlora_otel.commands._args import add_runbook_base_argument, command_parser, usage_error
from openlora_otel.config import ConfigError, TelemetryConfig
from openlora_otel.config.checks import check_url
from openlora_otel.exporters.discovery import scrape_address
from openlora_otel.redaction import redact_url
from openlora_otel.stack.chat import CHAT_WEBHOOK_ENV
from openlora_otel.stack.servers import (
    ALERTMANAGER_BINARIES,
    DEFAULT_ALERTMANAGER_PORT,
    DEFAULT_EVALUATION_INTERVAL,
    DEFAULT_METRICS_PORT,
    DEFAULT_PROMETHEUS_PORT,
    DEFAULT_RECEIVER_PORT,
    DEFAULT_SCRAPE_INTERVAL,
    LOOPBACK,
    MAX_RANKS,
    PROMETHEUS_BINARIES,
    StackPlan,
    find_binary,
    receive_only,
    start,
    write,
)

_DURATION = re.compile(r"(\d+)(ms|s|m)")


def register(commands: Any) -> None:
    add_parser(commands).set_defaults(func=run)


def _duration(text: str) -> str:
    match = _DURATION.fullmatch(text)
    seconds = 0.0
    if match:
        seconds = int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]
    if not match or not 1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(
            f"expected a Prometheus duration from 1s to 60m such as 5s, 15s or 1m, got {text!r}"
        )
    return text


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return value


def _ranks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_RANKS:
        raise argparse.ArgumentTypeError(f"expected a number of ranks from 1 to {MAX_RANKS}, got {text!r}")
    return value


def _url(option: str, *, hide_path: bool = False) -> Callable[[str], str]:
    """The argparse type of URL argument ``option`` (``hide_path``: a webhook's, whose path is its token)."""

    def parse(text: str) -> str:
        # argparse quotes the raw value of any other exception (a ValueError from urlsplit, say): every
        # refusal goes through this message, redacted.
        try:
            check_url(option, text, hide_path=hide_path)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


_webhook = _url("--webhook", hide_path=True)
_chat_webhook = _url("--chat-webhook", hide_path=True)
_prometheus = _url("--prometheus")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``stack`` subcommand to ``openlora-otel``'s subparsers."""
    parser = command_parser(
        subparsers,
        "stack",
        help="write (and with --start run) a native Prometheus and Alertmanager for local runs, no Docker",
        description="Write into DIR a Prometheus config that scrapes the local ranks' endpoints "
        "(localhost:PORT to PORT+N-1, or the targets the ranks register in OPENLORA_PROMETHEUS_FILE_SD_DIR "
        "when it is set), loads openlora-otel's alerting rules and sends alerts to a local Alertmanager, "
        "and an alertmanager.yml that routes them to a webhook; print the two command lines. With --start, "
        "run both on 127.0.0.1 (binaries `prometheus` and `prometheus-alertmanager` or `alertmanager` on "
        "PATH) until Ctrl-C or SIGTERM, and, unless --webhook names your receiver, print every alert here. "
        "Exit status: 0 done or stopped, 1 a server failed, 2 usage error or a binary missing.",
    )
    parser.add_argument("--dir", type=Path, metavar="DIR", help="where the configs, data and logs go")
    parser.add_argument(
        "--ranks",
        type=_ranks,
        default=1,
        metavar="N",
        help="training processes on this machine, on ports PORT to PORT+N-1 (default %(default)s)",
    )
    parser.add_argument(
        "--port",
        type=_port,
        metavar="PORT",
        help=f"the first rank's metrics port (default: OTEL_EXPORTER_PROMETHEUS_PORT, else {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument(
        "--webhook",
        type=_webhook,
        metavar="URL",
        help="send alerts to this webhook (Alertmanager's JSON) instead of printing them here",
    )
    parser.add_argument(
        "--start",
        action="store_true",
        help="run Prometheus and Alertmanager until Ctrl-C; the alerts are printed here (unless --webhook), "
        "with the diagnosis of each alerting run (openlora-otel diagnose) under its first alert",
    )
    parser.add_argument(
        "--receiver-only",
        action="store_true",
        help="only print the alerts an Alertmanager sends to http://127.0.0.1:RECEIVER_PORT/alerts (the "
        "default receiver of collector/alertmanager.yml, for the compose stack); no --dir needed",
    )
    parser.add_argument(
        "--chat-webhook",
        type=_chat_webhook,
        metavar="URL",
        help=f"also forward the alerts and diagnoses the receiver prints (--start, --receiver-only) to this "
        f'Slack-style incoming webhook ({{"text": ...}}: Slack, Mattermost, Rocket.Chat); default: '
        f"{CHAT_WEBHOOK_ENV}, which keeps the URL (its token) out of `ps`; the URL is never printed whole",
    )
    parser.add_argument(
        "--prometheus",
        type=_prometheus,
        metavar="URL",
        help="with --receiver-only: diagnose each alerting run from this Prometheus (openlora-otel diagnose) "
        "and print the top findings under its alert (--start diagnoses from the stack's own)",
    )
    parser.add_argument(
        "--prometheus-port", type=_port, default=DEFAULT_PROMETHEUS_PORT, help="(default %(default)s)"
    )
    parser.add_argument(
        "--alertmanager-port", type=_port, default=DEFAULT_ALERTMANAGER_PORT, help="(default %(default)s)"
    )
    parser.add_argument(
        "--receiver-port",
        type=_port,
        default=DEFAULT_RECEIVER_PORT,
        help="the port of the alert printer (default %(default)s)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=_duration,
        default=DEFAULT_SCRAPE_INTERVAL,
        help="(default %(default)s, as collector/prometheus.yml; under 5s OpenloraTrainingEndpointUnresponsive "
        "cannot fire, its threshold is 4 s of scrape time)",
    )
    parser.add_argument(
        "--evaluation-interval",
        type=_duration,
        default=DEFAULT_EVALUATION_INTERVAL,
        help="(default %(default)s)",
    )
    add_runbook_base_argument(parser)
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Carry out ``openlora-otel stack`` for parsed ``args``."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    chat_webhook = args.chat_webhook
    if chat_webhook is not None and not (args.start or args.receiver_only):
        usage_error(args, "--chat-webhook forwards what the receiver of --start or --receiver-only prints")
    if chat_webhook is not None and args.webhook and not args.receiver_only:
        usage_error(args, "--chat-webhook needs the built-in receiver: not with --webhook")
    if args.prometheus is not None and not args.receiver_only:
        usage_error(args, "--prometheus is for --receiver-only (--start diagnoses from the stack's own)")
    if chat_webhook is None and (args.receiver_only or (args.start and not args.webhook)):
        chat_webhook = os.environ.get(CHAT_WEBHOOK_ENV) or None
        if chat_webhook is not None:
            try:
                check_url(CHAT_WEBHOOK_ENV, chat_webhook, hide_path=True)
            except ConfigError as exc:
                print(f"openlora-otel stack: {exc}", file=err)
                return 2
    if args.receiver_only:
        return receive_only(
            args.receiver_port, out, err, diagnose_from=args.prometheus, chat_webhook=chat_webhook
        )
    if args.dir is None:
        usage_error(args, "--dir is required (where the configs go), unless --receiver-only")
    try:
        config = TelemetryConfig.from_env()
    except ConfigError as exc:
        print(f"openlora-otel stack: {exc}", file=err)
        return 2
    port = args.port
    if port is None:
        port = (
            config.prometheus_port
            if config.prometheus_port_explicit and config.prometheus_port
            else DEFAULT_METRICS_PORT
        )
    if port + args.ranks - 1 > 65535:
        usage_error(args, f"--port {port} with --ranks {args.ranks} runs past port 65535")
    ports = {args.prometheus_port, args.alertmanager_port} | (set() if args.webhook else {args.receiver_port})
    if len(ports) < (2 if args.webhook else 3):
        usage_error(args, "--prometheus-port, --alertmanager-port and --receiver-port must differ")
    directory = args.dir.expanduser().resolve()
    plan = StackPlan(
        directory=directory,
        targets=tuple(scrape_address(config.prometheus_host, p) for p in range(port, port + args.ranks)),
        file_sd_dir=config.file_sd_dir,
        webhook_url=args.webhook or f"http://{LOOPBACK}:{args.receiver_port}/alerts",
        builtin_receiver=args.webhook is None,
        prometheus_port=args.prometheus_port,
        alertmanager_port=args.alertmanager_port,
        receiver_port=args.receiver_port,
        scrape_interval=args.scrape_interval,
        evaluation_interval=args.evaluation_interval,
        runbook_base=args.runbook_base,
        chat_webhook=chat_webhook,
    )
    try:
        paths = write(plan)
    except OSError as exc:
        print(f"openlora-otel stack: cannot write into {directory} ({exc.strerror or exc})", file=err)
        return 2
    prometheus = find_binary(PROMETHEUS_BINARIES) or "prometheus"
    alertmanager = find_binary(ALERTMANAGER_BINARIES) or "prometheus-alertmanager"
    alerts = (
        f"sent to {redact_url(plan.webhook_url, path=True)}"
        if not plan.builtin_receiver
        else f"sent to {plan.webhook_url}, printed there by --start (or by `openlora-otel stack --receiver-only`)"
    )
    print(
        "wrote " + ", ".join(str(p) for p in paths) + "\n"
        f"Prometheus scrapes {plan.scraped}; alerts {alerts}\n"
        + ("starting:" if args.start else "start them (or run this command again with --start):")
        + "\n  "
        + shlex.join([Path(prometheus).name, *plan.prometheus_argv(prometheus)[1:]])
        + "\n  "
        + shlex.join([Path(alertmanager).name, *plan.alertmanager_argv(alertmanager)[1:]]),
        file=out,
        flush=True,
    )
    if not args.start:
        return 0
    return start(plan, err, out)

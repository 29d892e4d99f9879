"""``openlora-otel doctor``: the configuration, the ports and endpoints it names, the optional packages."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check the configuration, the ports and endpoints it names, and the optional packages",
        description="Print the configuration resolved from the environment (secrets redacted), check that "
        "the Prometheus port can be bound and the OTLP endpoint answers, list optional packages, and say "
        "what to fix. Exit status: 0 all good, 1 a check failed, 2 invalid configuration.",
    )
    doctor.add_argument(
        "--timeout", type=float, default=2.0, metavar="SECONDS", help="per network check (default 2)"
    )
    doctor.set_defaults(doctor_parser=doctor, func=run)


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        args.doctor_parser.error("--timeout must be > 0")
    from openlora_otel.doctor import run_doctor

    return run_doctor(timeout_s=args.timeout)

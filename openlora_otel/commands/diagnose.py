"""``openlora-otel diagnose``: why a run went wrong, from its history files (:mod:`openlora_otel.report.diagnosis`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from openlora_otel.commands._args import command_parser, fail, usage_error
from openlora_otel.report.model import ReportError


def register(commands: Any) -> None:
    add_parser(commands).set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``diagnose`` command to the CLI's subcommands."""
    parser = command_parser(
        subparsers,
        "diagnose",
        help="find why a run went wrong from its own metrics: ranked findings with their evidence",
        description="Read runs from history files (OPENLORA_HISTORY_DIR: a directory or .jsonl files, every rank's) "
        "or from a Prometheus server (--prometheus URL --run ID_OR_NAME) and print, for each run (or the --run ones), what went wrong, most severe first: a GPU that "
        "failed (fell off the bus, uncorrected ECC errors, a failed or pending row remap, an XID of a bad GPU), a loss or gradient norm "
        "gone non-finite (and whether the gradient norm grew or the loss spiked before it, with the learning rate "
        "then), a rank that stopped stepping while the others went on, a rank that ran out of GPU memory or whose "
        "allocated memory grows with the steps (and where it would run out) or fragments, a straggler rank (and what explains it: its GPU's "
        "clock held down by power or heat, its data wait, its PCIe link trained narrow), the step from which the run became lastingly slower (and what changed then), overfitting (the evaluation loss rising from its best while the training loss falls), a run waiting for its data, and where the rest of its time went (restarts, checkpoint saves, idle stalls) when it is a quarter or more. Each finding says when (step, wall time, rank), the values "
        "that show it and their series, the likely cause and what it ruled out, what to try, and the runbook "
        "entry. A healthy run has no finding. --json prints the documented JSON form instead "
        "(docs/how-to/diagnose.md). Exit status: 0 diagnosed (whatever was found), 2 usage error, unknown run or "
        "unreadable input.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH", help="history files (*.jsonl) or directories holding them")
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="read the --run runs from this Prometheus server instead (every rank, while the run is there: a "
        "running run too), in one range query per series for all its ranks",
    )
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="ID_OR_NAME",
        help="a run id (openlora_run_id) or run name to diagnose; repeat for several (default: every run in the "
        "files; with --prometheus: needed)",
    )
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON (the documented schema)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``openlora-otel diagnose`` with parsed ``args``; the exit status."""
    from openlora_otel.report.diagnosis import diagnose, text_lines, to_json
    from openlora_otel.report.history_source import read_runs

    if args.prometheus and args.paths:
        usage_error(args, "give history files or --prometheus URL, not both")
    if not args.paths and not args.prometheus:
        usage_error(args, "nothing to diagnose: give history files or directories, or --prometheus URL --run ID_OR_NAME")
    if args.prometheus and not args.run:
        usage_error(args, "--prometheus needs --run ID_OR_NAME (a run id or a run name; repeat it for several)")
    skipped: dict[str, int] = {}
    try:
        if args.prometheus:
            from openlora_otel.report.prometheus import read_prometheus

            runs = read_prometheus(args.prometheus, args.run, every_rank=True)
        else:
            runs = read_runs(args.paths, skipped=skipped)
        if args.run and not args.prometheus:
            missing = [w for w in args.run if not any(w in (r.run_id, r.name) for r in runs)]
            if missing:
                known = ", ".join(f"{r.run_id} ({r.name})" for r in runs)
                raise ReportError(
                    f"no run {', '.join(map(repr, missing))} in {', '.join(args.paths)}; the runs there are: {known}"
                )
            runs = [r for r in runs if r.run_id in args.run or r.name in args.run]
    except ReportError as exc:
        return fail("diagnose", exc)
    diagnosed = [(r, diagnose(r)) for r in runs]
    if args.json:
        print(json.dumps(to_json(diagnosed), indent=2, allow_nan=False))
    else:
        for r, findings in diagnosed:
            for line in text_lines(r, findings):
                print(line)
    for source, count in skipped.items():
        lines = "1 line" if count == 1 else f"{count:,} lines"
        print(f"openlora-otel diagnose: skipped {lines} of {source} (not OTLP/JSON metrics)", file=sys.stderr)
    return 0


__all__ = ["add_parser", "register", "run"]

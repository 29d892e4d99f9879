"""``openlora-otel report``: its parser, the runs it reads (history files, a Prometheus) and where it
writes the picture (:mod:`openlora_otel.report` reads and draws)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from openlora_otel.commands._args import command_parser, fail, usage_error
from openlora_otel.report.model import ReportError, Run

DEFAULT_SINCE = "1h"  # report.serving.DEFAULT_SINCE, without importing it for --help

FORMATS = ("png", "html")
X_AXES = ("step", "time", "elapsed")  # drawing.X_AXES, without importing matplotlib for --help
DEFAULT_STEM = "openlora-report"


def register(commands: Any) -> None:
    add_parser(commands).set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` command to the CLI's subcommands."""
    parser = command_parser(
        subparsers,
        "report",
        help="draw runs (loss, eval metrics, gradient norm, learning rate, throughput, step time, GPU) as PNG and "
        "an interactive HTML page",
        description="Draw one or more runs against the optimizer step (or the wall time, --x): loss and eval loss, "
        "the other evaluation metrics (accuracy, perplexity, ...: a panel each), gradient norm (mean "
        "and max), learning rate, throughput, step time, and GPU utilization and memory when the run had GPUs. "
        "A run that diverged (non-finite loss or gradient norm counted, a divergence guard tripped) is marked "
        "where it did, with what stopped it (openlora.run.outcome, e.g. stopped_by_guard). "
        "From history files, also where the time went: seconds and share per openlora.training.phase, "
        "goodput, and the steps lost per attempt, summed over ranks and attempts (printed and on the page). "
        "Runs come from history files (OPENLORA_HISTORY_DIR: a directory or .jsonl files; every run in them is "
        "drawn, or those --run names) or from a Prometheus server (--prometheus URL --run ID_OR_NAME ...). Several "
        "runs are overlaid, each labelled with its name and the hyperparameters that differ between them. "
        "Writes openlora-report.png and openlora-report.html in the current directory unless --out says "
        "otherwise. The HTML page is interactive and self-contained: charts drawn by uPlot (MIT, inlined "
        "with the data), drag to zoom, double-click to zoom out, hover for values, boxes to turn runs on and "
        "off, the x axis and the smoothing chosen on the page; it requests nothing from the network. "
        "Given --prometheus URL --adapter NAME: the served adapter next to the run that trained it. Its "
        "openlora_inference_adapter_info series names its training run (id and name), base model and final eval "
        "loss; that run's curves come from the history files given when they hold it, else from the same "
        "Prometheus; beside them, on a wall-time axis over --since, the adapter's request latency and time to "
        "first token (p50, p95), output tokens/s and joules per output token (the openlora-energy rules; empty, "
        "with a note, when the server had no GPU energy counter), with those figures over the range printed. "
        "Exit status: 0 written, 2 usage error, unknown run or adapter, unreadable input or unreachable server.",
    )
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="history files (*.jsonl) or directories holding them",
    )
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="read the --run runs, and the --adapter adapters, from this Prometheus server (for example "
        "http://127.0.0.1:9090)",
    )
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="ID_OR_NAME",
        help="a run id (openlora_run_id) or run name; repeat to compare runs. With --prometheus: the runs to read "
        "from it; without: the runs to keep from the files",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="with --prometheus: a served adapter (openlora_adapter_name); draws the run that trained it and "
        "the adapter's serving latency, tokens/s and energy per token; repeat for several. Of the history files "
        "given, only the adapters' training runs are drawn",
    )
    parser.add_argument(
        "--since",
        default=DEFAULT_SINCE,
        type=_since,
        metavar="DURATION",
        help="with --adapter: the serving range, up to now: a number and s, m, h, d or w (default %(default)s)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE_OR_DIR",
        help="where to write: a directory (gets openlora-report.png and .html; created when written with a "
        "trailing /), or a file name whose suffix is replaced per format (report.png -> report.png and "
        "report.html); default: ./openlora-report.*",
    )
    parser.add_argument(
        "--format",
        default="png,html",
        metavar="LIST",
        help="png, html, or both comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--x",
        default="step",
        choices=X_AXES,
        help="the x axis: the optimizer step, the wall time (UTC) the step was reached, or the seconds since "
        "the run's first step (default %(default)s; the page can switch)",
    )
    parser.add_argument(
        "--smooth",
        default=0.0,
        type=_weight,
        metavar="W",
        help="smooth the lines as TensorBoard does: an exponential moving average with weight W from 0 (off) "
        "to 0.99, debiased so it starts at the first value; the raw line is drawn faint behind. Evaluation "
        "points are not smoothed (default %(default)s; the page has a slider)",
    )
    return parser


def _since(text: str) -> str:
    from openlora_otel.report.serving import parse_duration

    try:
        parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (0 to 0.99)") from None
    if not 0.0 <= value <= 0.99:
        raise argparse.ArgumentTypeError(f"{text!r} is not from 0 (off) to 0.99")
    return value


def output_paths(out: str | None, formats: tuple[str, ...]) -> dict[str, Path]:
    """Where each format goes: ``out`` a directory (existing, or written with a trailing ``/``) or a file stem."""
    if out is None:
        base = Path.cwd() / DEFAULT_STEM
    elif out.endswith(("/", "\\")) or Path(out).is_dir():
        base = Path(out) / DEFAULT_STEM
    else:
        path = Path(out)
        base = path.with_suffix("") if path.suffix.lower() in (".png", ".html", ".htm") else path
    return {fmt: base.with_name(f"{base.name}.{fmt}") for fmt in formats}


def _formats(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    unknown = [fmt for fmt in chosen if fmt not in FORMATS]
    if not chosen or unknown:
        raise ValueError(f"{text!r} is not valid: expected png, html or png,html")
    return chosen


def run(args: argparse.Namespace) -> int:
    """Run ``openlora-otel report`` with parsed ``args``; the exit status."""
    try:
        formats = _formats(args.format)
    except ValueError as exc:
        usage_error(args, f"argument --format: {exc}")
    if args.adapter and not args.prometheus:
        usage_error(args, "--adapter needs --prometheus URL (the server that scraped the adapter's server)")
    if not args.paths and not args.prometheus:
        usage_error(
            args,
            "nothing to draw: give history files or directories, or --prometheus URL --run ID_OR_NAME"
        )
    if args.prometheus and not args.run and not args.adapter:
        usage_error(
            args,
            "--prometheus needs --run ID_OR_NAME (a run id or a run name; repeat it to compare runs) "
            "or --adapter NAME"
        )
    skipped: dict[str, int] = {}
    serving: list[Any] = []
    try:
        runs = _runs(args, skipped, serving)
        targets = output_paths(args.out, formats)
        if args.out and args.out.endswith(("/", "\\")):  # a directory by its spelling: made if missing
            _make_directory(Path(args.out))
        for path in targets.values():
            if not path.parent.is_dir():
                raise ReportError(f"--out: the directory {path.parent} does not exist")
        from openlora_otel.report.render import render

        drawing = render(
            runs,
            png=targets.get("png"),
            html_path=targets.get("html"),
            x=args.x,
            smoothing=args.smooth,
            serving=serving,
        )
    except ReportError as exc:
        return fail("report", exc)
    from openlora_otel.report.summary import time_lines

    for run, summary in zip(runs, drawing.summaries, strict=True):
        print(
            f"run {run.run_id}{f' ({run.name})' if run.name != run.run_id else ''}: {summary.steps} steps, "
            f"from {run.source}"
        )
        if summary.divergence is not None:
            print(f"  diverged: {summary.divergence.text}")
        for line in time_lines(run):
            print(f"  {line}")
    if serving:
        from openlora_otel.report.serving import summary_lines

        for adapter in serving:
            for line in summary_lines(adapter):
                print(line)
    print(f"panels: {', '.join(panel.title for panel in [*drawing.panels, *drawing.serving_panels])}")
    for path in targets.values():
        print(f"wrote {path}")
    for source, count in skipped.items():  # drawn without them: say so, after what was drawn
        lines = "1 line" if count == 1 else f"{count:,} lines"
        print(
            f"openlora-otel report: skipped {lines} of {source} (not OTLP/JSON metrics, or values that "
            "cannot be read; the warnings above name the first)",
            file=sys.stderr,
        )
    return 0


def _make_directory(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"--out: cannot create the directory {path}: {exc.strerror or exc}") from None


def _runs(args: argparse.Namespace, skipped: dict[str, int], serving: list[Any]) -> list[Run]:
    """The runs to draw; ``skipped`` gets the bad lines of each history file that had some, ``serving``
    each --adapter's serving (its training run is among the runs when found)."""
    runs: list[Run] = []
    found: list[Run] = []
    if args.paths:
        from openlora_otel.report.history_source import read_runs

        found = read_runs(args.paths, skipped=skipped)
    if args.adapter:
        return _adapter_runs(args, found, serving)
    if args.paths:
        if args.run and not args.prometheus:
            kept = [run for run in found if run.run_id in args.run or run.name in args.run]
            missing = [w for w in args.run if not any(w in (run.run_id, run.name) for run in found)]
            if missing:
                known = ", ".join(f"{run.run_id} ({run.name})" for run in found)
                raise ReportError(
                    f"no run {', '.join(map(repr, missing))} in {', '.join(args.paths)}; the runs there are: {known}"
                )
            found = kept
        runs += found
    if args.prometheus:
        from openlora_otel.report.prometheus import read_prometheus

        runs += read_prometheus(args.prometheus, args.run)
    return runs


def _adapter_runs(args: argparse.Namespace, found: list[Run], serving: list[Any]) -> list[Run]:
    """The --adapter serving (into ``serving``) and the runs to draw: each adapter's training run, from
    the files read (``found``) when they hold it, else from the Prometheus; then the --run runs."""
    from openlora_otel.report.prometheus import PrometheusSource, read_prometheus
    from openlora_otel.report.serving import parse_duration, read_adapter

    source = PrometheusSource(args.prometheus)
    since = parse_duration(args.since)
    runs: list[Run] = []
    for name in dict.fromkeys(args.adapter):
        adapter = read_adapter(source, name, since)
        serving.append(adapter)
        run_id = adapter.adapter.run_id
        if run_id is None or any(run.run_id == run_id for run in runs):
            continue
        in_files = [run for run in found if run.run_id == run_id]
        if in_files:
            runs += in_files
            continue
        try:
            runs.append(source.run(run_id))
        except ReportError:
            where = f"in {', '.join(args.paths)} nor " if args.paths else ""
            adapter.notes.append(
                f"its training run {run_id} is not {where}on Prometheus at {source.shown}: serving only "
                "(give the run's history files, OPENLORA_HISTORY_DIR, to draw its curves)"
            )
    if args.run:
        runs += [run for run in read_prometheus(args.prometheus, args.run) if run.run_id not in {r.run_id for r in runs}]
    return runs

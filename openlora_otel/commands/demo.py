"""``openlora-otel demo``: its parser, the checks before training, and the run with its summary."""

from __future__ import annotations

import argparse
import math
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
from openlora_otel.demo.options import DemoOptions
from openlora_otel.model.device import add_device_argument, device_problem


def register(commands: Any) -> None:
    demo = command_parser(
        commands,
        "demo",
        help="fine-tune a small LoRA model (CUDA when there is one, else CPU) with live metrics (needs the demo extra)",
        description="Fine-tune a small Llama built from a config with LoRA (PEFT) on a generated corpus, on "
        "the first CUDA device when torch sees one, else on CPU (--device), with setup_telemetry() on: by "
        f"default metrics are served at http://localhost:{DEFAULT_PROMETHEUS_PORT}/metrics while it runs. Nothing is downloaded. "
        "Under torchrun (torchrun --standalone --nproc_per_node=N -m openlora_otel demo) it trains "
        "data-parallel on CPU (DDP, gloo): each rank on its own data, with its "
        "own endpoint (port + LOCAL_RANK); only rank 0 prints, and all ranks stop at the same step on "
        "SIGINT / SIGTERM. A divergence guard watches the loss: 3 non-finite losses in a row stop the run. "
        "Exit status: 0 done, 2 usage or configuration error, 3 stopped by the divergence guard, "
        "130 / 143 stopped by SIGINT / SIGTERM (telemetry flushed first in every case).",
    )
    demo.set_defaults(func=run)
    defaults = DemoOptions()
    demo.add_argument(
        "--steps",
        type=positive_int,
        default=defaults.steps,
        help="optimizer steps (default %(default)s, under a minute on 2 CPU cores)",
    )
    demo.add_argument(
        "--batch-size",
        type=positive_int,
        default=defaults.batch_size,
        help="sequences per step (default %(default)s)",
    )
    demo.add_argument(
        "--lr", type=positive_float, default=defaults.lr, help="peak learning rate (default %(default)s)"
    )
    demo.add_argument(
        "--lora-r", type=positive_int, default=defaults.lora_r, help="LoRA rank (default %(default)s)"
    )
    demo.add_argument(
        "--lora-alpha",
        type=positive_int,
        default=defaults.lora_alpha,
        help="LoRA alpha (default %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default %(default)s)")
    add_device_argument(demo, "train on", defaults.device)
    demo.add_argument(
        "--eval-every",
        type=non_negative_int,
        default=defaults.eval_every,
        help="steps between evaluations, 0 for none (default %(default)s)",
    )
    demo.add_argument(
        "--run-name",
        metavar="NAME",
        help="a name for the run in legends, alerts and reports (overrides OPENLORA_RUN_NAME; default: the run id)",
    )
    demo.add_argument(
        "--exporter",
        metavar="LIST",
        help="overrides OTEL_METRICS_EXPORTER for this run: prometheus, otlp, console, none, or a comma list",
    )
    demo.add_argument(
        "--linger",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="keep serving the final values this long",
    )
    demo.add_argument(
        "--hf-trainer", action="store_true", help="run through the Hugging Face Trainer and our callback"
    )
    demo.add_argument(
        "--save",
        metavar="DIR",
        help="after training, save the adapter as DIR/adapters/NAME (NAME: --run-name, else seed-SEED) and, "
        "on the first run into DIR, the base model as DIR/base; later runs train on that base. "
        "`openlora-otel serve DIR` serves them (under torchrun rank 0 saves)",
    )
    demo.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save a checkpoint (the LoRA adapter, optimizer and scheduler state, data generator, step) to "
        "DIR/checkpoint.pt every --checkpoint-every steps, timed as checkpoint_save in "
        "openlora_training_time_seconds_total; DIR also keeps the run id and attempt (DIR/run.json) and the "
        "highest step reached (DIR/openlora-progress.json). A new run without --resume starts over in DIR. "
        "The demo's own loop in one process: not with --hf-trainer or under torchrun",
    )
    demo.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="N",
        help=f"steps between checkpoints (default {defaults.checkpoint_every}; needs --checkpoint-dir)",
    )
    demo.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --checkpoint-dir from its checkpoint (loading it counts as "
        "checkpoint_load): the same run id (DIR/run.json's, unless OPENLORA_RUN_ID is set) and the next "
        "attempt (DIR/run.json's + 1, unless OPENLORA_RUN_ATTEMPT is set); the steps the earlier attempt "
        "did after the checkpoint are done again and count as lost_progress "
        "(openlora_training_steps_lost_total)",
    )
    demo.add_argument(
        "--stop-at-step",
        type=positive_int,
        metavar="N",
        help="stop after step N as if the run had been killed there (no final evaluation, no --save; exit "
        "status 0): a run to try --resume on",
    )
    demo.add_argument("--quiet", "-q", action="store_true", help="no progress output; the summary only")
    demo.add_argument(
        "--straggle-rank",
        type=non_negative_int,
        metavar="R",
        help="under torchrun: make rank R a straggler (with --straggle-ms)",
    )
    demo.add_argument(
        "--straggle-ms",
        type=positive_float,
        metavar="MS",
        help="milliseconds rank R sleeps inside each of its steps (its step time shows it)",
    )
    demo.add_argument(
        "--hang-at-step",
        type=positive_int,
        metavar="N",
        help="at step N one process (under torchrun: rank --hang-rank) stops before its batch, as a rank whose "
        "data loader deadlocked, and stays stuck, its telemetry going on, until Ctrl-C or SIGTERM (to watch "
        "the hang alerts and `openlora-otel diagnose` find it); under torchrun the other ranks wait for it in "
        "their next all-reduce, and fail once it leaves",
    )
    demo.add_argument(
        "--hang-rank",
        type=non_negative_int,
        metavar="R",
        help="under torchrun: the rank --hang-at-step stops (default 0)",
    )
    demo.add_argument(
        "--nan-at-step",
        type=positive_int,
        metavar="N",
        help="from step N on the loss is NaN (to watch the NaN counters, alerts and the divergence guard "
        "work); the guard stops the run within about a second, exit status 3",
    )
    demo.add_argument(
        "--data-delay-ms",
        type=positive_float,
        metavar="MS",
        help="each batch takes MS milliseconds longer to arrive: an input-bound run, seen in "
        "openlora_training_data_wait_fraction",
    )


def run(args: argparse.Namespace) -> int:
    import os

    from openlora_otel._deps import MissingDependencyError
    from openlora_otel.config import ConfigError, TelemetryConfig
    from openlora_otel.telemetry import setup_telemetry

    environ = dict(os.environ)
    if args.exporter is not None:
        environ["OTEL_METRICS_EXPORTER"] = args.exporter
    problem = _checkpoint_problem(args)
    if problem:
        usage_error(args, problem)
    if args.resume:
        from openlora_otel.demo.checkpoint import CheckpointError, read_run_file

        # The attempt before this one: its run id, and this attempt's number after it.
        try:
            earlier = read_run_file(args.checkpoint_dir) or {}
        except CheckpointError as exc:
            return fail("demo", f"--resume: {exc}")
        if isinstance(earlier.get("run_id"), str) and earlier["run_id"] and not environ.get("OPENLORA_RUN_ID"):
            environ["OPENLORA_RUN_ID"] = earlier["run_id"]
        attempt = earlier.get("attempt")
        if not environ.get("OPENLORA_RUN_ATTEMPT") and isinstance(attempt, int) and attempt >= 1:
            environ["OPENLORA_RUN_ATTEMPT"] = str(attempt + 1)
    if environ.get("OPENLORA_HISTORY_DIR") and not environ.get("OPENLORA_HISTORY_INTERVAL"):
        # The demo lasts about a minute: a line a second gives its report a curve, not a dozen points.
        environ["OPENLORA_HISTORY_INTERVAL"] = "1000"
    try:
        config = TelemetryConfig.from_env(environ)
    except ConfigError as exc:
        if args.exporter is not None and exc.variable == "OTEL_METRICS_EXPORTER":
            usage_error(
                args,
                f"argument --exporter: {args.exporter!r} is not valid: expected {exc.accepted}"
            )
        return fail("demo", exc)
    from openlora_otel.demo.ddp import ranks_from_env

    try:
        ranks = ranks_from_env(environ)
    except ValueError as exc:
        return fail("demo", exc)
    problem = (
        _distributed_problem(args, ranks.world_size)
        or _save_problem(args)
        or _hf_device_problem(args)
    )
    if problem:
        usage_error(args, problem)
    if ranks.distributed and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
        print(
            f"openlora-otel demo: WORLD_SIZE={ranks.world_size} but MASTER_ADDR and MASTER_PORT are not both "
            "set, so the ranks cannot find each other; launch it with torchrun: "
            f"torchrun --standalone --nproc_per_node={ranks.world_size} -m openlora_otel demo",
            file=sys.stderr,
        )
        return 2
    try:
        from openlora_otel.demo.checkpoint import CheckpointError, read_checkpoint
        from openlora_otel.demo.llama import require_libraries
        from openlora_otel.demo.options import DemoOptions
        from openlora_otel.demo.train import run_demo

        torch, _, _ = require_libraries()
    except MissingDependencyError as exc:
        print(
            f"openlora-otel demo: {exc}".replace("openlora-otel[torch]", "openlora-otel[demo]").replace(
                "openlora-otel[hf]", "openlora-otel[demo]"
            ),
            file=sys.stderr,
        )
        return 2
    unusable = device_problem(args.device, torch)
    if unusable:
        return fail("demo", unusable)
    if args.resume:
        # Refused before anything starts: a checkpoint that is no file, no checkpoint, or not this demo's.
        try:
            read_checkpoint(args.checkpoint_dir, torch)
        except CheckpointError as exc:
            return fail("demo", f"--resume: {exc}")
    options = DemoOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        seed=args.seed,
        eval_every=args.eval_every,
        device=args.device,
        hf_trainer=args.hf_trainer,
        # Under torchrun only rank 0 prints (N copies of each line would say nothing more).
        quiet=args.quiet or ranks.rank != 0,
        linger=args.linger,
        distributed=ranks.distributed,
        straggle_rank=args.straggle_rank,
        straggle_ms=args.straggle_ms or 0.0,
        hang_rank=args.hang_rank,
        hang_at_step=args.hang_at_step,
        nan_at_step=args.nan_at_step,
        data_delay_ms=args.data_delay_ms or 0.0,
        save_dir=args.save,
        adapter_name=args.run_name if args.save else None,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every or defaults_checkpoint_every(),
        resume=args.resume,
        stop_at_step=args.stop_at_step,
    )
    try:
        # The demo says where its metrics are itself (the "metrics:" line below).
        telemetry = setup_telemetry(
            "openlora-demo",
            config=config.replace(quiet=True),
            run_name=args.run_name,
            hyperparameters=options.hyperparameters(world_size=ranks.world_size),
        )
    except (ConfigError, MissingDependencyError) as exc:
        return fail("demo", exc)
    if options.checkpoint_dir:
        from openlora_otel.demo.checkpoint import write_run_file

        try:
            write_run_file(options.checkpoint_dir, telemetry.run_id, config.run_attempt)
        except OSError as exc:
            telemetry.shutdown()
            return fail("demo", f"--checkpoint-dir: {exc}")
    where = telemetry.where_metrics_go()
    if not options.quiet:
        print(f"metrics: {where}", file=sys.stderr)
        if telemetry.enabled and {"prometheus", "otlp"} & set(config.enabled_exporters):
            # Only where a stack could see them: not for `none`, the console or a history file alone.
            print(
                "full stack (collector, Prometheus, Grafana): cd collector && "
                "GRAFANA_ADMIN_PASSWORD=... docker compose up -d, then open http://localhost:3000 "
                "(see docs/how-to/local-stack.md)",
                file=sys.stderr,
            )
    try:
        result = run_demo(options, telemetry, where=where)
    except CheckpointError as exc:  # the checkpoint changed since the check above, or does not fit
        return fail("demo", f"--resume: {exc}")
    finally:
        flushed = telemetry.shutdown()
    if ranks.rank == 0:
        _summary(
            result,
            where,
            flushed,
            run_id=telemetry.run_id,
            run_name=telemetry.run_name,
            world_size=ranks.world_size,
        )
    return result.exit_code


def defaults_checkpoint_every() -> int:
    return DemoOptions().checkpoint_every


def _checkpoint_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --checkpoint-dir, --checkpoint-every, --resume and --stop-at-step, if anything."""
    import os
    from pathlib import Path

    from openlora_otel.demo.checkpoint import CHECKPOINT_FILE

    if args.checkpoint_dir is None:
        if args.resume:
            return "--resume needs --checkpoint-dir: the directory whose checkpoint to continue from"
        if args.checkpoint_every is not None:
            return "--checkpoint-every needs --checkpoint-dir: where to save the checkpoints"
        return None
    if args.hf_trainer:
        return "--checkpoint-dir works with the demo's own loop; drop --hf-trainer"
    # Read before the configuration checks it: a WORLD_SIZE that is not a number is its error to report.
    world_size = os.environ.get("WORLD_SIZE", "").strip()
    if world_size.isascii() and world_size.isdigit() and len(world_size) <= 20 and int(world_size) > 1:
        return "--checkpoint-dir works in one process; under torchrun drop it"
    from openlora_otel.demo.checkpoint import RUN_FILE

    root = Path(args.checkpoint_dir)
    if root.exists() and not root.is_dir():
        return f"--checkpoint-dir: {args.checkpoint_dir} exists and is not a directory"
    for name in (RUN_FILE, CHECKPOINT_FILE):
        if (root / name).is_dir():  # replacing it with the file would fail, after training
            return f"--checkpoint-dir: {root / name} is a directory; the demo writes its {name} there"
    # A checkpoint.pt that is not a file (a FIFO, a directory) is there: read_checkpoint says what it is.
    if args.resume and not os.path.lexists(root / CHECKPOINT_FILE):
        return f"--resume: no checkpoint in {args.checkpoint_dir} ({CHECKPOINT_FILE}) to continue from"
    return None


def _distributed_problem(args: argparse.Namespace, world_size: int) -> str | None:
    """What is wrong with the straggler / trainer options for this launch, if anything."""
    if (args.straggle_rank is None) != (args.straggle_ms is None):
        return "--straggle-rank and --straggle-ms go together: which rank, and how much slower per step"
    if args.straggle_rank is not None:
        if world_size < 2:
            return (
                "--straggle-rank: slowing one rank needs two or more ranks, and WORLD_SIZE is "
                f"{world_size} here; launch with torchrun --standalone --nproc_per_node=2 -m openlora_otel demo ..."
            )
        if args.straggle_rank >= world_size:
            return (
                f"--straggle-rank: {args.straggle_rank} is not a rank of this launch "
                f"(WORLD_SIZE={world_size}: ranks 0 to {world_size - 1})"
            )
    if args.hang_rank is not None:
        if args.hang_at_step is None:
            return "--hang-rank needs --hang-at-step: at which step that rank hangs"
        if args.hang_rank >= world_size:
            return (
                f"--hang-rank: {args.hang_rank} is not a rank of this launch "
                f"(WORLD_SIZE={world_size}: ranks 0 to {world_size - 1})"
            )
    if world_size > 1 and args.device not in ("auto", "cpu"):
        return (
            f"--device {args.device}: under torchrun the demo trains data-parallel on CPU (DDP over gloo); "
            "drop --device or use --device cpu"
        )
    if args.hf_trainer and (args.nan_at_step is not None or args.data_delay_ms is not None or args.hang_at_step is not None):
        return "--nan-at-step, --data-delay-ms and --hang-at-step work with the demo's own loop; drop --hf-trainer"
    if args.hf_trainer and world_size > 1:
        return (
            "--hf-trainer runs one process; under torchrun the demo trains with its own DDP loop "
            "(drop --hf-trainer)"
        )
    return None


def _hf_device_problem(args: argparse.Namespace) -> str | None:
    """--hf-trainer on another GPU than the first: the Trainer chooses its device itself."""
    if args.hf_trainer and args.device.startswith("cuda:") and args.device != "cuda:0":
        index = args.device.partition(":")[2]
        return (
            f"--device {args.device}: the Hugging Face Trainer runs on cuda:0 (it picks its device itself); "
            f"use CUDA_VISIBLE_DEVICES={index} with --device cuda"
        )
    return None


def _save_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--save DIR`` (and the adapter name it implies), if anything; checked before training."""
    if args.save is None:
        return None
    from pathlib import Path

    from openlora_otel.demo.options import BASE_MODEL
    from openlora_otel.model.corpus import ALPHABET
    from openlora_otel.model.layout import BASE, LayoutError, adapter_name_problem, read_base

    root = Path(args.save)
    if root.exists() and not root.is_dir():
        return f"--save: {args.save} exists and is not a directory"
    if args.run_name is not None:
        problem = adapter_name_problem(args.run_name, BASE_MODEL)
        if problem:
            return f"--save names the adapter after --run-name: {problem}"
    if (root / BASE).exists():
        try:
            base = read_base(root)
        except LayoutError as exc:
            return f"--save: {exc}"
        if base.alphabet != ALPHABET or base.base_model != BASE_MODEL:
            return f"--save: {root / BASE} holds another base model ({base.base_model}), not this demo's"
    return None


def _summary(
    result: object, where: str, flushed: bool, *, run_id: str, run_name: str | None = None, world_size: int = 1
) -> None:
    from openlora_otel.demo.options import DemoResult

    assert isinstance(result, DemoResult)
    lines = []
    flush = "flushed" if flushed else "flush did not finish within OPENLORA_SHUTDOWN_TIMEOUT"
    if result.interrupted == "diverged":
        lines.append(
            f"stopped by the divergence guard after {result.steps} steps ({result.stop_detail}); telemetry {flush}"
        )
    elif result.interrupted:
        lines.append(f"stopped by {result.interrupted} after {result.steps} steps; telemetry {flush}")
        if result.interrupted == "--stop-at-step":
            lines[-1] += " (continue it with --resume)"
    if result.final_eval_loss != math.inf:  # NaN included: a diverged model's evaluation is shown as it was
        best = f"{result.best_eval_loss:.3f}" if math.isfinite(result.best_eval_loss) else "none finite"
        evaluation = f"eval loss {result.first_eval_loss:.3f} -> {result.final_eval_loss:.3f} (best {best})"
    else:  # stopped before any later evaluation (or --eval-every 0 and stopped early)
        evaluation = f"eval loss {result.first_eval_loss:.3f} at the start, no evaluation after it"
    lines += [
        f"run {run_id}{f' ({run_name})' if run_name and run_name != run_id else ''}: {result.steps} steps in {result.seconds:.1f} s, {result.tokens_per_s:,.0f} tokens/s",
        evaluation
        + (f", last train loss {result.last_train_loss:.3f}" if result.last_train_loss is not None else ""),
        f"metrics were {where}",
    ]
    if result.saved:
        lines.append(f"adapter saved to {result.saved}")
    if world_size > 1:
        lines.append(
            f"rank 0 of {world_size} shown; every rank trained on its own data and served its own series"
        )
    print("\n".join(lines))

"""The run's id, decided in one place (:func:`decide_run_id`), the same for every rank of a job.

The id ties a job's ranks together in ``target_info`` and OTLP resources, yet no rank may wait
for or talk to the others during a step: everything here runs once, in ``setup_telemetry()``,
and asks a key-value store for one key (``compare_set``, bounded, no collective), nothing more.
First match wins: ``run_id=``, ``OPENLORA_RUN_ID`` or a real ``TORCHELASTIC_RUN_ID``, a random id
when telemetry is disabled, else :func:`shared_run_id` (torchrun's store, the default process
group's store, Slurm's job and step, a random id). See docs/how-to/many-nodes.md.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from openlora_otel.config import TelemetryConfig

__all__ = ["STORE_KEY", "decide_run_id", "decided_run_id", "new_run_id", "shared_run_id"]

_logger = logging.getLogger(__name__)

# The key every rank agrees on; no torch component uses this prefix.
STORE_KEY = "openlora_otel/run_id"
# How long agreeing through a store may take in all; torchrun's is up before any worker starts.
STORE_TIMEOUT_S = 10.0
# What a run id read back from a store may look like (ours are 16 hex digits).
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_run_id() -> str:
    """A fresh run id: short enough to read in a dashboard, random enough not to collide."""
    return uuid.uuid4().hex[:16]


def decide_run_id(config: TelemetryConfig, run_id: str | None = None) -> TelemetryConfig:
    """``config`` with the run id decided: ``run_id`` (setup's argument), else ``config.run_id``
    (``OPENLORA_RUN_ID``, ``TORCHELASTIC_RUN_ID``), else a random one when telemetry is disabled,
    else :func:`shared_run_id`. The one place that decides it; setup_telemetry() calls it once."""
    decided = run_id or config.run_id
    if not decided:
        if config.sdk_disabled:
            decided = new_run_id()
        else:
            decided, source = shared_run_id()
            _logger.debug("run id %s from %s", decided, source)
    return config.replace(run_id=decided)


def decided_run_id(config: TelemetryConfig) -> str:
    """The run id :func:`decide_run_id` put in ``config``; ValueError for a config it has not decided."""
    if config.run_id is None:
        raise ValueError("the configuration carries no run id yet: decide_run_id() decides it at setup")
    return config.run_id


def shared_run_id(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The run id this rank shares with the other ranks of its job, and where it came from.

    Never raises: a store that cannot be reached is logged once, and the id is
    then this process's own.
    """
    env = os.environ if environ is None else environ
    candidate = new_run_id()
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        agreed = _from_torchrun_store(env, candidate)
        if agreed:
            return agreed, "torchrun store"
    agreed = _from_process_group(candidate)
    if agreed:
        return agreed, "process group store"
    world = env.get("WORLD_SIZE", "")
    several = _more_than_one(world) or _more_than_one(env.get("SLURM_STEP_NUM_TASKS", ""))
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    # Only for the tasks of one multi-task srun step: the sequential runs of an interactive
    # step (srun --pty bash, salloc) share job and step ids but are separate runs.
    # Slurm's ids are 32-bit numbers: longer digits are no Slurm's, and would make too long a run id.
    if several and _digits(job) and _digits(step) and len(job) <= 20 and len(step) <= 20:
        return f"slurm-{job}.{step}", "Slurm job and step"
    if _more_than_one(world):
        _logger.warning(
            "openlora-otel: rank %s of %s made up its own run id: nothing shares one (no OPENLORA_RUN_ID, "
            "no torchrun, torch.distributed not initialized yet, no srun). Set OPENLORA_RUN_ID to the same "
            "value on every rank, or call setup_telemetry() after init_process_group()",
            env.get("RANK", "?"),
            world,
        )
    return candidate, "random"


def _digits(value: str) -> bool:
    """ASCII digits only: str.isdigit() also takes a superscript two, which int() refuses, and a fullwidth
    two, which it reads as 2."""
    return value.isascii() and value.isdigit()


def _more_than_one(value: str) -> bool:
    # Without int(): it refuses more than 4300 digits.
    return _digits(value) and value.lstrip("0") not in ("", "1")


def _bounded(what: str, call: Callable[[], str | None]) -> str | None:
    """Run ``call`` on a daemon thread for at most ``STORE_TIMEOUT_S``.

    A TCPStore client waits for the server's reply without its own timeout, and a
    process group's store has the group's (up to 30 minutes): a store that accepts
    and never answers must not hold setup_telemetry(), and so the training, back.
    """
    result: list[str | None] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(call())
        except Exception as exc:  # torch missing or broken, store gone: telemetry goes on
            failure.append(exc)

    worker = threading.Thread(target=target, name="openlora-otel-run-id", daemon=True)
    worker.start()
    worker.join(STORE_TIMEOUT_S)
    if result:
        return result[0]
    reason = str(failure[0]) if failure else f"no answer within {STORE_TIMEOUT_S:g} s"
    _logger.warning(
        "openlora-otel: could not agree on a run id through %s (%s); this rank uses its own "
        "(set OPENLORA_RUN_ID to share one)",
        what,
        reason,
    )
    return None


def _agree(store: Any, candidate: str) -> str | None:
    """Offer ``candidate``; the value in the store afterwards is the first rank's offer."""
    value = store.compare_set(STORE_KEY, "", candidate)
    agreed = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if not _VALID_ID.match(agreed):
        _logger.warning("openlora-otel: the run id in the store is not usable (%r); using this rank's own", agreed)
        return None
    return agreed


def _from_torchrun_store(env: Mapping[str, str], candidate: str) -> str | None:
    host, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not host or not _digits(port):
        return None
    # torch is imported here, not inside the bounded thread: a torchrun worker imports it anyway,
    # and an import still running when the bound ran out could be cut by the interpreter's exit
    # half way through torch's C++ initialisation (an abort: "terminate called without an active
    # exception", seen once on a loaded machine). The bound then covers only the store.
    try:
        import torch.distributed  # noqa: F401
    except Exception as exc:  # torch missing or broken: this rank uses its own id
        _logger.warning(
            "openlora-otel: could not agree on a run id through torchrun's store (torch: %s); "
            "this rank uses its own (set OPENLORA_RUN_ID to share one)",
            exc,
        )
        return None

    def agree() -> str | None:
        from torch.distributed import TCPStore

        # Half the bound: a store that refuses or cannot be reached ends the thread well
        # before the join gives up, so no thread is left inside torch's C++ code.
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S / 2))
        return _agree(store, candidate)

    return _bounded(f"torchrun's store at {host}:{port}", agree)


def _from_process_group(candidate: str) -> str | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
    except Exception:  # a half-imported or broken torch
        return None
    return _bounded(
        "the process group's store", lambda: _agree(dist.distributed_c10d._get_default_store(), candidate)
    )

"""The demo under torchrun: data-parallel training with gloo on CPU, one stop decision, each rank's own step time.

Three choices, each for a reason:

- **Stopping together.** torchrun forwards SIGTERM and SIGINT to every worker,
  but each worker sees it at its own moment. A rank that stopped after step k
  while another went on into step k+1 would leave that one waiting in the
  gradient all-reduce until gloo's timeout (30 minutes). So no rank stops on
  its own: before each step the ranks all-reduce (MAX) one number, the
  strongest stop reason any of them has, and all stop before the same step for
  that reason. That is one 4-byte all-reduce per step, outside the timed step,
  paid by the demo's loop and not by the telemetry (which adds no communication
  at all); ``benchmarks/bench_torchrun_overhead.py`` prints what it costs.
  Every step rather than every K: a stop then takes one step, and K steps
  would save well under a millisecond per step.
- **Each rank's own step time.** In synchronous data parallelism every rank
  waits inside ``backward()`` for the slowest rank's gradients, so a step's
  wall time is the same on every rank and a straggler cannot be told apart by
  it (two ranks, one 50 ms slower per step: both measured 55 ms a step). The
  demo records as step time the rank's own work: the step's wall time less
  what ``backward()`` spent after this rank's last gradient bucket was ready,
  which is the wait for the other ranks plus the transfer itself. A DDP
  communication hook notes that moment and then runs DDP's usual all-reduce.
  (Once per run the wait falls elsewhere: DDP's second forward rebuilds its
  gradient buckets, a collective, and that step's own time includes it.)
- **No buffer broadcast.** The model's only buffers are rotary constants,
  equal on every rank; broadcasting them would put a collective into every
  forward, evaluations included, which each rank runs on its own.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["STOP_REASONS", "Ranks", "StepClock", "TrainingGroup", "ranks_from_env"]

# Stop reasons in increasing strength: the group stops for the strongest any rank has.
STOP_REASONS: tuple[str | None, ...] = (None, "requested", "SIGINT", "SIGTERM")


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in a torchrun launch."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def ranks_from_env(environ: Mapping[str, str]) -> Ranks:
    """torchrun's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; one process of one when unset.

    Called after ``TelemetryConfig.from_env`` has validated them as integers
    from 0 to 2**31 - 1; anything else left here is a launch mistake.
    """
    world_size = int(environ.get("WORLD_SIZE") or 1)
    rank = int(environ.get("RANK") or 0)
    local_rank = int(environ.get("LOCAL_RANK") or 0)
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: expected 0 <= RANK < WORLD_SIZE")
    return Ranks(rank=rank, local_rank=local_rank, world_size=world_size)


class StepClock:
    """A step's own time: its wall time less the wait for the other ranks at the gradient all-reduce."""

    __slots__ = ("grads_ready", "started")

    def __init__(self) -> None:
        self.started = 0.0
        self.grads_ready: float | None = None  # set by the communication hook, per bucket

    def start(self) -> None:
        self.started = time.perf_counter()
        self.grads_ready = None

    def waited_since_grads_ready(self, backward_done: float) -> float:
        """Seconds ``backward()`` spent after this rank's last gradient bucket was ready."""
        ready = self.grads_ready
        return 0.0 if ready is None else max(0.0, backward_done - ready)


class TrainingGroup:
    """The gloo process group of one torchrun launch, and the DDP wrapper the demo trains through."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._dist = torch.distributed
        if not self._dist.is_available() or not self._dist.is_gloo_available():
            raise RuntimeError("this torch build has no torch.distributed gloo backend; the demo needs it")
        # env:// : MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE as torchrun sets them.
        self._dist.init_process_group(backend="gloo")
        self.rank = self._dist.get_rank()
        self.world_size = self._dist.get_world_size()
        self._flag = torch.zeros(1, dtype=torch.int32)

    def wrap(self, model: Any, clock: StepClock) -> Any:
        """``model`` in DDP, with a communication hook that notes when this rank's gradients were ready."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp_class = self._torch.nn.parallel.DistributedDataParallel
        # torch 2.13 renamed the option (and warns on the old name); older versions know only the old.
        no_buffer_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(ddp_class).parameters
            else {"broadcast_buffers": False}
        )
        ddp = ddp_class(model, **no_buffer_sync)

        # No annotations: DDP checks that a hook's `bucket` is annotated as dist.GradBucket or not
        # at all, and under `from __future__ import annotations` any annotation is a string.
        def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            state.grads_ready = time.perf_counter()
            return default_hooks.allreduce_hook(None, bucket)  # DDP's default: mean over ranks

        ddp.register_comm_hook(clock, timed_allreduce)
        return ddp

    def agree_to_stop(self, reason: str | None) -> str | None:
        """The strongest stop reason of any rank (None: every rank goes on); a collective, every rank calls it."""
        self._flag.fill_(STOP_REASONS.index(reason))
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX)
        return STOP_REASONS[int(self._flag.item())]

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

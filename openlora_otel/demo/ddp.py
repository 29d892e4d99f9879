"""The demo under torchrun: data-parallel training with gloo on CPU, one stop decision, each rank's own step time.

The ranks stop together: each rank's stop reason rides in the all-reduce of its last gradient bucket,
so no rank is left waiting in a collective another never joins. The step time recorded is the rank's
own work (the wall time less the wait for the other ranks in ``backward()``), so a straggler shows.
No buffer broadcast: the only buffers are rotary constants. See docs/getting-started/demo.md.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["STOP_REASONS", "Ranks", "StepSync", "TrainingGroup", "ranks_from_env"]

# Stop reasons in increasing strength: the group stops for the strongest any rank has.
STOP_REASONS: tuple[str, ...] = ("requested", "diverged", "SIGINT", "SIGTERM")


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
    # Stripped as the configuration strips them: int() keeps the blanks str.strip() drops ("\x1c").
    world_size = int(environ.get("WORLD_SIZE", "").strip() or 1)
    rank = int(environ.get("RANK", "").strip() or 0)
    local_rank = int(environ.get("LOCAL_RANK", "").strip() or 0)
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: expected 0 <= RANK < WORLD_SIZE")
    return Ranks(rank=rank, local_rank=local_rank, world_size=world_size)


class StepSync:
    """What one step and the communication hook share: when it began, when the gradients were
    ready, this rank's stop reason going out, and the reason all ranks agreed on coming back."""

    __slots__ = ("agreed", "grads_ready", "offer", "started")

    def __init__(self) -> None:
        self.started = 0.0
        self.grads_ready: float | None = None
        self.offer: str | None = None
        self.agreed: str | None = None

    def start(self, offer: str | None = None) -> None:
        """A new step; ``offer`` is this rank's reason to stop (None: go on)."""
        self.started = time.perf_counter()
        self.grads_ready = None
        self.offer = offer
        self.agreed = None

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

    def wrap(self, model: Any, sync: StepSync) -> Any:
        """``model`` in DDP, its gradients averaged by :meth:`_allreduce_hook` (which also carries ``sync``)."""
        ddp_class = self._torch.nn.parallel.DistributedDataParallel
        # torch 2.13 renamed the option (and warns on the old name); older versions know only the old.
        no_buffer_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(ddp_class).parameters
            else {"broadcast_buffers": False}
        )
        ddp = ddp_class(model, **no_buffer_sync)
        ddp.register_comm_hook(sync, self._allreduce_hook())
        return ddp

    def _allreduce_hook(self) -> Any:
        """DDP's default all-reduce (the mean over ranks), noting when the gradients were ready;
        the last bucket of each step also carries the stop reasons."""
        torch, dist, world_size = self._torch, self._dist, self.world_size
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # No annotations: DDP checks that a hook's `bucket` is annotated as dist.GradBucket or not
        # at all, and under `from __future__ import annotations` any annotation is a string.
        def hook(sync, bucket):  # type: ignore[no-untyped-def]
            sync.grads_ready = time.perf_counter()
            if not bucket.is_last():
                return default_hooks.allreduce_hook(None, bucket)
            grads = bucket.buffer()
            size = grads.numel()
            # One flag per reason, summed over ranks: exact in float32 up to 2**24 ranks.
            payload = torch.zeros(size + len(STOP_REASONS), dtype=grads.dtype)
            torch.div(grads, world_size, out=payload[:size])
            if sync.offer is not None:
                payload[size + STOP_REASONS.index(sync.offer)] = 1
            reduced = dist.all_reduce(payload, async_op=True).get_future()

            def unpack(future):  # type: ignore[no-untyped-def]
                result = future.value()[0]
                flags = result[size:].tolist()
                wanted = [reason for reason, count in zip(STOP_REASONS, flags, strict=True) if count > 0]
                sync.agreed = wanted[-1] if wanted else None
                grads.copy_(result[:size])
                return grads

            return reduced.then(unpack)

        return hook

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

"""Data parallelism over torch.distributed (launched by `torchrun` or `accelerate launch`).

Every rank holds the same experience buffer: batch building is deterministic given (seed, step), rollouts and
rewards are computed for a rank's shard of the groups and then gathered, so every rank applies the same buffer
updates. Each rank trains on its shard; DDP averages gradients.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from exgrpo.errors import CheckpointError


@dataclass(frozen=True)
class Distributed:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def shard_bounds(self, n: int) -> tuple[int, int]:
        """This rank's contiguous slice [start, end) of n items (the first n % world ranks get one more)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def gather(self, items: list) -> list:
        """Concatenate every rank's list in rank order (identical on every rank)."""
        if not self.enabled:
            return items
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, items)
        return [x for part in out for x in part]

    def broadcast(self, item: Any = None) -> Any:
        """Rank 0's `item` on every rank (the others' is ignored)."""
        if not self.enabled:
            return item
        box = [item]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        return all(self.gather([flag]))

    def any_true(self, flag: bool) -> bool:
        return any(self.gather([flag]))

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def in_process_group() -> bool:
    """Whether this process is one of several ranks of an initialised process group (launched by torchrun)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed() -> Distributed:
    """Join the process group described by the launcher's environment (single process when absent)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Distributed()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    ctx = Distributed(world, rank, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        dist.init_process_group(backend=backend)
    return ctx


def close_distributed() -> None:
    """Leave the process group, every rank at once. Without it, gloo's threads outlive the interpreter's teardown
    and a rank can abort at exit ("terminate called without an active exception") after a run that succeeded; a
    rank that left while another still talked to it (rank 0 writing the last checkpoint) did so too."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "gloo":
        # a failed run's other ranks may be gone: then the barrier fails, and leaving is all that is left to do
        with contextlib.suppress(RuntimeError):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    dist.destroy_process_group()


def shard(items: Sequence, ctx: Distributed) -> list:
    start, end = ctx.shard_bounds(len(items))
    return list(items[start:end])


def check_replicas(ctx: Distributed, step: int, buffer_fingerprint: str, model=None) -> dict:
    """Every rank's buffer fingerprint and (given `model`, an unsharded replica) trainable-parameter hash must agree;
    raises when they differ. FSDP holds one copy of the weights, in shards: pass no model."""
    h = hashlib.sha256()
    if model is not None:
        for p in model.parameters():
            if p.requires_grad:
                h.update(p.detach().cpu().numpy().tobytes())
    hashes = ctx.gather([(buffer_fingerprint, h.hexdigest())])
    if len(set(hashes)) > 1:
        raise RuntimeError(f"data-parallel replicas diverged at step {step}: {hashes}")
    return {"replicas/buffer_hash": hashes[0][0], "replicas/param_hash": hashes[0][1],
            "replicas/count": float(len(hashes))}


def require_on_every_rank(ctx: Distributed, path: Path) -> None:
    """`path` must exist on every rank: a multi-node run resumes from storage every node shares."""
    if not ctx.all_true(path.exists()):
        raise CheckpointError(f"{path} is missing on some ranks: a multi-node run resumes from storage that every node "
                              "shares (logging.output_dir on a shared file system)")

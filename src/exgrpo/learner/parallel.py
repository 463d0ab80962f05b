"""How the learner's model is spread over the data-parallel ranks, chosen once when the learner is built
(`parallelism`): one process, DDP replicas (`train.sharding: ddp`) or FSDP2 shards (`fsdp`, exgrpo.runtime.sharding).

A strategy settles everything that differs between them: the module the training passes run through, the loss
scale, how many backward passes a mini-batch takes on every rank and when gradients are reduced, the gradient norm,
the finiteness check after a step, full weights for pushes (and whether a checkpoint must gather them), and the
optimizer state.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import ContextManager, Protocol

import torch
import torch.distributed

from exgrpo.config import TrainConfig
from exgrpo.runtime.distributed import Distributed
from exgrpo.runtime.sharding import (full_model_state, fully_shard_model, gathered, load_optimizer_state,
                                     optimizer_state)


class Parallelism(Protocol):
    """What the learner asks of the way its model is spread over the ranks."""

    train_model: torch.nn.Module  # the module training forward passes run through (the model, or its wrapper)
    shards_weights: bool  # each rank holds a shard of the weights: no replica to compare, checkpoints gather them
    casts_parameters: bool  # the parameters are cast to the compute precision by the wrapper: no autocast
    prompt_sharing: str  # `exgrpo.learner.forward.token_logprobs`'s prompt_sharing when the KV cache is on
    loss_multiplier: int  # what each micro-batch's loss is multiplied by before its backward pass

    def backward_passes(self, micro_batches: int) -> int:
        """The backward passes this rank runs for a mini-batch of which it holds `micro_batches` micro-batches
        (any beyond them are padding passes that join the collectives and add nothing)."""

    def gradient_sync(self, last: bool) -> ContextManager:
        """The context of one backward pass: gradients are reduced across ranks on the `last` one only."""

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the gradients of `params` to `max_norm` in total; their norm before clipping."""

    def all_finite(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether every weight of `params` is finite, on every rank."""

    def full_weights(self) -> ContextManager:
        """A context in which the model holds its full weights (forward passes that ranks run different numbers
        of times, weights read for a push)."""

    def assemble_rows(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`values` with every rank's `rows` filled in from that rank, on every rank."""

    def checkpoint_weights(self) -> dict | None:
        """The full weights a checkpoint writes, gathered (every rank must call it); None: the model's own."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's full state keyed by parameter name, whatever the sharding; every rank must call it."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a state that `optimizer_state` returned, under any parallelism."""


def parallelism(model: torch.nn.Module, train: TrainConfig, dist: Distributed, loss_scale: str) -> Parallelism:
    """The strategy for `dist`'s ranks and `train.sharding`; with FSDP the model is sharded in place here (before
    the optimizer is built on its parameters)."""
    if not dist.enabled:
        return SingleProcess(model)
    return _ACROSS_RANKS[train.sharding](model, train, dist, loss_scale)


class SingleProcess:
    """One process: the model trains as it is."""

    shards_weights, casts_parameters, prompt_sharing, loss_multiplier = False, False, "auto", 1

    def __init__(self, model: torch.nn.Module):
        self.model = self.train_model = model

    def backward_passes(self, micro_batches: int) -> int:
        return micro_batches

    def gradient_sync(self, last: bool) -> ContextManager:
        return contextlib.nullcontext()

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def all_finite(self, params: list[torch.nn.Parameter]) -> bool:
        return bool(self._finite(params))

    def _finite(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.isfinite(t).all() for t in tensors]).all().to(torch.int32)

    def full_weights(self) -> ContextManager:
        return contextlib.nullcontext()

    def assemble_rows(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return values

    def checkpoint_weights(self) -> dict | None:
        return None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer_state(self.model, optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(self.model, optimizer, state)


class _AcrossRanks(SingleProcess):
    """What DDP and FSDP share: each rank trains on its shard of every mini-batch, the ranks' gradients are
    averaged. With `loss_scale: global` the loss is multiplied by the world size, so that the average equals the
    one-process update; with `per_rank` each rank's loss stands alone (the released code's scale: spec §4.3)."""

    def __init__(self, model: torch.nn.Module, dist: Distributed, loss_scale: str):
        super().__init__(model)
        self.dist = dist
        self.loss_multiplier = dist.world_size if loss_scale == "global" else 1

    def all_finite(self, params: list[torch.nn.Parameter]) -> bool:
        finite = self._finite(params).to(self.dist.device)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        return bool(finite)

    def assemble_rows(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = values.clone()
        for index, part in self.dist.gather([(rows.tolist(), values[rows])]):
            out[index] = part
        return out


class Replicated(_AcrossRanks):
    """`train.sharding: ddp`: a full replica on every rank, gradients all-reduced by DDP."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig, dist: Distributed, loss_scale: str):
        super().__init__(model, dist, loss_scale)
        # no buffer broadcast at each forward: the model's buffers (e.g. rotary frequencies) never change, and without
        # it ranks may run different numbers of forward passes (one gradient all-reduce per mini-batch must match)
        self.train_model = torch.nn.parallel.DistributedDataParallel(model, **_no_forward_buffer_sync())

    def backward_passes(self, micro_batches: int) -> int:
        return max(micro_batches, 1)  # a rank without rows still joins the one all-reduce

    def gradient_sync(self, last: bool) -> ContextManager:
        return contextlib.nullcontext() if last else self.train_model.no_sync()


class Sharded(_AcrossRanks):
    """`train.sharding: fsdp`: the weights sharded over the ranks with FSDP2 (bf16 compute under `train.dtype:
    bf16`, cast by FSDP itself). Every forward and backward pass gathers parameters, so every rank runs the same
    passes: the most micro-batches any rank has, with the prompt sharing never decided per micro-batch."""

    shards_weights, casts_parameters, prompt_sharing = True, True, "always"

    def __init__(self, model: torch.nn.Module, train: TrainConfig, dist: Distributed, loss_scale: str):
        super().__init__(model, dist, loss_scale)
        fully_shard_model(model, dist, train.dtype == "bf16")

    def backward_passes(self, micro_batches: int) -> int:
        return max(self.dist.gather([micro_batches]))

    def gradient_sync(self, last: bool) -> ContextManager:
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm).full_tensor())  # a DTensor over the shards

    def all_finite(self, params: list[torch.nn.Parameter]) -> bool:
        return super().all_finite([p.to_local() for p in params])  # this rank's shard of each

    def full_weights(self) -> ContextManager:
        return gathered(self.model)

    def checkpoint_weights(self) -> dict | None:
        return full_model_state(self.model)


def _no_forward_buffer_sync() -> dict:
    """DDP's setting for no buffer broadcast at each forward: `forward_sync_buffers=False` from torch 2.13, which
    deprecates the old name; torch 2.11 and 2.12 know only `broadcast_buffers=False`. (The new setting still syncs
    the buffers once, when DDP is built: they are the same on every rank anyway.)"""
    parameters = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in parameters else {"broadcast_buffers": False}


_ACROSS_RANKS = {"ddp": Replicated, "fsdp": Sharded}

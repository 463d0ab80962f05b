"""Sharded training with PyTorch FSDP2 (`fully_shard`), and state dicts that do not depend on how a run is sharded.

`train.sharding: fsdp` shards every decoder layer (the model's `_no_split_modules` classes) and the root across
the data-parallel ranks, with bf16 compute and fp32 reduction under `train.dtype: bf16`. The root keeps its
parameters gathered between forward and backward (`reshard_after_forward=False`), so the log-prob head can run
its token chunks after the forward pass. Forward passes that ranks do not run the same number of times
(generation, candidate scoring, the pre-update log-prob pass) run inside `gathered(model)`: every parameter is
all-gathered once and the passes themselves need no collectives.

Checkpoints hold full (unsharded) weights and optimizer state keyed by parameter names, whatever the sharding,
so a run resumes on any number of ranks, sharded or not.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from exgrpo.errors import ConfigError
from exgrpo.runtime.distributed import Distributed

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def fully_shard_model(model, ctx: Distributed, bf16: bool) -> None:
    """Shard `model` in place over the ranks of `ctx` (decoder layers, then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # an explicit mesh of the training device: the default one picks CUDA when present (pytorch#132471)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    blocks = decoder_layers(model)
    if not blocks:
        raise ValueError(f"train.sharding fsdp: {type(model).__name__} names no decoder-layer class "
                         "(_no_split_modules) to shard by")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes its `_no_split_modules` names."""
    names = next((set(m._no_split_modules) for m in model.modules() if getattr(m, "_no_split_modules", None)), set())
    return [m for m in model.modules() if type(m).__name__ in names]


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(model) -> Iterator[None]:
    """Every FSDP parameter all-gathered for the block (no collectives inside it); a no-op when not sharded."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)


def full_model_state(model) -> dict[str, torch.Tensor]:
    """The full weights on CPU, keyed as `model.state_dict()`; every rank must call it (it gathers)."""
    return get_model_state_dict(model, options=_FULL)


def load_full_model_state(model, state: dict[str, torch.Tensor]) -> None:
    """Load full weights named as `model.state_dict()` (a subset, e.g. only the adapter) into `model`."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's full state keyed by parameter name; every rank must call it."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_optimizer_state(model, optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def refuse_accelerate_fsdp(sharding: str) -> None:
    """exgrpo shards with FSDP2 itself: a launch under an accelerate FSDP config must say train.sharding=fsdp."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and sharding != "fsdp":
        raise ConfigError("launched with an accelerate FSDP config: set train.sharding=fsdp (exgrpo shards with "
                          "FSDP2 itself; the accelerate config's FSDP settings are not read)")

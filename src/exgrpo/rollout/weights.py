"""The policy's weights as an engine loads them, and the check that an engine holds them exactly.

`pushed_weights` streams the trainer's weights under the base model's names with LoRA merged in (what a push
sends); `check_pushable` refuses adapters that cannot be merged so; `engine_differences` reads a vLLM model's
weights back and compares them with the policy's, bit for bit.
"""

from __future__ import annotations

from typing import Iterator

import torch

from exgrpo.errors import EngineError


def base_model(model):
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pushed_weights(model, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the base model's names, LoRA adapters merged in out of place (`merged=False`:
    the base weights in their place, for names, shapes and dtypes without the merge's cost).

    Tied aliases are included (`remove_duplicate=False`): without the tied `lm_head.weight`, vLLM's reload left
    SmolLM2's engine 2.8 nats off after a sync (vLLM 0.32). Under FSDP call it inside `sharding.gathered`, where
    the parameters are the unsharded tensors.
    """
    base = base_model(model)
    lora = {}
    if base is not model:
        from peft.tuners.lora import Linear as LoraLinear

        lora = {f"{name}.weight": m for name, m in base.named_modules() if isinstance(m, LoraLinear)}
    for name, param in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        yield name, _merged(lora[name]) if merged and name in lora else param.detach()  # merged when yielded


def copied_weights(model) -> list[tuple[str, torch.Tensor]]:
    """`pushed_weights` copied to CPU memory: a snapshot a later push can send while the learner goes on updating
    its own weights (under FSDP, take it inside `sharding.gathered`)."""
    return [(name, tensor.to("cpu", copy=True)) for name, tensor in pushed_weights(model)]


def _merged(module) -> torch.Tensor:
    """A LoRA layer's base weight plus its active adapters' deltas (peft's own: fan_in_fan_out layers transposed),
    summed in fp32 whatever the caller's autocast (the push runs in another thread) and rounded once to the base
    weight's precision (bf16 where the learner stores a frozen base so: `store_frozen_linear_weights`)."""
    weight = module.base_layer.weight
    with torch.autocast(weight.device.type, enabled=False):
        merged = weight.to(torch.float32, copy=True)
        for adapter in module.active_adapters:
            merged += module.get_delta_weight(adapter)
    return merged.to(weight.dtype).detach()


def fused_slots(vllm_model) -> dict[str, tuple[str, int, int]]:
    """Policy weight name -> (engine weight name, position among its fused parts, number of parts): vLLM fuses
    q/k/v and gate/up into one weight (`packed_modules_mapping`, where the model class declares one)."""
    packed = getattr(vllm_model, "packed_modules_mapping", {})
    slots = {}
    for name, _ in vllm_model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parent, _, kind = module.rpartition(".")
        parts = [f"{parent}.{p}.{leaf}" for p in packed[kind]] if kind in packed else [name]
        slots.update({part: (name, i, len(parts)) for i, part in enumerate(parts)})
    return slots


def check_pushable(model) -> None:
    """Refuse, with the reason, a peft model whose adapters `pushed_weights` cannot merge into plain weights: only
    LoRA on linear layers is pushed (fan_in_fan_out included). DoRA rescales the merged weight, modules_to_save
    keeps a trained copy under another name, and LoRA on other layers (embeddings, convolutions) is not merged:
    the engine would sample from stale weights while vLLM only warns about the names it did not load."""
    if not hasattr(model, "peft_config"):
        return
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils import ModulesToSaveWrapper

    for name, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            raise EngineError(f"rollout.engine vllm cannot push modules_to_save ({name}): train it with "
                              "rollout.engine hf, or leave it frozen")
        if isinstance(module, LoraLayer):
            if not isinstance(module, LoraLinear):
                raise EngineError(f"rollout.engine vllm pushes LoRA on linear layers only; {name} is a "
                                  f"{type(module.get_base_layer()).__name__} (model.lora.target_modules)")
            if any(module.use_dora.get(a, False) for a in module.active_adapters):
                raise EngineError(f"rollout.engine vllm cannot push DoRA adapters ({name}): their merged weight is "
                                  "rescaled per column; use plain LoRA, or rollout.engine hf")


def engine_differences(engine, model, slots: dict[str, tuple[str, int, int]]) -> list[str]:
    """The weights of the engine's model (`engine`, mapped by `fused_slots`) that differ from the policy's, cast to
    the engine's dtype (vLLM's fused q/k/v and gate/up weights against the concatenation of the parts); every
    slot's name when none matched by name. Where the CPU backend keeps a linear layer's weight packed in its GEMM
    handle (the parameter is empty), columns of it are read back exactly by multiplying unit vectors through it."""
    held, pending, differ, checked = dict(engine.named_parameters()), {}, [], 0
    for policy_name, tensor in pushed_weights(model):  # streamed: one fused group held at a time
        if policy_name not in slots:
            continue
        name, i, n = slots[policy_name]
        parts = pending.setdefault(name, {})
        parts[i] = tensor
        if len(parts) == n:
            want = torch.cat([parts[j] for j in range(n)]) if n > 1 else parts[0]
            del pending[name]
            if not _holds(engine, name, held[name], want, seed=checked):
                differ.append(name)
            checked += 1
    return differ if checked else sorted({name for name, _, _ in slots.values()})


def _holds(engine, name: str, held: torch.Tensor, want: torch.Tensor, seed: int) -> bool:
    """Whether engine parameter `name` (`held`) equals `want` cast to its dtype: read back from the GEMM handle
    where the CPU backend packed it, and within vLLM's padding of a vocabulary."""
    want = want.to(device=held.device, dtype=held.dtype)
    layer = engine.get_submodule(name.rpartition(".")[0])
    if held.numel() == 0 and hasattr(layer, "cpu_linear"):
        held, want = _packed_columns(layer, want, seed=seed)
    elif held.shape[0] > want.shape[0] and held.shape[1:] == want.shape[1:]:
        held = held[: want.shape[0]]
    return torch.equal(held, want)


def _packed_columns(layer, want: torch.Tensor, seed: int, columns: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(the engine's, the expected) values of `columns` input columns of a CPU linear layer whose (out, in) weight
    lives packed in `layer.cpu_linear`: unit vectors through the GEMM give W[:, j] exactly (products with 1 and 0)."""
    picked = torch.randperm(want.shape[1], generator=torch.Generator().manual_seed(seed))[:columns]
    probe = torch.zeros(len(picked), want.shape[1], dtype=want.dtype)
    probe[torch.arange(len(picked)), picked] = 1
    return layer.cpu_linear(probe, layer.weight, None).t(), want[:, picked]

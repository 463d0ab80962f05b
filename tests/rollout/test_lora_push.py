"""What the vllm engine's weight push sends for a peft model: LoRA on linear layers merged as peft merges it,
every other adapter kind refused before an engine is built (no vLLM needed)."""

import copy

import peft
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from exgrpo.config import LoraConfig
from exgrpo.models import apply_lora, load_policy
from exgrpo.rollout.vllm import EngineError
from exgrpo.rollout.weights import check_pushable, pushed_weights


def _randomise_adapters(model):
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _assert_pushes_peft_merge(model):
    check_pushable(model)
    pushed = dict(pushed_weights(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(pushed) == set(merged)
    for name, tensor in merged.items():
        assert torch.allclose(pushed[name], tensor, atol=1e-6), name


def test_lora_on_linear_layers_is_pushed_as_peft_merges_it():
    model, _ = load_policy("tiny:0", lora=LoraConfig(r=4, alpha=8))
    _randomise_adapters(model)
    _assert_pushes_peft_merge(model)


def test_fan_in_fan_out_layers_are_pushed_transposed_as_peft_merges_them():
    """GPT-2's Conv1D stores weights (in, out): peft's fan_in_fan_out."""
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    model = peft.get_peft_model(gpt2, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))
    _randomise_adapters(model)
    _assert_pushes_peft_merge(model)


@pytest.mark.parametrize("kind, settings, message", [
    ("embedding", dict(target_modules=["embed_tokens", "q_proj"]), "LoRA on linear layers only; .*embed_tokens"),
    ("DoRA", dict(target_modules=["q_proj"], use_dora=True), "cannot push DoRA adapters"),
    ("modules_to_save", dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "cannot push modules_to_save"),
])
def test_other_adapter_kinds_are_refused_with_the_reason(kind, settings, message):
    base, _ = load_policy("tiny:0")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, **settings))
    with pytest.raises(EngineError, match=message):
        check_pushable(model)


def test_the_configs_lora_is_pushable():
    model, _ = load_policy("tiny:0")
    check_pushable(apply_lora(model, LoraConfig(r=2, target_modules="q_proj,v_proj")))

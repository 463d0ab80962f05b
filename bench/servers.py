"""Rollouts from two `vllm serve` servers (rollout.engine servers, docs/scale.md) against the one engine of async mode,
on the demo setting with SmolLM2-135M-Instruct: the weight push's time (total and per GB) and, per layout, seconds per
step, rollouts per second and the learner's and the engines' idle shares.

    .venv-vllm/bin/python bench/servers.py                  # ~18 min on 2 cores
    .venv-vllm/bin/python bench/servers.py --steps 6 --pushes 5
    .venv-vllm/bin/python bench/servers.py --servers 1 --no-layouts   # the push and decode rate only (~2 min)
    bash bench/gpu_servers.sh                               # the same on a GPU machine with vLLM: --device cuda

The bench starts the servers with `exgrpo serve` on 127.0.0.1 and stops them at the end. The push: a learner in this
process (`ServerEngine`, its model on `--device`) pushes the full fp32 weights (LoRA merged: the base model's size)
`--pushes` times; the median of the wall time of `push_weights` (pause, the gloo broadcast to every server, version
label, read-back checks, resume) and the bytes sent. Then the servers' decode rate: one batch of 48 requests of up
to 192 tokens through the same engine, tokens per second of wall time. The layouts, each a whole `exgrpo train`
process (as bench/async.py measures them: steps 2.., rollouts per second, idle shares from `async/learner_idle` and
`async/engine_idle`, or in sync mode `time/rollout` and the rest of the step):
* one engine, async s = 1: the vLLM engine in processes of the learner's own (rollout.engine vllm);
* two servers, async s = 1: one learner process;
* two servers, sync: two learner ranks (torchrun, FSDP), each sampling its shard from both servers;
* two servers, async s = 1: two learner ranks, rank 0 sampling for both (docs/scale.md).
On 2 cores the servers, the engine and the learner share the same two cores, so the layouts say what the code
costs, not what separate machines would gain. The tiny preset is not measured: vLLM's CPU attention needs heads of
32 or more dimensions and its heads have 16.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

async_bench = importlib.import_module("async")  # bench/async.py: the same run and the same summary

ROOT = Path(__file__).resolve().parents[1]
SERVED = ["rollout.max_model_len=256", "rollout.generation_batch_size=48"]
GENERATED, GENERATED_TOKENS = 48, 192  # the decode-rate measure: one batch of the servers' size, near max_model_len


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def servers(count: int, log_dir: str):
    """`count` servers started with `exgrpo serve`, up; stopped (their whole process groups) at the end."""
    ports = [_free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = ["--config", str(ROOT / "configs" / "demo.yaml"), "rollout.engine=servers",
              f"rollout.servers={','.join(urls)}", *SERVED]
    processes = [subprocess.Popen([sys.executable, "-m", "exgrpo", "serve", *config, "--port", str(p)], cwd=ROOT,
                                  stdout=open(os.path.join(log_dir, f"server-{p}.log"), "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True) for p in ports]
    try:
        for url, process in zip(urls, processes):
            while not _up(url):
                if process.poll() is not None:
                    raise RuntimeError(f"the server at {url} exited; its log is in {log_dir}")
                time.sleep(1)
        yield urls
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            process.wait()


def _up(url: str) -> bool:
    with contextlib.suppress(requests.RequestException):
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    return False


def push_and_generate(urls: list[str], pushes: int, device: str) -> dict:
    """The push's time (median of `pushes`) from a learner whose model sits on `device`, then the servers' decode
    rate: GENERATED prompts of the demo's question sampled at once, up to GENERATED_TOKENS tokens each."""
    from exgrpo.config import LoraConfig
    from exgrpo.data import PromptEncoder, Question
    from exgrpo.models import load_policy
    from exgrpo.rollout import SamplingSettings
    from exgrpo.rollout.servers import PolicyWeights, ServerEngine

    model, tokenizer = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=32, alpha=64))
    model.to(device)
    engine = ServerEngine(model, tokenizer, urls, backend="exgrpo_gloo", dtype="float32",
                          transfer_address="127.0.0.1", transfer_port=0)
    try:
        times = []
        for version in range(1, pushes + 1):
            start = time.perf_counter()
            engine.push_weights(version)
            times.append(time.perf_counter() - start)
        prompt = PromptEncoder(tokenizer)(Question("q", ({"role": "user", "content": "What is 17 + 25?"},), "42", {}))
        start = time.perf_counter()
        rollouts = engine.generate([prompt] * GENERATED, SamplingSettings(GENERATED_TOKENS), range(GENERATED))
        generate_s = time.perf_counter() - start
    finally:
        engine.close()
    gigabytes = sum(m.dtype.itemsize * math.prod(m.shape) for m in PolicyWeights(model).metadata()) / 1e9
    median = statistics.median(times)
    tokens = sum(map(len, rollouts.completion_ids))
    return {"bench": "servers", "measure": "push", "servers": len(urls), "learner_device": device,
            "gigabytes": round(gigabytes, 3), "median_push_s": round(median, 2),
            "s_per_gb": round(median / gigabytes, 2),
            "pushes_s": [round(t, 2) for t in times], "generated_tokens": tokens,
            "generate_s": round(generate_s, 2), "tokens_per_s": round(tokens / generate_s)}


LAYOUTS = {
    "one engine, async s=1": (["rollout.engine=vllm", "rollout.mode=async", "rollout.max_staleness=1"], 1),
    "two servers, async s=1": (["rollout.mode=async", "rollout.max_staleness=1"], 1),
    "two servers, sync, two ranks": (["train.sharding=fsdp"], 2),
    "two servers, async s=1, two ranks": (["rollout.mode=async", "rollout.max_staleness=1", "train.sharding=fsdp"], 2),
}


def layout_run(name: str, urls: list[str], steps: int, directory: str) -> dict:
    extra, ranks = LAYOUTS[name]
    engine = [] if "rollout.engine=vllm" in extra else ["rollout.engine=servers", f"rollout.servers={','.join(urls)}"]
    launcher = [sys.executable, "-m"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m"]
    mode = "sync" if "rollout.mode=async" not in extra else "async"
    record = async_bench.run(mode, steps, directory, overrides=[*SERVED, *engine, *extra], launcher=launcher)
    return {**record, "bench": "servers", "measure": "layout", "layout": name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="the learner's device for the push (cuda: the GPU check)")
    parser.add_argument("--no-layouts", action="store_true", help="the push and the decode rate only")
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as scratch, servers(args.servers, scratch) as urls:
        records.append(push_and_generate(urls, args.pushes, args.device))
        print(json.dumps(records[-1]), flush=True)
        for name in [] if args.no_layouts else LAYOUTS:
            records.append(layout_run(name, urls, args.steps, os.path.join(scratch, f"run-{len(records)}")))
            print(json.dumps(records[-1]), flush=True)
    push = records[0]
    print(f"\npush: {push['gigabytes']} GB to {push['servers']} servers in {push['median_push_s']} s "
          f"(median of {args.pushes}; {push['s_per_gb']} s/GB); decode: {push['generated_tokens']} tokens in "
          f"{push['generate_s']} s, {push['tokens_per_s']} tokens/s")
    if args.no_layouts:
        return
    print("\n| layout | median step (s) | rollouts/s | learner idle | engine idle |")
    print("|---|---:|---:|---:|---:|")
    for r in records[1:]:
        print(f"| {r['layout']} | {r['median_step_s']} | {r['rollouts_per_s']} | "
              f"{100 * r['learner_idle_share']:.0f}% | {100 * r['engine_idle_share']:.0f}% |")


if __name__ == "__main__":
    main()

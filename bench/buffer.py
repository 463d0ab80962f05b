"""Experience-buffer scale: insert time, per-batch sample+select bookkeeping, bytes per stored token.

    python bench/buffer.py [--sizes 10000 100000 1000000] [--batch 64]

One JSON line per size. Trajectories are synthetic (lengths uniform in [32, 224], mean 128 tokens), 4 distinct
correct ones per question on average, spread over the 7 buckets. Bookkeeping per batch = draw the experiential
questions from the buckets + gather every stored candidate of each (the arrays the entropy forward needs) +
pick one per question from given scores; the model forward that scores candidates is not included.
"""

import argparse
import json
import time
import tracemalloc

import numpy as np
import torch

from exgrpo.experience import SELECTION_MODES, ExperienceBuffer, num_experiential, sample_questions

K = 8


def build(num_trajectories: int, rng: np.random.Generator) -> tuple[ExperienceBuffer, float]:
    buf = ExperienceBuffer(K)
    vocab = 150_000
    lengths = rng.integers(32, 225, size=num_trajectories)
    tokens = rng.integers(0, vocab, size=int(lengths.sum()), dtype=np.int32)
    logprobs = -rng.random(size=int(lengths.sum()), dtype=np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    start = time.perf_counter()
    t, q = 0, 0
    while t < num_trajectories:
        k = min(int(rng.integers(1, K)), num_trajectories - t)
        ids = [tokens[offsets[i]:offsets[i + 1]] for i in range(t, t + k)] + [tokens[:1]] * (K - k)
        lps = [logprobs[offsets[i]:offsets[i + 1]] for i in range(t, t + k)] + [logprobs[:1]] * (K - k)
        buf.update_group(f"q{q}", [True] * k + [False] * (K - k), ids, lps, step=q)
        t, q = t + k, q + 1
    return buf, time.perf_counter() - start


def batch_bookkeeping(buf: ExperienceBuffer, batch: int, rng: np.random.Generator) -> float:
    start = time.perf_counter()
    chosen = sample_questions(buf.buckets(), num_experiential(len(buf), 2 * batch, 0.5), rng, K)
    for qid in chosen:
        candidates = buf.trajectories(qid)
        scores = torch.from_numpy(np.array([c.logprobs.mean() for c in candidates]))
        SELECTION_MODES["argmin"](scores)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=64, help="experiential questions per batch")
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    for size in args.sizes:
        rng = np.random.default_rng(0)
        tracemalloc.start()
        buf, insert_s = build(size, rng)
        allocated, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        times = [batch_bookkeeping(buf, args.batch, rng) for _ in range(args.batches)]
        state = buf.state_dict()["arrays"]
        print(json.dumps({
            "trajectories": buf.num_trajectories,
            "questions": len(buf),
            "stored_tokens": buf.num_tokens,
            "insert_s": round(insert_s, 2),
            "insert_us_per_trajectory": round(1e6 * insert_s / size, 2),
            "batch_bookkeeping_ms_median": round(1e3 * float(np.median(times)), 3),
            "batch_bookkeeping_ms_p95": round(1e3 * float(np.percentile(times, 95)), 3),
            "state_bytes_per_token": round(sum(a.nbytes for a in state.values()) / buf.num_tokens, 3),
            "allocated_bytes_per_token": round(allocated / buf.num_tokens, 3),
        }), flush=True)


if __name__ == "__main__":
    main()

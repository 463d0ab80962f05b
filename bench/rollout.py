"""Rollout throughput: exgrpo's HFEngine (greedy decoding over per-row Gumbel-max scores) vs a plain transformers
`generate(do_sample=True)` on the same batch, plus the cost of one PerRowSampler call.

    .venv/bin/python bench/rollout.py [--models tiny smollm2] [--repeats 5]

The batch is the step benchmark's (bench/step_time.py): the first B prompts of the demo's 1-2 digit addition set,
each repeated K times, chat template applied, fp32 on CPU, temperature 1, no top-k/top-p (the plain call passes
top_k=0, top_p=1.0 explicitly so that the model's generation config cannot add a filter). One JSON line per
measurement:

* "rollout" (mode "natural"): the engine as the trainer calls it vs `generate(do_sample=True)`, both stopping at EOS
  or max_new_tokens. The samples differ (different random streams), so lengths differ a little: tokens_per_s
  counts completion tokens up to and including EOS; row_steps_per_s counts rows x decode steps (the work the
  decode loop does, finished rows included). The methods alternate, R repeats each; medians are reported.
* "rollout" (mode "fixed"): both forced to exactly max_new_tokens (min_new_tokens = max_new_tokens); the engine's
  path is reproduced as HFEngine builds it (the prompts prefilled once per distinct prompt, then do_sample=False +
  LogitsProcessorList([PerRowSampler])), since the engine API has no min_new_tokens. Equal token counts, so tokens/s
  compare the decode cost directly.
* "sampler": one logits-processor call on an (N, V) score matrix: PerRowSampler vs the default sampling path
  (softmax + torch.multinomial), ms per call, i.e. the per-decode-step overhead of per-row random streams.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from exgrpo.data import load_questions, render_prompt  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402
from exgrpo.rollout import HFEngine, PerRowSampler, SamplingSettings  # noqa: E402

DEMO_DATA = ("reasoning_gym:basic_arithmetic?size=64&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=2"
             "&operators=+&allow_negation=false&allow_parentheses=false")
SUFFIX = " Answer with only the final number."
MODELS = {"tiny": ("tiny:0", 8, 8, 32), "smollm2": ("smollm2-135m-instruct", 6, 8, 24)}  # name, B, K, T


def out(record: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), flush=True)


def completion_lengths(rows: list[list[int]], eos: set[int]) -> list[int]:
    lengths = []
    for row in rows:
        n = 0
        for token in row:
            n += 1
            if token in eos:
                break
        lengths.append(n)
    return lengths


def padded(prompt_ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    return ids, attention


def bench_model(name: str, repeats: int, threads: int) -> None:
    preset, B, K, T = MODELS[name]
    model, tok = load_policy(preset)
    model.eval()
    questions = list(load_questions(DEMO_DATA, prompt_suffix=SUFFIX))[:B]
    prompts = [tok(render_prompt(tok, q.messages), add_special_tokens=False)["input_ids"] for q in questions]
    batch = [p for p in prompts for _ in range(K)]
    N = len(batch)
    engine = HFEngine(model, tok)
    eos = engine.eos_ids
    ids, attention = padded(batch, tok.pad_token_id)
    width = ids.shape[1]

    def run_engine(seed: int, fixed: bool):
        sampling = SamplingSettings(T, 1.0, 1.0, 0)
        seeds = [seed * 10_000 + i for i in range(N)]
        if not fixed:
            r = engine.generate(batch, sampling, seeds)
            return [len(c) for c in r.completion_ids], max(len(c) for c in r.completion_ids)
        with torch.no_grad():
            o = model.generate(input_ids=ids, attention_mask=attention, do_sample=False,
                               past_key_values=engine.shared_prefill(ids, attention),
                               logits_processor=LogitsProcessorList([PerRowSampler(sampling, seeds)]),
                               max_new_tokens=T, min_new_tokens=T, pad_token_id=tok.pad_token_id,
                               eos_token_id=sorted(eos), temperature=None, top_p=None, top_k=None)
        return [T] * N, o.shape[1] - width

    def run_plain(seed: int, fixed: bool):
        torch.manual_seed(seed)
        with torch.no_grad():
            o = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0, top_p=1.0,
                               top_k=0, max_new_tokens=T, min_new_tokens=T if fixed else 0,
                               pad_token_id=tok.pad_token_id, eos_token_id=sorted(eos))
        rows = o[:, width:].tolist()
        return completion_lengths(rows, eos), o.shape[1] - width

    for mode in ("natural", "fixed"):
        results = {"hf_engine": [], "generate_do_sample": []}
        for r in range(repeats + 1):  # the first repeat of each method is a warm-up
            for method, fn in (("hf_engine", run_engine), ("generate_do_sample", run_plain)):
                t = time.perf_counter()
                lengths, steps = fn(r, mode == "fixed")
                seconds = time.perf_counter() - t
                if r == 0:
                    continue
                results[method].append((seconds, sum(lengths), steps))
                out({"bench": "rollout_run", "model": name, "mode": mode, "method": method, "repeat": r,
                     "rows": N, "max_new_tokens": T, "seconds": seconds, "tokens": sum(lengths),
                     "decode_steps": steps, "tokens_per_s": sum(lengths) / seconds,
                     "row_steps_per_s": N * steps / seconds})
        summary = {}
        for method, runs in results.items():
            summary[method] = {
                "seconds": statistics.median(s for s, _, _ in runs),
                "tokens_per_s": statistics.median(n / s for s, n, _ in runs),
                "row_steps_per_s": statistics.median(N * k / s for s, _, k in runs),
                "mean_tokens": statistics.mean(n for _, n, _ in runs) / N,
            }
        out({"bench": "rollout", "model": name, "mode": mode, "rows": N, "prompts": B, "K": K, "max_new_tokens": T,
             "threads": threads, "repeats": repeats,
             **{f"{m}/{k}": v for m, s in summary.items() for k, v in s.items()},
             "engine_over_plain_tokens_per_s": summary["hf_engine"]["tokens_per_s"]
             / summary["generate_do_sample"]["tokens_per_s"],
             "engine_over_plain_row_steps_per_s": summary["hf_engine"]["row_steps_per_s"]
             / summary["generate_do_sample"]["row_steps_per_s"]})

    # one logits-processor call on (N, V) scores
    V = model.config.vocab_size
    scores = torch.randn(N, V)
    sampler = PerRowSampler(SamplingSettings(T, 1.0, 1.0, 0), list(range(N)))

    def plain_sample(s):
        return torch.multinomial(torch.softmax(s / 1.0, dim=-1), 1)

    timings = {}
    for label, fn in (("per_row_sampler", lambda: sampler(None, scores).argmax(-1)),
                      ("softmax_multinomial", lambda: plain_sample(scores))):
        fn()
        calls = 200 if V < 1000 else 50
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        timings[label] = 1e3 * (time.perf_counter() - t) / calls
    out({"bench": "sampler", "model": name, "rows": N, "vocab": V, "threads": threads,
         "per_row_sampler_ms": timings["per_row_sampler"], "softmax_multinomial_ms": timings["softmax_multinomial"],
         "overhead_ms_per_decode_step": timings["per_row_sampler"] - timings["softmax_multinomial"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "smollm2"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for name in args.models:
        bench_model(name, args.repeats, args.threads)


if __name__ == "__main__":
    main()

"""The paper's entropy premise, checked on the base model without training (the premise the lowest-entropy selection
rests on).

ExGRPO replays, of a question's stored correct trajectories, the one with the lowest mean token entropy, on the
premise that low entropy marks valid reasoning and high entropy a lucky guess with wrong working. This script
samples the base model K times per question at T = 1.0 on a task whose completions show their working, grades every
completion with the project's training reward (math-verify, `MathReward`, restatements refused; a completion
without EOS scores 0, i.e. `reward.truncated=fail`), and for every correct completion checks each "lhs = rhs" it
writes (`steps`): *valid* (at least one checkable step, all of them right), *lucky* (right answer, at least one
wrong step) or *no working* (no checkable step at all). It then scores the correct completions with the project's
selection metric (mean token entropy under the model, `exgrpo.learner.forward.candidate_scores` with
`SELECTION_METRICS["entropy"]`, the same function the trainer's replay selection calls) and asks, over the
questions whose correct completions differ in validity, whether the lowest-entropy one is valid more often than a
random one.

    PYTHONPATH=src HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python bench/premise_check.py chain_sum \
        --questions 200 --out bench/results/premise_check.jsonl
    ... bench/premise_check.py paren_3term --questions 200 --out bench/results/premise_check.jsonl
    ... bench/premise_check.py add_3term --questions 200 --out bench/results/premise_check.jsonl
    ... bench/premise_check.py chain_sum --questions 20 --out /tmp/rate.jsonl      # rate probe (~2 min)

One JSON line per task on stdout, appended to `--out`; the correct completions (text, class, steps, entropy) go to
`--samples` (default: `--out` with `_samples` before the suffix), so that the classification can be read.
Reproducible: sample s of question i is drawn with seed derive_seed(--seed, i, s) (per-row Gumbel-max streams of
the `hf` engine, independent of the batch), the questions are reasoning-gym's with a fixed seed, the bootstrap
uses numpy's generator seeded with --seed. Torch runs on --threads threads (default 1).

Two comparisons per task, both on a question's correct completions:
* `rule_working`: among the correct completions *with checkable working* (valid or lucky), the questions with at
  least one of each: P(valid | lowest entropy) vs P(valid | random pick) = the share of valid ones;
* `rule_all`: among all correct completions, valid against not valid (lucky or no working), questions with both.
The difference's 95% interval is a percentile bootstrap over questions (10,000 resamples).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from exgrpo.rewards.arithmetic import steps  # noqa: E402
from exgrpo.studies.working import classify  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct"
_RG = "reasoning_gym:"
#: name: (data source, prompt suffix). The suffixes ask for the working that the check reads.
TASKS = {
    # reasoning-gym's chain_sum: "State the final answer to the following arithmetic problem: 5 + 9 + 7 ="
    "chain_sum": (_RG + "chain_sum?min_terms=3&max_terms=3&min_digits=1&max_digits=2&size=1000&seed=47",
                  " Work it out step by step, then give the final answer."),
    # three terms, + and -, with parentheses: "Calculate ( -9 - 8 ) + 6."
    "paren_3term": (_RG + "basic_arithmetic?min_terms=3&max_terms=3&min_digits=1&max_digits=2&operators=+-"
                    "&allow_negation=false&allow_parentheses=true&size=1000&seed=47", " Solve it step by step."),
    # three-term addition (the weak-model candidate) with a step-by-step suffix: "Calculate 12 + 7 + 40."
    "add_3term": (_RG + "basic_arithmetic?min_terms=3&max_terms=3&min_digits=1&max_digits=2&operators=+"
                  "&allow_negation=false&allow_parentheses=false&size=1000&seed=47",
                  " Think step by step: write each step as an equation, then give the final number."),
}

# --------------------------------------------------------------------------------------------------------------
# the selection rule against random


def rule_vs_random(groups: list[list[tuple[float, bool]]], seed: int, resamples: int = 10_000) -> dict:
    """Per question a list of (entropy, valid) of its correct completions; only questions with both a valid and an
    invalid one count. P(valid | lowest entropy) is the share of such questions whose lowest-entropy completion is
    valid; P(valid | random) the mean over them of the share of valid completions (a uniform pick's expectation)."""
    lowest, uniform = [], []
    for g in groups:
        valid = [v for _, v in g]
        if len(g) < 2 or all(valid) or not any(valid):
            continue
        lowest.append(float(min(g, key=lambda c: c[0])[1]))
        uniform.append(sum(valid) / len(valid))
    n = len(lowest)
    if n == 0:
        return {"questions": 0}
    lo, un = np.array(lowest), np.array(uniform)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    diffs = (lo[idx] - un[idx]).mean(axis=1)
    return {"questions": n, "p_valid_lowest": round(float(lo.mean()), 3), "p_valid_random": round(float(un.mean()), 3),
            "difference": round(float((lo - un).mean()), 3),
            "ci95": [round(float(np.percentile(diffs, 2.5)), 3), round(float(np.percentile(diffs, 97.5)), 3)]}


# --------------------------------------------------------------------------------------------------------------
# the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--samples-per-question", "-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-questions", type=int, default=16, help="questions per generate call")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="vllm: run with .venv-vllm (and VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1)")
    parser.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", required=True, help="JSONL file the task's summary line is appended to")
    parser.add_argument("--samples", help="JSONL of the correct completions (default: beside --out)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from exgrpo.data import PromptEncoder, load_questions
    from exgrpo.evaluation.sampling import sample_completions
    from exgrpo.experience.selection import SELECTION_METRICS
    from exgrpo.learner.forward import candidate_scores, token_logprobs
    from exgrpo.models import load_policy
    from exgrpo.rewards import MathReward, score_completions
    from exgrpo.rollout import SamplingSettings
    from exgrpo.rollout.hf import HFEngine

    if args.engine == "vllm":
        from exgrpo.rollout.vllm import VLLMEngine

    started = time.perf_counter()
    source, suffix = TASKS[args.task]
    questions = load_questions(source, prompt_suffix=suffix, limit=args.questions)
    model, tokenizer = load_policy(args.model)
    model.eval()
    encode = PromptEncoder(tokenizer)
    prompt_ids = [encode(q) for q in questions]
    K = args.samples_per_question
    sampling = SamplingSettings(args.max_new_tokens, temperature=1.0)
    completions: dict[tuple[int, int], tuple[list[int], bool]] = {}
    engine = HFEngine(model, tokenizer) if args.engine == "hf" else VLLMEngine(
        model, tokenizer, dtype=args.engine_dtype, max_model_len=max(map(len, prompt_ids)) + args.max_new_tokens,
        max_num_seqs=args.batch_questions * K, seed=args.seed)
    engine_ready = time.perf_counter()
    for batch in sample_completions(engine, prompt_ids, K, sampling, args.seed, batch_size=args.batch_questions * K):
        for request, ids, cut in zip(batch.requests, batch.completion_ids, batch.truncated):
            completions[request] = (ids, cut)
    engine.close()
    sampled = time.perf_counter()

    requests = sorted(completions)
    texts = [tokenizer.decode(completions[r][0], skip_special_tokens=True) for r in requests]
    rows = [questions[i] for i, _ in requests]
    prompts = [tokenizer.decode(prompt_ids[i]) for i, _ in requests]
    truncated = [completions[r][1] for r in requests]
    total, _ = score_completions([MathReward()], [1.0], prompts, texts, [completions[r][0] for r in requests], rows,
                                 truncated, truncated_reward=0.0)
    graded, _ = score_completions([MathReward()], [1.0], prompts, texts, [completions[r][0] for r in requests], rows)
    correct = [j for j, t in enumerate(total) if t >= 1.0]

    # the project's selection metric on the correct completions (one no-grad forward over prompt + completion)
    candidates = [(prompt_ids[requests[j][0]], completions[requests[j]][0]) for j in correct]
    with torch.no_grad():
        entropy = candidate_scores(lambda b, e: token_logprobs(model, b, 1.0, with_entropy=e), candidates,
                                   SELECTION_METRICS["entropy"], tokenizer.pad_token_id,
                                   batch_size=32) if candidates else []
    scored = time.perf_counter()

    classes = {j: classify(texts[j]) for j in correct}
    by_question: dict[int, list[tuple[float, str]]] = {}
    for j, h in zip(correct, entropy):
        by_question.setdefault(requests[j][0], []).append((h, classes[j]))
    counts = {c: sum(1 for v in classes.values() if v == c) for c in ("valid", "lucky", "no_working")}
    n_correct = len(correct)
    working = [[(h, c == "valid") for h, c in g if c != "no_working"] for g in by_question.values()]
    every = [[(h, c == "valid") for h, c in g] for g in by_question.values()]
    mean_entropy = {c: round(float(np.mean([h for j, h in zip(correct, entropy) if classes[j] == c])), 4)
                    if counts[c] else None for c in counts}
    lengths = [len(completions[r][0]) for r in requests]
    summary = {
        "bench": "premise_check", "task": args.task, "data": source, "prompt_suffix": suffix, "model": args.model,
        "questions": len(questions), "samples_per_question": K, "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0, "seed": args.seed, "threads": args.threads,
        "engine": args.engine + ("" if args.engine == "hf" else f" {args.engine_dtype}"),
        "accuracy": round(float(np.mean(total >= 1.0)), 4),
        "accuracy_truncated_graded": round(float(np.mean(graded >= 1.0)), 4),
        "truncated_share": round(float(np.mean(truncated)), 3),
        "mean_completion_tokens": round(float(np.mean(lengths)), 1),
        "questions_with_a_success": len(by_question),
        "questions_with_2plus_correct": sum(1 for g in by_question.values() if len(g) >= 2),
        "correct": n_correct, "counts": counts,
        "shares": {c: round(v / n_correct, 3) if n_correct else None for c, v in counts.items()},
        "valid_only_final_step": sum(1 for j in correct if classes[j] == "valid"
                                     and all(abs(s["rhs"] - float(rows[j].answer)) < 1e-9 for s in steps(texts[j]))),
        "mean_entropy_by_class": mean_entropy,
        "rule_working": rule_vs_random(working, args.seed),
        "rule_all": rule_vs_random(every, args.seed),
        "seconds": {"engine_start": round(engine_ready - started, 1), "sampling": round(sampled - engine_ready, 1),
                    "grading_and_entropy": round(scored - sampled, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    line = json.dumps(summary)
    print(line, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(line + "\n")
    samples = Path(args.samples) if args.samples else out.with_name(out.stem + "_samples" + out.suffix)
    with samples.open("a") as f:
        for j, h in zip(correct, entropy):
            f.write(json.dumps({"task": args.task, "question": requests[j][0], "sample": requests[j][1],
                                "prompt": rows[j].messages[-1]["content"], "gold": rows[j].answer,
                                "completion": texts[j], "class": classes[j], "entropy": round(h, 4),
                                "steps": [s["text"] + (" ✓" if s["ok"] else " ✗") for s in steps(texts[j])]}) + "\n")


if __name__ == "__main__":
    main()

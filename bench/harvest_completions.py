# How bench/reward_labels.jsonl (the training reward's yardstick) was built: real completions of this project's
# model, each labelled by a person reading it with what it STATES as its final answer (a number as a string), or
# null when it states none (no number given as the answer, the question's arithmetic restated unevaluated, or two
# conflicting final answers). Labelled without running any grader; the gold answer was kept out of the judgement.
# Sources: "round-five-samples" (docs/results-round-five/samples.md, every logged sample; id arm/seed/step/n),
# "premise-check" (bench/results/premise_check_samples.jsonl), "demo-base" (this script: the demo preset's base
# model, 4 samples at T = 1.0 of its 40 held-out questions, 24 tokens, as the demo's held-out evaluation samples),
# "demo-trained" (this script with --model: the demo model after `make demo`'s 15 steps, exported with its LoRA
# merged, sampled the same way; bench/results/demo_trained_completions.jsonl) and "hostile-read" (hand-written
# cases: correct answers with working after them, and the earlier corrections' wrong answers from
# src/exgrpo/rewards/graders.py and docs/evaluation.md). Rules: a declared answer wins over a later computation; a
# completed calculation of the asked problem states its result; cut off = what was stated.
"""Sample the demo model's completions of the demo's held-out questions and write them as JSONL.

Uses the project's own parts: the demo preset's config, `load_questions` with its prompt suffix, the held-out split
the trainer makes (`split_holdout` with data.holdout and train.seed; each distinct prompt once), `load_policy`, the
`hf` engine, the chat-template `PromptEncoder` and `sample_completions` with eval.samples, eval.temperature, the
rollout's max_completion_length and the seed of the trainer's step-0 evaluation; completions decoded as the
held-out evaluation decodes them.

    PYTHONPATH=src HF_HUB_OFFLINE=1 nice -n 15 .venv/bin/python bench/harvest_completions.py \
        --out bench/results/demo_base_completions.jsonl
    exgrpo export runs/demo exported --merge   # after `exgrpo demo`: the trained model, then
    ... bench/harvest_completions.py --model exported --source demo-trained --out ...

One line per completion: source, question (the user message the model was asked), gold, completion, truncated.
"""

from __future__ import annotations

import argparse
import json

import torch

from exgrpo.config import load_config
from exgrpo.data import PromptEncoder, collapse_replicas, load_questions, split_holdout
from exgrpo.evaluation.sampling import sample_completions
from exgrpo.models import load_policy
from exgrpo.rollout import SamplingSettings, derive_seed
from exgrpo.rollout.hf import HFEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo", help="preset or config file (default: demo)")
    parser.add_argument("--model", default=None, help="model to sample (default: the config's model.name)")
    parser.add_argument("--source", default="demo-base", help="the rows' source label")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's train.seed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core machine "
                        "2 threads ran 12x slower)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    c = load_config(args.config)
    torch.set_num_threads(args.threads)
    questions = load_questions(c.data.train, prompt_suffix=c.data.prompt_suffix)
    _, held_out = split_holdout(questions, c.data.holdout, c.train.seed)  # data.holdout distinct prompts ...
    held_out = [q for q, _ in collapse_replicas(held_out)]  # ... each once (the split keeps a prompt's replicas)
    model, tokenizer = load_policy(args.model or c.model.name, dtype=c.model.dtype)
    sampling = SamplingSettings.from_config(c.rollout, temperature=c.eval.temperature)
    encode = PromptEncoder.from_config(tokenizer, c.data)
    (out,) = sample_completions(HFEngine(model, tokenizer), [encode(q) for q in held_out], c.eval.samples, sampling,
                                derive_seed(c.train.seed if args.seed is None else args.seed, 0, 4))  # as at step 0
    with open(args.out, "w") as f:
        for (i, s), ids, truncated in zip(out.requests, out.completion_ids, out.truncated):
            q = held_out[i]
            f.write(json.dumps({"source": args.source, "id": f"{args.source}/q{i:02d}/s{s}",
                                "question": q.messages[-1]["content"], "gold": q.answer,
                                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                                "truncated": truncated}) + "\n")
    print(f"{len(out.requests)} completions of {len(held_out)} questions -> {args.out}")


if __name__ == "__main__":
    main()

"""Sampled start accuracy of SmolLM2-135M-Instruct on candidate reasoning-gym settings (issue #16's design):
held-out avg@4 at T = 1.0 before any training, with the demo config's prompt and grader. One JSON line each.

    .venv/bin/python bench/start_accuracy.py                  # every candidate (~5 min on 2 cores)
    .venv/bin/python bench/start_accuracy.py sub_2digit       # one of them
    .venv/bin/python bench/start_accuracy.py addsub_2-3terms eval.samples=8 reward.truncated=fail \
        rollout.max_completion_length=64                      # config overrides (key=value) after the names

Besides the accuracy, each line gives the share of questions by success count k of eval.samples (`k_shares`:
0, 1, 2..samples-2, samples-1, samples), the medium buckets ExGRPO's sampling favours being the middle one.
"""

import json
import sys
import time
from collections import Counter
from pathlib import Path

from exgrpo.config import load_config
from exgrpo.training.launch import build_run

ARITHMETIC = "reasoning_gym:basic_arithmetic?min_terms={terms}&max_terms={terms}&min_digits={low}&max_digits={high}" \
             "&operators={ops}&allow_negation=false&allow_parentheses=false&size={size}&seed={seed}"
CANDIDATES = {  # name: (data.train, data.holdout)
    "add_1-2digit": (ARITHMETIC.format(terms=2, low=1, high=2, ops="+", size=200, seed=1), 60),
    "sub_2digit": (ARITHMETIC.format(terms=2, low=2, high=2, ops="-", size=200, seed=1), 60),
    "addsub_2digit": (ARITHMETIC.format(terms=2, low=2, high=2, ops="+-", size=200, seed=1), 60),
    "mul_1digit": (ARITHMETIC.format(terms=2, low=1, high=1, ops="*", size=200, seed=1), 60),
    "add_3terms_1digit": (ARITHMETIC.format(terms=3, low=1, high=1, ops="+", size=200, seed=1), 60),
    "round_two": (ARITHMETIC.format(terms=2, low=2, high=2, ops="-", size=120, seed=7), 40),  # experiments/round-two
    # issue #37's candidates for round four's next setting
    "mixed_2term": (ARITHMETIC.format(terms=2, low=1, high=2, ops="+-*", size=200, seed=1), 60),
    "addsub_2-3terms": (ARITHMETIC.replace("min_terms={terms}", "min_terms=2").format(
        terms=3, low=1, high=2, ops="+-", size=200, seed=1), 60),
    "mul_1-2digit": (ARITHMETIC.format(terms=2, low=1, high=2, ops="*", size=200, seed=1), 60),
}
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"

names = [a for a in sys.argv[1:] if "=" not in a] or list(CANDIDATES)
overrides = [a for a in sys.argv[1:] if "=" in a]
for name in names:
    start = time.perf_counter()
    source, holdout = CANDIDATES[name]
    config = load_config(DEMO, [f"data.train={source}", f"data.holdout={holdout}", "logging.output_dir=/tmp/probe-run",
                                "logging.overwrite=true", "logging.progress=false", "logging.tensorboard=false",
                                *overrides])
    run = build_run(config)
    accuracy = run.trainer.evaluate()
    run.close()
    n, questions = accuracy.samples_per_question, accuracy.num_questions
    k = Counter(round(a * n) for a in accuracy.per_question)
    groups = {"0": k[0], "1": k[1], f"2-{n - 2}": sum(k[i] for i in range(2, n - 1)), f"{n - 1}": k[n - 1],
              f"{n}": k[n]}
    print(json.dumps({"setting": name, "data.train": source, "overrides": overrides,
                      "accuracy": round(accuracy.mean, 3),
                      "stderr": round(accuracy.stderr, 3), "questions": questions,
                      "k_shares": {g: round(c / questions, 3) for g, c in groups.items()},
                      "seconds": round(time.perf_counter() - start, 1)}), flush=True)

"""Sampled start accuracy of SmolLM2-135M-Instruct on candidate reasoning-gym settings (issue #16's design):
held-out avg@4 at T = 1.0 before any training, with the demo config's prompt and grader. One JSON line each.

    .venv/bin/python bench/start_accuracy.py                  # every candidate (~5 min on 2 cores)
    .venv/bin/python bench/start_accuracy.py sub_2digit       # one of them
"""

import json
import sys
import time
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
}
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"

for name in sys.argv[1:] or list(CANDIDATES):
    start = time.perf_counter()
    source, holdout = CANDIDATES[name]
    config = load_config(DEMO, [f"data.train={source}", f"data.holdout={holdout}", "logging.output_dir=/tmp/probe-run",
                                "logging.overwrite=true", "logging.progress=false", "logging.tensorboard=false"])
    run = build_run(config)
    accuracy = run.trainer.evaluate()
    run.close()
    print(json.dumps({"setting": name, "data.train": source, "accuracy": round(accuracy.mean, 3),
                      "stderr": round(accuracy.stderr, 3), "questions": accuracy.num_questions,
                      "seconds": round(time.perf_counter() - start, 1)}), flush=True)

"""Round three's pilot (issue #26): one GRPO run per candidate setting, reported before any registration.

Each candidate is the demo recipe on a reasoning-gym setting that mixes difficulties, run with GRPO
(`experience.ratio=0`) on the fastest engine the repo has on a CPU without bf16 hardware (vLLM in fp32: this
machine's AVX2 cores multiply bf16 at 0.9 GFLOP/s against 111 in fp32). After every step it
records how many of the training questions drawn so far sit in the medium buckets 1 <= k <= K-1 (k: the latest
success count of the question's group), how many are retired, and the fewest draws of any training question;
held-out accuracy every `eval.every` steps and before the first. One JSON line per step, then a summary line
that checks the registration criteria of issue #26:

* final held-out accuracy between 25% and 75%, and not below its best evaluation by more than 10 points;
* at mid-run at least a third of the training questions drawn so far in buckets 1..K-1;
* every training question drawn at least 4 times within the budget (or retired, solved K/K, before).

    .venv-vllm/bin/python bench/pilot.py                     # every candidate (~10 min each on 2 cores)
    .venv-vllm/bin/python bench/pilot.py mixed_ops           # one of them
"""

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from exgrpo.config import load_config  # noqa: E402
from exgrpo.records import own_members  # noqa: E402
from exgrpo.training.launch import build_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARITHMETIC = "reasoning_gym:basic_arithmetic?min_terms={terms[0]}&max_terms={terms[1]}&min_digits={digits[0]}" \
             "&max_digits={digits[1]}&operators={ops}&allow_negation=false&allow_parentheses={paren}&size=90&seed=11"
CANDIDATES = {  # name: data.train (90 questions; 40 held out, 50 trained on)
    "add_1-2digit": ARITHMETIC.format(terms=(2, 2), digits=(1, 2), ops="+", paren="false"),
    "mixed_ops": ARITHMETIC.format(terms=(2, 2), digits=(1, 2), ops="+-*", paren="false"),
    "mul_1-2digit": ARITHMETIC.format(terms=(2, 2), digits=(1, 2), ops="*", paren="false"),
    "ops_1-3digit": ARITHMETIC.format(terms=(2, 2), digits=(1, 3), ops="+-*", paren="false"),
    # second pass: two to four terms with parentheses, so that part of the set stays out of reach
    "terms_2-4": ARITHMETIC.format(terms=(2, 4), digits=(1, 2), ops="+-*", paren="true"),
    "terms_2-4_3digit": ARITHMETIC.format(terms=(2, 4), digits=(1, 3), ops="+-*", paren="true"),
}
FASTEST = ["rollout.engine=vllm", "rollout.max_model_len=256", "rollout.generation_batch_size=48"]
STEPS = 40


def grpo_config(name: str, steps: int, output_dir: str, eval_every: int):
    """The demo recipe with GRPO on candidate `name`, on the fastest engine, logging only metrics."""
    return load_config(ROOT / "configs" / "demo.yaml", [
        f"data.train={CANDIDATES[name]}", "data.holdout=40", "experience.ratio=0", f"train.steps={steps}",
        f"eval.every={eval_every}", f"logging.output_dir={output_dir}", "logging.overwrite=true",
        "logging.progress=false", "logging.tensorboard=false", "logging.sample_every=0", "train.save_every=0",
        *FASTEST])


def pilot(name: str) -> dict:
    start = time.perf_counter()
    config = grpo_config(name, STEPS, f"/tmp/pilot/{name}", eval_every=10)
    run = build_run(config, log=lambda _: None)
    trainer, K = run.trainer, config.rollout.num_generations
    latest, draws, evaluations, mid_share = {}, Counter(), {0: trainer.evaluate().mean}, []

    def on_step(step: int, metrics: dict) -> None:
        record = trainer.last_step
        for group, ok, own in zip(record.groups, record.correct, own_members(record.groups)):
            latest[group.question.id] = int(ok[own].sum())
            draws[group.question.id] += 1
        if "eval/accuracy" in metrics:
            evaluations[step] = metrics["eval/accuracy"]
        medium = sum(1 <= k <= K - 1 for k in latest.values())
        print(json.dumps({"setting": name, "step": step, "eval": metrics.get("eval/accuracy"), "drawn": len(latest),
                          "medium": medium, "retired": sum(k == K for k in latest.values()),
                          "pass@1": round(float(record.correct.mean()), 3)}), flush=True)
        if step == STEPS // 2:
            mid_share.append(medium / len(latest))

    trainer.train(on_step=on_step)
    run.close()
    final, best = evaluations[max(evaluations)], max(evaluations.values())
    # a question retired (solved K/K) has nothing left to revisit: it counts as drawn often enough
    short = [i for i in trainer.experience.question_pool.questions if draws[i] < 4 and latest.get(i) != K]
    summary = {"setting": name, "data.train": CANDIDATES[name], "steps_run": trainer.step,
               "heldout": {str(k): round(v, 3) for k, v in sorted(evaluations.items())},
               "mid_medium_share": round(mid_share[0], 3) if mid_share else None,
               "fewest_draws": min(draws[i] for i in trainer.experience.question_pool.questions),
               "drawn_under_4_unretired": len(short),
               "train_questions": len(trainer.experience.question_pool.questions),
               "minutes": round((time.perf_counter() - start) / 60, 1)}
    summary["criteria"] = {"final_25_75": 0.25 <= final <= 0.75, "not_collapsed": final >= best - 0.10,
                           "mid_medium_third": bool(mid_share) and mid_share[0] >= 1 / 3, "drawn_4_times": not short}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    for candidate in sys.argv[1:] or list(CANDIDATES):
        pilot(candidate)

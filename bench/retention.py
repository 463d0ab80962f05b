"""Round three's retention re-test (docs/results.md, registration): of the training questions a run ever solved
(a correct rollout of the policy's own at some step: the checkpoint's `solved`), the share that the final
checkpoint still solves, i.e. with at least one correct completion in 4 samples at T = 1.0. The same
sampling seed and grader for every run, so arms are compared alike. Each line also checks the registration
criteria on the run itself (`criteria`): final held-out accuracy within 25-75% and within 10 points of the run's
best; at step 20 a third of the training questions in the medium buckets 1 <= k <= K-1 (exact for ExGRPO-family
runs, whose buffer logs its buckets; for GRPO runs, which log no per-question k, only the upper bound "ever
solved minus retired"); every training question drawn at least 4 times or retired (true when the pool has made
4 full passes: each pass draws every question not retired). One JSON line per run directory; the run directories
are only read.

    .venv-vllm/bin/python bench/retention.py runs/round-three/*/seed-*   # -> bench/results/retention.jsonl
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from exgrpo.config import load_config  # noqa: E402
from exgrpo.experience.buffer import read_state  # noqa: E402
from exgrpo.evaluation.heldout import evaluate_accuracy  # noqa: E402
from exgrpo.rollout import SamplingSettings  # noqa: E402
from exgrpo.runtime.checkpoint import latest_intact_checkpoint, load_checkpoint, read_trainer_json  # noqa: E402
from exgrpo.runtime.tracking import read_metrics  # noqa: E402
from exgrpo.training.launch import build_run  # noqa: E402

SAMPLES, SEED, MID_STEP = 4, 20261202, 20


def criteria(run_dir: Path, trainer_state: dict, num_questions: int, K: int) -> dict:
    """The registration criteria of issue #26 on one run (see the module docstring), from its metrics and the
    final checkpoint's trainer state."""
    history = read_metrics(run_dir / "metrics.jsonl")
    evaluations = [m["eval/accuracy"] for m in history if "eval/accuracy" in m]
    mid = next(m for m in history if m["step"] == MID_STEP)
    exact = trainer_state["config"]["experience"]["ratio"] > 0  # a buffer that logs its non-empty buckets
    medium = sum(mid.get(f"experience/bucket_{k}", 0) for k in range(1, K)) if exact else \
        mid["coverage/solved"] - mid["experience/retired"]
    return {"final": evaluations[-1], "best": max(evaluations), "final_25_75": 0.25 <= evaluations[-1] <= 0.75,
            "not_collapsed": evaluations[-1] >= max(evaluations) - 0.10,
            "mid_medium": medium, "mid_medium_exact": exact, "mid_medium_third": medium / num_questions >= 1 / 3,
            "pool_passes": trainer_state["pool"]["epoch"], "drawn_4_times": trainer_state["pool"]["epoch"] >= 4}


def retention(run_dir: Path) -> dict:
    checkpoint = latest_intact_checkpoint(run_dir)
    if checkpoint is None:
        raise SystemExit(f"{run_dir}: no intact checkpoint")
    state = read_trainer_json(checkpoint)
    config = load_config(base=state["config"])
    run = build_run(config, log=lambda _: None)  # the questions, the model and the grader; nothing is written
    try:
        trainer = run.trainer
        trainer.load_state_dict(load_checkpoint(checkpoint, trainer.model, read_state))
        trainer.source.push(trainer.learner.weights_version)
        questions = [q for qid, q in trainer.experience.question_pool.questions.items()
                     if qid in trainer.experience.ever_correct]
        accuracy = evaluate_accuracy(trainer.engine, trainer.tokenizer, questions, trainer.scorer.reward_funcs,
                                     SamplingSettings.from_config(config.rollout, temperature=1.0), SAMPLES, SEED,
                                     config.reward.success_threshold, trainer.prompt_ids)
    finally:
        run.close()
    still = sum(p > 0 for p in accuracy.per_question)
    return {"run": str(run_dir), "checkpoint": checkpoint.name, "ever_solved": len(questions),
            "training_questions": len(trainer.experience.question_pool.questions), "still_solved": still,
            "retention": still / len(questions), "avg@4_on_ever_solved": accuracy.mean,
            **criteria(run_dir, state, len(trainer.experience.question_pool.questions), config.rollout.num_generations)}


if __name__ == "__main__":
    for directory in sys.argv[1:]:
        print(json.dumps(retention(Path(directory))), flush=True)

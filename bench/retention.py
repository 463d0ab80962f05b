"""Round three's retention re-test (docs/results.md, registration): of the training questions a run ever solved
(a correct rollout of the policy's own at some step: the checkpoint's `solved`), the share that the final
checkpoint still solves, i.e. with at least one correct completion in 4 samples at T = 1.0. The same
sampling seed and grader for every run, so arms are compared alike. One JSON line per run directory; the run
directories are only read.

    .venv-vllm/bin/python bench/retention.py runs/round-three/*/seed-*   # -> bench/results/retention.jsonl
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from exgrpo.config import load_config  # noqa: E402
from exgrpo.evaluation.heldout import evaluate_accuracy  # noqa: E402
from exgrpo.rollout import SamplingSettings  # noqa: E402
from exgrpo.runtime.checkpoint import latest_intact_checkpoint, load_checkpoint, read_trainer_json  # noqa: E402
from exgrpo.training.run import build_run  # noqa: E402

SAMPLES, SEED = 4, 20261202


def retention(run_dir: Path) -> dict:
    checkpoint = latest_intact_checkpoint(run_dir)
    if checkpoint is None:
        raise SystemExit(f"{run_dir}: no intact checkpoint")
    config = load_config(base=read_trainer_json(checkpoint)["config"])
    run = build_run(config, log=lambda _: None)  # the questions, the model and the grader; nothing is written
    try:
        trainer = run.trainer
        state = load_checkpoint(checkpoint, trainer.model)
        trainer.load_state_dict(state)
        trainer.engine.sync_weights(trainer.update.weights_version)
        questions = [q for q in trainer.pool.questions.values() if q.id in trainer.solved]
        accuracy = evaluate_accuracy(trainer.engine, trainer.tokenizer, questions, trainer.scorer.reward_funcs,
                                     SamplingSettings.from_config(config.rollout, temperature=1.0), SAMPLES, SEED,
                                     config.reward.success_threshold, trainer.prompt_ids)
    finally:
        run.close()
    still = sum(p > 0 for p in accuracy.per_question)
    return {"run": str(run_dir), "checkpoint": checkpoint.name, "ever_solved": len(questions),
            "training_questions": len(trainer.pool.questions), "still_solved": still,
            "retention": still / len(questions), "avg@4_on_ever_solved": accuracy.mean}


if __name__ == "__main__":
    for directory in sys.argv[1:]:
        print(json.dumps(retention(Path(directory))), flush=True)

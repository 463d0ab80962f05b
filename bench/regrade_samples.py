"""Re-grade a study's logged samples with this commit's training reward, to see what a change of the reward changes:
every completion in <output_dir>/<arm>/seed-<s>/samples.jsonl is graded again against its gold answer and its
question (the question's last user message, suffix included; the reward's question-aware rules read its
arithmetic), and every sample whose reward would change is printed with its text. A sample cut at
rollout.max_completion_length scores reward.min_value under `reward.truncated=fail`; samples logged without the
`truncated` field (before samples.jsonl recorded it) are graded as if complete, so a change from 0 there may be a
cut completion (its "truncated" prints as null).

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python bench/regrade_samples.py experiments/round-five-fifth-pilot.yaml

Run it from the tree that holds the study's runs (a study's worktree) with `PYTHONPATH` pointing at the reward to
test. Prints one line per run: samples, changed, then the changed samples.
"""

import json
import sys

from exgrpo.rewards.graders import grade_math
from exgrpo.rewards.scorer import truncated_score
from exgrpo.runtime.tracking import read_metrics
from exgrpo.studies.report import question_texts
from exgrpo.studies.study import load_study


def regrade(study_file: str) -> None:
    study = load_study(study_file)
    runs = [(study.config(arm, int(run.name.removeprefix("seed-"))), run) for arm in study.arms
            for run in sorted((study.output_dir / arm.name).glob("seed-*")) if (run / "samples.jsonl").exists()]
    questions = question_texts([config.data for config, _ in runs])
    for config, run in runs:
        samples = read_metrics(run / "samples.jsonl")
        cut_score = truncated_score(config.reward)
        changed = []
        for s in samples:
            reward = grade_math(s["completion"], s["answer"], question=questions[s["question_id"]])
            if s.get("truncated") and cut_score is not None:
                reward = cut_score
            if reward != s["reward"]:
                changed.append({"step": s["step"], "question_id": s["question_id"], "answer": s["answer"],
                                "logged": s["reward"], "now": reward, "truncated": s.get("truncated"),
                                "completion": s["completion"]})
        print(f"{run}: {len(samples)} samples, {len(changed)} changed")
        for c in changed:
            print("   ", json.dumps(c, ensure_ascii=False))


if __name__ == "__main__":
    for path in sys.argv[1:]:
        regrade(path)

"""Round four's pilot criteria (docs/results.md, issue #37), read from a study's run directories.

For each run: held-out accuracy at step 0 (the study's shared initial evaluation) and at every logged evaluation,
criteria 1-3 (learning >= 10 points, no collapse > 5 points below the best, entropy at step 20 >= 0.3 nats),
the delayed-start rule's input (largest batch Pass@1 in steps 1-15), criterion 5 (the first three pilots: the
buffer's share at k = 2..6 at steps 20, 30 and 40; the fourth: at least 3 questions there at 12 or more of steps
25-40), the share of completions cut at the cap, and the last 50 logged samples, written for reading by hand
(criterion 6) to <run>/last_50_samples.txt. Criterion 4 holds by construction (40 steps of 6 fresh questions draw
fewer than the training pool holds, and the pool draws an epoch without repeats).

    .venv/bin/python bench/pilot_criteria.py experiments/round-four-fourth-pilot.yaml exgrpo grpo
"""

import json
import sys
from pathlib import Path

from exgrpo.runtime.tracking import read_metrics
from exgrpo.studies.study import load_study

K = 8
MEDIUM = range(2, K - 1)  # k = 2..6
REPLAY_SLOTS = 3  # experiential questions per step: 6 questions x experience.ratio 0.5


def buckets(row: dict) -> dict[int, float]:
    return {int(key.rsplit("_", 1)[1]): v for key, v in row.items() if key.startswith("experience/bucket_")}


def medium_questions(row: dict) -> float:
    return sum(v for k, v in buckets(row).items() if k in MEDIUM)


def medium_share(row: dict) -> float | None:
    total = sum(buckets(row).values())
    return medium_questions(row) / total if total else None


def criteria(run: Path, initial: float) -> dict:
    log = read_metrics(run / "metrics.jsonl")
    by_step = {}
    for row in log:
        by_step.setdefault(row["step"], {}).update(row)
    evals = {0: initial} | {s: r["eval/accuracy"] for s, r in sorted(by_step.items()) if "eval/accuracy" in r}
    last = max(evals)
    entropy_20 = by_step[20]["entropy"]
    shares = {s: medium_share(by_step[s]) for s in (20, 30, 40) if s in by_step}
    return {
        "run": str(run), "evals": {s: round(100 * a, 1) for s, a in evals.items()},
        "1_learning": evals[last] - evals[0] >= 0.10,
        "2_no_collapse": evals[last] >= max(evals.values()) - 0.05,
        "entropy_20": round(entropy_20, 2), "3_entropy": entropy_20 >= 0.3,
        "max_solved_1_15": max(by_step[s]["batch/pass_at_1"] for s in range(1, 16)),
        "buffer_questions": {s: by_step[s].get("experience/questions") for s in shares},
        "medium_share": {s: None if v is None else round(v, 2) for s, v in shares.items()},
        "5_medium": bool(shares) and all(v is not None and v >= 0.40 for v in shares.values()),
        # the fourth pilot's criterion 5: at 12 or more of steps 25-40 the medium buckets can fill every replay slot
        "medium_questions_25_40": [medium_questions(by_step[s]) for s in range(25, 41) if s in by_step],
        "5_replay_slots": sum(medium_questions(by_step[s]) >= REPLAY_SLOTS for s in range(25, 41) if s in by_step)
        >= 12,
        "clipped_ratio_mean": round(sum(r["completions/clipped_ratio"] for r in by_step.values()) / len(by_step), 3),
    }


def write_samples(run: Path, n: int = 50) -> Path:
    out = run / f"last_{n}_samples.txt"
    out.write_text("".join(f"--- step {s['step']} {s['question_id']} gold={s['answer']} reward={s['reward']} "
                           f"replayed={s['replayed']}\n{s['completion']}\n"
                           for s in read_metrics(run / "samples.jsonl")[-n:]))
    return out


def main(study_path: str, arms: list[str]) -> None:
    study = load_study(study_path)
    for name in arms:
        arm = study.arm(name)
        for seed in arm.seeds:
            run = study.run_dir(arm, seed)
            initial = json.loads(study.initial_eval_path(study.config(arm, seed)).read_text())["accuracy"]
            print(json.dumps(criteria(run, initial) | {"samples": str(write_samples(run))}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

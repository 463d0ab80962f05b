"""Round five's pilot criteria (docs/results.md, "Round five: the weak-model pilot"), read from a study's run
directories: held-out accuracy at step 0 and at every evaluation, criterion 2 (mean of the evaluations from step 40
at least 5 points above step 0), 3 (the last step's evaluation no more than 5 points below the run's best), 4 (token
entropy of the step-30 rollouts >= 0.3 nats), 5 (ExGRPO replays in at least half of steps 11 to the last: 25 of
11-60) and 6 (at most 50% of the last step's completions cut at the cap). The last step is the study's
train.steps. Criterion 1 is read by hand: every logged sample is written to <run>/samples_to_read.txt with its
reward and the final number it states.

    .venv/bin/python bench/weak_pilot_criteria.py experiments/round-five-pilot.yaml exgrpo grpo
"""

import json
import re
import sys
from pathlib import Path

from exgrpo.runtime.tracking import read_metrics
from exgrpo.studies.study import load_study


def criteria(metrics: list[dict], start: float, last: int, replaying: bool) -> dict:
    evals = {0: start, **{m["step"]: m["eval/accuracy"] for m in metrics if "eval/accuracy" in m}}
    by_step = {m["step"]: m for m in metrics}
    late = [v for step, v in evals.items() if step >= 40]
    out = {"evaluations": {s: round(100 * v, 1) for s, v in sorted(evals.items())},
           "2: late mean - step 0 (points, >= 5 in some run)": round(100 * (sum(late) / len(late) - start), 1)
           if late else None,
           f"3: step {last} - best (points, >= -5)": round(100 * (evals[last] - max(evals.values())), 1)
           if last in evals else None,
           "4: entropy at step 30 (>= 0.3)": round(by_step[30]["entropy"], 3) if 30 in by_step else None,
           f"6: cut at step {last} (<= 0.5)": round(by_step[last]["completions/clipped_ratio"], 3)
           if last in by_step else None}
    if replaying:
        steps = [s for s in range(11, last + 1) if by_step.get(s, {}).get("experience/replayed", 0) >= 1]
        out[f"5: steps 11-{last} that replayed (>= {(last - 10 + 1) // 2})"] = len(steps)
    return out


def write_samples(run: Path) -> int:
    """Every logged sample, for reading by hand (criterion 1): reward, gold answer, the last number stated."""
    samples = read_metrics(run / "samples.jsonl")
    lines = []
    for s in samples:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", s["completion"])
        lines.append(f"--- step {s['step']} {s['question_id']} gold {s['answer']} reward {s['reward']} "
                     f"replayed {s['replayed']} last number {numbers[-1] if numbers else None}\n{s['completion']}\n")
    (run / "samples_to_read.txt").write_text("\n".join(lines))
    return len(samples)


def main(study_file: str, *arms: str) -> None:
    study = load_study(study_file)
    initial = next((study.output_dir / "initial").glob("*.json"))
    start = json.loads(initial.read_text())["accuracy"]
    for arm in arms:
        for run in sorted((study.output_dir / arm).glob("seed-*")):
            last = study.config(study.arm(arm), 1).train.steps
            result = criteria(read_metrics(run / "metrics.jsonl"), start, last, replaying=arm != study.baseline)
            print(f"{arm} {run.name}: {json.dumps(result)}; {write_samples(run)} samples in "
                  f"{run / 'samples_to_read.txt'}")


if __name__ == "__main__":
    main(*sys.argv[1:])

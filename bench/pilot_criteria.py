"""A pilot's registered criteria (its study file's `registered.criteria`, `exgrpo.studies.criteria`), read from
its run directories: for each run, the held-out accuracy at step 0 (the study's shared initial evaluation) and at
every evaluation, then each criterion's value and whether it is met. Criteria read by hand (the grading of what was
paid) get every logged sample written to <run>/samples_to_read.txt, with its reward and the last number it states.

    .venv/bin/python bench/pilot_criteria.py experiments/round-five-seventh-pilot.yaml exgrpo grpo
"""

import json
import re
import sys
from pathlib import Path

from exgrpo.rewards.arithmetic import SIGNED_NUMBER
from exgrpo.studies.criteria import PilotRun
from exgrpo.studies.study import RunResult, load_study, read_run


def pilot_run(result: RunResult, baseline: str) -> PilotRun:
    by_step: dict[int, dict] = {}
    for row in result.history:
        by_step.setdefault(row["step"], {}).update(row)
    config = result.config
    return PilotRun(by_step, result.initial["accuracy"], config.train.steps, config.rollout.num_generations,
                    int(config.train.prompts_per_step * config.experience.ratio), result.arm.name != baseline)


def write_samples(run_dir: Path, samples: list[dict]) -> Path:
    """Every logged sample, for reading by hand: reward, gold answer, the last number stated."""
    lines = []
    for s in samples:
        numbers = re.findall(SIGNED_NUMBER, s["completion"])
        lines.append(f"--- step {s['step']} {s['question_id']} gold {s['answer']} reward {s['reward']} "
                     f"replayed {s['replayed']} last number {numbers[-1] if numbers else None}\n{s['completion']}\n")
    out = run_dir / "samples_to_read.txt"
    out.write_text("\n".join(lines))
    return out


def _shown(value) -> object:
    return round(value, 3) if isinstance(value, float) else value


def main(study_file: str, *arms: str) -> None:
    study = load_study(study_file)
    if not study.registered.criteria:
        sys.exit(f"{study_file}: no registered.criteria to read")
    for name in arms or [a.name for a in study.arms]:
        arm = study.arm(name)
        for seed in arm.seeds:
            logged = read_run(study, arm, seed, study.config(arm, seed))
            run = pilot_run(logged, study.baseline)
            result = {"evaluations": {s: round(100 * a, 1) for s, a in run.evaluations.items()}}
            for criterion in study.registered.criteria:
                value, met = criterion.read(run)
                result[criterion.name] = _shown(value) if met is None else [_shown(value), "met" if met else "FAILED"]
            samples = write_samples(study.run_dir(arm, seed), logged.samples)
            print(f"{name} seed {seed}: {json.dumps(result)}; samples in {samples}")


if __name__ == "__main__":
    main(*sys.argv[1:])

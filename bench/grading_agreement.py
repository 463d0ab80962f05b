"""Agreement of exgrpo's graders with the grading corpus's labels, per class (docs/evaluation.md, issue #35).

The corpus (tests/rewards/grading_corpus.json) labels each case with the released evaluation pipeline's label and
the training reward we want. This grades every case with `exgrpo eval`'s grader (a think prompt, as the paper's
backbone) and with `MathReward` (the question as prompt), through the public API, so it runs on any checkout:

    PYTHONPATH=src .venv/bin/python bench/grading_agreement.py                  # this checkout
    git worktree add /tmp/before 769e266                                         # the graders before #35
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/grading_agreement.py

With --released PATH (ExGRPO's eval_scripts/oat_math_grader.py, not shipped here), the released labels are first
computed again by running that file, and cases whose stored label differs are listed. With --released and
--golds DIR (the benchmark parquet files), every distinct ID gold is also boxed in 8 forms (as written, with a
trailing period, in \\text{}, as x = ..., without spaces, with \\dfrac, in \\left( \\right), another gold) and
graded by both; the cases where they differ are listed.
"""

import argparse
import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

from exgrpo.evaluation import EvalProtocol, grader_for, grading_text
from exgrpo.rewards import MathReward, grade_math_boxed

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "grading_corpus.json"
THINK_PROMPT = "<|im_start|>assistant\n<think>\n"


def released_label(grader_module, completion: str, gold: str) -> float:
    """generate_vllm.py's label: "<think>\\n" prepended, the text after the first "</think>" (all without one),
    then boxed_reward_fn(..., fast=False)."""
    parts = ("<think>\n" + completion).split("</think>")
    text = parts[1] if len(parts) > 1 else parts[0]
    return grader_module.boxed_reward_fn(text, gold, fast=False)[1]


def gold_forms(data: Path) -> list[tuple[str, str]]:
    """(completion, gold) for each distinct ID benchmark gold in 8 boxed forms, the last another gold (seeded)."""
    from exgrpo.evaluation.benchmarks import load_benchmarks, resolve_benchmarks

    golds = sorted({q.answer for d in load_benchmarks(resolve_benchmarks("id"), data) for q in d.questions})
    rng, cases = random.Random(1), []
    for gold in golds:
        core, other = gold.strip().strip("$"), rng.choice(golds)
        for form in (core, core + ".", "\\text{" + core + "}", "x = " + core, core.replace(" ", ""),
                     core.replace("\\frac", "\\dfrac"), "\\left(" + core + "\\right)", other):
            cases.append(("\\boxed{" + form + "}", gold))
    return list(dict.fromkeys(cases))


def load_released(path: Path):
    spec = importlib.util.spec_from_file_location("released_oat_grader", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--released", type=Path, help="ExGRPO's eval_scripts/oat_math_grader.py, to relabel with")
    parser.add_argument("--golds", type=Path, metavar="DIR", help="with --released: every ID gold in 8 forms too")
    args = parser.parse_args()
    if args.golds and not args.released:
        parser.error("--golds needs --released")
    groups = json.loads(CORPUS.read_text())["groups"]
    if args.released:
        released = load_released(args.released)
        changed = [(g["gold"], c["completion"]) for g in groups for c in g["cases"]
                   if released_label(released, c["completion"], g["gold"]) != c["released"]]
        print(json.dumps({"released_labels_changed": changed}))
    if args.golds:
        cases = gold_forms(args.golds)
        differ = [(c, g) for c, g in cases if released.boxed_reward_fn(c, g, fast=False)[1] != grade_math_boxed(c, g)]
        print(json.dumps({"gold_forms": len(cases), "released_and_exgrpo_differ": differ}))
    protocol, reward = EvalProtocol(), MathReward()
    grade = grader_for("math", protocol)
    total, evaluation, training = Counter(), Counter(), Counter()
    for g in groups:
        cases = g["cases"]
        rewards = reward(prompts=[g["question"]] * len(cases), completions=[c["completion"] for c in cases],
                         completion_ids=None, answer=[g["gold"]] * len(cases))
        for c, r in zip(cases, rewards):
            total[c["class"]] += 1
            evaluation[c["class"]] += grade(grading_text(THINK_PROMPT, c["completion"], protocol), g["gold"]) == \
                c["released"]
            training[c["class"]] += r == c["training"]
    for name in total:
        print(json.dumps({"class": name, "cases": total[name], "eval_agrees_with_released": evaluation[name],
                          "training_reward_as_wanted": training[name]}))


if __name__ == "__main__":
    main()

"""The grading corpus (grading_corpus.json, its "about" says how it was made and labelled): `exgrpo eval`'s grader
must give every case the released evaluation pipeline's label, and the training reward the label we want.

Per class (cases): equivalent 399 (benchmark golds in other surface forms, and the forms of numeric golds the
restatement rule of ebe365f refused), wrong 172, placement 28 (a box inside the reasoning, several boxes),
restatement 54 (the question's arithmetic copied). docs/evaluation.md gives the agreement table, before and after
issue #35. Run with -s to print it.
"""

import json
from collections import Counter
from pathlib import Path

from exgrpo.evaluation import EvalProtocol, grader_for, grading_text
from exgrpo.rewards import MathReward

CORPUS = json.loads(Path(__file__).with_name("grading_corpus.json").read_text())["groups"]
THINK_PROMPT = "<|im_start|>assistant\n<think>\n"  # the paper's backbone: its prompts end with "<think>\n"
CLASSES = {"equivalent": 399, "wrong": 172, "placement": 28, "restatement": 54}


def _agreement(grades: list[tuple[str, float, float]]) -> tuple[dict[str, str], list]:
    """Per class "agreeing/total" of (class, label, grade) triples, and the disagreeing triples' indices."""
    total, agree = Counter(c for c, _, _ in grades), Counter(c for c, label, g in grades if label == g)
    return {c: f"{agree[c]}/{total[c]}" for c in total}, [i for i, (_, label, g) in enumerate(grades) if label != g]


def test_the_corpus_holds_the_documented_classes():
    counts = Counter(case["class"] for group in CORPUS for case in group["cases"])
    assert counts == CLASSES
    assert all(case["released"] in (0.0, 1.0) and case["training"] in (0.0, 1.0)
               for group in CORPUS for case in group["cases"])


def test_eval_grader_agrees_with_the_released_pipeline_on_every_case():
    protocol = EvalProtocol()  # the defaults of `exgrpo eval`
    grade = grader_for("math", protocol)
    cases = [(group["gold"], case) for group in CORPUS for case in group["cases"]]
    grades = [(case["class"], case["released"], grade(grading_text(THINK_PROMPT, case["completion"], protocol), gold))
              for gold, case in cases]
    table, disagreeing = _agreement(grades)
    print("\nexgrpo eval's grader vs the released pipeline:", table)
    assert [cases[i][1]["form"] + ": " + cases[i][1]["completion"] for i in disagreeing] == []


def test_training_reward_gives_the_wanted_label_on_every_case():
    reward = MathReward()  # no think gate, as configs/demo.yaml
    grades = []
    for group in CORPUS:
        cases = group["cases"]
        scores = reward(prompts=[group["question"]] * len(cases), completions=[c["completion"] for c in cases],
                        completion_ids=None, answer=[group["gold"]] * len(cases))
        grades += [(c["class"], c["training"], s) for c, s in zip(cases, scores)]
    table, disagreeing = _agreement(grades)
    print("\nthe training reward vs the wanted labels:", table)
    assert [grades[i] for i in disagreeing] == []

"""Does GRPO learn to restate the question instead of answering it? (found 2026-12-02, docs/results.md)

math-verify evaluates an arithmetic expression it finds in a completion, so under a grader that accepts one,
"To calculate 752 * -611 + 290 ..." scores as the answer -459182. This trains GRPO on a pilot setting
(bench/pilot.py's CANDIDATES) for STEPS steps and, before and after, samples each held-out question once (T = 1)
and counts the completions that restate the question's expression, the ones graded correct by the training
reward (`grade_math` given the prompt; before #35, `grade_math` refused restatements without it), and both. One
JSON line per measurement. Run it against the grader of any commit by putting that commit's src first:

    git worktree add /tmp/before ebe365f~1                     # the grader before the fix
    PYTHONPATH=/tmp/before/src .venv-vllm/bin/python bench/copying.py terms_2-4_3digit 20
    .venv-vllm/bin/python bench/copying.py terms_2-4_3digit 20    # this checkout's grader
"""

import inspect
import json
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import exgrpo  # noqa: E402
from exgrpo.rewards.graders import grade_math  # noqa: E402
from exgrpo.rollout import SamplingSettings  # noqa: E402
from exgrpo.training.launch import build_run  # noqa: E402
from pilot import grpo_config  # noqa: E402


# grade_math takes the question since #35 (its restatement rule needs it); a checkout from before does not.
_TAKES_QUESTION = "question" in inspect.signature(grade_math).parameters


def _graded(text: str, gold: str, prompt: str) -> float:
    return grade_math(text, gold, question=prompt) if _TAKES_QUESTION else grade_math(text, gold)


def _bare(text: str) -> str:
    return re.sub(r"[\s()]", "", text)


def measure(trainer, when: str) -> dict:
    questions = trainer.eval_dataset
    out = trainer.engine.generate([trainer.prompt_ids(q) for q in questions], SamplingSettings(24, temperature=1.0),
                                  list(range(len(questions))))
    texts = [trainer.tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]
    # "Calculate <expression>. Answer with ..." -> <expression>
    expressions = [q.messages[0]["content"].removeprefix("Calculate ").split(". ")[0] for q in questions]
    copied = [_bare(e) in _bare(t) for e, t in zip(expressions, texts)]
    prompts = [trainer.tokenizer.decode(trainer.prompt_ids(q)) for q in questions]  # what MathReward reads
    correct = [_graded(t, q.answer, p) for t, q, p in zip(texts, questions, prompts)]
    n = len(questions)
    return {"grader": str(exgrpo.__file__), "at": when, "copied_share": sum(copied) / n,
            "graded_correct": sum(correct) / n, "correct_and_copied": sum(c and g for c, g in zip(copied, correct)) / n,
            "examples": [[q.messages[0]["content"][:60], t] for q, t in list(zip(questions, texts))[:6]]}


def main(name: str, steps: int) -> None:
    run = build_run(grpo_config(name, steps, f"/tmp/copying/{name}", eval_every=0), log=lambda _: None)
    print(json.dumps({"setting": name, **measure(run.trainer, "step 0")}), flush=True)
    run.trainer.train()
    print(json.dumps({"setting": name, **measure(run.trainer, f"step {steps}")}), flush=True)
    run.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

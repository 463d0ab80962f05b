"""Held-out accuracy: sample each question several times and grade, through the rollout engine and the rewards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from exgrpo.data import Question, render_prompt
from exgrpo.rewards import combine_rewards
from exgrpo.rollout import RolloutEngine, SamplingSettings


@dataclass
class Accuracy:
    mean: float  # mean correctness over all samples (avg@k)
    stderr: float  # standard error over questions (samples of one question are not independent)
    num_questions: int
    samples_per_question: int
    per_question: list[float]

    def __str__(self) -> str:
        return f"{100 * self.mean:.1f}% ± {100 * self.stderr:.1f} (n={self.num_questions}×{self.samples_per_question})"


def evaluate_accuracy(engine: RolloutEngine, tokenizer, questions: Sequence[Question], reward_funcs: Sequence[Callable],
                      sampling: SamplingSettings, samples: int, seed: int, success_threshold: float = 1.0,
                      render: Callable[[Question], str] | None = None) -> Accuracy:
    """avg@samples with its standard error over questions."""
    if not questions:
        raise ValueError("no held-out questions to evaluate")
    render = render or (lambda q: render_prompt(tokenizer, q.messages))
    prompt_ids = [tokenizer(render(q), add_special_tokens=False)["input_ids"] for q in questions]
    requests = [i for i in range(len(questions)) for _ in range(samples)]
    out = engine.generate([prompt_ids[i] for i in requests], sampling, seed)
    completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]
    keys = sorted({k for q in questions for k in q.columns} - {"answer"})
    columns = {"answer": [questions[i].answer for i in requests],
               **{k: [questions[i].columns.get(k) for i in requests] for k in keys}}
    prompts = [tokenizer.decode(prompt_ids[i]) for i in requests]
    total, _ = combine_rewards(reward_funcs, [1.0] * len(reward_funcs), prompts, completions, out.completion_ids, columns)
    correct = (total >= success_threshold).reshape(len(questions), samples).astype(float)
    per_question = correct.mean(axis=1)
    n = len(questions)
    stderr = float(per_question.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return Accuracy(float(per_question.mean()), stderr, n, samples, per_question.tolist())

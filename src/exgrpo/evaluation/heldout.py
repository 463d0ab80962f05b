"""Held-out accuracy during training and in the demo: avg@k graded by the training reward functions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from exgrpo.data import PromptEncoder, Question
from exgrpo.evaluation.sampling import sample_completions
from exgrpo.rewards import score_completions
from exgrpo.rollout import RolloutEngine, SamplingSettings


@dataclass
class Accuracy:
    mean: float  # mean correctness over all samples (avg@k)
    stderr: float  # standard error over questions (samples of one question are not independent)
    num_questions: int
    samples_per_question: int
    per_question: list[float]
    samples: list[dict] = field(default_factory=list)  # a few graded completions (`graded_samples`)

    def __str__(self) -> str:
        return f"{100 * self.mean:.1f}% ± {100 * self.stderr:.1f} (n={self.num_questions}×{self.samples_per_question})"


def evaluate_accuracy(engine: RolloutEngine, tokenizer, questions: Sequence[Question], reward_funcs: Sequence[Callable],
                      sampling: SamplingSettings, samples: int, seed: int, success_threshold: float = 1.0,
                      prompt_ids_of: Callable[[Question], list[int]] | None = None,
                      truncated_reward: float | None = None) -> Accuracy:
    """avg@samples, graded by the reward functions (weights 1), with its standard error over questions.

    `prompt_ids_of` renders a question's prompt (default: its chat template, as `exgrpo.data.PromptEncoder`); a
    truncated completion scores `truncated_reward` when given, as in training (reward.truncated fail).
    """
    if not questions:
        raise ValueError("no held-out questions to evaluate")
    encode = prompt_ids_of or PromptEncoder(tokenizer)
    prompt_ids = [encode(q) for q in questions]
    (out,) = sample_completions(engine, prompt_ids, samples, sampling, seed)
    rows = [questions[i] for i, _ in out.requests]
    completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]
    prompts = [tokenizer.decode(prompt_ids[i]) for i, _ in out.requests]
    total, _ = score_completions(reward_funcs, [1.0] * len(reward_funcs), prompts, completions, out.completion_ids,
                                 rows, out.truncated, truncated_reward)
    correct = (total >= success_threshold).reshape(len(questions), samples).astype(float)
    per_question = correct.mean(axis=1)
    n = len(questions)
    stderr = float(per_question.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    logged = graded_samples(rows, completions, total, out.truncated, first_of=samples)
    return Accuracy(float(per_question.mean()), stderr, n, samples, per_question.tolist(), logged)


def graded_samples(rows: Sequence[Question], completions: list[str], total, truncated: Sequence[bool], first_of: int,
                   limit: int = 4) -> list[dict]:
    """The first sample of each of the first `limit` questions (`first_of` samples per question, in order) with its
    grade (total reward) and whether it was cut at the length cap: what an evaluation logs for reading by hand."""
    return [{"question_id": rows[i].id, "answer": rows[i].answer, "completion": completions[i],
             "reward": float(total[i]), "truncated": bool(truncated[i])}
            for i in range(0, min(len(rows), limit * first_of), first_of)]

"""Replicated rows and the held-out split: all rows of one prompt move together, so no prompt is on both sides."""

from __future__ import annotations

import random
from typing import Sequence

from exgrpo.data.questions import Question


def _groups(questions: Sequence[Question], by_prompt: bool = False) -> dict[tuple, list[int]]:
    """Row indices per content key (messages and answer), or per prompt (messages) with `by_prompt`."""
    groups: dict[tuple, list[int]] = {}
    for i, q in enumerate(questions):
        groups.setdefault(q.text_key[0] if by_prompt else q.text_key, []).append(i)
    return groups  # insertion order = first appearance, so results are deterministic


def conflicting_answers(questions: Sequence[Question]) -> list[list[Question]]:
    """The rows of each prompt that appears with more than one answer (one list per such prompt)."""
    return [[questions[i] for i in rows] for rows in _groups(questions, by_prompt=True).values()
            if len({questions[i].answer for i in rows}) > 1]


def distinct_prompts(questions: Sequence[Question]) -> int:
    """How many distinct prompts (messages) the questions hold: the units the held-out split moves."""
    return len(_groups(questions, by_prompt=True))


def collapse_replicas(questions: Sequence[Question]) -> list[tuple[Question, int]]:
    """Group rows with identical (messages, answer): (first row, number of copies), in first-appearance order."""
    return [(questions[idx[0]], len(idx)) for idx in _groups(questions).values()]


def split_holdout(questions: Sequence[Question], n_holdout: int, seed: int) -> tuple[list, list]:
    """Split into (train, holdout) with `n_holdout` distinct prompts held out, chosen at random with `seed`.

    All rows of a prompt move together (replicas, and rows that give the prompt another answer), so no prompt is on
    both sides. Both lists keep input order.
    """
    groups = list(_groups(questions, by_prompt=True).values())
    if not 0 <= n_holdout <= len(groups):
        raise ValueError(f"n_holdout must be in [0, {len(groups)}] (distinct prompts), got {n_holdout}")
    held = {i for g in random.Random(seed).sample(groups, n_holdout) for i in g}
    train = [q for i, q in enumerate(questions) if i not in held]
    holdout = [q for i, q in enumerate(questions) if i in held]
    return train, holdout

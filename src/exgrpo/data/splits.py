"""Replicated rows and the held-out split: whole replica groups move together, so no content is on both sides."""

from __future__ import annotations

import random
from typing import Sequence

from exgrpo.data.questions import Question


def _groups(questions: Sequence[Question]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, q in enumerate(questions):
        groups.setdefault(q.text_key, []).append(i)
    return groups  # insertion order = first appearance, so results are deterministic


def collapse_replicas(questions: Sequence[Question]) -> list[tuple[Question, int]]:
    """Group rows with identical (messages, answer): (first row, number of copies), in first-appearance order."""
    return [(questions[idx[0]], len(idx)) for idx in _groups(questions).values()]


def split_holdout(questions: Sequence[Question], n_holdout: int, seed: int) -> tuple[list, list]:
    """Split into (train, holdout) with `n_holdout` distinct questions held out, chosen at random with `seed`.

    Whole replica groups move together, so no question content is on both sides. Both lists keep input order.
    """
    groups = list(_groups(questions).values())
    if not 0 <= n_holdout <= len(groups):
        raise ValueError(f"n_holdout must be in [0, {len(groups)}] (distinct questions), got {n_holdout}")
    held = {i for g in random.Random(seed).sample(groups, n_holdout) for i in g}
    train = [q for i, q in enumerate(questions) if i not in held]
    holdout = [q for i, q in enumerate(questions) if i in held]
    return train, holdout

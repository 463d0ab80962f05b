"""Which stored trajectory each experiential question replays (spec §3): score every candidate under the current
policy, then pick by `selection_mode`. The scores come from a callable, so this module holds no model code."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np
import torch

from exgrpo.experience.selection import select_index
from exgrpo.records import Trajectory

Key = TypeVar("Key", bound=Hashable)


def select_replays(candidates: Sequence[tuple[Key, Sequence[Trajectory]]], metric: str, mode: str,
                   rng: np.random.Generator,
                   score: Callable[[list[tuple[Key, Trajectory]]], Sequence[float]]) -> list[Trajectory]:
    """One trajectory per (question, its stored trajectories) pair, in order.

    `score` maps the flat list of (question, candidate) pairs to one score each (e.g. the mean token entropy of
    the candidate under the current policy); it is not called for metric "random", which draws uniformly.
    """
    if metric == "random":
        return [cands[select_index(None, len(cands), "random", mode, rng)] for _, cands in candidates]
    scores = torch.tensor(list(score([(key, t) for key, cands in candidates for t in cands])))
    chosen, cursor = [], 0
    for _, cands in candidates:
        question_scores = scores[cursor : cursor + len(cands)]
        cursor += len(cands)
        chosen.append(cands[select_index(question_scores, len(cands), metric, mode, rng)])
    return chosen

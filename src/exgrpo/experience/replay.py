"""Which stored trajectory each experiential question replays (spec §3): score every candidate under the current
policy, then pick by the selection mode. The scores come from a callable, so this module holds no model code."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np
import torch

from exgrpo.records import Trajectory
from exgrpo.tensors import TrajectoryScore

Key = TypeVar("Key", bound=Hashable)


def select_replays(candidates: Sequence[tuple[Key, Sequence[Trajectory]]], metric: TrajectoryScore | None,
                   choose: Callable[[torch.Tensor], torch.Tensor], rng: np.random.Generator,
                   score: Callable[[list[tuple[Key, Trajectory]], TrajectoryScore], Sequence[float]]
                   ) -> list[Trajectory]:
    """One trajectory per (question, its stored trajectories) pair, in order: the one `choose` picks among the
    question's scores (`exgrpo.experience.selection`).

    `score` maps the flat list of (question, candidate) pairs and the `metric` to one score each (e.g. the mean
    token entropy of the candidate under the current policy); with no metric nothing is scored and the pick is
    uniform.
    """
    if metric is None:
        return [cands[int(rng.integers(len(cands)))] for _, cands in candidates]
    scores = torch.tensor(list(score([(key, t) for key, cands in candidates for t in cands], metric)))
    chosen, cursor = [], 0
    for _, cands in candidates:
        question_scores = scores[cursor : cursor + len(cands)]
        cursor += len(cands)
        chosen.append(cands[int(choose(question_scores))])
    return chosen

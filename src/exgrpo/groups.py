"""A step's GRPO groups: one question, its prompt and K members (fresh rollouts, or one replayed trajectory), and
the two things done to whole groups: grading them and packing them into tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from exgrpo.data import Question
from exgrpo.experience import Trajectory
from exgrpo.policy import PackedBatch, pack
from exgrpo.rewards import score_completions


@dataclass
class Member:
    completion_ids: list[int]
    truncated: bool = False  # stopped by max_completion_length
    replay: Trajectory | None = None  # set on the replayed member of an experiential group


@dataclass
class Group:
    question: Question
    prompt_ids: list[int]
    members: list[Member] = field(default_factory=list)


def form_groups(experiential: Sequence[tuple[Question, Trajectory]], fresh: Sequence[Question],
                prompt_ids: Callable[[Question], list[int]]) -> list[Group]:
    """Experiential groups first, each holding its replay as member 0, then the fresh groups (still empty)."""
    groups = [Group(q, prompt_ids(q), [Member(t.token_ids.tolist(), replay=t)]) for q, t in experiential]
    return groups + [Group(q, prompt_ids(q)) for q in fresh]


def pack_groups(groups: Sequence[Group], pad_id: int) -> PackedBatch:
    """Every member of every group, in order: row g*K + j is member j of group g."""
    return pack([(g.prompt_ids, m.completion_ids, None if m.replay is None else m.replay.logprobs)
                 for g in groups for m in g.members], pad_id)


@dataclass
class GroupRewards:
    total: np.ndarray  # (G, K) weighted sum of the reward functions
    per_function: dict[str, np.ndarray]  # name -> (G, K) rewards, NaN where a function returned None
    grading: dict[str, int] = field(default_factory=dict)  # timeouts, crashes, errors of the grading pool


def score_groups(groups: Sequence[Group], tokenizer, reward_funcs: Sequence[Callable],
                 reward_weights: Sequence[float]) -> GroupRewards:
    """Grade every member with the reward functions (TRL's signature; columns from the group's question)."""
    prompts, completions, completion_ids, questions = [], [], [], []
    for g in groups:
        prompt_text = tokenizer.decode(g.prompt_ids, skip_special_tokens=False)
        for m in g.members:
            prompts.append(prompt_text)
            completion_ids.append(m.completion_ids)
            completions.append(tokenizer.decode(m.completion_ids, skip_special_tokens=True))
            questions.append(g.question)
    total, per_function = score_completions(reward_funcs, reward_weights, prompts, completions, completion_ids,
                                            questions)
    shape = (len(groups), len(groups[0].members) if groups else 0)
    return GroupRewards(total.reshape(shape), {k: v.reshape(shape) for k, v in per_function.items()})

"""A step's GRPO groups: one question, its prompt and K members (fresh rollouts, or one replayed trajectory), and
the two things done to whole groups: grading them and packing them into tensors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.data import Question
from exgrpo.experience import Trajectory
from exgrpo.policy import PackedBatch, pack
from exgrpo.rewards import score_completions


@dataclass
class Member:
    completion_ids: list[int]
    truncated: bool = False  # stopped by max_completion_length
    replay: Trajectory | None = None  # set on the replayed member of an experiential group
    engine_logprobs: list[float] | None = None  # the engine's log-prob of each sampled token, if it reports them
    demonstration: bool = False  # an external reference solution from the data (guidance), not sampled

    @property
    def sampled(self) -> bool:
        """Rolled out by the policy in this step: neither a replay nor a demonstration."""
        return self.replay is None and not self.demonstration


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
    members = [m for g in groups for m in g.members]

    def recorded(m: Member) -> np.ndarray | None:  # a demonstration is off-policy with no behaviour log-probs
        if m.demonstration:
            return np.zeros(len(m.completion_ids), np.float32)
        return None if m.replay is None else m.replay.logprobs

    batch = pack([(g.prompt_ids, m.completion_ids, recorded(m)) for g in groups for m in g.members], pad_id)
    if any(m.demonstration for m in members):
        rows = torch.tensor([m.demonstration for m in members]).unsqueeze(-1)
        batch = replace(batch, demonstration_mask=batch.replay_mask & rows)
    if not any(m.engine_logprobs is not None for m in members):
        return batch
    engine = torch.zeros_like(batch.recorded_logp)
    has = torch.zeros_like(batch.replay_mask)
    for i, m in enumerate(members):
        if m.engine_logprobs is not None:
            engine[i, :len(m.engine_logprobs)] = torch.tensor(m.engine_logprobs)
            has[i, :len(m.engine_logprobs)] = True
    return replace(batch, engine_logp=engine, engine_mask=has)


@dataclass
class GroupRewards:
    total: np.ndarray  # (G, K) weighted sum of the reward functions
    per_function: dict[str, np.ndarray]  # name -> (G, K) rewards, NaN where a function returned None
    grading: dict[str, int] = field(default_factory=dict)  # timeouts, crashes, errors of the grading pool

    def take(self, index: Sequence[int]) -> "GroupRewards":
        """The rewards of groups `index` (in that order); grading counts stay with the step."""
        index = np.asarray(index, dtype=np.int64)
        return GroupRewards(self.total[index], {k: v[index] for k, v in self.per_function.items()}, self.grading)

    @staticmethod
    def concat(parts: Sequence["GroupRewards"]) -> "GroupRewards":
        """The rewards of several rounds' groups, one after the other; grading counts summed."""
        return GroupRewards(np.concatenate([p.total for p in parts]),
                            {k: np.concatenate([p.per_function[k] for p in parts]) for k in parts[0].per_function},
                            dict(sum((Counter(p.grading) for p in parts), Counter())))


def zero_variance(total: np.ndarray) -> np.ndarray:
    """(G,) True where all K rewards of a group are exactly equal: group-relative advantages are all 0.

    Exact equality on the reward values, so binary rewards test the success flags and continuous ones are let
    through whenever any member differs (OpenRLHF's filter tests the mean instead, #1270)."""
    return (total == total[:, :1]).all(axis=1)


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


@dataclass
class Generation:
    """What one step's generation produced and cost, over all its rounds (rollout.zero_variance)."""

    rounds: int = 0
    groups: int = 0  # groups rolled out, dropped ones included
    rollouts: int = 0  # fresh rollouts sampled (replayed members and demonstrations are not)
    zero_variance: int = 0  # groups whose K rewards were all equal
    retired: int = 0  # questions retired by any of the groups
    first_round_pass_at_1: float = 0.0  # the batch Pass@1 of the drawn batch: what the delayed start compares

    def record(self, groups: Sequence[Group], sampled: int, correct: np.ndarray, zero: np.ndarray,
               retired: int) -> None:
        if not self.rounds:
            self.first_round_pass_at_1 = float(correct.mean())
        self.rounds += 1
        self.groups += len(groups)
        self.rollouts += sampled
        self.zero_variance += int(zero.sum())
        self.retired += retired

    def metrics(self) -> dict[str, float]:
        informative = self.groups - self.zero_variance
        return {"generation/rounds": float(self.rounds), "generation/rollouts": float(self.rollouts),
                "generation/zero_variance_fraction": self.zero_variance / max(self.groups, 1),
                "generation/informative_groups": float(informative),
                "generation/rollouts_per_informative_group": self.rollouts / max(informative, 1)}

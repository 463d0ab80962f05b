"""The records that cross roles: a step's groups (one question, its prompt, K members), their rewards, a stored
trajectory, and the two phases of a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from exgrpo.data.questions import Question

WARMUP, MIXED = "warmup", "mixed"  # plain GRPO before the delayed start; experience replay after it


@dataclass
class Trajectory:
    """One stored trajectory: response token ids, their behaviour log-probs, the step it was collected at, the
    weights version (applied optimizer steps) those log-probs are of (the one that sampled it, in sync mode), and
    how often it was trained on as a replay before."""

    token_ids: np.ndarray  # (T,) int32
    logprobs: np.ndarray  # (T,) float32
    step: int
    version: int = -1  # -1: not recorded
    uses: int = 0


@dataclass
class Member:
    completion_ids: list[int]
    truncated: bool = False  # stopped by max_completion_length
    replay: Trajectory | None = None  # set on the replayed member of an experiential group
    engine_logp: list[float] | None = None  # the engine's log-prob of each sampled token, if it reports them
    demonstration: bool = False  # an external reference solution from the data (guidance), not sampled
    policy_version: int | None = None  # the weights version (applied optimizer steps) that sampled it

    @property
    def sampled(self) -> bool:
        """Rolled out by the policy in this step: neither a replay nor a demonstration."""
        return self.replay is None and not self.demonstration


@dataclass
class Group:
    question: Question
    prompt_ids: list[int]
    members: list[Member] = field(default_factory=list)


@dataclass
class GroupRewards:
    total: np.ndarray  # (G, K) weighted sum of the reward functions
    per_function: dict[str, np.ndarray]  # name -> (G, K) rewards, NaN where a function returned None
    grading: dict[str, int] = field(default_factory=dict)  # timeouts, crashes, errors of the grading pool
    failures: dict = field(default_factory=dict)  # grader label -> its raised items (`rewards.pool.Failures`)

    def take(self, index: Sequence[int]) -> "GroupRewards":
        """The rewards of groups `index` (in that order); grading counts stay with the step."""
        index = np.asarray(index, dtype=np.int64)
        return GroupRewards(self.total[index], {k: v[index] for k, v in self.per_function.items()}, self.grading,
                            self.failures)

    @staticmethod
    def concat(parts: Sequence["GroupRewards"]) -> "GroupRewards":
        """The rewards of several rounds' (or ranks') groups, one after the other, parts without groups skipped;
        grading counts summed over all parts, zeros kept (a count is logged whether or not it happened), failures
        merged per grader."""
        keys = dict.fromkeys(k for p in parts for k in p.grading)
        failures: dict = {}
        for p in parts:
            for label, f in p.failures.items():
                failures[label] = failures[label].merged(f) if label in failures else f
        graded = [p for p in parts if len(p.total)]
        return GroupRewards(np.concatenate([p.total for p in graded]),
                            {k: np.concatenate([p.per_function[k] for p in graded]) for k in graded[0].per_function},
                            {k: sum(p.grading.get(k, 0) for p in parts) for k in keys}, failures)


def own_members(groups: Sequence[Group]) -> np.ndarray:
    """(G, K) True for the policy's own members (rollouts and replays), False for demonstrations."""
    return np.array([[not m.demonstration for m in g.members] for g in groups], dtype=bool).reshape(len(groups), -1)


@dataclass
class PlannedStep:
    """A step's groups before their rollouts: experiential groups hold their replay as member 0, guided groups
    their demonstrations. `version`: the weights version (applied optimizer steps) the rollouts are sampled
    from; `rng`: the step's random stream, which refill rounds continue."""

    step: int
    phase: str
    groups: list[Group]
    version: int
    rng: np.random.Generator | None = None

    @property
    def question_ids(self) -> set[str]:
        return {g.question.id for g in self.groups}

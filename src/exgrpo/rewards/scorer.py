"""The group scorer: a step's groups graded by the reward functions (TRL's signature, columns from each group's
question), each rank grading its shard, every rank receiving all (G, K) rewards, checked by reward health."""

from __future__ import annotations

from typing import Callable, Sequence

from exgrpo.records import Group, GroupRewards
from exgrpo.rewards.functions import score_completions
from exgrpo.rewards.health import RewardHealth
from exgrpo.rewards.pool import GradingPool
from exgrpo.runtime.distributed import Distributed


def truncated_score(reward) -> float | None:
    """What a completion cut at rollout.max_completion_length scores under the `reward` config section:
    reward.min_value under `reward.truncated=fail`, None (its grade) under `grade`."""
    return reward.min_value if reward.truncated == "fail" else None


def score_groups(groups: Sequence[Group], tokenizer, reward_funcs: Sequence[Callable],
                 reward_weights: Sequence[float], truncated_reward: float | None = None) -> GroupRewards:
    """Grade every member of `groups` (one process, no health checks): (G, K) weighted totals and per function.
    A truncated member's total is `truncated_reward` when given (reward.truncated fail), its grades kept."""
    prompts, completions, completion_ids, questions, truncated = [], [], [], [], []
    for g in groups:
        prompt_text = tokenizer.decode(g.prompt_ids, skip_special_tokens=False)
        for m in g.members:
            prompts.append(prompt_text)
            completion_ids.append(m.completion_ids)
            completions.append(tokenizer.decode(m.completion_ids, skip_special_tokens=True))
            questions.append(g.question)
            truncated.append(m.truncated)
    total, per_function = score_completions(reward_funcs, reward_weights, prompts, completions, completion_ids,
                                            questions, truncated, truncated_reward)
    shape = (len(groups), len(groups[0].members) if groups else 0)
    return GroupRewards(total.reshape(shape), {k: v.reshape(shape) for k, v in per_function.items()})


class GroupScorer:
    """Owns the reward functions, their weights, the grading pool whose timeouts and crashes are counted, and the
    reward health that warns about (or stops on) unhealthy rewards. `truncated_reward`: what a truncated completion
    scores instead of its grade (None: its grade)."""

    def __init__(self, reward_funcs: Sequence[Callable], tokenizer, health: RewardHealth, *,
                 reward_weights: Sequence[float] | None = None, grading_pool: GradingPool | None = None,
                 distributed: Distributed = Distributed(), truncated_reward: float | None = None):
        self.reward_funcs = list(reward_funcs)
        if not self.reward_funcs:
            raise ValueError("at least one reward function is required")
        self.reward_weights = list(reward_weights) if reward_weights is not None else [1.0] * len(self.reward_funcs)
        self.tokenizer, self.health, self.grading_pool, self.dist = tokenizer, health, grading_pool, distributed
        self.truncated_reward = truncated_reward

    @classmethod
    def from_config(cls, reward_funcs: Sequence[Callable], tokenizer, reward, **kwargs) -> "GroupScorer":
        """With the `reward` config section's health checks and its handling of truncated completions."""
        return cls(reward_funcs, tokenizer, RewardHealth.from_config(reward),
                   truncated_reward=truncated_score(reward), **kwargs)

    def __call__(self, groups: list[Group], step: int) -> GroupRewards:
        """(G, K) rewards of `groups` at training step `step` (1-based, for health messages)."""
        start, end = self.dist.shard_bounds(len(groups))
        mine = score_groups(groups[start:end], self.tokenizer, self.reward_funcs, self.reward_weights,
                            self.truncated_reward)
        if self.grading_pool is not None:
            mine.grading, mine.failures = self.grading_pool.pop_stats(), self.grading_pool.pop_failures()
        rewards = GroupRewards.concat(self.dist.gather([mine]))  # a rank may have had no groups
        self.health.check(step, rewards.per_function, rewards.total, rewards.grading, rewards.failures)
        return rewards

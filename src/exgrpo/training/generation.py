"""The generation stage: roll out a step's groups, score them and, with `rollout.zero_variance` backfill or
replace_from_buffer, drop the groups whose K rewards are all equal and refill their slots, round after round.

The stage holds no trainer state: it gets the planned step and the experience side as a `GroupSupply` (`settle`:
retire and observe a round's outcomes; `refill`: groups for dropped slots), so it can be driven from another
process given an engine, a scorer and the questions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, Sequence

import numpy as np

from exgrpo.config import ExGRPOConfig
from exgrpo.config.schema import ZeroVariance
from exgrpo.errors import EngineError
from exgrpo.records import Group, GroupRewards, Member, PlannedStep, own_members
from exgrpo.rewards.scorer import GroupScorer
from exgrpo.rollout import RolloutEngine, Rollouts, SamplingSettings, derive_seed
from exgrpo.rollout.base import weight_receiver
from exgrpo.rollout.worker import Sampled
from exgrpo.runtime.distributed import Distributed
from exgrpo.runtime.timing import StageTimer


class GroupSupply(Protocol):
    """The experience side as the generation stage sees it (`exgrpo.training.experience_side.ExperienceSide`)."""

    def settle(self, groups: list[Group], correct: np.ndarray, step: int) -> int:
        """A round's outcome ((G, K) `correct`), dropped groups included; returns the questions retired now."""
        ...

    def refill(self, n: int, planned: PlannedStep, asked: frozenset[str], timer: StageTimer) -> list[Group]:
        """`n` groups for dropped slots, of questions not `asked` yet this step."""
        ...


@dataclass(frozen=True)
class ZeroVarianceRule:
    """What a step does with its groups whose K rewards are all equal (no gradient)."""

    refills: bool  # drop them and roll out further groups for their slots (else train on them, A = 0)
    from_buffer: bool = False  # in the mixed phase, refill with experiential questions first


#: rollout.zero_variance
ZERO_VARIANCE_RULES: dict[ZeroVariance, ZeroVarianceRule] = {
    "keep": ZeroVarianceRule(refills=False),  # released
    "backfill": ZeroVarianceRule(refills=True),  # DAPO's dynamic sampling
    "replace_from_buffer": ZeroVarianceRule(refills=True, from_buffer=True),
}


def zero_variance(total: np.ndarray) -> np.ndarray:
    """(G,) True where all K rewards of a group are exactly equal: group-relative advantages are all 0.

    Exact equality on the reward values, so binary rewards test the success flags and continuous ones are let
    through whenever any member differs (OpenRLHF's filter tests the mean instead, #1270)."""
    return (total == total[:, :1]).all(axis=1)


@dataclass
class GenerationStats:
    """What one step's generation produced and cost, over all its rounds (rollout.zero_variance)."""

    rounds: int = 0
    groups: int = 0  # groups rolled out, dropped ones included
    rollouts: int = 0  # fresh rollouts sampled (replayed members and demonstrations are not)
    zero_variance: int = 0  # groups whose K rewards were all equal
    retired: int = 0  # questions retired by any of the groups
    first_round_pass_at_1: float = 0.0  # the delayed start's batch Pass@1: the drawn batch's own members

    def record(self, groups: Sequence[Group], sampled: int, correct: np.ndarray, zero: np.ndarray,
               retired: int) -> None:
        if not self.rounds:
            self.first_round_pass_at_1 = float(correct[own_members(groups)].mean())
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


@dataclass
class GenerationResult:
    groups: list[Group]  # the groups to train on, K members each
    rewards: GroupRewards  # (G, K), aligned with `groups`
    correct: np.ndarray  # (G, K) reward >= the success threshold
    stats: GenerationStats


class GenerationRounds:
    """Fill groups to K members with the engine's samples and score them, for one round or, with zero_variance
    backfill / replace_from_buffer, until the step holds as many informative groups as it started with (at most
    `max_rounds`). Retirement sees every group; if no group of the step is informative, the last round's are kept.

    Request (group g, member j) of step s is seeded by (seed, s, g, j), g counting every group of the step's rounds,
    so each has its own stream. `weights` (the learner's full weights, in its compute precision) is entered around
    each rollout of an engine that samples with the training model; one with a copy of the weights needs none.
    """

    def __init__(self, engine: RolloutEngine, scorer: GroupScorer, *, sampling: SamplingSettings,
                 num_generations: int, seed: int, success_threshold: float, zero_variance: ZeroVariance = "keep",
                 max_rounds: int = 3, distributed: Distributed = Distributed(),
                 weights: Callable[[], ContextManager] = contextlib.nullcontext):
        self.engine, self.scorer, self.sampling, self.K, self.seed = engine, scorer, sampling, num_generations, seed
        self.success_threshold, self.dist = success_threshold, distributed
        self.refills = ZERO_VARIANCE_RULES[zero_variance].refills
        self.weights = contextlib.nullcontext if engine.holds_copy else weights
        self.receiver = weight_receiver(engine)  # whose weights_version its samples come from
        self.max_rounds = max_rounds if self.refills else 1

    @classmethod
    def from_config(cls, config: ExGRPOConfig, engine: RolloutEngine, scorer: GroupScorer, *,
                    distributed: Distributed = Distributed(),
                    weights: Callable[[], ContextManager] = contextlib.nullcontext) -> "GenerationRounds":
        r = config.rollout
        return cls(engine, scorer, sampling=SamplingSettings.from_config(r), num_generations=r.num_generations,
                   seed=config.train.seed, success_threshold=config.reward.success_threshold,
                   zero_variance=r.zero_variance, max_rounds=r.max_generation_rounds, distributed=distributed,
                   weights=weights)

    def __call__(self, planned: PlannedStep, first_round: Callable[[], Sampled], supply: GroupSupply,
                 timer: StageTimer | None = None) -> GenerationResult:
        """Generate for the planned step (`planned.step`, 0-based: the steps done before this one) from the policy
        at `planned.version` (applied optimizer steps): an engine that reports another version is an error.
        `first_round()` gives the rollouts that fill the planned groups (the schedule's; its wait counts as rollout
        time); refill rounds sample here."""
        groups, step, weights_version, timer = planned.groups, planned.step, planned.version, timer or StageTimer()
        wanted, stats, asked = len(groups), GenerationStats(), set()
        kept, kept_rewards, kept_correct = [], [], []
        for _ in range(self.max_rounds):
            sampled = len(groups) * self.K - sum(len(g.members) for g in groups)
            with timer("rollout"):
                rollouts = first_round() if not stats.rounds else self.sample(groups, step, stats.groups,
                                                                                 weights_version)
                self._check_version(weights_version, rollouts.version)
                self.fill(groups, rollouts.rollouts, rollouts.version)
            with timer("reward"):
                rewards = self.scorer(groups, step + 1)
            correct = rewards.total >= self.success_threshold
            zero = zero_variance(rewards.total)
            stats.record(groups, sampled, correct, zero, supply.settle(groups, correct, step))
            if not self.refills:
                return GenerationResult(groups, rewards, correct, stats)
            informative = np.flatnonzero(~zero)
            kept += [groups[i] for i in informative]
            kept_rewards.append(rewards.take(informative))
            kept_correct.append(correct[informative])
            asked.update(g.question.id for g in groups)
            if len(kept) == wanted or stats.rounds == self.max_rounds:
                break
            refilled = supply.refill(wanted - len(kept), planned, frozenset(asked), timer)
            if not refilled:
                break
            groups = refilled
        if not kept:
            return GenerationResult(groups, rewards, correct, stats)
        return GenerationResult(kept, GroupRewards.concat(kept_rewards), np.concatenate(kept_correct), stats)

    @staticmethod
    def _check_version(wanted: int | None, held: int | None) -> None:
        if wanted is not None and held is not None and held != wanted:
            raise EngineError(f"the rollout engine sampled from weights version {held}, but the learner is at version "
                              f"{wanted} (applied optimizer steps): a weight sync did not happen")

    def sample(self, groups: list[Group], step: int, first_group: int = 0, version: int | None = None) -> Sampled:
        """Fresh samples that fill every group up to K members, with the weights version they come from (the
        engine's where it reports one, else `version`). Each rank samples its shard of the groups and every rank
        receives all of them."""
        start, end = self.dist.shard_bounds(len(groups))
        prompts, seeds = self.requests(groups[start:end], step, first_group + start)
        with self.weights():
            rollouts = self.engine.generate(prompts, self.sampling, seeds)
        engine_logp = rollouts.logprobs or [None] * len(prompts)
        sampled = self.dist.gather(list(zip(rollouts.completion_ids, rollouts.truncated, engine_logp)))
        ids, truncated, logprobs = (list(column) for column in zip(*sampled)) if sampled else ([], [], [])
        return Sampled(Rollouts(ids, truncated, logprobs), version if self.receiver is None
                       else self.receiver.weights_version)

    def requests(self, groups: Sequence[Group], step: int, first_group: int = 0) -> tuple[list, list[int]]:
        """The (prompt ids, seeds) of the samples that fill `groups` up to K members; group i is the step's
        (first_group + i)-th group of the step, whose member j is sampled with seed derive_seed(seed, step,
        first_group + i, j) wherever and whenever it is sampled."""
        requests = [(gi, j) for gi in range(len(groups)) for j in range(len(groups[gi].members), self.K)]
        return ([groups[gi].prompt_ids for gi, _ in requests],
                [derive_seed(self.seed, step, first_group + gi, j) for gi, j in requests])

    def fill(self, groups: list[Group], rollouts: Rollouts, version: int | None) -> None:
        """Append `rollouts` (in `requests` order) to the groups, tagged with the weights version that sampled
        them."""
        slots = [g for g in groups for _ in range(self.K - len(g.members))]
        if len(slots) != len(rollouts.completion_ids):
            raise EngineError(f"{len(rollouts.completion_ids)} rollouts for {len(slots)} requested samples")
        logprobs = rollouts.logprobs or [None] * len(slots)
        for g, ids, truncated, lps in zip(slots, rollouts.completion_ids, rollouts.truncated, logprobs):
            g.members.append(Member(ids, truncated, engine_logp=lps, policy_version=version))

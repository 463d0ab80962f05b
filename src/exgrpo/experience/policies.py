"""Replay policies (`experience.replay_policy`): which questions a mixed-phase batch re-asks, and whether a stored
trajectory joins their group. Every policy sits on the same buffer; the trainer asks it three things:

* `experiential(n, rng, step)`: up to n question ids to re-ask this step, drawn from what the policy tracks;
* `replays_trajectories`: an experiential group's member 0 is a stored correct trajectory (else all K are fresh);
* `replays_into_fresh`: fresh questions with stored successes replay one of them too (RLEP);
* `observe(question_id, successes, step)`: every rolled-out group's outcome, dropped zero-variance groups included.

All policies start after the same delayed start (`experience.start_threshold`), so a comparison isolates the
replay rule. No model code here.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from exgrpo.config.schema import ReplayPolicyName
from exgrpo.experience.buffer import ExperienceBuffer
from exgrpo.experience.sampler import sample_questions


class ReplayPolicy(Protocol):
    replays_trajectories: bool
    replays_into_fresh: bool

    def experiential(self, n: int, rng: np.random.Generator, step: int,
                     exclude: frozenset[str] = frozenset()) -> list[str]:
        """Up to n question ids to re-ask at `step`, none in `exclude`: the draw is made over the questions left,
        so excluding some never shifts it towards others (drawing more and dropping the excluded would)."""
        ...

    def observe(self, question_id: str, successes: int, step: int) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class _Stateless:
    def observe(self, question_id: str, successes: int, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class BucketReplay(_Stateless):
    """ExGRPO (Zhan et al., 2025, arXiv 2510.02245): questions drawn from the correctness buckets by the bucket
    scheme (a Gaussian over the latest success count k favours medium difficulty); each replays one stored
    trajectory (chosen by `experience.selection_metric`) in a group of K - 1 fresh rollouts.

    With `replays_trajectories=False` this is prompt replay (arXiv 2603.21177): the same medium-difficulty
    questions are re-asked, but all K members are fresh, so training stays on-policy."""

    replays_into_fresh = False

    def __init__(self, buffer: ExperienceBuffer, K: int, scheme: str, sigma: float, mean: float | None,
                 replays_trajectories: bool = True):
        self.buffer, self.K, self.scheme, self.sigma, self.mean = buffer, K, scheme, sigma, mean
        self.replays_trajectories = replays_trajectories

    def experiential(self, n: int, rng: np.random.Generator, step: int,
                     exclude: frozenset[str] = frozenset()) -> list[str]:
        buckets = self.buffer.buckets()
        if exclude:
            buckets = {k: [q for q in ids if q not in exclude] for k, ids in buckets.items()}
        return sample_questions(buckets, n, rng, self.K, self.scheme, self.sigma, self.mean)


class SuccessReplay(_Stateless):
    """RLEP (arXiv 2507.07451): no experiential questions and no buckets; every fresh question that has stored
    verified successes replays one of them in its group (K - 1 fresh rollouts + 1 replay)."""

    replays_trajectories = True
    replays_into_fresh = True

    def experiential(self, n: int, rng: np.random.Generator, step: int,
                     exclude: frozenset[str] = frozenset()) -> list[str]:
        return []


class PrioritizedReplay:
    """Prioritized prompt replay (arXiv 2601.02648): a question's priority is p(1 - p), p its latest success rate
    (successes / K of its latest group), so the questions with the most group-relative signal are re-asked most.
    p is tracked for every question ever rolled out, retired and unsolved ones included. Their priority is 0,
    so every `retest_every`-th step draws its experiential questions uniformly from them instead. That re-test
    moves questions whose success rate has changed back into play. All K members are fresh."""

    replays_trajectories = False
    replays_into_fresh = False

    def __init__(self, K: int, retest_every: int):
        self.K, self.retest_every = K, retest_every
        self.success_rate: dict[str, float] = {}

    def priorities(self) -> tuple[list[str], np.ndarray]:
        ids = sorted(self.success_rate)
        p = np.array([self.success_rate[q] for q in ids])
        return ids, p * (1 - p)

    def experiential(self, n: int, rng: np.random.Generator, step: int,
                     exclude: frozenset[str] = frozenset()) -> list[str]:
        ids, priority = self.priorities()
        if self.retest_every and step % self.retest_every == 0:
            priority = (priority == 0).astype(float)  # the re-test: extremes only, uniformly
        if exclude:
            priority = np.where([q in exclude for q in ids], 0.0, priority)
        candidates = np.flatnonzero(priority > 0)
        n = min(n, len(candidates))
        if n == 0:
            return []
        weights = priority[candidates] / priority[candidates].sum()
        return [ids[i] for i in rng.choice(candidates, size=n, replace=False, p=weights)]

    def observe(self, question_id: str, successes: int, step: int) -> None:
        self.success_rate[question_id] = successes / self.K

    def state_dict(self) -> dict:
        return {"success_rate": dict(self.success_rate)}

    def load_state_dict(self, state: dict) -> None:
        self.success_rate = dict(state.get("success_rate", {}))


def replay_policy_from_config(experience, buffer: ExperienceBuffer, num_generations: int) -> ReplayPolicy:
    """The policy the `experience` config section names, with its bucket scheme and retest settings."""
    e = experience
    return build_replay_policy(e.replay_policy, buffer, num_generations=num_generations, scheme=e.bucket_scheme,
                               sigma=e.bucket_sigma, mean=e.bucket_mean, retest_every=e.retest_every)


def build_replay_policy(name: str, buffer: ExperienceBuffer, *, num_generations: int, scheme: str = "normal",
                        sigma: float = 1.0, mean: float | None = None, retest_every: int = 10) -> ReplayPolicy:
    """The policy `experience.replay_policy` names (the bucket scheme's settings and retest_every as in its config)."""
    return REPLAY_POLICIES[name](buffer=buffer, K=num_generations, scheme=scheme, sigma=sigma, mean=mean,
                                 retest_every=retest_every)


#: experience.replay_policy -> its policy, from keywords buffer, K, scheme, sigma, mean, retest_every
REPLAY_POLICIES: dict[ReplayPolicyName, Callable[..., ReplayPolicy]] = {
    "exgrpo": lambda buffer, K, scheme, sigma, mean, **_: BucketReplay(buffer, K, scheme, sigma, mean),
    "rlep": lambda **_: SuccessReplay(),
    "prioritized": lambda K, retest_every, **_: PrioritizedReplay(K, retest_every),
    "prompt_replay": lambda buffer, K, scheme, sigma, mean, **_: BucketReplay(buffer, K, scheme, sigma, mean,
                                                                             replays_trajectories=False),
}

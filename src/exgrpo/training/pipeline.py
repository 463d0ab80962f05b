"""The asynchronous schedule (`rollout.mode: async`, docs/async.md): a step's groups are planned and their
rollouts submitted `max_staleness` steps before the step trains on them.

With s = rollout.max_staleness, step t's rollouts are sampled from exactly the weights after step max(t - s, 0):
at the start of step t the learner plans step t + s (the buffer, phase and selection as they are then, under
the current weights) and submits its generation, which the engine runs after the push of the current weights and
while the learner trains on step t. s = 0 plans and samples each step just before it trains: sync mode's run.

A planned step is what the sync trainer forms at the start of a step; its rollouts carry the weights version that
sampled them. A checkpoint holds the steps in flight with their finished rollouts (the pipeline is drained first),
so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass
from typing import Callable

import numpy as np

from exgrpo.data import Question
from exgrpo.experience import Trajectory
from exgrpo.records import Group, Member
from exgrpo.rollout import Rollouts
from exgrpo.rollout.worker import RolloutWorker, Sampled


@dataclass
class PlannedStep:
    """A step's groups before their rollouts: experiential groups hold their replay as member 0, guided groups
    their demonstrations. `version`: the weights version (applied optimizer steps) the rollouts are sampled
    from; `rng`: the step's random stream, which sync mode's refill rounds continue."""

    step: int
    phase: str
    groups: list[Group]
    version: int
    rng: np.random.Generator | None = None

    @property
    def question_ids(self) -> set[str]:
        return {g.question.id for g in self.groups}


Plan = Callable[[int, frozenset], PlannedStep]  # (step, question ids in flight) -> the planned step
Requests = Callable[[list[Group], int], tuple[list, list[int]]]  # (groups, step) -> (prompt ids, seeds)


class AsyncPipeline:
    """Keeps the steps up to t + max_staleness planned and their generation submitted to the worker.

    Args:
        worker: the RolloutWorker sampling in the background.
        plan: forms a step's groups, leaving out questions in flight.
        requests: the (prompt ids, seeds) that fill a step's groups.
        sampling: the rollout sampling settings.
        max_staleness: s, steps between planning a step and training on it.
        last_step: steps past this one are never planned (train.steps).
    """

    def __init__(self, worker: RolloutWorker, plan: Plan, requests: Requests, sampling, max_staleness: int,
                 last_step: int):
        self.worker, self._plan, self._requests, self.sampling = worker, plan, requests, sampling
        self.max_staleness, self.last_step = max_staleness, last_step
        self._in_flight: collections.deque[tuple[PlannedStep, concurrent.futures.Future]] = collections.deque()
        self._push: concurrent.futures.Future | None = None

    def next(self, step: int) -> tuple[PlannedStep, Callable[[], Sampled]]:
        """Step `step`'s plan and a wait for its rollouts, after planning and submitting the steps up to
        step + max_staleness."""
        planned_up_to = self._in_flight[-1][0].step if self._in_flight else step - 1
        for ahead in range(planned_up_to + 1, min(step + self.max_staleness, self.last_step - 1) + 1):
            in_flight = frozenset().union(*(p.question_ids for p, _ in self._in_flight))
            planned = self._plan(ahead, in_flight)
            self._in_flight.append((planned, self._submit(planned)))
        planned, future = self._in_flight.popleft()
        if planned.step != step:
            raise RuntimeError(f"the pipeline holds step {planned.step} where step {step} was due")
        return planned, lambda: self.worker.wait(future, f"the rollouts of step {step}")

    def _submit(self, planned: PlannedStep) -> concurrent.futures.Future:
        prompts, seeds = self._requests(planned.groups, planned.step)
        return self.worker.generate(prompts, self.sampling, seeds)

    def push(self, version: int) -> None:
        """Send the learner's weights, now at `version`, to the engine, behind every generation submitted so far."""
        self._push = self.worker.push(version)

    def weights_read(self) -> None:
        """Wait until the last push has read the learner's weights (before the learner changes them)."""
        if self._push is not None:
            self.worker.wait(self._push, "weight push")
            self._push = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> list[dict]:
        """The steps in flight with their rollouts, waiting for any still being sampled (JSON-able)."""
        return [_encode(planned, self.worker.wait(future, f"the rollouts of step {planned.step}"))
                for planned, future in self._in_flight]

    def load_state_dict(self, state: list[dict], questions: dict[str, Question],
                        prompt_ids: Callable[[Question], list[int]]) -> None:
        self._in_flight.clear()
        for entry in state:
            planned, sampled = _decode(entry, questions, prompt_ids)
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(sampled)
            self._in_flight.append((planned, future))


def staleness_metrics(groups: list[Group], learner_version: int) -> dict[str, float]:
    """async/staleness_{mean,max}: versions between the learner's weights and those that sampled each trained
    fresh token (token-weighted; replayed members are counted by replay/version_lag_mean instead)."""
    lags = [(learner_version - m.policy_version, len(m.completion_ids))
            for g in groups for m in g.members if m.sampled and m.policy_version is not None]
    if not lags:
        return {}
    lag, tokens = np.array(lags, dtype=np.float64).T
    return {"async/staleness_mean": float((lag * tokens).sum() / max(tokens.sum(), 1)),
            "async/staleness_max": float(lag.max())}


def _encode(planned: PlannedStep, sampled: Sampled) -> dict:
    def member(m: Member) -> dict:
        out = {"ids": m.completion_ids, "demonstration": m.demonstration}
        if m.replay is not None:
            t = m.replay
            out["replay"] = {"logprobs": t.logprobs.tolist(), "step": t.step, "version": t.version, "uses": t.uses}
        return out

    r = sampled.rollouts
    return {"step": planned.step, "phase": planned.phase, "version": planned.version,
            "groups": [{"question": g.question.id, "members": [member(m) for m in g.members]}
                       for g in planned.groups],
            "rollouts": {"ids": r.completion_ids, "truncated": r.truncated, "logprobs": r.logprobs,
                         "version": sampled.version}}


def _decode(entry: dict, questions: dict[str, Question], prompt_ids) -> tuple[PlannedStep, Sampled]:
    def member(m: dict) -> Member:
        replay = m.get("replay")
        if replay is None:
            return Member(list(m["ids"]), demonstration=m["demonstration"])
        trajectory = Trajectory(np.asarray(m["ids"], np.int32), np.asarray(replay["logprobs"], np.float32),
                                replay["step"], replay["version"], replay["uses"])
        return Member(list(m["ids"]), replay=trajectory)

    groups = []
    for g in entry["groups"]:
        question = questions[g["question"]]
        groups.append(Group(question, prompt_ids(question), [member(m) for m in g["members"]]))
    r = entry["rollouts"]
    planned = PlannedStep(entry["step"], entry["phase"], groups, entry["version"])
    return planned, Sampled(Rollouts(r["ids"], r["truncated"], r["logprobs"]), r["version"])

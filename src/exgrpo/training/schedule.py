"""When and where a step's rollouts are sampled: one schedule for both modes (docs/async.md).

At the start of step t the learner plans the steps up to t + s (s = rollout.max_staleness; sync mode is s = 0) and
submits each one's generation to the rollout source; step t then waits for its own rollouts. Step t's rollouts are
sampled from exactly the weights after step max(t - s, 0): a step is planned (the buffer, phase and selection as
they are then, under the current weights) s steps before it trains, and the engine runs its generation after the
push of the weights current at that time. The rollout source decides where and when sampling happens:

* `InlineSource` (rollout.mode sync): on the learner's thread when the step waits for its rollouts, each rank
  sampling its shard of the groups;
* `ThreadedSource` (rollout.mode async): on a RolloutWorker thread driving an engine with its own copy of the
  weights, in order with the weight pushes, while the learner trains; under torchrun on rank 0, the other ranks
  receiving its rollouts (`FollowingSource`).

A checkpoint holds the steps in flight with their finished rollouts (waited for), so a resumed run continues
exactly where it stopped; at s = 0 none is in flight between steps.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, ContextManager, Iterator, Protocol

import numpy as np

from exgrpo.config import ConfigError, ExGRPOConfig
from exgrpo.config.rules import ASYNC_ACROSS_RANKS_NEEDS_SERVERS, ASYNC_NEEDS_ITS_OWN_ENGINE
from exgrpo.data import Question
from exgrpo.records import Group, Member, Trajectory
from exgrpo.rollout import RolloutEngine, Rollouts
from exgrpo.rollout.base import Weights, weight_receiver
from exgrpo.rollout.worker import RolloutWorker, Sampled
from exgrpo.runtime.distributed import Distributed
from exgrpo.runtime.timing import StageTimer
from exgrpo.records import PlannedStep
from exgrpo.training.generation import GenerationRounds

Plan = Callable[[int, frozenset, StageTimer], PlannedStep]  # (step, question ids in flight, timer) -> the plan
Wait = Callable[[], Sampled]  # a planned step's rollouts, sampled or waited for


class RolloutSource(Protocol):
    max_staleness: int  # s: steps between planning a step and training on it (0: sync)

    def submit(self, planned: PlannedStep) -> Wait:
        """Start (or defer) sampling the members that fill the planned step's groups."""
        ...

    def push(self, version: int) -> None:
        """The learner's weights are now at `version`: the engine samples from them from the next submitted step."""
        ...

    def weights_read(self) -> None:
        """Return once the last push no longer reads the learner's weights (before the learner changes them)."""
        ...

    def begin_step(self) -> None:
        """A training step starts: the times `step_metrics` reports count from here."""
        ...

    def step_metrics(self, groups: list[Group], version: int) -> dict[str, float]:
        """What the source measures of a trained step (groups as trained, learner at `version`)."""
        ...

    def evaluation_engine(self) -> ContextManager[RolloutEngine]:
        """The engine to evaluate with between steps, with the weights of the last push."""
        ...

    def close(self) -> None:
        ...


class InlineSource:
    """rollout.mode sync: a step's rollouts are sampled when it waits for them, by `generation` (each rank its
    shard of the groups). An engine with a copy of the weights receives a push at once, with the learner's full
    weights gathered (`full_weights`), whenever their version changes (not when every optimizer step of a step was
    skipped: nothing changed)."""

    max_staleness = 0  # each step is planned and sampled when it trains

    def __init__(self, generation: GenerationRounds, full_weights: Callable[[], ContextManager]):
        self.generation, self.engine, self.full_weights = generation, generation.engine, full_weights
        self.receiver = generation.receiver  # the engine as weight receiver, or None
        self._version = 0  # the engine starts from the learner's weights before any optimizer step

    def submit(self, planned: PlannedStep) -> Wait:
        return lambda: self.generation.sample(planned.groups, planned.step, version=planned.version)

    def push(self, version: int) -> None:
        if version != self._version and self.receiver is not None:
            with self.full_weights():
                self.receiver.push_weights(version)
        self._version = version

    def weights_read(self) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def step_metrics(self, groups: list[Group], version: int) -> dict[str, float]:
        return {}

    @contextlib.contextmanager
    def evaluation_engine(self) -> Iterator[RolloutEngine]:
        with self.generation.weights():
            yield self.engine

    def close(self) -> None:
        pass


class ThreadedSource:
    """rollout.mode async, in the process whose `worker` drives the engine (the one learner process, or rank 0 under
    torchrun): the worker samples submitted steps in the background, in order with the weight pushes.

    In one process a push reads the learner's weights on the worker thread, so the learner waits for it
    (`weights_read`) before changing them. Under torchrun (`snapshot` given) every rank joins the gather of the full
    weights at a push (`full_weights`; the others in `FollowingSource`), this rank keeps a copy (`snapshot`) that its
    worker sends, and it hands each step's rollouts to the other ranks. An engine error raised here ends the run;
    torchrun stops the other ranks.
    """

    def __init__(self, worker: RolloutWorker, generation: GenerationRounds, max_staleness: int,
                 distributed: Distributed = Distributed(),
                 full_weights: Callable[[], ContextManager] = contextlib.nullcontext,
                 snapshot: Callable[[], Weights] | None = None):
        if not distributed.is_main:
            raise ValueError("the rollout worker runs on rank 0 (the other ranks follow it: FollowingSource)")
        self.worker, self.generation, self.dist, self._push = worker, generation, distributed, None
        self.max_staleness = max_staleness
        self.full_weights, self.snapshot = full_weights, snapshot

    def submit(self, planned: PlannedStep) -> Wait:
        prompts, seeds = self.generation.requests(planned.groups, planned.step)
        future = self.worker.generate(prompts, self.generation.sampling, seeds)
        return lambda: self.dist.broadcast(self.worker.wait(future, f"the rollouts of step {planned.step}"))

    def push(self, version: int) -> None:
        copy = None
        if self.snapshot is not None:
            with self.full_weights():
                copy = self.snapshot()
        self._push = self.worker.push(version, copy)

    def weights_read(self) -> None:
        if self._push is not None:
            self.worker.wait(self._push, "weight push")
            self._push = None

    def begin_step(self) -> None:
        self.worker.take_times()

    def step_metrics(self, groups: list[Group], version: int) -> dict[str, float]:
        return {**staleness_metrics(groups, version), **self.worker.take_times()}

    @contextlib.contextmanager
    def evaluation_engine(self) -> Iterator[RolloutEngine]:
        # the engine samples from its own copy; a push queued before the evaluation reads the learner's weights
        # from the worker thread meanwhile, so they stay as they are (no context changes them)
        yield _Shared(self.worker.as_engine(), self.dist)

    def close(self) -> None:
        self.worker.close()  # its thread first: it may still be sampling a step the run will not reach


class FollowingSource:
    """rollout.mode async under torchrun, ranks other than 0: rank 0's worker samples (`ThreadedSource`); this rank
    receives each step's rollouts from it and joins the gather of the full weights at every push."""

    def __init__(self, distributed: Distributed, full_weights: Callable[[], ContextManager], max_staleness: int):
        self.dist, self.full_weights, self.max_staleness = distributed, full_weights, max_staleness

    def submit(self, planned: PlannedStep) -> Wait:
        return self.dist.broadcast  # rank 0's rollouts

    def push(self, version: int) -> None:
        with self.full_weights():
            pass

    def weights_read(self) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def step_metrics(self, groups: list[Group], version: int) -> dict[str, float]:
        return staleness_metrics(groups, version)

    @contextlib.contextmanager
    def evaluation_engine(self) -> Iterator[RolloutEngine]:
        yield _Received(self.dist)

    def close(self) -> None:
        pass


class _Shared:
    """A RolloutEngine whose samples rank 0 draws from `engine` and hands to every rank."""

    holds_copy = True

    def __init__(self, engine: RolloutEngine, distributed: Distributed):
        self.engine, self.dist, self.reports_logprobs = engine, distributed, engine.reports_logprobs

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        return self.dist.broadcast(self.engine.generate(prompt_ids, sampling, seeds))

    def close(self) -> None:
        pass


class _Received:
    """A RolloutEngine of a rank other than 0: the samples rank 0 drew (`_Shared`), received."""

    holds_copy = reports_logprobs = True  # async across ranks samples from servers

    def __init__(self, distributed: Distributed):
        self.dist = distributed

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        return self.dist.broadcast(None)

    def close(self) -> None:
        pass


def rollout_source(config: ExGRPOConfig, engine: RolloutEngine, generation: GenerationRounds,
                   full_weights: Callable[[], ContextManager], distributed: Distributed,
                   snapshot: Callable[[], Weights]) -> RolloutSource:
    """Where rollouts are sampled, chosen once: inline (sync), or on a worker thread, rollout.max_staleness steps
    ahead (async; docs/async.md): rank 0's under torchrun, sampling from servers (docs/scale.md), which take a
    `snapshot` of the full weights that every rank helped gather."""
    r = config.rollout
    if r.mode == "sync":
        return InlineSource(generation, full_weights)
    receiver = weight_receiver(engine)
    if receiver is None:
        raise ConfigError(ASYNC_NEEDS_ITS_OWN_ENGINE)
    if distributed.enabled and not receiver.takes_snapshots:
        raise ConfigError(ASYNC_ACROSS_RANKS_NEEDS_SERVERS)
    if not distributed.is_main:
        return FollowingSource(distributed, full_weights, r.max_staleness)
    return ThreadedSource(RolloutWorker(engine, r.generation_timeout), generation, r.max_staleness, distributed,
                          full_weights, snapshot if distributed.enabled else None)


class Schedule:
    """Keeps the steps up to t + s planned and their generation submitted to the source (s: its max_staleness).

    Args:
        source: where rollouts are sampled.
        plan: forms a step's groups, leaving out questions in flight.
        last_step: steps past this one are never planned (train.steps).
    """

    def __init__(self, source: RolloutSource, plan: Plan, last_step: int):
        self.source, self._plan, self.max_staleness, self.last_step = source, plan, source.max_staleness, last_step
        self._in_flight: collections.deque[tuple[PlannedStep, Wait]] = collections.deque()

    def next(self, step: int, timer: StageTimer) -> tuple[PlannedStep, Wait]:
        """Step `step`'s plan and a wait for its rollouts, after planning and submitting the steps up to
        step + max_staleness."""
        self.source.begin_step()
        planned_up_to = self._in_flight[-1][0].step if self._in_flight else step - 1
        for ahead in range(planned_up_to + 1, min(step + self.max_staleness, self.last_step - 1) + 1):
            in_flight = frozenset().union(*(p.question_ids for p, _ in self._in_flight))
            planned = self._plan(ahead, in_flight, timer)
            self._in_flight.append((planned, self.source.submit(planned)))
        planned, wait = self._in_flight.popleft()
        if planned.step != step:
            raise RuntimeError(f"the schedule holds step {planned.step} where step {step} was due")
        return planned, wait

    # ------------------------------------------------------------------ state
    def state_dict(self) -> list[dict]:
        """The steps in flight with their rollouts, waiting for any still being sampled (JSON-able)."""
        return [_encode(planned, wait()) for planned, wait in self._in_flight]

    def load_state_dict(self, state: list[dict], questions: dict[str, Question],
                        prompt_ids: Callable[[Question], list[int]]) -> None:
        self._in_flight.clear()
        for entry in state:
            planned, sampled = _decode(entry, questions, prompt_ids)
            self._in_flight.append((planned, lambda sampled=sampled: sampled))


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

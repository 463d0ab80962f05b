"""`Schedule` on its own, with a fake rollout source and plan: at step t it plans the steps up to t + s (never past
the last), each plan leaving out the questions of the steps in flight, and a checkpoint's steps in flight come back
with their rollouts on resume, without being planned or sampled again (exgrpo.training.schedule)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exgrpo.data import Question
from exgrpo.records import MIXED, WARMUP, Group, Member, PlannedStep, Trajectory
from exgrpo.rollout import Rollouts
from exgrpo.rollout.worker import Sampled
from exgrpo.runtime.timing import StageTimer
from exgrpo.training.schedule import Schedule

QUESTIONS = {f"q{i}": Question(f"q{i}", ({"role": "user", "content": f"question {i}"},), str(i), {})
             for i in range(20)}


def prompt_ids(question: Question) -> list[int]:
    return [int(question.id[1:]), 7]


class FakeSource:
    """A RolloutSource that records what is submitted; a step's rollouts are one completion per member, [step]."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.submitted: list[int] = []
        self.steps_begun = 0

    def submit(self, planned: PlannedStep):
        self.submitted.append(planned.step)
        n = sum(len(g.members) for g in planned.groups)
        return lambda: Sampled(Rollouts([[planned.step]] * n, [False] * n), planned.version)

    def begin_step(self) -> None:
        self.steps_begun += 1


class FakePlan:
    """A Plan that gives step t two questions, q(2t) and q(2t + 1), and records the questions in flight it was told
    to leave out."""

    def __init__(self):
        self.calls: list[tuple[int, frozenset]] = []

    def __call__(self, step: int, in_flight: frozenset, timer: StageTimer) -> PlannedStep:
        self.calls.append((step, in_flight))
        questions = [QUESTIONS[f"q{i}"] for i in (2 * step, 2 * step + 1)]
        groups = [Group(question, prompt_ids(question), [Member([])]) for question in questions]
        return PlannedStep(step, WARMUP, groups, version=max(step - 1, 0))


def q(*steps: int) -> frozenset:
    return frozenset(f"q{i}" for s in steps for i in (2 * s, 2 * s + 1))


def make(max_staleness: int, last_step: int = 100) -> tuple[Schedule, FakeSource, FakePlan]:
    source, plan = FakeSource(max_staleness), FakePlan()
    return Schedule(source, plan, last_step), source, plan


def test_step_t_plans_and_submits_the_steps_up_to_t_plus_s():
    schedule, source, plan = make(max_staleness=2)
    planned, wait = schedule.next(0, StageTimer())
    assert planned.step == 0 and wait().rollouts.completion_ids == [[0], [0]]
    assert source.submitted == [0, 1, 2]
    for step in (1, 2, 3):
        planned, wait = schedule.next(step, StageTimer())
        assert planned.step == step and wait().rollouts.completion_ids[0] == [step]
        assert source.submitted[-1] == step + 2  # one step more each time
    assert source.submitted == [0, 1, 2, 3, 4, 5] and [s for s, _ in plan.calls] == source.submitted
    assert source.steps_begun == 4


def test_sync_plans_each_step_when_it_is_due():
    schedule, source, _ = make(max_staleness=0)
    for step in range(3):
        assert schedule.next(step, StageTimer())[0].step == step
        assert source.submitted == list(range(step + 1))


def test_no_step_past_the_last_is_planned():
    schedule, source, _ = make(max_staleness=2, last_step=3)  # steps 0, 1, 2
    for step in range(3):
        schedule.next(step, StageTimer())
    assert source.submitted == [0, 1, 2]


def test_each_plan_leaves_out_the_questions_of_the_steps_in_flight():
    schedule, _, plan = make(max_staleness=2)
    schedule.next(0, StageTimer())
    assert plan.calls == [(0, q()), (1, q(0)), (2, q(0, 1))]
    schedule.next(1, StageTimer())  # step 0 is trained now: no longer in flight
    assert plan.calls[-1] == (3, q(1, 2))
    schedule.next(2, StageTimer())
    assert plan.calls[-1] == (4, q(2, 3))


def test_a_step_other_than_the_one_due_is_refused():
    schedule, _, _ = make(max_staleness=1)
    schedule.next(0, StageTimer())
    with pytest.raises(RuntimeError, match="holds step 1 where step 2 was due"):
        schedule.next(2, StageTimer())


def test_a_resumed_schedule_continues_with_the_steps_in_flight_and_their_rollouts():
    schedule, _, _ = make(max_staleness=2)
    schedule.next(0, StageTimer())  # steps 1 and 2 in flight at the checkpoint
    state = json.loads(json.dumps(schedule.state_dict()))  # as a checkpoint holds it
    assert [s["step"] for s in state] == [1, 2]

    resumed, source, plan = make(max_staleness=2)
    resumed.load_state_dict(state, QUESTIONS, prompt_ids)
    planned, wait = resumed.next(1, StageTimer())
    assert source.submitted == [3]  # steps 1 and 2 are neither planned nor sampled again
    assert plan.calls == [(3, q(1, 2))]  # the restored steps are in flight
    assert planned.step == 1 and planned.version == 0 and wait().rollouts.completion_ids == [[1], [1]]
    assert [g.question.id for g in planned.groups] == ["q2", "q3"] and planned.groups[0].prompt_ids == [2, 7]
    planned, wait = resumed.next(2, StageTimer())
    assert planned.step == 2 and wait().rollouts.completion_ids == [[2], [2]]
    assert resumed.next(3, StageTimer())[0].step == 3


def test_a_loaded_state_replaces_the_steps_in_flight():
    schedule, source, _ = make(max_staleness=2)
    schedule.next(0, StageTimer())
    schedule.load_state_dict([], QUESTIONS, prompt_ids)  # a checkpoint of a run with none in flight
    assert schedule.next(1, StageTimer())[0].step == 1
    assert source.submitted == [0, 1, 2, 1, 2, 3]  # planned again, from the loaded state


def test_a_step_in_flight_round_trips_with_its_replays_demonstrations_and_rollouts():
    replay = Trajectory(np.array([5, 6], np.int32), np.array([-0.5, -0.25], np.float32), step=3, version=2, uses=1)
    groups = [Group(QUESTIONS["q4"], [4, 7], [Member([5, 6], replay=replay), Member([])]),
              Group(QUESTIONS["q5"], [5, 7], [Member([8, 9], demonstration=True), Member([])])]
    rich = PlannedStep(6, MIXED, groups, version=4)
    sampled = Sampled(Rollouts([[1, 2], [3], [4], [5]], [False, True, False, False],
                               [[-0.1, -0.2], [-0.3], [-0.4], [-0.5]]), version=4)
    source, plan = FakeSource(max_staleness=1), FakePlan()
    schedule = Schedule(source, lambda step, in_flight, timer: rich if step == 6 else plan(step, in_flight, timer),
                        last_step=100)
    source.submit = lambda planned: (lambda: sampled)
    schedule.next(5, StageTimer())  # step 6 in flight
    state = json.loads(json.dumps(schedule.state_dict()))

    resumed, _, _ = make(max_staleness=1)
    resumed.load_state_dict(state, QUESTIONS, prompt_ids)
    got, wait = resumed.next(6, StageTimer())
    assert (got.step, got.phase, got.version) == (6, MIXED, 4)
    assert [g.question.id for g in got.groups] == ["q4", "q5"] and got.groups[1].prompt_ids == [5, 7]
    restored = got.groups[0].members[0].replay
    assert restored.token_ids.tolist() == [5, 6] and restored.logprobs.tolist() == [-0.5, -0.25]
    assert (restored.step, restored.version, restored.uses) == (3, 2, 1)
    assert got.groups[1].members[0].demonstration and got.groups[1].members[0].completion_ids == [8, 9]
    assert got.groups[0].members[1].replay is None and not got.groups[0].members[1].demonstration
    assert wait() == sampled

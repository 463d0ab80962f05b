"""`ExperienceSide` on its own, with a fake scorer of replay candidates: a step's plan (fresh questions in the
warm-up; experiential ones with the replay the scorer ranks first in the mixed phase; none of the questions in
flight), a round's settlement (retirement, each question's k, coverage), the refill of dropped slots, the buffer's
collection and the delayed start (exgrpo.training.experience_side)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exgrpo.config import load_config
from exgrpo.data import Question
from exgrpo.experience import SELECTION_METRICS
from exgrpo.records import MIXED, WARMUP, Group, Member, PlannedStep
from exgrpo.runtime.timing import StageTimer
from exgrpo.training.experience_side import ExperienceSide

K, B = 4, 4
QUESTIONS = [Question(f"q{i}", ({"role": "user", "content": f"question {i}"},), str(i), {}) for i in range(20)]
BY_ID = {q.id: q for q in QUESTIONS}


def prompt_ids(question: Question) -> list[int]:
    return [int(question.id[1:])]


class FakeScorer:
    """Scores (question, stored trajectory) pairs as the policy would: here a trajectory's score is its first token
    id. Records every call."""

    def __init__(self):
        self.calls: list[tuple[list, object]] = []

    def __call__(self, pairs, metric) -> list[float]:
        self.calls.append((pairs, metric))
        return [float(t.token_ids[0]) for _, t in pairs]


def make(*overrides: str) -> tuple[ExperienceSide, FakeScorer]:
    config = load_config(overrides=[f"train.prompts_per_step={B}", f"rollout.num_generations={K}",
                                    "experience.start_threshold=0.5", *overrides])
    scorer = FakeScorer()
    return ExperienceSide(config, QUESTIONS, prompt_ids, tokenizer=None, score=scorer), scorer


def ids(groups: list[Group]) -> list[str]:
    return [g.question.id for g in groups]


def seen(side: ExperienceSide, qid: str, correct: list[bool], step: int = 0, first_tokens=(10, 11, 12, 13)) -> None:
    """A mixed-phase step trained one group of `qid`: member j answered [first_tokens[j], 1, 2] (log-probs -1, -2,
    -3), `correct` as given."""
    members = [Member([t, 1, 2]) for t in first_tokens]
    planned = PlannedStep(step, MIXED, [Group(BY_ID[qid], prompt_ids(BY_ID[qid]), members)], version=step)
    mask = torch.tensor([[1, 1, 1, 0]] * K)
    old_logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0]] * K)
    side.collect_step(planned, planned.groups, np.array([correct]), mask, old_logp, version=step)


def mixed(side: ExperienceSide) -> ExperienceSide:
    side.switch_phase(0.75)
    assert side.phase == MIXED
    return side


# ---------------------------------------------------------------------------------------------------- plan


def test_a_warmup_step_asks_fresh_questions_none_of_those_in_flight():
    side, scorer = make()
    first = side.plan(0, version=0)
    assert first.phase == WARMUP and first.step == 0 and len(first.groups) == B
    assert all(not g.members for g in first.groups) and all(pairs == [] for pairs, _ in scorer.calls)

    again, _ = make()  # the same run, with the first step's questions still in flight
    planned = again.plan(1, version=1, in_flight=frozenset(ids(first.groups)))
    assert len(planned.groups) == B and not set(ids(planned.groups)) & set(ids(first.groups))
    assert planned.version == 1 and planned.step == 1


@pytest.mark.parametrize("mode, replayed", [("argmin", 10), ("argmax", 11)])
def test_a_mixed_step_replays_the_trajectory_the_scorer_ranks_first(mode, replayed):
    side, scorer = make(f"experience.selection_mode={mode}")
    seen(side, "q0", [True, True, False, False])
    seen(side, "q1", [True, True, False, False])
    planned = mixed(side).plan(3, version=2)
    assert planned.phase == MIXED
    assert sorted(ids(planned.groups[:2])) == ["q0", "q1"]  # floor(B * ratio) experiential groups, first
    for g in planned.groups[:2]:
        assert g.members[0].replay is not None and g.members[0].completion_ids == [replayed, 1, 2]
        assert g.members[0].replay.logprobs.tolist() == [-1.0, -2.0, -3.0]
    assert all(not g.members for g in planned.groups[2:])
    [(pairs, metric)] = scorer.calls  # the stored correct trajectories of both questions, by the configured metric
    assert metric is SELECTION_METRICS["entropy"]
    assert sorted((q.id, t.token_ids[0]) for q, t in pairs) == [("q0", 10), ("q0", 11), ("q1", 10), ("q1", 11)]


def test_a_mixed_step_leaves_out_experiential_questions_in_flight():
    side, _ = make()
    for qid in ("q0", "q1", "q2"):
        seen(side, qid, [True, False, False, False])
    planned = mixed(side).plan(3, version=2, in_flight=frozenset({"q0", "q1"}))
    assert ids(planned.groups)[0] == "q2" and planned.groups[0].members[0].replay is not None
    assert not {"q0", "q1"} & set(ids(planned.groups)) and len(planned.groups) == B


# ---------------------------------------------------------------------------------------------------- settle


def test_settle_retires_questions_solved_by_all_their_own_members():
    side, _ = make()
    demo = Member([5], demonstration=True)
    groups = [Group(BY_ID["q0"], [0], [Member([1])] * K),  # 4/4: retired
              Group(BY_ID["q1"], [1], [Member([1])] * K),  # 3/4
              Group(BY_ID["q2"], [2], [demo] + [Member([1])] * (K - 1)),  # 3/3 of its own: retired
              Group(BY_ID["q3"], [3], [demo] + [Member([1])] * (K - 1))]  # only the demonstration: k = 0
    correct = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=bool)
    assert side.settle(groups, correct, step=4) == 2
    assert side.buffer.retired == {"q0", "q2"}
    assert side.ever_correct == {"q0", "q1", "q2"}  # a correct demonstration is not the policy's
    assert side.settle(groups[:1], correct[:1], step=5) == 0  # retired once


def test_settle_retires_nothing_with_retirement_none():
    side, _ = make("experience.retirement=none")
    groups = [Group(BY_ID["q0"], [0], [Member([1])] * K)]
    assert side.settle(groups, np.ones((1, K), bool), step=0) == 0 and not side.buffer.retired
    assert side.ever_correct == {"q0"}


def test_settle_tells_the_replay_policy_each_questions_k():
    side, _ = make("experience.replay_policy=prioritized")
    groups = [Group(BY_ID[q], [0], [Member([1])] * K) for q in ("q0", "q1")]
    side.settle(groups, np.array([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=bool), step=2)
    assert side.replay_policy.success_rate == {"q0": 0.25, "q1": 0.0}


# ---------------------------------------------------------------------------------------------------- refill


def test_refill_from_the_buffer_takes_experiential_questions_not_asked_yet_then_fresh():
    side, _ = make("rollout.zero_variance=replace_from_buffer")
    seen(side, "q0", [True, False, False, False])
    seen(side, "q1", [True, True, False, False])
    planned = mixed(side).plan(3, version=2)
    refill = side.refill(3, planned, asked=frozenset({"q0"}), timer=StageTimer())
    assert len(refill) == 3 and ids(refill)[0] == "q1" and refill[0].members[0].replay is not None
    assert "q0" not in ids(refill) and all(not g.members for g in refill[1:])


@pytest.mark.parametrize("zero_variance, phase", [("backfill", MIXED), ("replace_from_buffer", WARMUP)])
def test_refill_takes_fresh_questions_otherwise(zero_variance, phase):
    side, _ = make(f"rollout.zero_variance={zero_variance}")
    for qid in ("q0", "q1", "q2"):  # more than a step's experiential questions: one is left to refill from
        seen(side, qid, [True, False, False, False])
    if phase == MIXED:
        mixed(side)
    planned = side.plan(3, version=2)
    refill = side.refill(2, planned, asked=frozenset(ids(planned.groups)), timer=StageTimer())
    assert len(refill) == 2 and all(not g.members for g in refill)  # no replay


# ---------------------------------------------------------------------------------------------------- collect, switch


def test_the_warmup_collects_nothing_and_the_mixed_phase_stores_correct_trajectories_with_their_logprobs():
    side, _ = make()
    planned = side.plan(0, version=0)
    groups = [Group(g.question, g.prompt_ids, [Member([7, 1, 2])] * K) for g in planned.groups]
    mask, old_logp = torch.ones(B * K, 3), torch.full((B * K, 3), -0.5)
    correct = np.array([[True, False, False, False]] * B)  # k = 1: a group the mixed phase would collect
    side.collect_step(planned, groups, correct, mask, old_logp, version=0)
    assert len(side.buffer) == 0

    seen(side, "q0", [True, False, True, False], step=2)
    stored = side.buffer.trajectories("q0")
    assert sorted(t.token_ids.tolist()[0] for t in stored) == [10, 12]
    assert all(t.logprobs.tolist() == [-1.0, -2.0, -3.0] and (t.step, t.version) == (2, 2) for t in stored)


def test_a_trained_replay_counts_as_a_use_of_its_trajectory():
    side, _ = make()
    seen(side, "q0", [True, False, False, False])
    replay = side.buffer.trajectories("q0")[0]
    group = Group(BY_ID["q0"], [0], [Member(replay.token_ids.tolist(), replay=replay)] + [Member([9, 9, 9])] * 3)
    planned = PlannedStep(3, MIXED, [group], version=3)
    side.collect_step(planned, [group], np.array([[True, False, False, False]]), torch.ones(K, 3),
                      torch.zeros(K, 3), version=3)
    assert side.buffer.trajectories("q0")[0].uses == 1


@pytest.mark.parametrize("ratio, pass_at_1, switches", [(0.5, 0.5, False), (0.5, 0.51, True), (0.0, 1.0, False)])
def test_the_mixed_phase_starts_once_pass_at_1_exceeds_the_threshold(ratio, pass_at_1, switches):
    side, _ = make(f"experience.ratio={ratio}")
    side.switch_phase(pass_at_1)
    assert side.phase == (MIXED if switches else WARMUP)
    side.switch_phase(0.0)  # for good
    assert side.phase == (MIXED if switches else WARMUP)


def test_state_round_trips():
    side, _ = make()
    seen(side, "q0", [True, True, False, False])
    mixed(side).settle([Group(BY_ID["q1"], [1], [Member([1])] * K)], np.ones((1, K), bool), step=1)
    side.plan(2, version=1)
    state = side.state_dict()
    resumed, _ = make()
    resumed.load_state_dict(state["trainer"], state["buffer"])
    assert resumed.phase == MIXED and resumed.ever_correct == {"q1"} and resumed.buffer.retired == {"q1"}
    assert ids(resumed.plan(3, version=2).groups) == ids(side.plan(3, version=2).groups)

"""experience.replay_policy: exgrpo, rlep, prioritized and prompt_replay, as units and in the trainer (tiny model)."""

import json

import numpy as np
import pytest

from exgrpo.config import ConfigError, config_from_dict
from exgrpo.experience import ExperienceBuffer, build_replay_policy, sample_questions
from exgrpo.experience.policies import PrioritizedReplay
from exgrpo.models import load_policy
from exgrpo.records import MIXED
from exgrpo.training.trainer import ExGRPOTrainer

K = 4


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _buffer(counts):
    """A buffer holding question q<i> with success count counts[i] (one stored trajectory each)."""
    buffer = ExperienceBuffer(K)
    for i, k in enumerate(counts):
        buffer.update_group(f"q{i}", [True] * k + [False] * (K - k), [np.array([1, 2])] * K,
                            [np.zeros(2, np.float32)] * K)
    return buffer


def test_exgrpo_and_prompt_replay_draw_from_the_buckets_like_the_sampler():
    buffer = _buffer([1, 2, 2, 3, 1, 2])
    for name, replays in (("exgrpo", True), ("prompt_replay", False)):
        policy = build_replay_policy(name, buffer, num_generations=K)
        want = sample_questions(buffer.buckets(), 3, np.random.default_rng(7), K)
        assert policy.experiential(3, np.random.default_rng(7), step=1) == want
        assert policy.replays_trajectories is replays and not policy.replays_into_fresh


def test_rlep_re_asks_nothing_and_replays_into_fresh_groups():
    policy = build_replay_policy("rlep", _buffer([1, 2]), num_generations=K)
    assert policy.experiential(8, np.random.default_rng(0), step=1) == []
    assert policy.replays_trajectories and policy.replays_into_fresh


def test_prioritized_draws_in_proportion_to_p_times_one_minus_p():
    policy = PrioritizedReplay(K, retest_every=0)
    for qid, successes in {"a": 1, "b": 2, "c": 0, "d": 4, "e": 3}.items():
        policy.observe(qid, successes, step=1)
    ids, priority = policy.priorities()
    assert ids == ["a", "b", "c", "d", "e"]
    assert priority.tolist() == pytest.approx([0.1875, 0.25, 0.0, 0.0, 0.1875])
    rng = np.random.default_rng(0)
    draws = [policy.experiential(1, rng, step=1)[0] for _ in range(6000)]
    freq = {q: draws.count(q) / len(draws) for q in "abcde"}
    assert freq["c"] == freq["d"] == 0  # solved and unsolved questions carry no signal
    assert freq["b"] == pytest.approx(0.25 / 0.625, abs=0.02) and freq["a"] == pytest.approx(0.3, abs=0.02)
    assert sorted(policy.experiential(10, rng, step=1)) == ["a", "b", "e"]  # at most the questions with signal


def test_prioritized_retests_the_extremes_every_n_steps_and_round_trips_its_state():
    policy = PrioritizedReplay(K, retest_every=5)
    assert policy.experiential(3, np.random.default_rng(0), step=1) == []  # nothing seen yet
    for qid, successes in {"a": 1, "c": 0, "d": 4}.items():
        policy.observe(qid, successes, step=1)
    assert policy.experiential(3, np.random.default_rng(0), step=4) == ["a"]
    assert sorted(policy.experiential(3, np.random.default_rng(0), step=5)) == ["c", "d"]  # the re-test
    policy.observe("c", 2, step=5)  # the re-test found signal: c is back in play
    restored = PrioritizedReplay(K, retest_every=5)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.priorities()[1].tolist() == [0.1875, 0.25, 0.0]


def test_policies_need_the_mixed_phase_and_retest_only_with_prioritized():
    with pytest.raises(ConfigError, match="experience.replay_policy rlep does nothing with experience.ratio 0"):
        config_from_dict({"experience": {"replay_policy": "rlep", "ratio": 0.0}})
    with pytest.raises(ConfigError, match="experience.retest_every applies to experience.replay_policy prioritized"):
        config_from_dict({"experience": {"retest_every": 3}})


def _trainer(policy, steps=6, **experience):
    def first_char(prompts, completions, completion_ids, answer, **_):
        return [1.0 if c[:1] in "abcdefghijklm" else 0.0 for c in completions]

    from conftest import make_questions

    config = config_from_dict({
        "rollout": {"num_generations": K, "max_completion_length": 4},
        "train": {"steps": steps, "prompts_per_step": 4, "mini_batches": 1, "micro_batch_size": 16,
                  "learning_rate": 1e-3, "seed": 3},
        "experience": {"start_threshold": 0.0, "replay_policy": policy, **experience},
        "logging": {"output_dir": "run", "progress": False, "tensorboard": False, "sample_every": 0}})
    model, tok = load_policy("tiny:0")
    return ExGRPOTrainer(model, tok, [first_char], config, make_questions(12))


def test_rlep_replays_a_stored_success_into_the_group_of_a_fresh_question():
    trainer = _trainer("rlep")
    trainer.experience.phase = MIXED
    for q in trainer.experience.question_pool.questions.values():  # every question has a stored success
        trainer.experience.buffer.update_group(q.id, [True, False, False, False], [np.array([5, 6])] * K,
                                    [np.zeros(2, np.float32)] * K)
    metrics = trainer.train_step()
    groups = trainer.last_step.groups
    assert len(groups) == 4 and all(g.members[0].replay is not None for g in groups)
    assert metrics["experience/replayed"] == 4 and metrics["generation/rollouts"] == 4 * (K - 1)


@pytest.mark.parametrize("policy", ["prompt_replay", "prioritized"])
def test_prompt_level_policies_re_ask_questions_with_fresh_members_only(policy):
    trainer = _trainer(policy, retest_every=0) if policy == "prioritized" else _trainer(policy)
    trainer.experience.phase = MIXED
    for i in range(6):
        trainer.experience.buffer.update_group(f"q{i}", [True, True, False, False], [np.array([5, 6])] * K,
                                    [np.zeros(2, np.float32)] * K)
        trainer.experience.replay_policy.observe(f"q{i}", 2, step=0)
    trainer.train_step()
    asked = [g.question.id for g in trainer.last_step.groups]
    assert set(asked[:2]) <= {f"q{i}" for i in range(6)}  # floor(4 * 0.5) re-asked questions come first
    assert all(m.replay is None for g in trainer.last_step.groups for m in g.members)


@pytest.mark.parametrize("policy", ["rlep", "prioritized", "prompt_replay"])
def test_tiny_model_runs_through_the_mixed_phase_with_each_policy(policy):
    trainer = _trainer(policy, steps=5)
    history = trainer.train()
    assert history[-1]["phase"] == "mixed"
    replayed = sum(m["experience/replayed"] for m in history)
    assert replayed > 0 if policy == "rlep" else replayed == 0
    state = trainer.state_dict()["trainer"]["replay_policy"]
    assert bool(state) is (policy == "prioritized") and json.dumps(state)


def test_excluded_questions_never_shift_the_bucket_draw():
    """Questions in flight (async) or already asked (replace_from_buffer) are excluded from the draw itself: the
    bucket scheme then draws over what is left. Drawing extra and dropping the excluded, as before, collapsed the
    draw onto the lowest buckets (the ids come back grouped by bucket in ascending k)."""
    k_of = {k: size for k, size in zip(range(1, 8), (30, 40, 50, 50, 50, 40, 30))}
    buffer = ExperienceBuffer(8)
    for k, size in k_of.items():
        for i in range(size):
            buffer.update_group(f"k{k}-{i}", [True] * k + [False] * (8 - k), [np.array([1, 2])] * 8,
                                [np.zeros(2, np.float32)] * 8)
    policy = build_replay_policy("exgrpo", buffer, num_generations=8)
    in_flight = frozenset(f"fresh-{i}" for i in range(128))  # none of them in the buffer
    for seed in range(20):
        want = policy.experiential(64, np.random.default_rng(seed), step=1)
        assert policy.experiential(64, np.random.default_rng(seed), step=1, exclude=in_flight) == want
    asked = frozenset(f"k4-{i}" for i in range(25))  # half of bucket 4, in the buffer
    rng = np.random.default_rng(0)
    drawn = [q for _ in range(200) for q in policy.experiential(64, rng, step=1, exclude=asked)]
    assert not asked & set(drawn)
    high = sum(q.startswith(("k5", "k6", "k7")) for q in drawn) / len(drawn)
    assert 0.25 < high < 0.40, high  # k >= 5 keeps its share (0.31 without any exclusion); it fell to 0 before

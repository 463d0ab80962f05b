"""rollout.zero_variance: groups whose rewards are all equal are kept (released), backfilled with fresh questions
(DAPO's dynamic sampling) or replaced from the buffer; with scripted completions and a real tiny model."""

import numpy as np
import pytest
import torch

from exgrpo.config import ConfigError, config_from_dict
from exgrpo.data import PromptEncoder
from exgrpo.training.generation import zero_variance
from exgrpo.models import load_policy
from exgrpo.records import MIXED
from exgrpo.training.trainer import ExGRPOTrainer

K, B = 2, 4


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _config(zero="backfill", rounds=3, **sections):
    base = {"rollout": {"num_generations": K, "max_completion_length": 4, "zero_variance": zero},
            "train": {"steps": 4, "prompts_per_step": B, "mini_batches": 1, "micro_batch_size": 16,
                      "learning_rate": 1e-3, "seed": 5},
            "experience": {"start_threshold": 0.0},
            "logging": {"output_dir": "run", "progress": False, "tensorboard": False, "sample_every": 0}}
    if zero != "keep":
        base["rollout"]["max_generation_rounds"] = rounds
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def _scripted(tiny_policy, scripted_engine, questions, outcomes, zero="backfill", rounds=3, reward=None, **sections):
    """A trainer whose question i's members complete with the letters outcomes[i] (one per member)."""
    model, tok = tiny_policy
    qs = questions(len(outcomes))
    by_prompt = {tuple(PromptEncoder(tok)(q)): outcomes[i] for i, q in enumerate(qs)}
    eos = tok.eos_token_id

    def respond(prompt, n):
        return tok(by_prompt[tuple(prompt)][n % K], add_special_tokens=False)["input_ids"] + [eos], False

    def letter_a(prompts, completions, completion_ids, answer, **_):
        return [float(c.startswith("a")) for c in completions]

    engine = scripted_engine(respond)
    trainer = ExGRPOTrainer(model, tok, [reward or letter_a], _config(zero, rounds, **sections), qs, engine=engine)
    return trainer, engine


def test_zero_variance_is_an_exact_test_on_the_rewards():
    total = np.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.7], [0.3, 0.3]])
    assert zero_variance(total).tolist() == [True, True, False, False, True]


def test_keep_trains_on_every_group_and_counts_the_zero_variance_ones(tiny_policy, scripted_engine, questions):
    trainer, engine = _scripted(tiny_policy, scripted_engine, questions, ["ab", "bb"] * 4, zero="keep")
    metrics = trainer.train_step()
    assert len(trainer.last_step.groups) == B and metrics["generation/rounds"] == 1
    assert metrics["generation/zero_variance_fraction"] == 0.5 and metrics["generation/rollouts"] == B * K
    assert metrics["generation/informative_groups"] == 2 and len(engine.calls) == 1


def test_backfill_drops_zero_variance_groups_and_rolls_out_fresh_ones(tiny_policy, scripted_engine, questions):
    # 4 informative questions among 12; the all-"a" ones are solved K/K and retire even though they are dropped
    outcomes = ["ab", "bb", "aa", "bb", "ab", "bb", "aa", "ab", "bb", "ab", "bb", "aa"]
    trainer, engine = _scripted(tiny_policy, scripted_engine, questions, outcomes, rounds=6)
    metrics = trainer.train_step()
    groups = trainer.last_step.groups
    assert len(groups) == B and not zero_variance(trainer.last_step.rewards.total).any()
    asked = metrics["generation/rollouts"] / K
    assert metrics["generation/rounds"] == len(engine.calls) > 1
    assert metrics["generation/informative_groups"] == B
    assert metrics["generation/rollouts_per_informative_group"] == asked * K / B
    assert metrics["generation/zero_variance_fraction"] == (asked - B) / asked
    solved = [f"q{i}" for i, o in enumerate(outcomes) if o == "aa"]
    assert metrics["experience/retired_this_step"] == sum(trainer.experience.buffer.is_retired(q) for q in solved) > 0
    # every request of the step had its own seed
    seeds = [s for _, _, call_seeds in engine.calls for s in call_seeds]
    assert len(set(seeds)) == len(seeds)


def test_backfill_stops_at_the_round_budget_and_trains_on_what_it_has(tiny_policy, scripted_engine, questions):
    trainer, engine = _scripted(tiny_policy, scripted_engine, questions, ["bb"] * 20, rounds=3)
    metrics = trainer.train_step()
    assert metrics["generation/rounds"] == 3 and len(engine.calls) == 3
    assert metrics["generation/rollouts"] == 3 * B * K and metrics["generation/informative_groups"] == 0
    # nothing informative: the last round's groups are trained on (A = 0), so the step still has a batch
    assert len(trainer.last_step.groups) == B and torch.all(trainer.last_step.advantages == 0)


def test_backfill_keeps_groups_of_unequal_continuous_rewards(tiny_policy, scripted_engine, questions):
    def graded(prompts, completions, completion_ids, answer, **_):  # all below the success threshold
        return [{"a": 0.5, "b": 0.7, "c": 0.3}[c[0]] for c in completions]

    outcomes = ["ab", "cc"] * 4  # equal success flags everywhere; unequal reward values in the "ab" groups
    trainer, _ = _scripted(tiny_policy, scripted_engine, questions, outcomes, rounds=8, reward=graded)
    trainer.train_step()
    kept = {g.question.id for g in trainer.last_step.groups}
    assert kept == {f"q{i}" for i in range(0, 8, 2)}


def test_replace_from_buffer_refills_from_the_buffer_in_the_mixed_phase(tiny_policy, scripted_engine, questions):
    """q0..q3 are stored in the buffer with a correct trajectory; every fresh rollout is wrong, so fresh groups are
    zero-variance and their slots are refilled with experiential questions not asked yet this step."""
    model, tok = tiny_policy
    trainer, engine = _scripted(tiny_policy, scripted_engine, questions, ["bb"] * 16, zero="replace_from_buffer",
                                experience={"start_threshold": 0.0, "ratio": 0.25})
    a = np.array(tok("a", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    for i in range(4):
        trainer.experience.buffer.update_group(f"q{i}", [True, False], [a, a], [np.zeros(len(a), np.float32)] * 2)
    trainer.experience.phase = MIXED
    metrics = trainer.train_step()
    replayed = [g.question.id for g in trainer.last_step.groups if g.members[0].replay is not None]
    assert len(replayed) > 1  # one experiential question from experience.ratio, the others refilled
    assert len(set(replayed)) == len(replayed) and set(replayed) <= {"q0", "q1", "q2", "q3"}
    assert metrics["experience/replayed"] == len(replayed) and metrics["generation/rounds"] >= 2
    assert metrics["generation/rollouts"] == sum(n for n, _, _ in engine.calls)  # replays are not sampled


def test_bad_combinations_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="replace_from_buffer needs a buffer: experience.ratio"):
        _config("replace_from_buffer", experience={"ratio": 0.0})
    with pytest.raises(ConfigError, match="rollout.max_generation_rounds applies to"):
        _config("keep", rollout={"num_generations": K, "max_generation_rounds": 5})
    with pytest.raises(ConfigError, match="rollout.max_generation_rounds"):
        _config("backfill", rounds=0)


@pytest.mark.parametrize("mode", ["backfill", "replace_from_buffer"])
def test_tiny_model_runs_reach_replays_in_each_mode(mode):
    def first_char(prompts, completions, completion_ids, answer, **_):
        return [1.0 if c[:1] in "abcdefghijklm" else 0.0 for c in completions]

    model, tok = load_policy("tiny:0")
    config = _config(mode, rollout={"num_generations": 4, "max_completion_length": 4, "zero_variance": mode},
                     train={"steps": 5, "prompts_per_step": 4, "seed": 3})
    from conftest import make_questions

    trainer = ExGRPOTrainer(model, tok, [first_char], config, make_questions(40))
    history = trainer.train()
    assert history[-1]["phase"] == "mixed" and sum(m["experience/replayed"] for m in history) > 0
    assert any(m["generation/rounds"] > 1 for m in history)

"""External guidance (guidance.*): reference solutions from the data as off-policy group members, shaped by
f(pi) = pi / (pi + gamma); on the tiny model with scripted rollouts."""

import numpy as np
import pytest
import torch

from exgrpo.config import ConfigError, config_from_dict
from exgrpo.data import DataError, PromptEncoder, Question
from exgrpo.training.groups import pack_groups
from exgrpo.training.guidance import demonstration_ids
from exgrpo.learner.objective import LossSettings, token_losses
from exgrpo.records import MIXED
from exgrpo.training.trainer import ExGRPOTrainer

K = 4


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _questions(demos):
    return [Question(f"q{i}", ({"role": "user", "content": f"q {i}"},), "a", {} if d is None else {"ref": d})
            for i, d in enumerate(demos)]


def test_demonstrations_are_tokenised_with_eos_and_the_long_ones_dropped(tiny_policy):
    _, tok = tiny_policy
    qs = _questions(["abc", ["ab", "x" * 50, ""], None, []])
    ids, dropped = demonstration_ids(qs, "ref", tok, max_length=10)
    eos = tok.eos_token_id
    assert ids["q0"] == [tok("abc", add_special_tokens=False)["input_ids"] + [eos]]
    assert ids["q1"] == [tok("ab", add_special_tokens=False)["input_ids"] + [eos]]  # the 51-token one is dropped
    assert dropped == 1 and "q2" not in ids and "q3" not in ids  # absent, null-like and empty rows have none


def test_bad_demonstration_columns_are_named(tiny_policy):
    _, tok = tiny_policy
    with pytest.raises(DataError, match="guidance.field 'target' is not a column of the training data"):
        demonstration_ids(_questions(["a"]), "target", tok, 8)
    with pytest.raises(DataError, match="question q1: guidance.field 'ref' must hold a string or a list"):
        demonstration_ids(_questions(["a", 3]), "ref", tok, 8)


def test_demonstration_tokens_are_weighted_by_pi_over_pi_plus_gamma():
    logp = torch.log(torch.tensor([[0.5, 0.1, 0.9]])).requires_grad_()
    zeros = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, True]])
    settings = LossSettings(clip_fresh=False, guidance_gamma=0.1)
    losses, parts = token_losses(logp, zeros, zeros, torch.tensor([2.0]), mask, settings, demonstration_mask=mask)
    pi = torch.tensor([0.5, 0.1, 0.9])
    assert torch.allclose(parts["shaped"][0], pi / (pi + 0.1))
    losses.sum().backward()
    # d/dlogp of -A f(pi) = -A * gamma * pi / (pi + gamma)^2: small where pi is near 0 or 1, as LUFFY intends
    assert torch.allclose(logp.grad[0], -2.0 * 0.1 * pi / (pi + 0.1) ** 2)


def test_bad_guidance_settings_are_refused():
    with pytest.raises(ConfigError, match=r"guidance.members must be in \[1, num_generations - 1 = 3\]"):
        config_from_dict({"rollout": {"num_generations": K}, "guidance": {"field": "ref", "members": 4}})
    with pytest.raises(ConfigError, match="guidance.members, mode and gamma apply only with guidance.field set"):
        config_from_dict({"guidance": {"mode": "fallback"}})


def _trainer(tiny_policy, scripted_engine, demos, own, mode="always", experience=None):
    """Question i has demonstrations demos[i]; the policy's own rollouts of it cycle through the letters own[i]."""
    model, tok = tiny_policy
    qs = _questions(demos)
    by_prompt = {tuple(PromptEncoder(tok)(q)): own[i] for i, q in enumerate(qs)}
    eos = tok.eos_token_id
    def respond(prompt, n):  # own[i] cycles through its letters, one per rollout
        letters = by_prompt[tuple(prompt)]
        return tok(letters[n % len(letters)], add_special_tokens=False)["input_ids"] + [eos], False

    engine = scripted_engine(respond)

    def letter_a(prompts, completions, completion_ids, answer, **_):
        return [float(c.startswith("a")) for c in completions]

    config = config_from_dict({
        "rollout": {"num_generations": K, "max_completion_length": 6},
        "train": {"steps": 3, "prompts_per_step": 2, "mini_batches": 1, "micro_batch_size": 16,
                  "learning_rate": 1e-3, "seed": 1},
        "experience": experience or {"start_threshold": 0.9},
        "guidance": {"field": "ref", "members": 2, "mode": mode},
        "logging": {"output_dir": "run", "progress": False, "tensorboard": False, "sample_every": 0}})
    return ExGRPOTrainer(model, tok, [letter_a], config, qs, engine=engine), engine, tok


def test_demonstrations_join_groups_from_step_0_after_the_chat_templated_prompt(tiny_policy, scripted_engine):
    trainer, engine, tok = _trainer(tiny_policy, scripted_engine, [["ab", "ac", "ad"], None], ["b", "b"])
    metrics = trainer.train_step()
    step = trainer.last_step
    group = next(g for g in step.groups if g.question.id == "q0")
    assert [m.demonstration for m in group.members] == [True, True, False, False]
    # the member is the templated prompt followed by the reference solution and EOS, as a rollout would be
    row = [g.question.id for g in step.groups].index("q0") * K
    text = tok.decode(step.batch.input_ids[row][step.batch.attention_mask[row].bool()])
    assert text.endswith("<|im_start|>assistant\nab" + tok.eos_token)
    assert metrics["guidance/demonstrations"] == 2 and metrics["guidance/demonstration_reward"] == 1.0
    assert metrics["generation/rollouts"] == 2 * K - 2 == sum(n for n, _, _ in engine.calls)
    assert step.batch.demonstration_mask[row].any() and not step.batch.demonstration_mask[row + 2].any()
    assert step.advantages[[g.question.id for g in step.groups].index("q0")].tolist() == [0.5, 0.5, -0.5, -0.5]


def test_k_counts_the_policys_own_members_and_demonstrations_are_never_stored(tiny_policy, scripted_engine):
    trainer, _, tok = _trainer(tiny_policy, scripted_engine, [["ab"], ["ab"]], ["a", "b"])
    trainer.experience.phase = MIXED
    trainer.train_step()
    a = tok("a", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # q0: demo + 3 correct own rollouts: every own member correct, retired; q1: demo correct, own wrong: k = 0,
    # nothing of its own to store
    assert trainer.experience.buffer.is_retired("q0") and "q1" not in trainer.experience.buffer
    buffer = trainer.experience.buffer
    assert all(t.token_ids.tolist() == a for q in buffer.questions() for t in buffer.trajectories(q))


def test_fallback_stops_guiding_a_question_once_the_policy_solves_it(tiny_policy, scripted_engine):
    trainer, _, _ = _trainer(tiny_policy, scripted_engine, [["ab"], ["ab"]], ["ab", "b"], mode="fallback")
    first = trainer.train_step()
    assert first["guidance/demonstrations"] == 2  # each question's one demonstration
    assert trainer.experience.ever_correct == {"q0"}
    assert not trainer.experience.buffer.is_retired("q0")
    second = trainer.train_step()
    assert second["guidance/demonstrations"] == 1  # q1 only: the policy has answered q0 correctly itself
    restored, _, _ = _trainer(tiny_policy, scripted_engine, [["ab"], ["ab"]], ["ab", "b"], mode="fallback")
    restored.load_state_dict(trainer.state_dict())
    assert restored.experience.ever_correct == {"q0"}
    from exgrpo.runtime.checkpoint import RENAMED_STATE  # old checkpoints are read under the names written now

    assert set(RENAMED_STATE.values()) <= set(trainer.state_dict()["trainer"])


def test_pack_groups_marks_demonstrations_as_off_policy_rows(tiny_policy, scripted_engine):
    trainer, _, _ = _trainer(tiny_policy, scripted_engine, [["ab"], None], ["b", "b"])
    trainer.train_step()
    batch = pack_groups(trainer.last_step.groups, 0)
    rows = batch.demonstration_mask.any(-1)
    assert rows.sum() == 1 and torch.equal(batch.replay_mask.any(-1), rows)
    assert np.allclose(batch.recorded_logp[rows].numpy(), 0)


def test_the_delayed_start_reads_the_pass_at_1_of_the_policys_own_members(tiny_policy, scripted_engine):
    # both questions: 2 correct demonstrations + 2 wrong own rollouts; counting demonstrations, Pass@1 = 0.5 > 0.35
    trainer, _, _ = _trainer(tiny_policy, scripted_engine, [["ab", "ac"], ["ab", "ac"]], ["b", "b"],
                             experience={"start_threshold": 0.35})
    metrics = trainer.train_step()
    assert metrics["batch/pass_at_1"] == 0.5  # the step's members, demonstrations included
    assert trainer.experience.phase == "warmup"  # the policy's own Pass@1 is 0


def test_replay_metrics_and_the_replay_policy_see_no_demonstrations(tiny_policy, scripted_engine):
    trainer, _, _ = _trainer(tiny_policy, scripted_engine, [["ab"], ["ab"]], ["b", "ab"],
                             experience={"start_threshold": 0.9, "replay_policy": "prioritized"})
    metrics = trainer.train_step()
    assert metrics["guidance/demonstrations"] == 2
    assert not any(k.startswith("replay/") for k in metrics)  # no replayed trajectory in the step
    # q0: demo correct, own wrong -> k = 0; q1: demo correct, own "a", "b", "a" -> k = 2 of K
    assert trainer.experience.replay_policy.success_rate == {"q0": 0.0, "q1": 2 / K}

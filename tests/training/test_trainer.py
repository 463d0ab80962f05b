"""The trainer on a tiny random-weight model: phases, buffer, replay, retirement, learning."""

import json
import math

import numpy as np
import pytest
import torch

from exgrpo.config import config_from_dict
from exgrpo.data import Question
from exgrpo.errors import EngineError
from exgrpo.models import load_policy
from exgrpo.records import MIXED, WARMUP
from exgrpo.training.trainer import ExGRPOTrainer

torch.set_num_threads(2)
GOOD = "abcdefghijklmnopqrstuvwxyz"


def _questions(n=24):
    return [Question(id=f"q{i}", messages=({"role": "user", "content": f"q {i}"},), answer=str(i), columns={})
            for i in range(n)]


def first_char_reward(prompts, completions, completion_ids, answer, **_):
    """1 when the completion starts with a lowercase letter: learnable, and ~25% likely at random init."""
    return [1.0 if c[:1] in GOOD else 0.0 for c in completions]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # train() writes its logs to logging.output_dir, relative to here


def _config(**sections):
    base = {
        "rollout": {"num_generations": 4, "max_completion_length": 4},
        "train": {"steps": 6, "prompts_per_step": 8, "mini_batches": 2, "micro_batch_size": 16,
                  "learning_rate": 3e-3, "seed": 3},
        "experience": {"start_threshold": 0.1},
        "logging": {"output_dir": "run", "progress": False, "tensorboard": False, "sample_every": 0},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def _trainer(config, reward=first_char_reward, questions=None, seed=0):
    model, tokenizer = load_policy(f"tiny:{seed}")
    return ExGRPOTrainer(model, tokenizer, [reward], config, questions or _questions())


def test_warmup_switch_collection_and_replay(tmp_path):
    trainer = _trainer(_config())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    log = []
    for _ in range(6):
        buffer_before = {q: {t.token_ids.tobytes(): t.logprobs for t in trainer.experience.buffer.trajectories(q)}
                         for q in trainer.experience.buffer.questions()}
        metrics = trainer.train_step()
        log.append(metrics)
        for g in trainer.last_step.groups:
            replays = [m for m in g.members if m.replay is not None]
            assert len(g.members) == 4 and len(replays) <= 1
            if replays:  # a replay is a stored trajectory, member 0, carrying its recorded log-probs
                assert g.members[0] is replays[0]
                recorded = buffer_before[g.question.id][np.asarray(replays[0].completion_ids, np.int32).tobytes()]
                assert np.array_equal(replays[0].replay.logprobs, recorded)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    # the first step is warm-up; its Pass@1 > 0.1 switches; collection from step 2, replay from step 3
    assert log[0]["phase"] == WARMUP and log[0]["batch/pass_at_1"] > 0.1
    assert all(m["phase"] == MIXED for m in log[1:])
    assert log[0]["experience/trajectories"] == 0 and log[0]["experience/replayed"] == 0
    assert log[1]["experience/replayed"] == 0 and log[1]["experience/trajectories"] > 0
    assert all(m["experience/replayed"] > 0 for m in log[2:])
    assert all(m["experience/replayed"] <= 4 for m in log)  # floor(B * 0.5)
    assert any("replay/ratio_mean" in m for m in log[2:])
    assert all(len(trainer.last_step.groups) == 8 for _ in [0])  # exactly B questions per step
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_entropy_of_replayed_and_fresh_correct_trajectories():
    import copy

    from exgrpo.learner.forward import token_logprobs

    trainer = _trainer(_config(train={"mini_batches": 1}))  # one mini-batch: the forward is the pre-update policy
    for _ in range(3):
        before = copy.deepcopy(trainer.model)
        metrics = trainer.train_step()
    step = trainer.last_step
    members = [m for g in step.groups for m in g.members]
    correct = (step.rewards.total >= 1.0).reshape(-1)
    with torch.no_grad():
        _, entropy = token_logprobs(before.eval(), step.batch, 1.0, with_entropy=True)
    mask = step.batch.completion_mask
    for name, rows in (("entropy/replayed", [m.replay is not None for m in members]),
                       ("entropy/fresh_correct", [m.replay is None and c for m, c in zip(members, correct)])):
        rows = torch.tensor(rows)
        assert rows.any()
        expected = float((entropy[rows] * mask[rows]).sum() / mask[rows].sum())
        assert metrics[name] == pytest.approx(expected, rel=1e-4), name
    assert metrics["entropy/replayed"] != metrics["entropy/fresh_correct"]


def test_replays_know_their_age_version_and_use_count_and_exgrpo_buffer_shows_them():
    """Every stored trajectory records the step and weights version that produced it and how often it was trained
    on as a replay; replay metrics give the age; `exgrpo buffer RUN --json` reports the same buffer."""
    from collections import Counter

    from conftest import run_cli

    trainer = _trainer(_config(train={"steps": 6}))  # two mini-batches: the version advances 2 per step
    uses, seen = Counter(), []

    def on_step(step, metrics):
        replays = [g for g in trainer.last_step.groups if g.members[0].replay is not None]
        for g in replays:
            t = g.members[0].replay
            assert t.version == 2 * t.step and g.members[1].policy_version == 2 * (step - 1)
            assert t.uses == uses[g.question.id, t.token_ids.tobytes()]  # earlier replays of it, counted
            uses[g.question.id, t.token_ids.tobytes()] += 1
        if replays:
            ages = [step - 1 - g.members[0].replay.step for g in replays]
            assert metrics["replay/age_mean"] == pytest.approx(np.mean(ages)) and min(ages) >= 1
            assert metrics["replay/version_lag_mean"] == pytest.approx(2 * np.mean(ages))
            seen.append(step)

    trainer.train(on_step=on_step)
    assert len(seen) >= 3
    buffer = trainer.experience.buffer
    stored = {(q, t.token_ids.tobytes()): t for q in buffer.questions() for t in buffer.trajectories(q)}
    assert all(t.uses == uses[key] for key, t in stored.items()) and any(t.uses > 0 for t in stored.values())

    result = run_cli(["buffer", "run", "--json", "--examples", "2"])
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["step"] == 6 and summary["questions"] == len(trainer.experience.buffer)
    assert summary["trajectories"] == len(stored) and summary["retired"] == trainer.experience.buffer.num_retired
    assert sum(summary["uses_histogram"].values()) == len(stored)
    assert summary["uses_histogram"].get("0", 0) == sum(t.uses == 0 for t in stored.values())
    assert sum(b["questions"] for b in summary["buckets"]) == len(trainer.experience.buffer)
    example = summary["examples"][0]
    first = trainer.experience.buffer.trajectories(example["question_id"])[0]
    assert example["trajectories"][0]["text"] == trainer.tokenizer.decode(first.token_ids.tolist(),
                                                                         skip_special_tokens=True)
    assert example["trajectories"][0]["age"] == 6 - first.step
    tables = run_cli(["buffer", "run"])
    assert tables.returncode == 0 and "buckets" in tables.stdout and example["question_id"] in tables.stdout


def test_threshold_not_crossed_stays_in_warmup():
    trainer = _trainer(_config(experience={"start_threshold": 0.99}, train={"steps": 2}))
    history = trainer.train()
    assert [m["phase"] for m in history] == [WARMUP, WARMUP]
    assert len(trainer.experience.buffer) == 0


def test_ratio_zero_is_plain_grpo_and_keeps_buffer_empty():
    trainer = _trainer(_config(experience={"ratio": 0.0, "start_threshold": 0.0}, train={"steps": 3}))
    history = trainer.train()
    assert all(m["phase"] == WARMUP for m in history)
    assert len(trainer.experience.buffer) == 0 and trainer.experience.buffer.num_trajectories == 0
    assert all(m["experience/replayed"] == 0 for m in history)


EASY = {f"q{i}" for i in range(6)}


def easy_or_first_char(prompts, completions, completion_ids, answer, **_):
    """The easy questions are always right (K/K: retired); the rest depend on the first character."""
    return [1.0 if f"q{a}" in EASY else float(c[:1] in GOOD) for c, a in zip(completions, answer)]


def _seen_after_retirement(trainer, steps: int) -> list[str]:
    seen, retired = [], set()
    for _ in range(steps):
        trainer.train_step()
        seen += list({g.question.id for g in trainer.last_step.groups} & retired)
        retired = set(trainer.experience.buffer.retired)
    return seen


def test_retired_questions_are_never_drawn_again_with_immediate_retirement():
    trainer = _trainer(_config(train={"steps": 8}, experience={"retirement": "immediate"}), reward=easy_or_first_char)
    assert not _seen_after_retirement(trainer, 8)
    retired = set(trainer.experience.buffer.retired)
    assert EASY <= retired and not (set(trainer.experience.buffer.questions()) & retired)


def test_released_retirement_leaves_a_small_pool_whole_and_none_retires_nothing():
    """24 questions, 8 per step: never more than 8 + 20, so released retirement keeps drawing retired questions as
    fresh ones (never as experiential ones); retirement none (the paper's GRPO baseline) retires nothing."""
    released = _trainer(_config(train={"steps": 8}), reward=easy_or_first_char)
    assert set(_seen_after_retirement(released, 8)) & EASY
    assert EASY <= released.experience.buffer.retired and released.experience.question_pool.remaining == 24
    grpo = _trainer(_config(train={"steps": 4}, experience={"ratio": 0.0, "retirement": "none"}),
                    reward=easy_or_first_char)
    history = grpo.train()
    assert grpo.experience.buffer.num_retired == 0 and all(m["experience/retired"] == 0 for m in history)


def test_pool_exhaustion_ends_cleanly():
    def always_right(prompts, completions, completion_ids, answer, **_):
        return [1.0] * len(completions)

    trainer = _trainer(_config(train={"steps": 10}, experience={"retirement": "immediate"}), reward=always_right,
                       questions=_questions(8))
    history = trainer.train()
    assert len(history) == 1 and trainer.experience.question_pool.remaining == 0


def test_tiny_model_learns_a_rewarded_behaviour():
    """Learning, not just running: the rewarded first character goes from ~25% to > 80% within 25 steps."""
    config = _config(train={"steps": 25, "learning_rate": 1e-2, "mini_batches": 1, "micro_batch_size": 32},
                     rollout={"num_generations": 4, "max_completion_length": 2})
    trainer = _trainer(config)
    history = trainer.train()
    first = np.mean([m["reward"] for m in history[:3]])
    last = np.mean([m["reward"] for m in history[-3:]])
    assert first < 0.5 and last > 0.8, (first, last)


def test_same_seed_same_run_bit_for_bit():
    """docs/reliability.md: same seed, machine, software and thread count give the same run, to the bit."""
    runs = [_trainer(_config(train={"steps": 3}, logging={"output_dir": name})) for name in ("a", "b")]
    histories = [[{k: v for k, v in m.items() if not k.startswith("time/") and k != "tokens_per_second"}
                  for m in t.train()] for t in runs]
    assert histories[0] == histories[1] and histories[0][-1]["phase"] == MIXED
    for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(p, q)


def test_shared_prompt_forward_matches_the_full_forward():
    """Rows sharing a prompt run it once; log-probs, entropies and gradients equal a full forward per row."""
    from exgrpo.learner.forward import token_logprobs
    from exgrpo.tensors import pack

    trainer = _trainer(_config())
    prompts = [trainer.prompt_ids(q) for q in _questions(12)[::5]]  # "q 10" is longer: left padding differs
    completions = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    batch = pack([(p, c, None) for p in prompts for c in completions], trainer.tokenizer.pad_token_id)
    grouped = torch.arange(12)  # consecutive rows share prompts: the shared path
    interleaved = torch.tensor([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])  # no neighbours share: the full path
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    results = []
    for rows in (grouped, interleaved):
        logp, entropy = token_logprobs(trainer.model, batch, 1.0, rows, with_entropy=True)
        order = rows.argsort()
        logp, entropy = logp[order], entropy[order]
        mask = batch.completion_mask
        grads = torch.autograd.grad(((logp + entropy) * mask).sum(), params)
        results.append((logp * mask, entropy * mask, grads))
    (lp_a, ent_a, grad_a), (lp_b, ent_b, grad_b) = results
    torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_a, ent_b, atol=1e-5, rtol=1e-5)
    for a, b in zip(grad_a, grad_b):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_an_engine_short_of_the_weight_receiving_role_is_refused(tiny_policy, questions):
    """An engine with a copy of the weights written before WeightReceiver.takes_snapshots: it was never pushed to
    (the role is decided by type since holds_copy stopped deciding it), sampling from its first weights."""
    class OlderEngine:
        holds_copy, reports_logprobs, weights_version = True, False, 0

        def generate(self, prompt_ids, sampling, seeds):
            raise AssertionError("refused before sampling")

        def push_weights(self, version, snapshot=None):
            self.weights_version = version

        def close(self):
            pass

    model, tok = tiny_policy
    with pytest.raises(EngineError, match="^OlderEngine has push_weights but no takes_snapshots: an engine that "):
        ExGRPOTrainer(model, tok, [first_char_reward], _config(), questions(8), engine=OlderEngine())


def test_one_mixed_step_against_hand_computed_advantages_and_loss(tiny_policy, scripted_engine, questions):
    """K = 2, B = 2 in the mixed phase. q0 replays its stored trajectory "ab<eos>", recorded with log-probs ln 3
    below the current policy's (so w = 3 on each of its tokens), plus one fresh rollout "zz<eos>"; q1 gets two fresh
    rollouts, "zzz<eos>" and "aaaa" (truncated). The reward is 1 for a completion starting with "a"."""
    from exgrpo.data import PromptEncoder
    from exgrpo.learner.forward import token_logprobs
    from exgrpo.tensors import pack

    model, tok = tiny_policy
    eos = tok.eos_token_id

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    qs = questions(2)
    prompt = {q.id: PromptEncoder(tok)(q) for q in qs}
    script = {tuple(prompt["q0"]): [(encode("zz") + [eos], False)],
              tuple(prompt["q1"]): [(encode("zzz") + [eos], False), (encode("aaaa"), True)]}
    engine = scripted_engine(lambda p, n: script[tuple(p)][n])
    config = _config(rollout={"num_generations": 2, "max_completion_length": 4},
                     train={"prompts_per_step": 2, "mini_batches": 1, "micro_batch_size": 8},
                     objective={"entropy_coef": 0.0, "normalizer": 10.0, "beta": 0.1})

    def starts_with_a(prompts, completions, completion_ids, answer, **_):
        return [float(c.startswith("a")) for c in completions]

    trainer = ExGRPOTrainer(model, tok, [starts_with_a], config, qs, engine=engine)

    def current_logp(question_id, ids):
        with torch.no_grad():
            return token_logprobs(model, pack([(prompt[question_id], ids, None)], tok.pad_token_id), 1.0)[0][0]

    replay_ids = encode("ab") + [eos]
    recorded = (current_logp("q0", replay_ids) - math.log(3)).numpy()
    trainer.experience.buffer.update_group("q0", [True, False], [np.array(replay_ids), np.array(encode("x"))],
                                [recorded, np.zeros(1, np.float32)])
    trainer.experience.phase = MIXED
    state = trainer.experience.question_pool.state_dict()
    if trainer.experience.question_pool.draw(1)[0].id != "q1":  # make q1 the next fresh question
        state = trainer.experience.question_pool.state_dict()
    trainer.experience.question_pool.load_state_dict(state)
    behaviour_q1 = current_logp("q1", encode("aaaa"))

    metrics = trainer.train_step()

    step = trainer.last_step
    assert [g.question.id for g in step.groups] == ["q0", "q1"]
    assert step.rewards.total.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert step.advantages.tolist() == [[0.5, -0.5], [-0.5, 0.5]]
    assert step.batch.replay_mask[0].tolist() == [True, True, True, False] and not step.batch.replay_mask[1:].any()
    assert np.array_equal(step.batch.recorded_logp[0, :3].numpy(), recorded)
    # token sum / 10: replay 3 tokens of -A*f(3) = -0.5 * 3/3.1; fresh tokens -A*r with r = 1 (one mini-batch)
    expected_loss = (-0.5 * 3 * (3 / 3.1) + 0.5 * 3 + 0.5 * 4 - 0.5 * 4) / 10
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4)
    assert metrics["replay/ratio_mean"] == pytest.approx(3.0, rel=1e-4)
    assert metrics["replay/shaped_weight_mean"] == pytest.approx(3 / 3.1, rel=1e-4)
    assert metrics["ratio/mean"] == 1.0 and metrics["reward"] == 0.5 and metrics["reward_std"] == 0.5
    assert metrics["experience/replayed"] == 1 and metrics["completions/clipped_ratio"] == pytest.approx(1 / 3)
    assert engine.pushes == [1]
    # collection: q1 (1 of 2 correct) is stored with its pre-update log-probs; q0's replay is not stored twice
    assert trainer.experience.buffer.bucket_of("q1") == 1 and len(trainer.experience.buffer.trajectories("q0")) == 1
    (stored,) = trainer.experience.buffer.trajectories("q1")
    assert stored.token_ids.tolist() == encode("aaaa")
    np.testing.assert_allclose(stored.logprobs, behaviour_q1.numpy(), atol=1e-5)

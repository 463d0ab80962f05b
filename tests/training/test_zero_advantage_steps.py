"""train.zero_advantage_steps: a mini-batch whose advantages are all 0 moves the weights by the entropy bonus alone
(apply, released, with a warning when a run starts so) or not at all (skip); with a real tiny model."""

import warnings

import torch

from exgrpo.config import config_from_dict
from exgrpo.data import Question
from exgrpo.models import load_policy
from exgrpo.runtime.checkpoint import latest_checkpoint
from exgrpo.training.entropy_drift import EntropyDriftWatch
from exgrpo.training.trainer import ExGRPOTrainer


def _trainer(tmp_path, policy: str, steps: int = 3):
    config = config_from_dict({
        "rollout": {"num_generations": 4, "max_completion_length": 3},
        "train": {"steps": steps, "prompts_per_step": 4, "mini_batches": 2, "micro_batch_size": 16,
                  "learning_rate": 1e-3, "zero_advantage_steps": policy},
        "logging": {"output_dir": str(tmp_path / policy), "progress": False, "tensorboard": False,
                    "sample_every": 0},
    })
    model, tokenizer = load_policy("tiny:0")

    def never_right(prompts, completions, completion_ids, answer, **_):
        return [0.0] * len(completions)

    questions = [Question(f"q{i}", ({"role": "user", "content": "hi"},), "1", {}) for i in range(8)]
    return ExGRPOTrainer(model, tokenizer, [never_right], config, questions)


def _train(trainer) -> tuple[list[dict], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.train()
    return history, [str(w.message) for w in caught]


def test_skip_leaves_the_weights_and_adams_moments_of_a_run_without_a_reward_spread(tmp_path):
    trainer = _trainer(tmp_path, "skip")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history, warned = _train(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    moments = [m for state in trainer.learner.optimizer.state_dict()["state"].values()  # (checkpointing creates
               for name, m in state.items() if name.startswith("exp_avg")]  # them, at zero)
    assert all(not m.any() for m in moments) and trainer.learner.weights_version == 0
    assert [m["skipped_zero_advantage_steps"] for m in history] == [2.0, 4.0, 6.0]  # 2 mini-batches a step
    assert [m["zero_advantage_steps"] for m in history] == [2.0, 2.0, 2.0]  # per step, skipped or applied
    assert [m["skipped_optimizer_steps"] for m in history] == [0.0] * 3
    assert not [w for w in warned if "reward spread" in w]
    assert not [w for w in warned if "lr_scheduler.step()" in w]  # torch's schedule-order warning: skipping is meant
    resumed = _trainer(tmp_path, "skip", steps=4)  # the counter is checkpointed: the version goes on from 0
    resumed.resume(latest_checkpoint(resumed.config.logging.output_dir))
    assert resumed.learner.skipped_zero_advantage_steps == 6 and resumed.learner.weights_version == 0


def test_apply_steps_on_the_entropy_bonus_alone_and_says_so(tmp_path):
    trainer = _trainer(tmp_path, "apply")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history, warned = _train(trainer)
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.learner.weights_version == 6 and history[-1]["skipped_zero_advantage_steps"] == 0.0
    assert [m["zero_advantage_steps"] for m in history] == [2.0, 2.0, 2.0]  # counted although applied
    drift = [w for w in warned if "reward spread" in w]
    assert len(drift) == 1 and drift[0].startswith("steps 1-3 had no group with a reward spread (every advantage "
                                                   "0): their optimizer steps followed the entropy bonus alone")
    assert f"{history[0]['entropy']:.2f} -> {history[2]['entropy']:.2f} nats" in drift[0]


def test_the_drift_warning_is_for_a_runs_first_steps_only():
    """Later runs of steps without a reward spread are damped by AdamW's moments: no warning for them."""
    flat, spread = {"frac_reward_zero_std": 1.0, "entropy": 2.0}, {"frac_reward_zero_std": 0.5, "entropy": 2.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after_a_spread, resumed = EntropyDriftWatch(config_from_dict({})), EntropyDriftWatch(config_from_dict({}))
        for step, metrics in enumerate([spread, flat, flat, flat, flat], 1):
            after_a_spread.observe(step, metrics)
        for step in (4, 5, 6):
            resumed.observe(step, flat)
    assert caught == []

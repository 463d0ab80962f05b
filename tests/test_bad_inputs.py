"""Bad inputs, one row each: what the user did wrong and exactly what they get back."""

import math
import os
import time

import pytest
import torch

from exgrpo.config import ConfigError, config_from_dict, load_config
from exgrpo.data import DataError, Question, load_questions
from exgrpo.models import load_policy
from exgrpo.rewards import GradingPool, combine_rewards
from exgrpo.training.trainer import ExGRPOTrainer


def hang(completion, gold):
    time.sleep(60)


def crash(completion, gold):
    os._exit(3)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _raises(exc, message):
    def check(action):
        with pytest.raises(exc) as info:
            action()
        assert message in str(info.value), str(info.value)
    return check


def _tiny_trainer(tmp_path, reward=None, experience=None, **train):
    config = config_from_dict({
        "rollout": {"num_generations": 4, "max_completion_length": 3},
        "experience": experience or {},
        "train": {"steps": 2, "prompts_per_step": 4, "mini_batches": 1, "micro_batch_size": 16, **train},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False},
    })
    questions = [Question(f"q{i}", ({"role": "user", "content": "hi"},), "1", {}) for i in range(8)]
    reward = reward or (lambda prompts, completions, completion_ids, answer, **_:
                        [float(c[:1] < "m") for c in completions])
    model, tokenizer = load_policy("tiny:0")
    return ExGRPOTrainer(model, tokenizer, [reward], config, questions)


def _skipped_optimizer_steps(tmp_path):
    trainer = _tiny_trainer(tmp_path, skip_grad_norm=1e-12)  # every gradient norm is "too large"
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train()
    assert trainer.learner.skipped_optimizer_steps == 2 and history[-1]["skipped_optimizer_steps"] == 2.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def _nan_reward_is_skipped_by_nansum(tmp_path):
    def reward(prompts, completions, completion_ids, answer, **_):
        return [None] * len(completions)
    total, per = combine_rewards([reward], [1.0], [""], ["x"], [[1]], {"answer": ["1"]})
    assert total.tolist() == [0.0] and math.isnan(per["reward"][0])


def _retired_pool_ends(tmp_path):
    trainer = _tiny_trainer(tmp_path, reward=lambda prompts, completions, **_: [1.0] * len(completions), steps=50,
                            experience={"retirement": "immediate"})
    history = trainer.train()
    # 8 questions, 4 per step, all solved K/K
    assert len(history) == 2 and trainer.experience.question_pool.remaining == 0


def _skip_invalid(tmp_path):
    path = _write(tmp_path, "e.jsonl", '{"prompt": "q", "answer": "1"}\n{"prompt": "q"}\n')
    questions = load_questions(path, skip_invalid=True)
    assert len(questions) == 1 and questions.skipped == 1


def _vllm_not_installed(tmp_path):
    import importlib.util

    from exgrpo.errors import EngineError
    from exgrpo.rollout import engine_from_config

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    config = config_from_dict({"rollout": {"engine": "vllm"}})
    model, tokenizer = load_policy("tiny:0")
    with pytest.raises(EngineError, match=r"needs vLLM, which is not installed: pip install 'exgrpo\[vllm\]'"):
        engine_from_config(config, model, tokenizer, lambda: 8)


def _timeout(tmp_path):
    with GradingPool(num_workers=1, timeout=1.0) as pool:
        start = time.monotonic()
        assert pool.grade(hang, ["x"], ["y"]) == [0.0]
        assert time.monotonic() - start < 30 and pool.stats["timeouts"] == 1


def _crash(tmp_path):
    with GradingPool(num_workers=1, timeout=10.0) as pool:
        assert pool.grade(crash, ["x"], ["y"]) == [0.0] and pool.stats["crashes"] == 1


CASES = {
    # config
    "unknown config field": (lambda p: load_config(None, ["rollout.num_gen=4"]),
                             _raises(ConfigError, "unknown config field 'rollout.num_gen'")),
    "ill-typed config value": (lambda p: load_config(None, ["train.learning_rate=fast"]),
                               _raises(ConfigError, "train.learning_rate: expected a number, got 'fast'")),
    "value outside the choices": (
        lambda p: load_config(None, ["objective.aggregation=mean"]),
        _raises(ConfigError, "objective.aggregation: 'mean' is not allowed; expected one of")),
    "inconsistent batch sizes": (lambda p: load_config(None, ["train.prompts_per_step=3"]),
                                 _raises(ConfigError, "must be divisible by train.mini_batches")),
    "bad YAML": (lambda p: load_config(_write(p, "c.yaml", "train: {steps: [")),
                 _raises(ConfigError, "c.yaml: not valid YAML")),
    "engine precision the trainer cannot correct for": (
        lambda p: load_config(None, ["rollout.engine=vllm", "rollout.engine_dtype=bfloat16",
                                     "objective.engine_correction=none"]),
        _raises(ConfigError, "the vllm engine samples in bfloat16 but the trainer computes in float32")),
    "vllm engine with top-p": (lambda p: load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9"]),
                               _raises(ConfigError, "it needs rollout.top_p 1 and rollout.top_k 0")),
    "vllm not installed": (_vllm_not_installed, lambda action: action()),
    "servers engine without servers": (lambda p: load_config(None, ["rollout.engine=servers"]),
                                       _raises(ConfigError, "rollout.servers (the servers' base URLs) goes with")),
    "servers that are not URLs": (lambda p: load_config(None, ["rollout.engine=servers",
                                                               "rollout.servers=127.0.0.1:8000"]),
                                  _raises(ConfigError, "rollout.servers must be http(s)://host:port URLs")),
    "a server URL whose port is not a number": (
        lambda p: load_config(None, ["rollout.engine=servers", "rollout.servers=http://127.0.0.1:notaport"]),
        _raises(ConfigError, "'http://127.0.0.1:notaport' has no valid port ('notaport' is not a number from 1 to")),
    "an empty entry among the servers": (
        lambda p: load_config(None, ["rollout.engine=servers", "rollout.servers=http://127.0.0.1:8000,,"]),
        _raises(ConfigError, "rollout.servers has an empty entry (a comma too many?): 'http://127.0.0.1:8000,,'")),
    "servers for another engine": (lambda p: load_config(None, ["rollout.servers=http://127.0.0.1:8000"]),
                                   _raises(ConfigError, "rollout.servers (the servers' base URLs) goes with")),
    # datasets
    "missing data file": (lambda p: load_questions(str(p / "nope.jsonl")),
                          _raises(DataError, "nope.jsonl: no such file or directory")),
    "row without prompt": (lambda p: load_questions(_write(p, "a.jsonl", '{"answer": "1"}\n')),
                           _raises(DataError, "a.jsonl row 0 (line 1): field 'prompt' is missing")),
    "ground truth of the wrong type": (
        lambda p: load_questions(_write(p, "b.jsonl", '{"prompt": "q", "reward_model": {"ground_truth": [1]}}\n')),
        _raises(DataError, "b.jsonl row 0 (line 1): field 'reward_model.ground_truth' is of type list")),
    "malformed JSON line": (lambda p: load_questions(_write(p, "c.jsonl", '{"prompt": "q", "answer": "1"}\n{oops\n')),
                            _raises(DataError, "c.jsonl row 1 (line 2): malformed JSON")),
    "empty dataset": (lambda p: load_questions(_write(p, "d.jsonl", "")), _raises(DataError, "d.jsonl: no rows")),
    "invalid rows skipped when asked": (_skip_invalid, lambda action: action()),
    # models
    "model path that does not exist": (lambda p: load_policy(str(p / "no-model")),
                                       _raises(FileNotFoundError, "no-model': no such directory")),
    "model directory without config.json": (lambda p: (p / "empty").mkdir() or load_policy(str(p / "empty")),
                                            _raises(FileNotFoundError, "empty' has no config.json")),
    "unknown dtype": (lambda p: load_policy("tiny", dtype="fp8"), _raises(ValueError, "unsupported dtype 'fp8'")),
    # graders and rewards
    "grader that hangs": (_timeout, lambda action: action()),
    "grader that crashes": (_crash, lambda action: action()),
    "negative number of grading workers": (lambda p: GradingPool(num_workers=-1),
                                           _raises(ValueError, "num_workers must be >= 0 (0 grades in-process)")),
    "reward function returning the wrong length": (
        lambda p: combine_rewards([lambda **kw: [1.0]], [1.0], ["a", "b"], ["x", "y"], [[1], [2]],
                                  {"answer": ["1", "2"]}),
        _raises(ValueError, "returned 1 rewards for 2 completions")),
    "reward function returning None": (_nan_reward_is_skipped_by_nansum, lambda action: action()),
    # numerics and the run
    "gradient norm above the skip bound": (_skipped_optimizer_steps, lambda action: action()),
    "every question retired": (_retired_pool_ends, lambda action: action()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make, check = CASES[name]
    check(lambda: make(tmp_path))

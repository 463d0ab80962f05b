"""The public API a TRL user imports (`from exgrpo import ...`), and a CLI that stays light until a command runs."""

import subprocess
import sys

import pytest

import exgrpo


def test_the_readme_names_come_from_the_package_top():
    from exgrpo import ExGRPOConfig, ExGRPOTrainer, MathReward, load_config, load_policy, load_questions
    from exgrpo.config import schema
    from exgrpo.training import trainer

    assert ExGRPOTrainer is trainer.ExGRPOTrainer and ExGRPOConfig is schema.ExGRPOConfig
    assert load_config.__module__ == "exgrpo.config.load" and callable(load_policy) and callable(load_questions)
    assert MathReward.__module__ == "exgrpo.rewards.functions"
    assert set(exgrpo.__all__) <= set(dir(exgrpo))
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        exgrpo.Trainer  # noqa: B018


def test_the_readme_python_example_on_the_tiny_model(tmp_path):
    from exgrpo import ExGRPOTrainer, MathReward, load_config, load_policy, load_questions

    config = load_config("tiny", ["train.steps=2", f"logging.output_dir={tmp_path}", "logging.progress=false"])
    model, tokenizer = load_policy("tiny")
    questions = load_questions(config.data.train, prompt_suffix=config.data.prompt_suffix)
    history = ExGRPOTrainer(model, tokenizer, [MathReward()], config, questions).train()
    assert [len(h) > 0 for h in history] == [True, True] and (tmp_path / "checkpoints" / "step-000002").is_dir()


def test_importing_the_cli_loads_no_heavy_module():
    code = "import sys, exgrpo.cli; print(sorted({'torch', 'transformers', 'sympy', 'matplotlib'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr

import copy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from exgrpo import __version__
from exgrpo.config import ConfigError, config_changes, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_paper_config_equals_the_released_run_script():
    """configs/qwen2.5-math-7b.yaml holds spec §7's values (no weights are loaded)."""
    c = load_config(ROOT / "configs" / "qwen2.5-math-7b.yaml")
    assert c.model.name == "Elliott/Qwen2.5-Math-7B-16k-think" and c.model.dtype == "float32"  # fp32 masters
    assert (c.rollout.num_generations, c.rollout.max_completion_length, c.rollout.temperature, c.rollout.top_p,
            c.rollout.top_k) == (8, 8192, 1.0, 1.0, 0)
    assert c.reward.grader == "math" and c.reward.think_gate and c.data.think_prefix == "<think>\n"
    o = c.objective
    assert (o.scale_rewards, o.epsilon_low, o.epsilon_high, o.clip_after_switch, o.beta, o.policy_shaping,
            o.aggregation, o.normalizer, o.entropy_coef) == \
        ("none", 0.2, 0.2, False, 0.1, True, "sum_constant", 8192.0, 0.001)
    e = c.experience
    assert (e.ratio, e.start_threshold, e.bucket_scheme, e.bucket_sigma, e.selection_metric, e.selection_mode,
            e.importance_correction, e.lbound, e.rbound) == (0.5, 0.35, "normal", 1.0, "entropy", "argmin", True, 0, 7)
    t = c.train
    assert (t.steps, t.prompts_per_step, t.mini_batches, t.learning_rate, t.weight_decay, t.adam_beta1, t.adam_beta2,
            t.lr_scheduler, t.warmup_steps, t.max_grad_norm, t.skip_grad_norm, t.seed) == \
        (700, 128, 2, 1e-6, 0.01, 0.9, 0.999, "constant", 0, 1.0, 500.0, 47)


def test_paper_configs_shard_in_bf16_with_checkpointing_and_the_released_scale():
    for name in ("qwen2.5-math-7b.yaml", "qwen2.5-math-1.5b.yaml"):
        t = load_config(ROOT / "configs" / name).train
        assert (t.sharding, t.dtype, t.activation_checkpointing, t.max_tokens_per_micro_batch) == \
            ("fsdp", "bf16", True, 32768), name
        c = load_config(ROOT / "configs" / name)
        assert c.objective.loss_scale == "per_rank" and c.data.max_prompt_length == 1024 and t.logprob_chunk_tokens


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_resumes_from_its_resolved_form(path):
    config = load_config(path)
    # a resume rebuilds the config from the run's resolved config.json, where every field is present
    assert load_config(None, [f"logging.output_dir={config.logging.output_dir}"], base=config.to_dict()) == config


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_every_study_file_builds_every_runs_config(path):
    from exgrpo.studies.study import load_study

    study = load_study(path)
    configs = [study.config(arm, seed) for arm in study.arms for seed in arm.seeds]
    assert len({c.logging.output_dir for c in configs}) == len(configs) >= 2


def test_overrides_in_both_spellings():
    c = load_config(None, ["experience.ratio=0.25", "--train.steps", "3", "--model.lora.r=8", "model.lora.alpha=16"])
    assert c.experience.ratio == 0.25 and c.train.steps == 3 and c.model.lora.r == 8 and c.model.lora.alpha == 16
    assert load_config(None, ["experience.rbound=null"]).experience.rbound is None


@pytest.mark.parametrize("old,new,value,other", [
    ("rollout.sync_timeout", "rollout.push_timeout", 30.0, 40.0),
    ("experience.policy", "experience.replay_policy", "rlep", "prioritized"),
    ("train.max_skipped_updates", "train.max_skipped_optimizer_steps", 3, 7)])
def test_a_renamed_field_is_read_under_its_new_name_and_said_once(tmp_path, capsys, old, new, value, other):
    (section, old_key), new_key = old.split("."), new.split(".")[1]
    config = load_config("tiny", [f"{old}={value}"])  # an override
    assert getattr(getattr(config, section), new_key) == value
    (tmp_path / "old.yaml").write_text(f"model: {{name: tiny}}\n{section}: {{{old_key}: {other}}}\n")
    assert getattr(getattr(load_config(tmp_path / "old.yaml"), section), new_key) == other  # a file
    stored = config.to_dict()
    stored[section][old_key] = stored[section].pop(new_key)  # a run config saved before
    assert getattr(getattr(load_config(base=stored), section), new_key) == value  # as `exgrpo train --resume` reads it
    assert config_changes(stored, config.to_dict()) == ([], [])  # resuming it changes nothing
    said = capsys.readouterr().err.splitlines()
    assert said == [f"exgrpo: {old} is now called {new}: read as that"] * 4
    with pytest.raises(ConfigError, match=f"{old} and {new} are both set"):
        config_from_dict({section: {old_key: value, new_key: other}})


def test_a_renamed_field_is_said_by_rank_0_alone(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # another rank under torchrun: its line would repeat rank 0's
    assert load_config("tiny", ["rollout.sync_timeout=5"]).rollout.push_timeout == 5
    assert capsys.readouterr().err == ""


def test_a_config_stored_before_a_field_existed_resumes_as_it_ran():
    """A missing field reads as its default, or as BEFORE_THE_FIELD says where the default changed what it did."""
    config = load_config("tiny", ["experience.retirement=immediate"]).to_dict()
    stored = copy.deepcopy(config)
    del stored["train"]["zero_advantage_steps"], stored["experience"]["retirement"]
    assert config_changes(stored, config) == ([], [])
    skip = copy.deepcopy(config)
    skip["train"]["zero_advantage_steps"] = "skip"
    assert config_changes(stored, skip) == (["train.zero_advantage_steps: 'apply' -> 'skip'"], [])


@pytest.mark.parametrize("section,key,value,expected", [
    ("train", "steps", "1e3", 1000),  # a CLI's or a sweep's scientific notation
    ("train", "steps", 40.0, 40),
    ("train", "learning_rate", "2e-4", 2e-4),
    ("reward", "think_gate", "Yes", True),
    ("reward", "think_gate", "0", False),
])
def test_scalar_values_are_converted_to_their_field_type(section, key, value, expected):
    config = config_from_dict({section: {key: value}})
    assert getattr(getattr(config, section), key) == expected


@pytest.mark.parametrize("overrides,message", [
    (["experience.ratoi=0.2"], "unknown config field 'experience.ratoi'; allowed fields of experience: ["),
    (["trainer.steps=3"], "unknown config field 'trainer'; allowed fields: ["),
    (["train.steps=three"], "train.steps: expected an integer, got 'three'"),
    (["train.steps=2.5"], "train.steps: expected an integer, got 2.5"),
    (["experience.bucket_scheme=gauss"], "experience.bucket_scheme: 'gauss' is not allowed; expected one of "
                                         "['normal', 'linear', 'sqrt', 'linear_clip', 'uniform']"),
    (["reward.think_gate=maybe"], "reward.think_gate: expected true or false, got 'maybe'"),
    (["experience.ratio=1.5"], "experience.ratio must be in [0, 1]"),
    (["train.prompts_per_step=5", "train.mini_batches=2"], "must be divisible by train.mini_batches"),
    (["train.steps=null"], "train.steps: null is not allowed"),
    # every value is checked when the config loads, with the field and what it needs
    (["train.steps=0"], "train.steps must be >= 1 (got 0)"),
    (["train.learning_rate=-1e-5"], "train.learning_rate must be in (0, 1] for AdamW (got -1e-05)"),
    (["train.learning_rate=.nan"], "train.learning_rate must be a finite number (got nan)"),
    (["train.compile=true"], "train.compile needs rollout.engine vllm or servers: the hf engine generates through"),
    (["train.compile=true", "rollout.engine=vllm", "train.sharding=fsdp"],
     "train.compile is not tested with train.activation_checkpointing or train.sharding fsdp: turn those off"),
    (["objective.beta=.inf"], "objective.beta must be a finite number (got inf)"),
    (["rollout.top_k=-1"], "rollout.top_k must be >= 0 (got -1)"),
    (["rollout.temperature=0"], "rollout.temperature must be > 0 (got 0.0; GRPO groups need sampling)"),
    (["model.lora.r=0"], "model.lora.r must be >= 1 (got 0)"),
    (["model.lora.dropout=1.0"], "model.lora.dropout must be in [0, 1) (got 1.0)"),
    (["data.holdout=-2"], "data.holdout must be >= 0 (got -2)"),
    (["reward.timeout=0"], "reward.timeout must be > 0 (got 0.0)"),
    (["reward.workers=-1"], "reward.workers must be >= 0 (got -1)"),
    (["reward.function=nocolon"], "reward.function must look like 'module:name' (got 'nocolon')"),
    (["reward.grader=choice", "reward.think_gate=true"], "reward.think_gate applies to the math grader only"),
    (["reward.success_threshold=0"], "reward.success_threshold (0.0) must lie in (reward.min_value"),
    (["objective.epsilon_low=1.5"], "objective.epsilon_low must be in [0, 1) (got 1.5)"),
    (["objective.aggregation=token_mean", "objective.normalizer=4"],
     "objective.normalizer is used by aggregation sum_constant only"),
    (["experience.start_threshold=1.0"], "experience.start_threshold must be in [0, 1) (got 1.0)"),
    (["experience.ratio=0.001"], "experience.ratio (0.001) x train.prompts_per_step (128) < 1"),
    (["experience.bucket_scheme=linear", "experience.bucket_mean=3"],
     "experience.bucket_mean and bucket_sigma apply to bucket_scheme normal only"),
    (["experience.bucket_mean=12"], "experience.bucket_mean must be null or in [1, num_generations-1 = 7]"),
    (["experience.lbound=7"], "experience.lbound (7) < experience.rbound (7) <= num_generations-1 (7) must hold"),
    (["experience.max_questions=0"], "experience.max_questions must be null or >= 1 (got 0)"),
    (["train.adam_beta2=1.0"], "train.adam_beta2 must be in [0, 1) (got 1.0)"),
    (["train.warmup_steps=5000"], "train.warmup_steps must be in [0, train.steps x train.mini_batches = 1400]"),
    (["train.seed=-1"], "train.seed must be in [0, 2**32 - 1] (got -1)"),
    (["train.seed=4294967296"], "train.seed must be in [0, 2**32 - 1] (got 4294967296)"),
    (["train.save_total_limit=0"], "train.save_total_limit must be >= 1 (got 0)"),
    (["eval.samples=0"], "eval.samples must be >= 1 (got 0)"),
    (["logging.output_dir=' '"], "logging.output_dir must be a non-empty string"),
    (["experience"], "must look like section.field=value"),
    (["model.lora.target_modules=q_proj,"], "model.lora.target_modules must be all-linear or a comma list"),
    (["objective.loss_scale=per_rank", "objective.aggregation=token_mean"],
     "objective.loss_scale per_rank is the released scale of aggregation sum_constant"),
    # "x applies to y only" is judged on what the user set, even when it equals the default
    (["rollout.max_generation_rounds=3"], "rollout.max_generation_rounds applies to rollout.zero_variance backfill"),
    (["experience.bucket_scheme=uniform", "experience.bucket_sigma=1.0"],
     "experience.bucket_mean and bucket_sigma apply to bucket_scheme normal only"),
    (["experience.retest_every=10"], "experience.retest_every applies to experience.replay_policy prioritized only"),
    (["guidance.gamma=0.1"], "guidance.members, mode and gamma apply only with guidance.field set"),
    (["objective.engine_correction=auto"], "objective.engine_correction apply to rollout.engine vllm and servers only"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_bad_yaml_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_a_preset_is_named_without_its_path(tmp_path, monkeypatch):
    """`--config demo` is the packaged preset; an existing file of that name wins; an unknown name lists the
    presets; train without any config is refused rather than starting the paper-scale defaults."""
    assert load_config("demo") == load_config("demo.yaml") == load_config(ROOT / "configs" / "demo.yaml")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").write_text("train: {steps: 3}\n")
    assert load_config("demo").train.steps == 3
    with pytest.raises(ConfigError, match=r"'demoo' is not a preset \(presets: demo, gemma3-270m, qwen2.5-math-1.5b"):
        load_config("demoo")
    refused = run_cli(["train", "train.steps=1"])
    assert refused.returncode == 2 and "exgrpo train needs --config: a preset (demo, " in refused.stderr


def test_version_flag():
    result = subprocess.run([sys.executable, "-m", "exgrpo", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"exgrpo {__version__}"


def test_cli_train_tiny_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "exgrpo", "train", "--config", str(ROOT / "configs" / "tiny.yaml"),
         f"logging.output_dir={out}", "logging.progress=false", "train.steps=3"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and (out / "config.json").is_file()


def test_cli_config_error_exit_code(tmp_path):
    result = run_cli(["train", "--config", "tiny", "train.stpes=3"])
    assert result.returncode == 2 and "unknown config field 'train.stpes'" in result.stderr


def test_cli_demo_tiny_writes_report(tmp_path):
    out = tmp_path / "demo"
    result = run_cli(["demo", "--config", str(ROOT / "configs" / "tiny.yaml"), f"logging.output_dir={out}",
                      "logging.progress=false", "eval.every=2", "reward.function=toy_rewards:first_char_is_lowercase"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out accuracy before" in result.stdout and "held-out accuracy after" in result.stdout
    report = (out / "report.md").read_text()
    assert "| steps | 4 |" in report
    for png in ("reward.png", "heldout_accuracy.png", "buckets.png"):
        assert (out / png).stat().st_size > 1000


def test_every_config_field_is_documented_where_it_is_defined():
    """Each dataclass field in config/schema.py is followed by its docstring (what README's table points to)."""
    import ast

    import exgrpo.config.schema as config_module

    tree = ast.parse(Path(config_module.__file__).read_text())
    undocumented, fields = [], 0
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                fields += 1
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str)
                if not documented:
                    undocumented.append(f"{cls.name}.{node.target.id}")
    assert fields > 100 and not undocumented, undocumented

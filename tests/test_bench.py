"""The GPU check runs here on CPU at toy sizes (`--smoke`), so the script a GPU session runs once is not broken;
bench/metrics_diff.py's comparison and its settings' overrides, without a run."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exgrpo.config import load_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("metrics_diff", ROOT / "bench" / "metrics_diff.py")
metrics_diff = sys.modules["metrics_diff"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(metrics_diff)


def test_the_gpu_check_runs_every_part_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["tiny_training"]["steps"] == 2 and report["fsdp_one_rank"]["grads"]
    shaped = report["qwen2.5_1.5b_shape"]
    assert shaped["tokens"] == 512 and shaped["train_tokens_per_s"] > 0 and shaped["decode_tokens"] > 0


def _step(step, **values):
    return {"step": step, "time": 1e9 + step, "time/step": 1.5, "tokens_per_second": 9.0, "async/engine_idle": 0.1,
            "async/learner_idle": 0.2, "reward": 0.5, "loss": 0.25, "guidance/demonstration_reward": float("nan"),
            **values}


def test_the_whole_run_bench_runs_round_fives_grpo_run_as_its_study_file_says(tmp_path):
    spec = importlib.util.spec_from_file_location("whole_run", ROOT / "bench" / "whole_run.py")
    whole_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(whole_run)
    config = load_config("demo", whole_run.study_overrides() + [f"logging.output_dir={tmp_path}"])
    assert (config.train.steps, config.eval.every, config.data.holdout, config.train.seed) == (60, 10, 160, 1)
    assert config.experience.ratio == 0 and "seed=56" in config.data.train


def test_metrics_diff_ignores_wall_times_only():
    base = [_step(1), _step(2)]
    timed_again = [{**m, "time/step": 9.9, "time": 0.0, "tokens_per_second": 1.0, "async/engine_idle": 5.0,
                    "async/learner_idle": 5.0} for m in base]
    assert metrics_diff.first_difference(base, timed_again) is None  # NaN equals NaN too
    staleness = [_step(1), _step(2, **{"async/staleness_max": 1.0})]
    assert metrics_diff.first_difference(base, staleness) == (
        "first difference at step 2:\n    async/staleness_max: base '(absent)', working tree 1.0")


def test_metrics_diff_reports_the_first_differing_step_with_both_values():
    base = [_step(1), _step(2), _step(3)]
    changed = [_step(1), _step(2, loss=0.75, reward=0.0), _step(3, loss=1.0)]
    assert metrics_diff.first_difference(base, changed) == (
        "first difference at step 2:\n    loss: base 0.25, working tree 0.75\n    reward: base 0.5, working tree 0.0")
    assert metrics_diff.first_difference(base, base[:2]) == "line 3 (step 3): only the base logged it"


@pytest.mark.parametrize("name", ["demo-sync", "demo-async", "tiny-sync"])
def test_metrics_diff_settings_are_valid_configs(name, tmp_path):
    arguments = metrics_diff.SETTINGS[name].arguments(ROOT, tmp_path, 5)
    assert arguments[:4] == ["-m", "exgrpo", "train", "--config"]
    config = load_config(arguments[4], arguments[5:])
    assert config.train.steps == config.eval.every == 5 and config.logging.output_dir == str(tmp_path)
    assert config.experience.start_threshold == 0


def test_metrics_diff_tiny_async_runs_the_async_tests_harness(tmp_path):
    script = Path(metrics_diff.SETTINGS["tiny-async"].arguments(ROOT, tmp_path, 5)[0])
    assert script == ROOT / "tests" / "training" / "async_ranks.py" and script.is_file()


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_seeds_refuses_seeds_and_overrides_that_would_not_run_what_was_asked(capsys):
    """--seeds 1,a ran seed 1 alone; train.seed=5 among the overrides ran seed 5 under every --seeds label. Refused
    before BASE is looked at (a BASE that is no commit here: nothing can run)."""
    demo_seeds = _bench_module("demo_seeds")
    assert demo_seeds.seeds(" 2,1") == [2, 1]
    for text in ("1,a", "1,,2", "1,1", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct whole numbers, comma-separated"):
            demo_seeds.seeds(text)
    for override in ("train.seed=5", "logging.output_dir=runs/x"):
        with pytest.raises(SystemExit) as exited:
            demo_seeds.main(["no-such-commit", override])
        assert exited.value.code == 2
        assert f"error: override {override.split('=')[0]}: the script sets it" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # nothing read it, yet each record said trl_bf16: true
    (["step_time.py", "--trainers", "grpo", "--trl-bf16", "--steps", "1", "--warmup", "0"],
     "--trl-bf16 sets TRL's precision: it goes with --trainers trl"),
    # a FileNotFoundError traceback (for --exgrpo-python: after both TRL runs)
    (["trl_process.py", "--trl-python", "{tmp}/no-venv/bin/python"], "--trl-python {tmp}/no-venv/bin/python: no such"),
])
def test_bench_trl_flags_that_cannot_be_honoured_are_refused_before_a_run(tmp_path, argv, message):
    script, *args = argv
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *[a.format(tmp=tmp_path) for a in args]],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and message.format(tmp=tmp_path) in out.stderr, out.stderr[-3000:]
    assert out.stdout == ""


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it (No such file or directory)"),
    ("garbage", "expected an earlier --grades file (a JSON list of {id, training, released}), got something else"),
    ('{"a": 1}', "expected an earlier --grades file"),
])
def test_reward_yardstick_refuses_a_compare_file_that_is_not_grades_before_grading(tmp_path, capsys, content,
                                                                                   message):
    """It graded every labelled completion first, then ended in a FileNotFoundError or JSONDecodeError traceback."""
    spec = importlib.util.spec_from_file_location("reward_yardstick", ROOT / "bench" / "reward_yardstick.py")
    yardstick = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(yardstick)
    earlier = tmp_path / "grades.json"
    if content is not None:
        earlier.write_text(content)
    with pytest.raises(SystemExit) as exited:
        yardstick.main(["--compare", str(earlier)])
    err = capsys.readouterr()
    assert exited.value.code == 2 and f"error: --compare {earlier}: {message}" in err.err.splitlines()[-1]
    assert err.out == ""  # refused before the table


def test_the_pooled_rounds_pair_each_rounds_seeds_and_reproduce_round_five(tmp_path):
    """Round five's own curves give its reported +1.99 [+0.27, +3.71]; a second round's pairs join the same
    interval, and a seed run by one arm only is no pair."""
    spec = importlib.util.spec_from_file_location("pooled_rounds", ROOT / "bench" / "pooled_rounds.py")
    pooled = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pooled)
    five = json.loads((ROOT / "docs" / "results-round-five" / "curves.json").read_text())
    d = pooled.late_mean_differences(five, "exgrpo", "grpo")
    assert len(d) == 12 and round(100 * float(np.mean(d)), 2) == 1.99
    rows = lambda *acc: [[10 * i, 100 * i, a] for i, a in enumerate(acc)]  # noqa: E731
    six = {"grpo/seed-1": rows(0.0, 0.1, 0.1, 0.1), "exgrpo/seed-1": rows(0.0, 0.1, 0.2, 0.3),
           "exgrpo/seed-2": rows(0.0, 0.5, 0.5, 0.5)}  # seed 2 has no GRPO run
    assert pooled.late_mean_differences(six, "exgrpo", "grpo") == pytest.approx([0.1])
    for name, curves in (("five", five), ("six", six)):
        (tmp_path / f"{name}.json").write_text(json.dumps(curves))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "pooled_rounds.py"), str(tmp_path / "five.json"),
                          str(tmp_path / "six.json")], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "pooled, 13 pairs: exgrpo − grpo" in out.stdout

"""Multi-seed studies: runs, skip/resume bookkeeping, the shared before-training evaluation, the report."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from exgrpo.config import ConfigError, config_from_dict
from exgrpo.studies.study import (Arm, Registration, RunResult, completed_steps, load_results, load_study,
                                  run_study, study_status)

ROOT = Path(__file__).resolve().parents[2]


def _study(tmp_path, arms=None, **extra):
    spec = {
        "base": "tiny", "output_dir": "runs", "seeds": [1, 2],  # a preset's name
        "overrides": ["train.steps=3", "train.save_every=2", "eval.every=2", "logging.progress=false",
                      "logging.sample_every=0"],
        "baseline": "grpo",
        "arms": arms if arms is not None else {"grpo": {"label": "GRPO", "overrides": ["experience.ratio=0"]},
                         "exgrpo": {"label": "ExGRPO"},
                         "uniform": {"overrides": ["experience.bucket_scheme=uniform"], "seeds": [1]}},
        **extra,
    }
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def test_study_runs_every_arm_and_seed_once_and_reports(tmp_path):
    study = load_study(_study(tmp_path))
    assert study_status(study, seeds=[2]) == ["grpo seed 2: not started", "exgrpo seed 2: not started",
                                              "0 of 2 runs complete"]
    messages = []
    run_study(study, log=messages.append)
    assert sum("starting" in m for m in messages) == 5
    for arm in study.arms:
        for seed in arm.seeds:
            assert completed_steps(study.run_dir(arm, seed)) == 3
    # arms of one seed start from the same model, data and eval seed: one before-training evaluation per seed
    assert len(list((study.output_dir / "initial").glob("*.json"))) == 2
    results = load_results(study)
    grpo = [r for r in results if r.arm.name == "grpo"]
    assert all(m["experience/replayed"] == 0 for r in grpo for m in r.history)
    assert [s for s, _ in grpo[0].evaluations()] == [0, 2, 3]  # every 2 steps and after the last
    assert grpo[0].fresh_rollouts() == [16, 32, 48]  # 4 questions × K=4 per step, nothing replayed

    messages.clear()
    run_study(study, log=messages.append)  # everything complete: nothing runs again
    assert len(messages) == 5 and all("skipped" in m for m in messages)

    out = tmp_path / "report"
    done = run_cli(["experiment", "report", str(tmp_path / "study.yaml"), "--main", "grpo", "exgrpo", "--output",
                    str(out)])
    assert done.returncode == 0, done.stderr
    text = (out / "report.md").read_text()
    assert "| GRPO | 1, 2 |" in text and "| uniform | 1 |" in text
    paired = text.split("## Paired differences")[1].split("## Buffer")[0]
    assert "| ExGRPO − GRPO | 1, 2 |" in paired and "uniform" not in paired  # uniform has one seed: no interval
    assert "above their step 0 (take-off): GRPO " in text and "; uniform " in text
    for png in ("main_heldout.png", "main_training.png", "main_buffer.png", "main_analyses.png",
                "ablations_heldout.png", "all_final.png"):
        assert (out / png).stat().st_size > 1000 and f"({png})" in text

    def report(*arms):
        return run_cli(["experiment", "report", str(tmp_path / "study.yaml"), "--main", "grpo", "exgrpo", "--arms",
                        *arms, "--output", str(tmp_path / "some")])

    assert report("grpo", "exgrpo").returncode == 0  # an unfinished arm can be left out
    assert "uniform" not in (tmp_path / "some" / "report.md").read_text()
    # --main without the baseline: it comes first; it was an ablation of exgrpo as well, a second paired row
    assert run_cli(["experiment", "report", str(tmp_path / "study.yaml"), "--main", "exgrpo", "--arms", "grpo",
                    "exgrpo", "--output", str(tmp_path / "some")]).returncode == 0
    assert (tmp_path / "some" / "report.md").read_text().count("| ExGRPO − GRPO |") == 1
    refused = report("exgrpo", "uniform")
    assert refused.returncode == 2 and "leaves out grpo" in refused.stderr
    assert report("grpo", "exgrpo", "--seeds", "2").returncode == 0  # an interim report says it is one
    interim = (tmp_path / "some" / "report.md").read_text()
    assert "**Interim report: seeds 2 only (`--seeds`), 1 of the study's 2.**" in interim and "| GRPO | 2 |" in interim
    refused = report("grpo", "exgrpo", "--seeds", "3")
    assert refused.returncode == 2 and "--seeds 3: no selected arm of" in refused.stderr
    refused = report("grpo", "exgrpo", "uniform", "--seeds", "2")
    assert refused.returncode == 2 and "--seeds 2: arm uniform has none of those seeds" in refused.stderr

    assert '"helps" when the mean is ≥ +3.0 and the 95% interval is above 0' in text  # the default rule, said
    spec = json.loads((tmp_path / "study.yaml").read_text())
    (tmp_path / "study.yaml").write_text(json.dumps({**spec, "registered": {"verdict_rule": "interval"}}))
    assert report("grpo", "exgrpo").returncode == 0
    interval_text = (tmp_path / "some" / "report.md").read_text()
    assert '"helps" when the 95% interval is above 0, whatever the mean' in interval_text


def test_a_run_that_retires_every_question_is_complete_and_evaluated_at_its_last_step(tmp_path):
    path = _study(tmp_path, arms={"grpo": {"overrides": ["experience.ratio=0"]}}, seeds=[1], overrides=[
        "data.train=reasoning_gym:basic_arithmetic?size=24&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=1",
        "reward.function=toy_rewards:always_right", "experience.retirement=immediate",
        "train.steps=10", "eval.every=3", "logging.progress=false"])
    study = load_study(path)
    run_study(study, log=lambda m: None)
    (result,) = load_results(study)  # complete, although it stopped before train.steps
    assert result.history[-1]["fresh_questions_remaining"] == 0 and result.history[-1]["step"] < 10
    last = result.history[-1]["step"]
    assert [s for s, _ in result.evaluations()] == [0, 3, last] and last > 3
    messages = []
    run_study(study, log=messages.append)
    assert messages == [f"grpo seed 1: complete ({last} steps), skipped"]


def test_interrupted_run_resumes_and_report_waits_for_it(tmp_path):
    path = _study(tmp_path, arms={"grpo": {"overrides": ["experience.ratio=0"]}}, seeds=[1])
    study = load_study(path)
    arm = study.arm("grpo")
    run_study(study, log=lambda m: None)
    metrics = study.run_dir(arm, 1) / "metrics.jsonl"
    full = metrics.read_text().splitlines()
    # as if killed after step 2: only that checkpoint is left
    for ckpt in (study.run_dir(arm, 1) / "checkpoints").iterdir():
        if ckpt.name.endswith("000003"):
            import shutil

            shutil.rmtree(ckpt)
    _record_a_crash(study.run_dir(arm, 1))
    assert completed_steps(study.run_dir(arm, 1)) == 2
    status = run_cli(["experiment", "status", str(path)])
    assert status.stdout.splitlines() == ["grpo seed 1: checkpointed at step 2 of 3, logged to step 3 (a resume runs "
                                          "the steps after 2 again)", "0 of 1 runs complete"]
    with pytest.raises(ConfigError, match="grpo/seed-1"):
        load_results(study)
    messages = []
    run_study(study, log=messages.append)
    assert messages[0].startswith("grpo seed 1: data.train reasoning_gym:basic_arithmetic") and "64 questions" in \
        messages[0]
    assert messages[1:] == ["grpo seed 1: resuming at step 2"]
    assert [json.loads(x)["reward"] for x in metrics.read_text().splitlines()] == \
        [json.loads(x)["reward"] for x in full]
    assert study_status(study) == ["grpo seed 1: complete (3 steps)", "1 of 1 runs complete"]


@pytest.mark.parametrize("change, message", [
    ({"seeds": []}, "seeds: expected a non-empty list"),
    ({"base": "tiny.yml"}, r"'tiny.yml' is not a preset \(presets: demo, "),
    ({"arms": {}}, "arms: expected a mapping"),
    ({"colour": 1}, r"unknown keys \['colour'\]"),
    ({"baseline": "nope"}, "no arm 'nope'"),
    ({"arms": {"a": {"overrides": ["experience.ratio=two"]}}, "baseline": "a"}, "arm 'a'.*experience.ratio"),
    ({"arms": {"a": {"overrides": "experience.ratio=0"}}, "baseline": "a"}, "arms.a.overrides: expected a list"),
    ({"seeds": [1, 1, 2]}, r"seeds: seed 1 appears more than once in \[1, 1, 2\]; expected distinct seeds"),
    ({"arms": {"a": {"seeds": [3, 4, 3]}}, "baseline": "a"}, r"arms.a.seeds: seed 3 appears more than once"),
    ({"arms": {"../../escaped": {}}, "baseline": "../../escaped"}, r"arm name '../../escaped' is not a plain name"),
    ({"arms": {"a/b": {}}, "baseline": "a/b"}, r"arm name 'a/b' is not a plain name"),
    ({"arms": {"..": {}}, "baseline": ".."}, r"arm name '..' is not a plain name"),
    ({"arms": {"initial": {}}, "baseline": "initial"}, r"arm name 'initial' is not a plain name"),
    ({"arms": {"a": {"overrides": ["logging.output_dir=elsewhere"]}}, "baseline": "a"},
     r"arms.a.overrides: 'logging.output_dir=elsewhere': the study sets logging.output_dir itself \(runs go to "),
    ({"arms": {"a": {"overrides": ["--train.seed=7"]}}, "baseline": "a"},
     r"arms.a.overrides: '--train.seed=7': the study sets train.seed itself \(each run's seed is one of the arm's"),
    ({"overrides": ["train.seed=7"]}, r"overrides: 'train.seed=7': the study sets train.seed itself"),
    ({"registered": {"verdict_rule": "votes"}}, r"verdict_rule must be effect or interval, got 'votes'"),
    ({"seeds": [10**23]}, r"train.seed must be in \[0, 2\*\*32 - 1\] \(got 100000000000000000000000\)"),  # a traceback
])
def test_bad_study_files_name_the_key(tmp_path, change, message):
    path = _study(tmp_path, **change)
    with pytest.raises(ConfigError, match=message):
        load_study(path)


def test_two_arms_whose_names_read_the_same_are_refused(tmp_path):
    """YAML's 1 and "1" are two keys, but one run directory: the second arm's runs resumed the first's."""
    path = tmp_path / "study.yaml"
    path.write_text('base: tiny\noutput_dir: runs\nseeds: [1]\narms:\n  1: {}\n  "1": {}\n')
    with pytest.raises(ConfigError, match="study.yaml: arms: two arms are named '1' .* expected distinct names"):
        load_study(path)


def test_an_arm_named_by_a_word_yaml_reads_as_true_false_or_null_is_refused(tmp_path):
    """Unquoted, the arms on and off ran in runs/True and runs/False and were reported as True and False."""
    path = tmp_path / "study.yaml"
    path.write_text('base: tiny\noutput_dir: runs\nseeds: [1]\narms:\n  "on": {}\n  off: {}\n')
    with pytest.raises(ConfigError, match="study.yaml: arms: arm name False is how YAML reads an unquoted on/off, "
                                          "yes/no, true/false .*; quote the name"):
        load_study(path)


def _grpo_study(tmp_path, steps: int, eval_every: int):
    """A one-run study file (GRPO, seed 1, a checkpoint every step) and the study it loads."""
    path = _study(tmp_path, arms={"grpo": {"overrides": ["experience.ratio=0"]}}, seeds=[1], overrides=[
        f"train.steps={steps}", "train.save_every=1", f"eval.every={eval_every}", "logging.progress=false",
        "logging.sample_every=0"])
    return path, load_study(path)


def _run_and_remove_checkpoints(study):
    run_study(study, log=lambda m: None)
    run_dir = study.run_dir(study.arm("grpo"), 1)
    shutil.rmtree(run_dir / "checkpoints")
    return run_dir


def test_a_run_whose_checkpoints_are_gone_is_said_and_started_over_by_the_command_given(tmp_path):
    path, study = _grpo_study(tmp_path, steps=2, eval_every=0)
    run_dir = _run_and_remove_checkpoints(study)
    _record_a_crash(run_dir)  # a run that finished would be complete without its checkpoints (the next test)
    command = f"`exgrpo experiment run {path} --arms grpo --seeds 1 --overwrite`"
    assert study_status(study) == [f"grpo seed 1: logged to step 2 of 2, but no checkpoint is left: it cannot resume "
                                   f"(restore a checkpoint, or start it over with {command})", "0 of 1 runs complete"]
    refused = run_cli(["experiment", "run", str(path)])
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1].endswith(
        f"Restore a checkpoint, or start over with {command}, which deletes the run"), refused.stderr
    done = run_cli(command.strip("`").split()[1:])
    assert done.returncode == 0 and "grpo seed 1: starting over" in done.stdout, done.stderr
    assert study_status(study) == ["grpo seed 1: complete (2 steps)", "1 of 1 runs complete"]
    status = run_cli(["experiment", "status", str(path), "--overwrite"])
    assert status.returncode == 2 and "--overwrite starts runs over: it goes with `exgrpo experiment run`" in \
        status.stderr


def _record_a_crash(run_dir):
    """The run's last session as a crash leaves it: never ended."""
    sessions = json.loads((run_dir / "provenance.json").read_text())["sessions"]
    sessions[-1].update(ended=None, to_step=None)
    (run_dir / "provenance.json").write_text(json.dumps({"sessions": sessions}))


def test_a_finished_run_whose_checkpoints_are_removed_stays_complete(tmp_path):
    """Its records (metrics, provenance, samples) are what a report reads: a study can keep them and drop the
    checkpoints, and is neither trained again nor refused."""
    _, study = _grpo_study(tmp_path, steps=2, eval_every=2)
    _run_and_remove_checkpoints(study)
    assert study_status(study) == ["grpo seed 1: complete (2 steps; its checkpoints removed)", "1 of 1 runs complete"]
    said = []
    assert run_study(study, log=said.append) is None
    assert said == ["grpo seed 1: complete (2 steps; its checkpoints removed), skipped"]
    (result,) = load_results(study)
    assert result.evaluations()[-1][0] == 2
    _, longer = _grpo_study(tmp_path, steps=3, eval_every=2)  # the same study file, asking one step more
    assert study_status(longer)[-1] == "0 of 1 runs complete"  # it ended at step 2, not 3


def test_status_says_what_a_run_has_on_disk(tmp_path):
    from exgrpo.studies.study import run_state

    run_dir = tmp_path / "run"
    assert run_state(run_dir, 5) == (False, 0, "not started")
    run_dir.mkdir()
    assert run_state(run_dir, 5) == (False, 0, "started, no step logged yet")
    (run_dir / "config.json").write_text(json.dumps({"train": {"save_every": 2}}))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')  # a last line cut short by a kill
    assert run_state(run_dir, 5)[2] == "logged to step 2 of 5, no checkpoint yet (a resume starts it again)"
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert run_state(run_dir, 5, "X")[2] == ("logged to step 3 of 5, but no checkpoint is left: it cannot resume "
                                             "(restore a checkpoint, or start it over with X)")


def test_a_report_panel_with_nothing_to_show_has_no_legend_and_no_warning(tmp_path):
    """One arm: no paired difference to plot; no replay: no replayed entropy (matplotlib warned "No artists with
    labels found to put in legend" for each)."""
    import warnings

    from exgrpo.studies.report import _analyses, _curves

    run = _result(1, [8] * 3, {3: 0.2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _curves({"a": [run]}, ["a"], tmp_path, "main") == ["main_heldout.png", "main_training.png"]
        assert _analyses({"a": [run]}, ["a"], tmp_path, "main") == "main_analyses.png"
    assert (tmp_path / "main_heldout.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["run", "{study}", "--seeds", "7"], "--seeds 7: no selected arm of {study} has that seed (its seeds: 1, 2)"),
    (["run", "{study}", "--arms", "uniform", "--seeds", "2"],
     "--seeds 2: no selected arm of {study} has that seed (its seeds: 1)"),
    (["report", "{study}", "--output", "{study}/report"], "--output {study}/report: {study} is a file; --output must"),
    # --main without --arms reports every arm (it was a TypeError traceback)
    (["report", "{study}", "--main", "exgrpo", "--output", "{study}.report"], "runs not complete yet: grpo/seed-1"),
])
def test_study_flags_that_select_nothing_or_cannot_be_written_are_refused(tmp_path, argv, message):
    study = _study(tmp_path)
    result = run_cli(["experiment", *[a.format(study=study) for a in argv]])
    assert result.returncode == 2 and message.format(study=study) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()  # nothing ran


def test_an_arm_named_twice_on_the_command_line_counts_once(tmp_path):
    status = run_cli(["experiment", "status", str(_study(tmp_path)), "--arms", "uniform", "uniform"])
    assert status.stdout.splitlines() == ["uniform seed 1: not started", "0 of 1 runs complete"], status.stdout


def test_t_interval_and_the_pre_registered_verdict_rules():
    from exgrpo.studies.statistics import t_interval, verdict

    mean, low, high = t_interval(np.array([1.0, 2.0, 3.0]))
    assert mean == 2.0 and high - mean == pytest.approx(4.303 * 1.0 / np.sqrt(3))

    def points(*values, equivalence=0.05):
        return verdict(np.array(values) / 100, Registration(effect=0.03, equivalence=equivalence))

    assert points(4, 5, 6) == "helps"  # mean +5, interval [+2.5, +7.5]
    assert points(2, 2.5, 3) == "no difference"  # mean below +3, interval inside ±5
    assert points(1, 2.5, 4, equivalence=0.03) == "inconclusive at this power"  # [−1.2, +6.2] is not inside ±3
    assert points(-4, -5, -6) == "hurts"
    assert points(-1, -2.5, -4) == "inconclusive at this power"  # mean −2.5, interval reaching past −5
    assert points(-10, 5, 20) == "inconclusive at this power"
    with pytest.raises(ValueError, match="2 to 40"):
        t_interval(np.array([0.1]))


def test_the_interval_rule_never_says_no_difference_for_an_interval_that_excludes_0():
    """Round five's flaw: with a ±3 margin, a true +2 with more seeds made "no difference" likely although the
    interval excluded 0. Under verdict_rule "interval" the interval alone decides: over 24 seeds at SD 2.7 a true
    +2 is called "helps" 93% of the time and "no difference" only when its interval reaches 0 (6%, not 41%)."""
    from exgrpo.studies.statistics import no_difference_power, power, verdict

    effect_rule = Registration(effect=0.03, equivalence=0.03)
    interval_rule = Registration(verdict_rule="interval", effect=0.035, equivalence=0.03)
    tight = np.array([1.5, 2.0, 2.5, 2.0, 1.8, 2.2]) / 100  # mean +2.0, interval about [+1.6, +2.4]
    assert verdict(tight, effect_rule) == "no difference"  # the old rule contradicts its own interval
    assert verdict(tight, interval_rule) == "helps"
    assert verdict(-tight, interval_rule) == "hurts"
    assert verdict(np.array([-1.0, 0.5, 1.0, -0.5]) / 100, interval_rule) == "no difference"  # [−1.4, +1.4]
    assert verdict(np.array([-4.0, 5.0, 1.0, 6.0]) / 100, interval_rule) == "inconclusive at this power"
    assert no_difference_power(0.02, 0.027, 24, effect_rule) > 0.3
    assert no_difference_power(0.02, 0.027, 24, interval_rule) < 0.1
    assert power(0.02, 0.027, 24, interval_rule) > 0.9 > power(0.02, 0.027, 24, effect_rule)


def _result(seed: int, rollouts_per_step: list[int], accuracies: dict[int, float], initial: float = 0.1):
    """A run's result from its per-step sampled rollouts and its evaluations {step: accuracy}."""
    history = [{"step": s, "phase": "warmup", "generation/rollouts": n, "experience/replayed": 0,
                **({"eval/accuracy": accuracies[s]} if s in accuracies else {})}
               for s, n in enumerate(rollouts_per_step, start=1)]
    return RunResult(Arm("a", "a", (), (seed,)), seed, config_from_dict({}), history, {"accuracy": initial})


def test_equal_rollouts_are_read_by_interpolation_and_the_primary_metric_is_registered():
    """The reference is read between its evaluations, never at another evaluation step: an arm that sampled 10%
    fewer rollouts is compared with the reference 10% of the way back along its last segment."""
    from exgrpo.studies.statistics import paired_difference

    reference = _result(1, [10] * 10, {5: 0.50, 10: 0.40})  # 50 rollouts: 0.50, 100 rollouts: 0.40
    arm = _result(1, [9] * 10, {5: 0.45, 10: 0.45})  # 45 and 90 rollouts
    final, late = Registration(primary="final"), Registration(primary="late_mean", late_evaluations=2)
    assert reference.primary_at_rollouts(final, arm.curve()[1]) == pytest.approx(0.42)  # 90 of 50..100
    d = paired_difference([arm], [reference], final)
    assert d.at_equal_steps[0] == pytest.approx(0.05) and d.at_equal_rollouts[0] == pytest.approx(0.03)
    # the late mean: the arm's evaluations at 45 and 90 rollouts against the reference read there, 0.46
    # (0.1 + 0.4 * 45/50) and 0.42
    assert arm.primary(late) == pytest.approx(0.45) and reference.primary(late) == pytest.approx(0.45)
    assert paired_difference([arm], [reference], late).at_equal_rollouts[0] == pytest.approx(0.45 - 0.44)
    more = _result(1, [11] * 10, {5: 0.5, 10: 0.5})  # 110 rollouts: beyond the reference's last evaluation
    assert np.isnan(paired_difference([more], [reference], final).at_equal_rollouts[0])


def test_the_paired_table_adds_a_row_without_the_seeds_where_the_replaying_arm_never_replayed():
    """Round six's registered secondary: an ExGRPO run with no success is its GRPO run (difference 0 by
    construction); the second row leaves such seeds out."""
    from exgrpo.studies.report import paired_table

    def run(arm, ratio, seed, late, mixed):
        history = [{"step": s, "phase": "mixed" if mixed and s > 1 else "warmup", "generation/rollouts": 10,
                    "experience/replayed": 0, **({"eval/accuracy": late} if s in (4, 5, 6) else {})}
                   for s in range(1, 7)]
        config = config_from_dict({"experience": {"ratio": ratio}})
        return RunResult(Arm(arm, arm.upper(), (), (seed,)), seed, config, history, {"accuracy": 0.0})

    arms = {"grpo": [run("grpo", 0.0, s, 0.10, False) for s in (1, 2, 3, 4)],
            "exgrpo": [run("exgrpo", 0.5, 1, 0.13, True), run("exgrpo", 0.5, 2, 0.14, True),
                       run("exgrpo", 0.5, 3, 0.12, True), run("exgrpo", 0.5, 4, 0.10, False)]}
    rows = paired_table(arms, [("exgrpo", "grpo")], Registration(primary="late_mean", late_evaluations=3))
    assert rows[2].startswith("| EXGRPO − GRPO | 1, 2, 3, 4 | +2.2 [")
    assert rows[3].startswith("| EXGRPO − GRPO, seeds where it replayed | 1, 2, 3 | +3.0 [")
    assert len(paired_table({**arms, "exgrpo": arms["exgrpo"][:3]}, [("exgrpo", "grpo")], Registration())) == 3


def test_the_power_is_stated_at_each_comparisons_number_of_paired_seeds():
    """Round six's third arm stops at 16 of 24 seeds (its registered budget rule): the comparisons with it are
    powered at 16 pairs, the others at 24."""
    from exgrpo.studies.report import _power_statements
    from exgrpo.studies.statistics import power_statement

    def runs(name, seeds):
        return [RunResult(Arm(name, name.upper(), (), tuple(seeds)), s, config_from_dict({}), [], {}) for s in seeds]

    rules = Registration(power_sd=0.027, power_effects=(0.02,))
    arms = {"grpo": runs("grpo", range(1, 25)), "exgrpo": runs("exgrpo", range(1, 25)),
            "skip": runs("skip", range(1, 17))}
    lines = _power_statements(arms, [("exgrpo", "grpo"), ("skip", "grpo"), ("exgrpo", "skip")], rules)
    assert lines == [f"EXGRPO − GRPO: {power_statement(rules, 24)}", "",
                     f"SKIP − GRPO; EXGRPO − SKIP: {power_statement(rules, 16)}", ""]
    assert "With 16 paired seeds" in lines[2]
    assert _power_statements({k: arms[k] for k in ("grpo", "exgrpo")}, [("exgrpo", "grpo")], rules) == \
        [power_statement(rules, 24), ""]


def test_the_registered_power_statement_reproduces_round_three():
    """Round three's figures (issue #37): a paired SD of 8.3 points over 5 seeds gives P("helps") ≈ 11% for a true
    +3.5 and ≈ 35% for +7.6, and 80% power only at about +14."""
    from exgrpo.studies.statistics import detectable_effect, power, power_statement

    rules = Registration(effect=0.03, equivalence=0.05, power_sd=0.083, power_effects=(0.035, 0.076))
    assert 0.08 < power(0.035, 0.083, 5, rules) < 0.14 and 0.30 < power(0.076, 0.083, 5, rules) < 0.40
    assert 0.12 < detectable_effect(0.083, 5, rules) < 0.16
    assert power(0.035, 0.083, 10, rules) > power(0.035, 0.083, 5, rules)
    assert "80% power needs a true effect of +1" in power_statement(rules, 5)


def test_the_power_statement_gives_both_probabilities_round_four_computed():
    """Round four part two's dated note: 6 seeds at the registered SD 3.0 say "no difference" with no true effect
    22% of the time (7% at SD 4.0, 96% at the observed 1.43)."""
    from exgrpo.studies.statistics import no_difference_power, power_statement

    rules = Registration(effect=0.03, equivalence=0.03, power_sd=0.03, power_effects=(0.035,))
    assert no_difference_power(0.0, 0.03, 6, rules) == pytest.approx(0.218, abs=0.002)
    assert no_difference_power(0.0, 0.04, 6, rules) == pytest.approx(0.065, abs=0.002)
    assert no_difference_power(0.0, 0.0143, 6, rules) == pytest.approx(0.962, abs=0.002)
    assert "With no true difference they say \"no difference\" with probability 22%." in power_statement(rules, 6)


def test_the_mechanism_table_reads_what_was_paid():
    from exgrpo.studies.report import mechanism_table

    run = _result(1, [48] * 4, {4: 0.1})
    for m, zero, replayed in zip(run.history, (1.0, 0.5, 0.5, 0.0), (0, 0, 3, 3)):
        m.update({"generation/zero_variance_fraction": zero, "experience/replayed": replayed})
    run.history[1]["entropy/fresh_correct"] = 0.4  # the first correct rollout of its own: step 2
    paid = [("5 + 9 = 14, 14 + 7 = 21. The answer is 21.", False), ("5 + 9 = 15, so 21.", False),
            ("The answer is 21.", False), ("5 + 9 = 14, 14 + 7 = 21, so 21", True)]
    run.samples = [{"completion": text, "replayed": replayed, "reward": 1.0} for text, replayed in paid] + \
        [{"completion": "5 + 9 = 14, so 14.", "replayed": False, "reward": 0.0}]  # not paid: not read
    table = mechanism_table({"a": [run]}, ["a"])
    assert table[2] == "| a | 2.0 | 1.50 | 50.0% | 3: 1 / 1 / 1 | 1: 1 / 0 / 0 |"
    never = _result(2, [48] * 4, {4: 0.0})  # no correct rollout of its own in any step
    for m in never.history:
        m.update({"generation/zero_variance_fraction": 1.0, "experience/replayed": 0})
    assert mechanism_table({"a": [run, never]}, ["a"])[2].startswith("| a | 2.0 (1 of 2 runs) | 0.75 | 75.0% |")


def test_the_samples_page_shows_every_paid_sample_and_every_unpaid_one_stating_its_gold(tmp_path):
    """The report's page for reading what was paid by hand: questions read from the run's own training data."""
    from exgrpo.studies.report import SAMPLES_PAGE, _write_samples_page

    data = tmp_path / "sums.jsonl"
    data.write_text(json.dumps({"prompt": "Calculate 83 + 95 + 10.", "answer": "188"}) + "\n")
    run = _result(1, [8] * 2, {})
    run.config = config_from_dict({"data": {"train": str(data), "prompt_suffix": " Answer with only the number."}})
    logged = [("83 + 95 = 188", True, 1.0),  # paid, the step is wrong: lucky
              ("So 1188.", False, 0.0),  # 188 only inside a longer number: not shown
              ("83 + 95 + 10 = 188\nSo", False, 0.0)]  # cut at the cap: unpaid, states the gold answer
    run.samples = [{"step": 5, "question_id": "sums/0", "answer": "188", "completion": text, "replayed": replayed,
                    "reward": reward, "truncated": text.endswith("So")} for text, replayed, reward in logged]
    link = _write_samples_page({"a": [run]}, ["a"], tmp_path)
    assert f"[{SAMPLES_PAGE}]({SAMPLES_PAGE})" in link[0]
    page = (tmp_path / SAMPLES_PAGE).read_text()
    assert "## a, seed 1: 1 paid of 3 logged" in page and "1188" not in page
    assert ("**step 5, replayed: paid, lucky.** Calculate 83 + 95 + 10. Answer with only the number. Gold: 188.\n\n"
            "> 83 + 95 = 188\n") in page
    assert "**step 5: not paid, cut at the length cap.** Calculate" in page and "> 83 + 95 + 10 = 188\n> So\n" in page
    assert _write_samples_page({"a": [_result(2, [8], {})]}, ["a"], tmp_path) == []  # nothing logged: no page,
    assert not (tmp_path / SAMPLES_PAGE).exists()  # not even the last report's


def test_the_take_off_count_compares_each_run_with_its_own_start():
    from exgrpo.studies.report import take_off_line

    late = Registration(primary="late_mean", late_evaluations=2)
    up, flat = _result(1, [8] * 4, {2: 0.14, 4: 0.18}, initial=0.1), _result(2, [8] * 4, {2: 0.13, 4: 0.15})
    assert take_off_line({"a": [up, flat]}, ["a"], late) == \
        "Runs whose primary metric is at least 5 points above their step 0 (take-off): a 1 of 2."


def test_medium_bucket_supply_reads_the_buckets_a_step_drew_its_replays_from():
    from exgrpo.studies.report import medium_bucket_supply

    history = [
        {"step": 1, "experience/replayed": 0, "experience/bucket_4": 2, "experience/bucket_7": 5},
        {"step": 2, "experience/replayed": 3, "experience/bucket_1": 4, "experience/bucket_6": 1},  # drew from 2
        {"step": 3, "experience/replayed": 3, "experience/bucket_7": 9},  # drew from 1 medium question of 3 slots
        {"step": 4, "experience/replayed": 2},  # drew from none (k = 7 is not medium)
    ]
    medium, filled = medium_bucket_supply(history, num_generations=8)
    assert medium == pytest.approx((2 + 1 + 0) / 3) and filled == pytest.approx((2 / 3 + 1 / 3 + 0) / 3)
    assert medium_bucket_supply(history[:1], num_generations=8) is None


def test_curves_of_runs_that_end_at_different_steps_align():
    from exgrpo.studies.report import _aligned

    short, long = [(0, 0.1), (10, 0.5), (12, 1.0)], [(0, 0.2), (10, 0.6), (20, 0.8)]
    grid, rows = _aligned([short, long], carry=True)  # held-out accuracy: a finished run keeps its last value
    assert grid.tolist() == [0, 10, 12, 20]
    assert np.allclose(rows, [[0.1, 0.5, 1.0, 1.0], [0.2, 0.6, 0.64, 0.8]])
    _, rows = _aligned([short, long], carry=False)  # training metrics: nothing after a run's last step
    assert np.isnan(rows[0, 3]) and np.isnan(rows[1, 2]) and rows[1, 3] == 0.8


@pytest.mark.slow
def test_sigterm_stops_the_whole_study_after_checkpointing_the_current_run(tmp_path):
    path = _study(tmp_path, arms={"grpo": {"overrides": ["experience.ratio=0"]}}, overrides=[
        "train.steps=400", "train.save_every=0", "eval.every=0", "logging.progress=false"])
    proc = subprocess.Popen([sys.executable, "-m", "exgrpo", "experiment", "run", str(path)], cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "grpo" / "seed-1" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert f"SIGTERM: the study stopped after checkpointing the current run; continue it with `exgrpo experiment " \
           f"run {path}`" in err
    assert completed_steps(tmp_path / "runs" / "grpo" / "seed-1") >= 1  # checkpointed where it stopped
    assert not (tmp_path / "runs" / "grpo" / "seed-2").exists()  # the next run never started


def _git(checkout: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(checkout), "-c", "user.name=test", "-c", "user.email=test@example.org",
                           "-c", "commit.gpgsign=false", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _run_study_with(checkout: Path, path: Path) -> None:
    """`exgrpo experiment run` with the exgrpo of `checkout`, in a process of its own."""
    done = subprocess.run([sys.executable, "-m", "exgrpo", "experiment", "run", str(path)], cwd=path.parent,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(checkout / "src")},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_runs_record_when_and_which_code_ran_them_and_the_report_flags_mixed_code(tmp_path):
    """A run started by one commit and resumed by another records both sessions; the report shows them and warns."""
    from exgrpo.runtime.provenance import read_sessions

    checkout = tmp_path / "code"  # a git checkout of this exgrpo, committed: the code a run records
    shutil.copytree(ROOT / "src" / "exgrpo", checkout / "src" / "exgrpo", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / ".gitignore").write_text("__pycache__/\n")  # as a real checkout has: the run writes bytecode
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-qm", "one")
    first = _git(checkout, "rev-parse", "HEAD")
    path = _study(tmp_path, arms={"grpo": {"overrides": ["experience.ratio=0"]}}, seeds=[1])
    run_dir = tmp_path / "runs" / "grpo" / "seed-1"
    _run_study_with(checkout, path)
    (session,) = read_sessions(run_dir)
    assert (session["from_step"], session["to_step"], session["stopped_by"]) == (0, 3, None)
    assert session["code"]["git"] == {"checkout": str(checkout.resolve()), "commit": first, "dirty": False,
                                      "changes": []}
    assert session["started"] <= session["ended"] and session["code"]["source"] == str(checkout.resolve() / "src"
                                                                                       / "exgrpo")

    def report():
        done = run_cli(["experiment", "report", str(path), "--output", str(tmp_path / "report")])
        assert done.returncode == 0, done.stderr
        return done.stderr, (tmp_path / "report" / "report.md").read_text()

    stderr, text = report()
    assert "exgrpo: warning" not in stderr and "WARNING" not in text
    assert f"Every run was run and resumed by the same code: exgrpo 0.1.0 at {first[:7]}." in text
    assert f"| grpo/seed-1 | 1 | {session['started']} | {session['ended']} | exgrpo 0.1.0 at {first[:7]} | " in text
    curves = json.loads((tmp_path / "report" / "curves.json").read_text())
    assert curves["provenance"] == {"grpo/seed-1": [session]} and len(curves["grpo/seed-1"]) == 3

    shutil.rmtree(run_dir / "checkpoints" / "step-000003")  # as if killed after step 2; then the code changes
    _record_a_crash(run_dir)
    (checkout / "src" / "exgrpo" / "__init__.py").write_text(
        (checkout / "src" / "exgrpo" / "__init__.py").read_text() + "# a change\n")
    _git(checkout, "commit", "-qam", "two")
    second = _git(checkout, "rev-parse", "HEAD")
    _run_study_with(checkout, path)
    sessions = read_sessions(run_dir)
    assert sessions[0] == {**session, "ended": None, "to_step": None}
    assert [(s["from_step"], s["to_step"]) for s in sessions] == [(0, None), (2, 3)]
    assert sessions[1]["code"]["git"]["commit"] == second
    held_out = [json.loads(line)["step"] for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert held_out == [2] * 4 + [3] * 4  # each evaluation's graded completions, step 3's logged once

    stderr, text = report()
    mixed = (f"the runs of this study were run or resumed by different code: exgrpo 0.1.0 at {first[:7]}: "
             f"grpo/seed-1; exgrpo 0.1.0 at {second[:7]}: grpo/seed-1")
    assert f"exgrpo: warning: {mixed}" in stderr and f"**WARNING: {mixed}** (see Runs, below)." in text
    assert f"| 2 | {session['started']} | {sessions[1]['ended']} | exgrpo 0.1.0 at {first[:7]} / exgrpo 0.1.0 at " \
           f"{second[:7]} | " in text


def test_the_report_warns_of_a_dirty_tree_and_counts_zero_advantage_steps():
    from exgrpo.studies.report import code_warning, provenance_summary, provenance_table, zero_advantage_steps

    def session(commit: str, dirty: bool) -> dict:
        git = {"checkout": "/c", "commit": commit, "dirty": dirty, "changes": [" M x.py"] if dirty else []}
        return {"code": {"exgrpo": "0.1.0", "source": "/c/src/exgrpo", "git": git}}

    clean, dirty = session("a" * 40, False), session("a" * 40, True)
    assert code_warning({"g/seed-1": [clean], "e/seed-1": [clean, clean]}) is None
    assert code_warning({"g/seed-1": [dirty]}) == (
        "the runs of this study were run from a tree with uncommitted changes, so which code ran them is not known "
        "exactly: exgrpo 0.1.0 at aaaaaaa (dirty tree): g/seed-1")
    assert code_warning({"g/seed-1": [clean], "e/seed-1": []}) == (
        "the runs of this study were run or resumed by different code: exgrpo 0.1.0 at aaaaaaa: g/seed-1; "
        "not recorded: e/seed-1")
    assert code_warning({"g/seed-1": [], "e/seed-1": []}) is None
    assert provenance_summary({"g/seed-1": []}, None).startswith("No run recorded its sessions")

    run = _result(1, [8] * 4, {})  # logged before zero_advantage_steps: one optimizer step a step, read from the spread
    for m, flat in zip(run.history, (1.0, 0.5, 1.0, 0.0)):
        m["frac_reward_zero_std"] = flat
    run.config = config_from_dict({"train": {"mini_batches": 1}})
    assert zero_advantage_steps(run) == 2
    run.config = config_from_dict({"train": {"mini_batches": 2}})
    assert zero_advantage_steps(run) is None  # two mini-batches: a step with a spread may still have had one
    for m, n in zip(run.history, (2, 1, 2, 0)):
        m["zero_advantage_steps"] = float(n)
    assert zero_advantage_steps(run) == 5
    assert provenance_table({"g": [run]}, ["g"], {"g/seed-1": []})[-1].endswith("| 5 applied |")
    run.config = config_from_dict({"train": {"mini_batches": 2, "zero_advantage_steps": "skip"}})
    assert provenance_table({"g": [run]}, ["g"], {"g/seed-1": []})[-1].endswith("| 5 skipped |")

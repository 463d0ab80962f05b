"""A pilot's criteria (`exgrpo.studies.criteria`): each measure on a run's logged rows, and a bad criterion in a
study file refused in one line naming it."""

import pytest

from exgrpo.errors import ConfigError
from exgrpo.studies.criteria import PilotRun, criteria_from


def _run(replays=True) -> PilotRun:
    """40 steps, K = 8, 3 replay slots: evaluations 10% -> 30% (step 20) -> 26% (step 40) from 5% at step 0."""
    rows = {}
    for step in range(1, 41):
        rows[step] = {"entropy": 1.0 - step / 100, "completions/clipped_ratio": step / 80, "batch/pass_at_1": step / 40,
                      "experience/replayed": int(step % 2 == 0), "experience/questions": 10,
                      "experience/bucket_1": 6, "experience/bucket_3": 2 if step < 30 else 4}
    rows[10]["eval/accuracy"], rows[20]["eval/accuracy"], rows[40]["eval/accuracy"] = 0.10, 0.30, 0.26
    return PilotRun(rows, start=0.05, last=40, num_generations=8, replay_slots=3, replays=replays)


def _read(spec: dict, run: PilotRun | None = None):
    (criterion,) = criteria_from({"c": spec}, "study.yaml: registered.criteria")
    return criterion.read(run or _run())


def test_each_measure_reads_the_run():
    assert _read({"measure": "learning", "at_least": 0.2}) == (pytest.approx(0.21), True)
    assert _read({"measure": "late_gain", "from_step": 20, "at_least": 0.25}) == (pytest.approx(0.23), False)
    assert _read({"measure": "drop_from_best", "at_least": -0.05}) == (pytest.approx(-0.04), True)
    assert _read({"measure": "entropy", "step": 20, "at_least": 0.3}) == (pytest.approx(0.8), True)
    assert _read({"measure": "cut", "at_most": 0.4}) == (0.5, False)  # the last step's, without a step
    assert _read({"measure": "medium_share", "step": 20}) == (0.25, None)  # a figure without a bound
    assert _read({"measure": "medium_share", "step": 30, "at_least": 0.4}) == (0.4, True)
    assert _read({"measure": "medium_share"}) == (0.4, None)  # the last step's, without a step
    assert _read({"measure": "medium_share", "step": 50, "at_least": 0.4}) == (None, None)  # a step not logged
    assert _read({"measure": "medium_supply", "from_step": 25, "to_step": 40, "at_least": 12}) == (11, False)
    assert _read({"measure": "replayed_steps", "from_step": 11, "at_least": 15}) == (15, True)
    assert _read({"measure": "replayed_steps", "from_step": 11}, _run(replays=False)) == (None, None)
    assert _read({"measure": "max_pass_at_1", "to_step": 15}) == (0.375, None)
    assert _read({"measure": "start", "at_least": 0.01, "at_most": 0.04}) == (0.05, False)


@pytest.mark.parametrize("spec,said", [
    ({"measure": "entropi", "step": 20}, "a measure among"),
    ({"measure": "late_gain"}, "measure late_gain takes ['from_step'], got none"),
    ({"measure": "learning", "step": 20}, "measure learning takes no parameters, got ['step']"),
    ({"measure": "entropy", "step": "20"}, "steps are integers"),
    ({"measure": "entropy", "at_least": "high"}, "at_least / at_most numbers"),
    ("entropy", "expected a mapping with a measure")])
def test_a_bad_criterion_is_one_line_naming_it(spec, said):
    with pytest.raises(ConfigError, match="study.yaml: registered.criteria.c: ") as e:
        criteria_from({"c": spec}, "study.yaml: registered.criteria")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_pilot_script_reads_a_study_files_criteria_from_its_runs(tmp_path, capsys):
    """bench/pilot_criteria.py on a study's run directories (written here, not trained): each run's evaluations and
    criteria, and its logged samples written out to read."""
    import importlib.util
    import json
    from pathlib import Path

    from exgrpo.studies.study import load_study

    study_file = tmp_path / "pilot.yaml"
    study_file.write_text("base: tiny\noutput_dir: runs\nseeds: [1]\nbaseline: grpo\n"
                          "arms: {grpo: {overrides: [experience.ratio=0]}, exgrpo: {}}\n"
                          "registered:\n  criteria:\n"
                          "    learning: {measure: learning, at_least: 0.1}\n"
                          "    replayed: {measure: replayed_steps, from_step: 2, at_least: 2}\n")
    study = load_study(study_file)
    for arm in study.arms:
        run = study.run_dir(arm, 1)
        run.mkdir(parents=True)
        rows = [{"step": s, "experience/replayed": 1} for s in (1, 2, 3)] + [{"step": 4, "eval/accuracy": 0.5}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "samples.jsonl").write_text(json.dumps({"step": 2, "question_id": "q1", "answer": "7", "reward": 1.0,
                                                       "replayed": False, "completion": "3 + 4 = 7"}) + "\n")
        initial = study.initial_eval_path(study.config(arm, 1))
        initial.parent.mkdir(parents=True, exist_ok=True)
        initial.write_text(json.dumps({"accuracy": 0.25}))
    spec = importlib.util.spec_from_file_location("pilot_criteria",
                                                  Path(__file__).parents[2] / "bench" / "pilot_criteria.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(str(study_file))
    lines = capsys.readouterr().out.splitlines()
    grpo, exgrpo = (json.loads(line.split(": ", 1)[1].rsplit("; samples in", 1)[0]) for line in lines)
    assert grpo == {"evaluations": {"0": 25.0, "4": 50.0}, "learning": [0.25, "met"], "replayed": None}
    assert exgrpo["replayed"] == [2, "met"]
    written = (study.run_dir(study.arm("exgrpo"), 1) / "samples_to_read.txt").read_text()
    assert "gold 7 reward 1.0 replayed False last number 7\n3 + 4 = 7" in written

"""Checkpoints are atomic and a killed run resumes exactly: same buffer, same metrics as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from exgrpo.runtime.checkpoint import checkpoint_dirs, latest_checkpoint
from exgrpo.config import ConfigError, load_config
from exgrpo.errors import CheckpointError, ExgrpoWarning
from exgrpo.experience import ExperienceBuffer
from exgrpo.training.launch import build_run

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # for toy_rewards
STEPS = 8
# A tiny run that switches to the mixed phase after its first step and replays from the third.
OVERRIDES = [f"train.steps={STEPS}", "train.save_every=1", "train.save_total_limit=2", "logging.progress=false",
             "experience.start_threshold=0.0", "reward.workers=0",
             "reward.function=toy_rewards:first_char_is_lowercase", "rollout.max_completion_length=6"]
TIMING = ("time/", "tokens_per_second", "experience/selection_time")


def _train(run_dir, *extra, resume=False, kill_at=None):
    """The tiny run as a process; `kill_at` SIGKILLs it at that point (see tests/faults.py)."""
    cmd = [sys.executable, "-m", "faults" if kill_at else "exgrpo", "train",
           "--config", str(ROOT / "configs" / "tiny.yaml"), *OVERRIDES, f"logging.output_dir={run_dir}", *extra]
    if resume:
        cmd += ["--resume", "auto"]
    env = {**ENV, "EXGRPO_KILL_AT": kill_at} if kill_at else ENV
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _comparable(metrics):
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith(TIMING)} for m in metrics]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, "train.save_every=0", "train.steps=200")
    deadline = time.time() + 240
    while len(_metrics(run)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM  # a stop, not a completion
    steps = len(_metrics(run))
    assert 2 <= steps < 200 and latest_checkpoint(run).name == f"step-{steps:06d}"


def test_resume_without_checkpoint_is_an_error(tmp_path):
    result = run_cli(["train", "--resume", str(tmp_path)])
    assert result.returncode == 2 and "no run there" in result.stderr


@pytest.mark.parametrize("stored, message", [
    ('{"train": {"steps": "many"}}', "config.json with the overrides: train.steps: expected an integer, got 'many'"),
    ('{"model": {"dtype": "f', "config.json: not valid YAML: found unexpected end of stream (line 1, column 23)"),
    (None, "config.json is a directory; expected the run's config file"),  # it said "no run there"
])
def test_resume_of_a_damaged_config_says_which_file_in_one_line(tmp_path, stored, message):
    """A wrong field of a stored config.json did not name the file; a truncated one printed PyYAML's six lines."""
    config = tmp_path / "config.json"
    config.mkdir() if stored is None else config.write_text(stored)
    result = run_cli(["train", "--resume", str(tmp_path)])
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_a_resume_with_fewer_steps_than_the_run_has_is_refused(tmp_path):
    """train.steps=1 on a run at step 2 trained nothing, exited 0 and stored train.steps 1 as the run's length."""
    run = ["train", "--config", "tiny", f"logging.output_dir={tmp_path}", "logging.progress=false", "train.steps=2"]
    assert run_cli(run).returncode == 0
    stored = (tmp_path / "config.json").read_text()
    result = run_cli(["train", "--resume", str(tmp_path), "train.steps=1"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == (f"exgrpo: config error: cannot resume {tmp_path}/checkpoints/step-000002 "
                                              "with train.steps 1: the run is at step 2 already (train.steps is the "
                                              "run's length, not the steps to add)")
    assert (tmp_path / "config.json").read_text() == stored


def test_a_damaged_provenance_record_is_refused_before_the_model_loads(tmp_path):
    """An empty or null provenance.json was refused in one line only once the model had loaded (start_session)."""
    from exgrpo.errors import RunDirectoryError
    from exgrpo.training.launch import start_point

    run = ["train", "--config", "tiny", f"logging.output_dir={tmp_path}", "logging.progress=false", "train.steps=1"]
    assert run_cli(run).returncode == 0
    (tmp_path / "provenance.json").write_text("null")
    with pytest.raises(RunDirectoryError, match=r"provenance\.json: unreadable"):
        start_point(load_config("tiny", [f"logging.output_dir={tmp_path}"]), resume=True)


def test_a_checkpoint_written_before_a_rename_reads_under_the_new_names(tmp_path):
    from exgrpo.runtime.checkpoint import read_trainer_json

    (tmp_path / "trainer.json").write_text(json.dumps({"step": 3, "solved": ["q0"], "skipped_updates": 1}))
    assert read_trainer_json(tmp_path) == {"step": 3, "ever_correct": ["q0"], "skipped_optimizer_steps": 1}
    (tmp_path / "trainer.json").write_text(json.dumps({"step": 3, "solved": ["q0"], "ever_correct": []}))
    with pytest.raises(CheckpointError, match=r"trainer\.json: solved and ever_correct are both set"):
        read_trainer_json(tmp_path)


def test_a_stored_config_with_a_field_under_both_names_is_refused_naming_its_file(tmp_path):
    from exgrpo.training.launch import start_point

    assert run_cli(["train", "--config", "tiny", f"logging.output_dir={tmp_path}", "logging.progress=false",
                    "train.steps=1"]).returncode == 0
    checkpoint = latest_checkpoint(tmp_path)
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    trainer["config"]["experience"]["policy"] = "exgrpo"  # replay_policy's old name, beside it
    (checkpoint / "trainer.json").write_text(json.dumps(trainer))
    (checkpoint / "manifest.json").unlink()  # resumed unverified (with a warning), so the edit is read
    with pytest.warns(ExgrpoWarning), pytest.raises(ConfigError, match=rf"{checkpoint}/trainer\.json: config: "
                                                    "experience.policy and experience.replay_policy are both set"):
        start_point(load_config("tiny", [f"logging.output_dir={tmp_path}"]), resume=True)


def _check_resumable(run) -> None:
    """Every complete checkpoint loads, and the trainer resumed from the newest holds exactly its buffer."""
    for ckpt in checkpoint_dirs(run):
        ExperienceBuffer.load(ckpt / "buffer.safetensors")
        json.loads((ckpt / "trainer.json").read_text())
    latest = latest_checkpoint(run)
    resumed = build_run(load_config(ROOT / "configs" / "tiny.yaml", OVERRIDES + [f"logging.output_dir={run}"]))
    try:
        resumed.trainer.resume(latest)
        saved = ExperienceBuffer.load(latest / "buffer.safetensors")
        assert resumed.trainer.experience.buffer.fingerprint() == saved.fingerprint()
        assert resumed.trainer.step == int(latest.name.split("-")[1]) and resumed.trainer.experience.phase == "mixed"
    finally:
        resumed.close()


@pytest.mark.slow
def test_kills_inside_checkpoint_writes_and_prunes_lose_nothing(tmp_path):
    """SIGKILL at exact points (tests/faults.py): before a written checkpoint is renamed into place, inside a prune,
    right after a rename, and inside the last save's prune (the finished run's resume trains nothing and must still
    sweep the scratch). Each resume ends identical to an uninterrupted run, with no scratch directories left."""
    from exgrpo.runtime.checkpoint import verify_checkpoint

    reference = tmp_path / "reference"  # uninterrupted, in this process
    done = run_cli(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), *OVERRIDES,
                    f"logging.output_dir={reference}"])
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _comparable(_metrics(reference))
    assert len(expected) == STEPS and expected[-1]["phase"] == "mixed" and expected[-1]["experience/replayed"] > 0

    run = tmp_path / "killed"
    kills = ["replace:.tmp-step-000002", "rmtree:.deleting-step-000002", "after-replace:.tmp-step-000005",
             "rmtree:.deleting-step-000006"]  # keep 2: saving step 4 prunes step 2, saving step 8 prunes step 6
    for i, kill_at in enumerate(kills):
        proc = _train(run, resume=i > 0, kill_at=kill_at)
        assert proc.wait(timeout=300) == -signal.SIGKILL, (kill_at, proc.stderr.read()[-3000:])
        _check_resumable(run)
    scratch = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert scratch and all(name.startswith(".deleting-step-000006") for name in scratch)
    proc = _train(run, resume=True)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    got = _comparable(_metrics(run))
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert got == expected  # exact: per-step seeds derive from (seed, step) and all state is restored
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-000007", "step-000008"]  # no .tmp-/.deleting- leftovers
    assert all(verify_checkpoint(run / "checkpoints" / n) is None for n in names)

"""Hostile use of real runs (tiny model, the CLI in-process or, where a case needs its own process, in a subprocess):
one row per case, the expected outcome beside it.

Each case function gets a fresh directory and returns the finished process (or asserts more on its own); the
table below pairs it with the exit code and a message that must appear on stderr.
"""

import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_the_learner_only, run_cli, wait_for_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT.parent / "shared" / "data" / "benchmarks"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "HF_HUB_OFFLINE": "1"}
BASE = ["--config", str(ROOT / "configs" / "tiny.yaml"), "logging.progress=false", "reward.workers=0",
        "reward.function=toy_rewards:first_char_is_lowercase", "train.steps=2", "train.save_every=1",
        "train.save_total_limit=3", "train.threads=1"]


def start(run_dir, *args, preexec_fn=None, env=None):
    return subprocess.Popen([sys.executable, "-m", "exgrpo", "train", *BASE, f"logging.output_dir={run_dir}", *args],
                            cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=preexec_fn, start_new_session=True)


def train(run_dir, *args, preexec_fn=None, env=None, isolated=False) -> subprocess.CompletedProcess:
    """`exgrpo train` on the tiny config, in this process unless it needs its own (an rlimit, grading workers)."""
    if not (isolated or preexec_fn):
        return run_cli(["train", *BASE, f"logging.output_dir={run_dir}", *args], env={**ENV, **(env or {})})
    proc = start(run_dir, *args, preexec_fn=preexec_fn, env=env)
    _, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def steps(run_dir) -> list[int]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def last_metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[-1])


def checkpoints(run_dir) -> list[str]:
    root = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def wait_for_steps(run_dir, n, proc, timeout=240):
    deadline = time.time() + timeout
    while len(steps(run_dir)) < n:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)


# --- the cases --------------------------------------------------------------------------------------------------


def two_runs_in_one_directory(d):
    first = start(d, "train.steps=400", "train.save_every=0")
    try:
        wait_for_steps(d, 1, first)
        second = train(d)
        assert first.poll() is None and steps(d) == list(range(1, len(steps(d)) + 1))  # the first run is untouched
        return second
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def new_run_in_a_used_directory(d):
    assert train(d).returncode == 0
    refused = train(d, "train.steps=3")
    assert steps(d) == [1, 2] and checkpoints(d) == ["step-000001", "step-000002"]  # nothing was touched
    overwritten = train(d, "train.steps=1", "--overwrite")
    assert overwritten.returncode == 0 and steps(d) == [1] and checkpoints(d) == ["step-000001"]
    return refused


def corrupt_latest_checkpoint(d):
    assert train(d, "train.steps=3").returncode == 0
    weights = Path(d) / "checkpoints" / "step-000003" / "model" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        f.write(b"\0" * 4096)
    resumed = train(d, "--resume", str(d), "train.steps=4")
    assert "resumed from" in resumed.stderr and "step-000002" in resumed.stderr
    assert steps(d) == [1, 2, 3, 4]  # step 3 re-run from step 2's checkpoint, logged once
    return resumed


def truncated_buffer_in_the_only_checkpoint(d):
    assert train(d, "train.steps=1").returncode == 0
    buffer = Path(d) / "checkpoints" / "step-000001" / "buffer.safetensors"
    buffer.write_bytes(buffer.read_bytes()[:-100])
    return train(d, "--resume", str(d), "train.steps=2")


def resume_that_changes_the_algorithm(d):
    assert train(d).returncode == 0
    refused = train(d, "--resume", str(d), "rollout.num_generations=8")
    assert json.loads((Path(d) / "config.json").read_text())["rollout"]["num_generations"] == 4  # not rewritten
    extended = train(d, "--resume", str(d), "train.steps=3")
    assert extended.returncode == 0 and "resuming with changed settings: train.steps: 2 -> 3" in extended.stderr
    assert steps(d) == [1, 2, 3]
    return refused


def torn_last_metrics_line(d):
    assert train(d).returncode == 0
    with open(Path(d) / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')
    resumed = train(d, "--resume", "auto", "train.steps=3")
    assert steps(d) == [1, 2, 3]
    return resumed


def killed_before_the_first_checkpoint(d):
    proc = start(d, "train.steps=400", "train.save_every=0")
    wait_for_steps(d, 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoints(d) == [] and len(steps(d)) >= 2
    resumed = train(d, "--resume", "auto", "train.steps=2")
    assert steps(d) == [1, 2]
    return resumed


def resume_as_stored(d, *overrides):
    """`exgrpo train --resume RUN`: the run's own config.json, no config file."""
    return run_cli(["train", "--resume", str(d), *overrides], env=ENV)


def resume_of_a_run_started_over(d):
    assert train(d).returncode == 0 and train(d, "--overwrite").returncode == 0  # the README's "start over"
    assert json.loads((Path(d) / "config.json").read_text())["logging"]["overwrite"] is False  # an action, done
    resumed = resume_as_stored(d, "train.steps=3")
    assert steps(d) == [1, 2, 3]
    return resumed


def resume_of_a_run_that_stored_overwrite(d):
    assert train(d).returncode == 0
    config = json.loads((Path(d) / "config.json").read_text())
    config["logging"]["overwrite"] = True  # as exgrpo stored it before: a run started with --overwrite
    (Path(d) / "config.json").write_text(json.dumps(config))
    resumed = resume_as_stored(d, "train.steps=3")
    assert steps(d) == [1, 2, 3]
    return resumed


def resume_with_every_checkpoint_removed(d):
    assert train(d, "train.steps=3").returncode == 0
    for checkpoint in (Path(d) / "checkpoints").iterdir():
        shutil.rmtree(checkpoint)
    history = (Path(d) / "metrics.jsonl").read_text()
    refused = train(d, "--resume", str(d), "train.steps=4")
    assert (Path(d) / "metrics.jsonl").read_text() == history  # kept, not replaced
    return refused


def one_unretired_question_left(d):
    done = train(d, "experience.ratio=0", "experience.retirement=immediate",
                 "reward.function=toy_rewards:all_but_answer_15", "train.steps=6",
                 "data.train=reasoning_gym:basic_arithmetic?size=12&seed=1&min_terms=2&max_terms=2&min_digits=1"
                 "&max_digits=1&operators=+", "data.holdout=0")
    assert last_metrics(d)["fresh_questions_remaining"] == 1 and steps(d) == list(range(1, 7))
    return done


def ctrl_c_while_grading(d):
    proc = start(d, "reward.function=toy_rewards:slow_lowercase", "reward.workers=1", "reward.timeout=60",
                 "train.steps=400", "train.save_every=0", "train.prompts_per_step=2", "rollout.num_generations=2")
    wait_for_steps(d, 1, proc)
    time.sleep(0.5)  # into the next step's grading (0.5 s per completion)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground process group
    _, stderr = proc.communicate(timeout=300)
    m = last_metrics(d)
    assert m["grading/crashes"] == 0 and m["grading/timeouts"] == 0  # the in-flight answers were graded
    assert checkpoints(d) == [f"step-{m['step']:06d}"]
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def grading_timeouts(d):
    done = train(d, "reward.function=toy_rewards:hangs_once", "reward.workers=1", "reward.timeout=2",
                 "train.steps=1", env={"TOY_MARKER": str(d.parent / "marker")}, isolated=True)
    assert last_metrics(d)["grading/timeouts"] > 0
    return done


def in_process_grading_timeouts(d):
    done = train(d, "reward.function=toy_rewards:hangs_once", "reward.timeout=2", "train.steps=1",
                 env={"TOY_MARKER": str(d.parent / "marker")})  # reward.workers=0: SIGALRM stops the item
    assert last_metrics(d)["grading/timeouts"] == 1
    return done


def sigterm_twice_in_a_hung_reward(d):
    marker = d.parent / "marker"
    proc = start(d, "reward.function=toy_rewards:hangs_once", "reward.timeout=600", env={"TOY_MARKER": str(marker)})
    deadline = time.time() + 240
    while not marker.exists():  # the reward has started hanging
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    seen = []  # the second SIGTERM only once the first is acknowledged: two at once would merge into one
    while not seen or "SIGTERM: stopping after this step" not in seen[-1]:
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)  # EOF: the process ended before acknowledging
    asked = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - asked < 10 and checkpoints(d) == [] and steps(d) == []
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", "".join(seen) + stderr)


def sigkill_of_a_learner_with_grading_workers(d):
    proc = start(d, "reward.workers=2", "train.steps=400", "train.save_every=1")
    wait_for_checkpoint(d, 1, proc)
    workers, _ = kill_the_learner_only(proc)  # the grading workers follow it within seconds
    assert len(workers) == 2
    return train(d, "--resume", str(d), "train.steps=2", "reward.workers=2", isolated=True)


def raising_on_some_completions(d):
    result = train(d, "reward.function=toy_rewards:raises_on_uppercase", "train.steps=3")
    assert result.stderr.count("the first failure") == 1  # shown once, not at every step
    failed = [json.loads(line)["grading/errors"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert 0 < sum(failed) < 3 * 16, failed  # counted per step
    return result


def disk_full_while_checkpointing(d):
    assert train(d, "train.steps=1").returncode == 0
    limit = 300_000  # bytes per file: the tiny model's weights (~380 kB) no longer fit

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    failed = train(d, "--resume", str(d), "train.steps=2", preexec_fn=small_disk)
    assert checkpoints(d) == ["step-000001"]  # no partial step-2 checkpoint, step 1 intact
    assert failed.stderr.count("File too large") == 1  # the OS's words (torch.save's own are a C++ assertion)
    assert train(d, "--resume", str(d), "train.steps=2").returncode == 0 and steps(d) == [1, 2]
    return failed


def disk_full_while_logging(d):
    def small_disk():  # config.json (3 kB) fits, the metrics of a few steps (1.6 kB each) do not
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))

    failed = train(d, "train.steps=20", "train.save_every=0", preexec_fn=small_disk)
    assert failed.stderr.count("File too large") == 1 and checkpoints(d) == []
    return failed


FOUR_COMPLETIONS = ("train.prompts_per_step=2", "rollout.num_generations=2")  # 4 completions a step


def failing_reward(d, function, *args, workers=0):
    """A run whose reward `toy_rewards:<function>` fails on every completion: it stops at step 1, saving nothing."""
    result = train(d, f"reward.function=toy_rewards:{function}", f"reward.workers={workers}", *FOUR_COMPLETIONS,
                   *args, isolated=workers > 0)
    assert steps(d) == [] and checkpoints(d) == []
    return result


def buffer_of_a_checkpoint_with_a_truncated_buffer(d):
    assert train(d, "train.steps=1").returncode == 0
    checkpoint = Path(d) / "checkpoints" / "step-000001"
    buffer = checkpoint / "buffer.safetensors"
    buffer.write_bytes(buffer.read_bytes()[:-100])
    assert "no intact checkpoint in" in run_cli(["buffer", str(d)]).stderr  # the run: verified, refused
    assert "buffer.safetensors has " in run_cli(["buffer", str(checkpoint)]).stderr  # the checkpoint: verified
    (checkpoint / "manifest.json").unlink()  # an unverifiable checkpoint: the file itself is refused by name
    return run_cli(["buffer", str(checkpoint)])


def benchmark_questions_held_out(d):
    return train(d, f"data.eval={BENCH / 'valid.parquet'}", "eval.every=1")


def benchmark_questions_trained_on(d):
    return train(d, f"data.train={BENCH / 'test.id.parquet'}", "data.holdout=0")


CASES = {  # name: (case, exit code, message on stderr)
    "second run in a busy run directory": (two_runs_in_one_directory, 2, "is in use by another run"),
    "fresh run in a used run directory": (new_run_in_a_used_directory, 2, "already holds a run"),
    "corrupt weights in the latest checkpoint": (corrupt_latest_checkpoint, 0,
                                                 "skipping checkpoint step-000003: "),
    "truncated buffer in the only checkpoint": (truncated_buffer_in_the_only_checkpoint, 2,
                                                "no intact checkpoint to resume from"),
    "resume that changes K": (resume_that_changes_the_algorithm, 2,
                              "changes the algorithm: rollout.num_generations: 4 -> 8"),
    "torn last line of metrics.jsonl": (torn_last_metrics_line, 0, "resumed from"),
    "killed before the first checkpoint": (killed_before_the_first_checkpoint, 0,
                                           "stopped before its first checkpoint; starting it again from step 0"),
    "resume of a run started over with --overwrite": (resume_of_a_run_started_over, 0, "resumed from"),
    "resume of a run whose config.json stored overwrite: true": (resume_of_a_run_that_stored_overwrite, 0,
                                                                 "resumed from"),
    "resume with every checkpoint removed": (
        resume_with_every_checkpoint_removed, 2,
        "its history (metrics.jsonl) reaches step 3, past its first checkpoint (step 1, train.save_every 1), but no "
        "checkpoint is left in"),
    "one unretired question left (GRPO)": (one_unretired_question_left, 0, ""),
    "learning rate inf": (lambda d: train(d, "train.learning_rate=.inf"), 2,
                          "train.learning_rate must be a finite number"),
    "learning rate beyond float32": (lambda d: train(d, "train.learning_rate=1e39"), 2,
                                     "train.learning_rate must be in (0, 1]"),
    "reward returning inf": (lambda d: train(d, "reward.function=toy_rewards:infinite"), 2,
                             "returned a non-finite reward"),
    "reward returning only None": (lambda d: train(d, "reward.function=toy_rewards:no_opinion"), 2,
                                   "no reward function gave a reward"),
    "reward on another scale": (lambda d: train(d, "reward.function=toy_rewards:wrong_is_worth_two",
                                                "train.steps=5"), 0, "outside reward.min_value..max_value"),
    "reward on another scale retires everything": (
        lambda d: train(d, "reward.function=toy_rewards:wrong_is_worth_two", "train.steps=5"), 0,
        "every rollout of the first 5 steps reached reward.success_threshold"),
    "reward that never reaches the threshold": (lambda d: train(d, "reward.function=toy_rewards:at_most_half",
                                                                "train.steps=5"), 0,
                                                "no rollout of the first 5 steps reached"),
    "async with the hf engine, refused before loading": (lambda d: train(d, "rollout.mode=async"), 2,
                                                        "needs an engine with its own copy of the weights"),
    "async with the vllm engine under torchrun, refused before loading": (
        lambda d: train(d, "rollout.mode=async", "rollout.engine=vllm", env={"WORLD_SIZE": "2"}), 2,
        "rollout.mode async under torchrun needs an engine that rank 0 alone drives"),
    "threshold above the declared range": (lambda d: train(d, "reward.success_threshold=2"), 2,
                                           "reward.success_threshold (2.0) must lie in"),
    "skipped updates beyond the budget": (lambda d: train(d, "train.skip_grad_norm=1e-12",
                                                          "train.max_skipped_optimizer_steps=1"), 2,
                                          "more than train.max_skipped_optimizer_steps 1"),
    "reward raising on every completion": (lambda d: train(d, "reward.function=toy_rewards:raises"), 2,
                                           "ZeroDivisionError: a bug in the reward function"),
    "reward returning a string": (lambda d: train(d, "reward.function=toy_rewards:returns_a_string"), 2,
                                  "failed on every one of the 16 completions it graded"),
    "reward returning a scalar": (lambda d: train(d, "reward.function=toy_rewards:returns_a_scalar"), 2,
                                  "returned 1.0 for one completion"),
    "reward returning a list of the wrong length": (
        lambda d: train(d, "reward.function=toy_rewards:returns_two_rewards"), 2, "returned [1.0, 0.0] for one"),
    "reward raising on some completions": (raising_on_some_completions, 0, "the first failure:\nKeyError"),
    "SIGKILL of a learner with grading workers": (sigkill_of_a_learner_with_grading_workers, 0, "resumed from"),
    "grading timeouts": (grading_timeouts, 0, "failed on 1 of 16 (1 timed out: raise reward.timeout if correct"),
    "reward hanging on every completion, in-process": (
        lambda d: failing_reward(d, "hangs", "reward.timeout=0.5"), 2,
        "failed on every one of the 4 completions it graded (all 4 timed out: raise reward.timeout"),
    "reward hanging on every completion, in workers": (
        lambda d: failing_reward(d, "hangs", "reward.timeout=1", workers=2), 2,
        "failed on every one of the 4 completions it graded (all 4 timed out: raise reward.timeout"),
    "reward busy-looping on every completion, in-process": (
        lambda d: failing_reward(d, "busy_loop", "reward.timeout=0.5"), 2, "(all 4 timed out: "),
    "reward raising SystemExit(0), in-process": (
        lambda d: failing_reward(d, "exits"), 2, "(all 4 exited: it raised SystemExit or KeyboardInterrupt"),
    "reward raising SystemExit(0), in workers": (lambda d: failing_reward(d, "exits", workers=2), 2,
                                                 "the first failure:\nSystemExit: 0"),
    "reward raising KeyboardInterrupt, in workers": (lambda d: failing_reward(d, "interrupts", workers=2), 2,
                                                     "(all 4 exited: it raised SystemExit or KeyboardInterrupt"),
    "reward calling os._exit, in workers": (
        lambda d: failing_reward(d, "ends_the_process", workers=2), 2,
        "(all 4 crashed: its grading worker died (os._exit(), a crash in native code, or out of memory)); the first "
        "failure:\nits grading worker died (exit code 0)"),
    "Ctrl-C while grading": (ctrl_c_while_grading, 128 + signal.SIGINT, "SIGINT: checkpointing at step"),
    "a hung reward graded in-process": (in_process_grading_timeouts, 0, "grading failed for some completions"),
    "SIGTERM twice while a reward hangs": (sigterm_twice_in_a_hung_reward, 128 + signal.SIGTERM,
                                           "SIGTERM again: stopped at once"),
    "held-out set as large as the training data": (lambda d: train(d, "data.holdout=1000"), 2,
                                                   "data.holdout (1000) must be less than the "),
    "every prompt longer than data.max_prompt_length": (
        lambda d: train(d, "data.max_prompt_length=2"), 2,
        "data.max_prompt_length (2) is below every training question's prompt: all 55 would be dropped"),
    "fewer training questions than a step's": (
        lambda d: train(d, "data.holdout=0", "train.prompts_per_step=8", "data.train=reasoning_gym:basic_arithmetic"
                        "?size=6&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=1&operators=+"), 2,
        "train.prompts_per_step (8) is more than the 6 training questions (after the held-out split and screening)"),
    "unwritable output directory": (lambda d: train("/dev/null/run"), 2, "/dev/null/run: cannot write there"),
    "disk full while checkpointing": (disk_full_while_checkpointing, 2, "cannot write checkpoint"),
    "disk full while logging": (disk_full_while_logging, 2, "metrics.jsonl: File too large"),
    "buffer of a directory that is no run": (lambda d: run_cli(["buffer", str(d.parent)]), 2,
                                             "neither a run directory with checkpoints nor a checkpoint (no "
                                             "buffer.safetensors in it)"),
    "buffer with a negative number of examples": (lambda d: run_cli(["buffer", str(d.parent), "--examples", "-1"]), 2,
                                                  "--examples must be >= 0 (got -1)"),
    "reward raising KeyboardInterrupt, in-process": (lambda d: failing_reward(d, "interrupts"), 2,
                                                     "(all 4 exited: it raised SystemExit or KeyboardInterrupt"),
    "servers engine without vLLM installed": (
        lambda d: pytest.skip("vLLM is installed here") if importlib.util.find_spec("vllm") else
        train(d, "rollout.engine=servers", "rollout.servers=http://127.0.0.1:9", "rollout.mode=async"), 2,
        "rollout.engine servers needs vLLM, which is not installed: pip install 'exgrpo[vllm]'"),
    "buffer of a missing path": (lambda d: run_cli(["buffer", str(d / "nope")]), 2,
                                 "nope: no such run or checkpoint directory"),
    "buffer of a checkpoint with a truncated buffer": (buffer_of_a_checkpoint_with_a_truncated_buffer, 2,
                                                       "buffer.safetensors: not a readable safetensors file"),
    "benchmark test questions as held-out data": (benchmark_questions_held_out, 2,
                                                  "are benchmark test questions"),
    "benchmark test questions as training data": (benchmark_questions_trained_on, 2,
                                                  "are benchmark test questions"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_hostile(name, tmp_path):
    case, code, message = CASES[name]
    if "benchmark" in name and not BENCH.is_dir():
        pytest.skip(f"benchmark files not found at {BENCH}")
    result = case(tmp_path / "run")
    assert result.returncode == code, result.stderr[-3000:]
    assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]

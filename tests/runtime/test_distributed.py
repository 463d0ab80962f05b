"""Two CPU ranks (gloo): identical replicas after every step, and the same run as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, trained_once

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # for toy_rewards
STEPS = 5
OVERRIDES = [f"train.steps={STEPS}", "train.check_replicas=true", "train.threads=1", "logging.progress=false",
             "experience.start_threshold=0.0", "reward.workers=0",
             "reward.function=toy_rewards:first_char_is_lowercase", "rollout.max_completion_length=6",
             "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=3", "train.save_every=0"]
# Quantities that do not depend on float summation order, and those that may differ in the last bits
# (gradients are summed across ranks in another order than in one process).
EXACT = ("reward", "reward_std", "batch/pass_at_1", "completions/mean_length", "experience/questions",
         "experience/trajectories", "experience/replayed", "experience/retired", "phase")
CLOSE = ("loss", "grad_norm", "entropy", "ratio/mean")


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _launch(cmd, run_dir, *extra) -> subprocess.CompletedProcess:
    """`cmd` (TORCHRUN) as processes, or ONE: `exgrpo train` in this process (the comparisons' one-process runs
    need no process of their own)."""
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), *OVERRIDES, f"logging.output_dir={run_dir}", *extra]
    if cmd is ONE:
        result = run_cli(ONE + argv)
    else:
        result = subprocess.run(cmd + argv, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _run(cmd, run_dir, *extra):
    _launch(cmd, run_dir, *extra)
    return _metrics(run_dir)


TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2", "-m", "exgrpo",
            "train"]
ONE = ["train"]  # `exgrpo train` in this process (run_cli)


def _one_process(tmp_path_factory, *extra):
    """The one-process run with `extra`, trained once per session: several tests compare against the same one."""
    name = "one-process" + "".join(f"-{e}" for e in extra)
    return _metrics(trained_once(tmp_path_factory, name, lambda d: _run(ONE, d, *extra)))


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path, tmp_path_factory):
    said = [line for line in _launch(TORCHRUN, tmp_path / "ddp").stderr.splitlines() if line.startswith("exgrpo: ")]
    assert any(line.startswith("exgrpo: data.train") for line in said)
    assert len(said) == len(set(said)), said  # rank 0 speaks for both ranks: no line twice
    two = _metrics(tmp_path / "ddp")
    one = _one_process(tmp_path_factory)
    assert len(two) == len(one) == STEPS
    assert two[-1]["experience/replayed"] > 0  # the comparison covers the mixed phase with replays
    for a, b in zip(two, one):
        assert a["replicas/count"] == 2.0  # both ranks' hashes were compared (the run fails if they differ)
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key)
        for key in CLOSE:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def _assert_same_run(a_metrics, b_metrics):
    assert len(a_metrics) == len(b_metrics) and a_metrics[-1]["experience/replayed"] > 0
    for a, b in zip(a_metrics, b_metrics):
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key)
        for key in CLOSE:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
def test_fsdp_on_two_ranks_matches_one_process(tmp_path, tmp_path_factory):
    two = _run(TORCHRUN, tmp_path / "fsdp", "train.sharding=fsdp")
    one = _one_process(tmp_path_factory)
    _assert_same_run(two, one)
    assert all(m["replicas/count"] == 2.0 for m in two)  # the ranks' buffers were compared every step


@pytest.mark.slow
def test_fsdp_with_lora_matches_one_process_and_resumes_on_another_number_of_ranks(tmp_path, tmp_path_factory):
    """LoRA on 2 FSDP ranks, steps 1-3 then 4-5: a 2-rank checkpoint continues in one process and a one-process
    checkpoint on 2 FSDP ranks, and both end as the uninterrupted one-process run, step for step."""
    reference = _one_process(tmp_path_factory, "model.lora.r=4")
    lora = ["model.lora.r=4", "train.save_every=2"]
    fsdp = ["train.sharding=fsdp"]
    for (first, first_extra), (then, then_extra), name in (((TORCHRUN, fsdp), (ONE, []), "fsdp-then-one"),
                                                          ((ONE, []), (TORCHRUN, fsdp), "one-then-fsdp")):
        run_dir = tmp_path / name
        _run(first, run_dir, *lora, *first_extra, "train.steps=3")  # checkpoints at steps 2 and 3
        resumed = _run(then, run_dir, *lora, *then_extra, "--resume", str(run_dir))
        assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
        _assert_same_run(resumed, reference)
        on_two_ranks = resumed[:3] if first is TORCHRUN else resumed[3:]
        assert [m["replicas/count"] for m in on_two_ranks] == [2.0] * len(on_two_ranks)  # buffers compared


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_rank_without_groups_does_not_hang(tmp_path, sharding):
    """12 questions solved at once except one: the last steps have one group for two ranks."""
    data = ("data.train=reasoning_gym:basic_arithmetic?size=12&seed=1&min_terms=2&max_terms=2&min_digits=1"
            "&max_digits=1&operators=+")
    metrics = _run(TORCHRUN, tmp_path / "run", f"train.sharding={sharding}", "experience.ratio=0",
                   "experience.retirement=immediate", data,
                   "data.holdout=0", "reward.function=toy_rewards:all_but_answer_15")
    assert len(metrics) == STEPS and [m["fresh_questions_remaining"] for m in metrics][-2:] == [1, 1]


@pytest.mark.slow
def test_per_rank_loss_scale_is_the_released_sum_over_each_ranks_share(tmp_path):
    """sum_constant, loss_scale per_rank on 2 ranks: each rank's token sum / normalizer, gradients averaged, so the
    first step's gradient is exactly half the one-process gradient (entropy bonus off, same weights)."""
    step = ["train.steps=1", "objective.entropy_coef=0", "experience.ratio=0", "train.mini_batches=1",
            "train.micro_batch_size=16"]
    two = _run(TORCHRUN, tmp_path / "per_rank", *step, "objective.loss_scale=per_rank")[0]
    one = _run(ONE, tmp_path / "one", *step)[0]
    assert two["reward"] == one["reward"] and two["completions/mean_length"] == one["completions/mean_length"]
    assert two["grad_norm"] == pytest.approx(one["grad_norm"] / 2, rel=1e-4)


def test_a_rank_that_is_not_a_number_is_one_line(tmp_path):
    """RANK is the CLI's first question (only rank 0 speaks); a value that is no rank was a ValueError traceback."""
    result = run_cli(["train", "--config", "tiny", f"logging.output_dir={tmp_path}"], env={"RANK": "abc"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == ["exgrpo: error: the environment variable RANK is 'abc', not a process rank "
                                          "(torchrun sets it to 0, 1, ...); unset it to run one process"]

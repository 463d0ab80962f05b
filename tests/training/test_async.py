"""rollout.mode async on the tiny model, with an engine that holds its own copy of the weights (as vLLM does):
the schedule, its reproducibility and resume, the staleness bound, the importance correction of stale tokens,
ExGRPO's rules under asynchrony, and failures that stop the run instead of hanging it."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from exgrpo.config import ConfigError, config_from_dict
from exgrpo.errors import EngineError
from exgrpo.learner.forward import token_logprobs
from exgrpo.tensors import pack
from exgrpo.models import load_policy
from exgrpo.records import MIXED, WARMUP
from exgrpo.rollout import HFEngine, Rollouts
from exgrpo.runtime.checkpoint import latest_intact_checkpoint
from exgrpo.training.trainer import ExGRPOTrainer

from test_trainer import _questions, first_char_reward


class CopyEngine:
    """Samples with transformers from its own copy of the policy and reports that copy's log-probs of the tokens
    it sampled; `push_weights` copies the learner's weights in. Optionally dies or forgets to push."""

    holds_copy = reports_logprobs = True
    takes_snapshots = False

    def __init__(self, model, tokenizer, die_at_call: int | None = None, pushes: bool = True):
        self.learner, self.copy, self.tokenizer = model, copy.deepcopy(model), tokenizer
        self.hf = HFEngine(self.copy, tokenizer, 64)
        self.weights_version, self.calls, self.die_at_call, self.pushes = 0, 0, die_at_call, pushes
        self.log: list[tuple[str, int]] = []  # ("generate" | "push", weights version held)

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        self.calls += 1
        if self.calls == self.die_at_call:
            raise RuntimeError("EngineCore died unexpectedly")
        out = self.hf.generate(prompt_ids, sampling, seeds)
        batch = pack([(p, c, None) for p, c in zip(prompt_ids, out.completion_ids)], self.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(self.copy, batch, sampling.temperature)
        self.log.append(("generate", self.weights_version))
        return Rollouts(out.completion_ids, out.truncated, [logp[i, :len(c)].tolist()
                                                             for i, c in enumerate(out.completion_ids)])

    def push_weights(self, version: int, snapshot=None) -> None:
        if self.pushes:
            with torch.no_grad():
                for mine, theirs in zip(self.copy.parameters(), self.learner.parameters()):
                    mine.copy_(theirs)
            self.weights_version = version
        self.log.append(("push", version))

    def close(self) -> None:
        pass


_TRAINERS: list = []


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Each test in its own directory; every trainer it built closed after it (its rollout worker thread may still
    be sampling when a test ends on an error)."""
    monkeypatch.chdir(tmp_path)
    yield
    while _TRAINERS:
        _TRAINERS.pop().close()


def _config(mode="async", staleness=1, steps=5, output_dir="run", **sections):
    rollout = {"num_generations": 4, "max_completion_length": 4, "mode": mode}
    if mode == "async":
        rollout["max_staleness"] = staleness
    base = {"rollout": rollout,
            "train": {"steps": steps, "prompts_per_step": 6, "mini_batches": 1, "micro_batch_size": 24,
                      "learning_rate": 3e-3, "seed": 3},
            "experience": {"start_threshold": 0.1},
            "logging": {"output_dir": output_dir, "progress": False, "tensorboard": False, "sample_every": 0}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def _trainer(config, **engine_options):
    model, tokenizer = load_policy("tiny:0")
    engine = CopyEngine(model, tokenizer, **engine_options)
    trainer = ExGRPOTrainer(model, tokenizer, [first_char_reward], config, _questions(18), engine=engine)
    _TRAINERS.append(trainer)
    return trainer


def _run(trainer):
    """Train; per step, its metrics without wall times and the (question, member versions) of its groups."""
    steps = []

    def on_step(step, metrics):
        groups = [(g.question.id, [m.policy_version for m in g.members if m.sampled],
                   g.members[0].replay.step if g.members[0].replay is not None else None)
                  for g in trainer.last_step.groups]
        steps.append({"metrics": _without_times(metrics), "groups": groups, "phase_after": trainer.experience.phase})

    trainer.train(on_step=on_step)
    return steps


def _without_times(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "async/")) and k != "tokens_per_second"}


def _same_numbers(a, b):
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_staleness_zero_is_the_sync_run():
    """The same groups, completions and versions; the same metrics but for the truncated-IS weights async mode
    applies (rollout.engine hf: sync mode here has none), which are 1 up to float rounding on the same weights.
    With vLLM both modes correct alike and agree exactly (tests/rollout/test_vllm.py)."""
    sync = _run(_trainer(_config(mode="sync", output_dir="sync")))
    zero = _run(_trainer(_config(staleness=0, output_dir="zero")))
    for s, z in zip(sync, zero):
        assert s["groups"] == z["groups"]
        assert z["metrics"]["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)
        rest = {k: v for k, v in z["metrics"].items() if not k.startswith("tis/")}
        assert rest.keys() == s["metrics"].keys() and rest["phase"] == s["metrics"]["phase"]
        for key, value in rest.items():
            if key != "phase":
                assert value == pytest.approx(s["metrics"][key], rel=1e-4, abs=1e-6), key
    assert len(sync) == len(zero) == 5 and sync[-1]["metrics"]["phase"] == MIXED


def test_staleness_one_samples_step_t_from_the_weights_after_step_t_minus_one_and_reproduces():
    trainer = _trainer(_config(staleness=1, steps=6))
    first = _run(trainer)
    for t, step in enumerate(first):
        for _, versions, _ in step["groups"]:
            assert versions == [max(t - 1, 0)] * len(versions)  # one optimizer step per step
    # the engine ran the generation of step t + 1 before the push that followed step t's update
    assert trainer.engine.log[:4] == [("generate", 0), ("generate", 0), ("push", 1), ("generate", 1)]
    second = _run(_trainer(_config(staleness=1, steps=6, output_dir="again")))
    _same_numbers([s["metrics"] for s in first], [s["metrics"] for s in second])
    assert [s["groups"] for s in first] == [s["groups"] for s in second]


def test_async_metrics_report_staleness_and_idle_times():
    trainer = _trainer(_config(staleness=1, steps=3))
    history = trainer.train()
    assert history[0]["async/staleness_max"] == 0 and history[1]["async/staleness_max"] == 1
    assert history[2]["async/staleness_mean"] == 1
    assert all(m["async/engine_idle"] >= 0 and m["async/learner_idle"] >= 0 for m in history)
    assert all(0 < m["tis/ess"] <= 1 and 0 <= m["tis/truncated_fraction"] <= 1 for m in history)


def test_a_resumed_async_run_continues_exactly_with_the_steps_in_flight():
    whole = _run(_trainer(_config(staleness=2, steps=6, output_dir="whole")))
    first = _trainer(_config(staleness=2, steps=6, output_dir="split"))
    part_one = [{"metrics": _without_times(first.train_step())} for _ in range(3)]
    first.save()  # as a kill after step 3's checkpoint leaves it
    saved = json.loads((latest_intact_checkpoint("split") / "trainer.json").read_text())
    assert [s["step"] for s in saved["in_flight"]] == [3, 4]  # planned and sampled before the checkpoint
    resumed = _trainer(_config(staleness=2, steps=6, output_dir="split"))
    resumed.resume(latest_intact_checkpoint("split"))
    part_two = _run(resumed)
    _same_numbers([s["metrics"] for s in whole], [s["metrics"] for s in part_one + part_two])


def test_stale_fresh_tokens_are_weighted_by_truncated_importance_sampling_against_their_behaviour_policy():
    trainer = _trainer(_config(staleness=1, steps=2, objective={"tis_cap": 1.5}))
    trainer.train_step()
    trainer.train_step()  # sampled from the weights before step 0's update: off-policy by one step
    record = trainer.last_step
    engine_logp, mask = record.batch.engine_logp, record.batch.engine_mask
    w = torch.exp(record.update.old_logp - engine_logp).clamp(max=1.5)[mask]
    assert record.update.stats["tis/weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert record.update.stats["tis/truncated_fraction"] == pytest.approx(float((w >= 1.5).float().mean()))
    assert float((w - 1).abs().max()) > 1e-4  # really off-policy: not all weights are 1
    ess = float(w.sum() ** 2 / (len(w) * (w ** 2).sum()))
    assert record.update.stats["tis/ess"] == pytest.approx(ess, rel=1e-4)


def test_exgrpo_rules_under_asynchrony():
    """s = 1: the phase switch and the buffer reach a step one step later than in sync mode; no question is in
    flight twice; a replay was collected before its step was planned."""
    steps = _run(_trainer(_config(staleness=1, steps=8, train={"prompts_per_step": 4})))
    phases = [s["metrics"]["phase"] for s in steps]
    for t in range(len(steps)):  # step t was planned at the start of step t - 1, after step t - 2's switch
        assert phases[t] == (steps[t - 2]["phase_after"] if t >= 2 else WARMUP)
        if t:
            assert not {q for q, _, _ in steps[t]["groups"]} & {q for q, _, _ in steps[t - 1]["groups"]}
        assert all(collected <= t - 2 for _, _, collected in steps[t]["groups"] if collected is not None)
    assert MIXED in phases and any(c is not None for s in steps for _, _, c in s["groups"])


def test_a_dead_engine_stops_the_run_with_a_clear_error_and_keeps_the_last_checkpoint():
    trainer = _trainer(_config(staleness=1, steps=6, train={"save_every": 2}), die_at_call=5)
    with pytest.raises(EngineError, match="the rollout engine failed during the rollouts of step .*EngineCore died"):
        trainer.train()
    assert latest_intact_checkpoint("run").name == "step-000002"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_that_did_not_happen_is_caught_by_the_version_check(mode):
    trainer = _trainer(_config(mode, steps=4), pushes=False)
    with pytest.raises(EngineError, match="sampled from weights version 0, but the learner is at version 1"):
        trainer.train()


def test_async_needs_an_engine_of_its_own_and_keep():
    model, tokenizer = load_policy("tiny:0")
    with pytest.raises(ConfigError, match="needs an engine with its own copy of the weights"):
        ExGRPOTrainer(model, tokenizer, [first_char_reward], _config(), _questions(8))
    with pytest.raises(ConfigError, match="rollout.zero_variance must be keep"):
        _config(rollout={"zero_variance": "backfill"})
    with pytest.raises(ConfigError, match="rollout.max_staleness applies to rollout.mode async only"):
        config_from_dict({"rollout": {"max_staleness": 2}})


def test_the_engine_versions_match_the_learner_after_every_push():
    trainer = _trainer(_config(staleness=1, steps=4))
    trainer.train()
    pushes = [v for kind, v in trainer.engine.log if kind == "push"]
    assert pushes == [1, 2, 3, 4] and trainer.engine.weights_version == trainer.learner.weights_version
    assert np.allclose([p.detach().sum() for p in trainer.engine.copy.parameters()],
                       [p.detach().sum() for p in trainer.model.parameters()])


@pytest.mark.parametrize("size", [6, 10])
def test_a_pool_no_larger_than_the_steps_in_flight_still_gives_whole_batches(size, tmp_path):
    """B = 6, s = 1: planning step t + 1 while step t's 6 questions are in flight leaves 0 (or 4) others; the draw
    then asks questions in flight again, as sync mode would, instead of planning an empty (or short) step."""
    model, tokenizer = load_policy("tiny:0")
    trainer = ExGRPOTrainer(model, tokenizer, [first_char_reward],
                            _config(steps=4, output_dir=str(tmp_path / "run"), experience={"ratio": 0.0}),
                            _questions(size), engine=CopyEngine(model, tokenizer))
    _TRAINERS.append(trainer)
    steps = _run(trainer)
    assert [len(s["groups"]) for s in steps] == [6, 6, 6, 6]


def test_the_learners_weights_are_left_as_they_are_while_an_async_engine_evaluates(tmp_path):
    """bf16 training with LoRA stores the frozen base in bf16 once, when the learner is built; an async engine
    samples from its own copy, and a push queued behind the evaluation reads the learner's weights from the
    worker thread: they must be stored the same way whatever the evaluation is doing (nothing cast for a while)."""
    from exgrpo.config import LoraConfig

    class DtypeWatch(CopyEngine):
        """Records the dtypes of the learner's parameters at every generation (evaluations included)."""

        def generate(self, prompt_ids, sampling, seeds):
            self.seen = getattr(self, "seen", []) + [{p.dtype for p in self.learner.parameters()}]
            return super().generate(prompt_ids, sampling, seeds)

    model, tokenizer = load_policy("tiny:0", lora=LoraConfig(r=4))
    config = _config(steps=2, output_dir=str(tmp_path / "run"), train={"dtype": "bf16"}, eval={"every": 1},
                     model={"lora": {"r": 4}})
    engine = DtypeWatch(model, tokenizer)
    trainer = ExGRPOTrainer(model, tokenizer, [first_char_reward], config, _questions(18),
                            eval_dataset=_questions(24)[18:], engine=engine)
    _TRAINERS.append(trainer)
    _run(trainer)
    assert len(engine.seen) >= 4 and all(dtypes == {torch.float32, torch.bfloat16} for dtypes in engine.seen), \
        engine.seen


def _async_ranks(*args, ranks: int = 1):
    """tests/training/async_ranks.py under torchrun, or in this process for one rank; its metrics without wall
    times."""
    if ranks == 1:
        import async_ranks

        threads = torch.get_num_threads()
        try:
            async_ranks.main(*map(str, args))
        finally:
            torch.set_num_threads(threads)
    else:
        script = Path(__file__).with_name("async_ranks.py")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run([*launcher, str(script), *map(str, args)], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
    lines = (Path(args[0]) / "metrics.jsonl").read_text().splitlines()
    timings = ("time", "time/", "tokens_per_second", "async/engine_idle", "async/learner_idle")
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(timings)} for line in lines]


@pytest.mark.slow
def test_two_learner_ranks_in_async_mode_are_the_one_process_run_and_resume_with_the_steps_in_flight(tmp_path):
    """Under torchrun rank 0 alone drives the engine: every rank joins the gather of each push, rank 0 sends a
    snapshot of it and hands the rollouts to the other rank, whose buffer stays the same (check_replicas)."""
    one = _async_ranks(tmp_path / "one", 4)
    two = _async_ranks(tmp_path / "two", 4, ranks=2)
    assert one[-1]["phase"] == MIXED and all(m["replicas/count"] == 2 for m in two)
    for a, b in zip(two, one, strict=True):
        for key in ("reward", "experience/replayed", "experience/trajectories", "phase", "async/staleness_max"):
            assert a[key] == b[key], (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    # as a kill after the checkpoint of step 2 leaves it: the checkpoint holds the rollouts of the step after
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    checkpoints = tmp_path / "resumed" / "checkpoints"
    for later in ("step-000003", "step-000004"):
        shutil.rmtree(checkpoints / later)
    assert [s["step"] for s in json.loads((checkpoints / "step-000002" / "trainer.json").read_text())["in_flight"]] \
        == [2]
    resumed = _async_ranks(tmp_path / "resumed", 4, checkpoints / "step-000002", ranks=2)
    _same_numbers(resumed, two)

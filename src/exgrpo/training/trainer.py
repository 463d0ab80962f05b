"""The ExGRPO training loop (spec §1). `ExGRPOTrainer.train_step` is the algorithm, one line per stage:

  1. sample experiential questions from the buffer's correctness buckets (mixed phase only; the replay policy,
     `experience.policy`, decides which);
  2. draw exactly B - n_exp fresh questions; form the groups, selecting for each experiential question the stored
     trajectory to replay (lowest mean token entropy under the current policy) as member 0, and adding the
     data's reference solutions where `guidance` asks for them;
  3-6. generation (`exgrpo.training.generation`): roll out the remaining members (K - 1 per experiential
     question), score every member, retire questions whose group is K/K correct; with `rollout.zero_variance`
     backfill or replace_from_buffer, drop groups whose rewards are all equal and refill their slots;
  7. pack the groups into tensors; 8. advantages R - mean over each group;
  9. update: M mini-batches of the mixed-policy loss (pre-update log-probs = behaviour log-probs);
  10. collect the groups into the buffer (mixed phase only); 11. switch to the mixed phase once the batch Pass@1
  of the policy's own members > threshold (the delayed start); 12. metrics.
With experience.ratio = 0 the same loop is plain GRPO (PPO clipping throughout, buffer never used). With
rollout.mode async, steps 1-2 of step t + max_staleness run at the start of step t and its rollouts are sampled
meanwhile (`exgrpo.training.pipeline`, docs/async.md).

A question's success count k is the number of correct members among the policy's own (its rollouts and a replayed
trajectory; demonstrations excluded): the bucket, the replay policy and retirement (k equal to the number of own
members) all read this k.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.config import ConfigError, ExGRPOConfig
from exgrpo.config.rules import ASYNC_IN_ONE_PROCESS, ASYNC_NEEDS_ITS_OWN_ENGINE
from exgrpo.data import PromptEncoder, Question, QuestionPool, drop_long_prompts
from exgrpo.errors import Shutdown
from exgrpo.evaluation.contamination import screen_benchmark_questions
from exgrpo.evaluation.heldout import Accuracy, evaluate_accuracy
from exgrpo.experience import ExperienceBuffer, Trajectory, num_experiential, replay_policy_from_config, select_replays
from exgrpo.learner.objective import group_advantages
from exgrpo.learner.update import PolicyUpdate, loss_settings
from exgrpo.models import save_policy
from exgrpo.records import MIXED, WARMUP, Group
from exgrpo.rewards import GradingPool
from exgrpo.rewards.health import RewardHealth
from exgrpo.rewards.scorer import GroupScorer
from exgrpo.rollout import HFEngine, RolloutEngine, SamplingSettings, build_engine, derive_seed
from exgrpo.rollout.parity import ParityProbe
from exgrpo.rollout.worker import RolloutWorker
from exgrpo.runtime.atomic import write_text_atomic
from exgrpo.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from exgrpo.runtime.distributed import Distributed, check_replicas, init_distributed, require_on_every_rank, shard
from exgrpo.runtime.rundir import claim_run_directory, lock_run_directory, unlock_run_directory
from exgrpo.runtime.sharding import full_model_state, refuse_accelerate_fsdp
from exgrpo.runtime.signals import StopRequest
from exgrpo.runtime.timing import StageTimer
from exgrpo.runtime.tracking import Tracker, truncate_metrics
from exgrpo.training.generation import GenerationRounds, own_members
from exgrpo.training.groups import form_groups, pack_groups
from exgrpo.training.guidance import Guidance
from exgrpo.training.metrics import StepRecord, sample_lines, step_metrics
from exgrpo.training.pipeline import AsyncPipeline, PlannedStep, staleness_metrics

__all__ = ["ExGRPOTrainer", "StepRecord"]


class ExGRPOTrainer:
    """Train a causal LM with ExGRPO.

    Args:
        model, tokenizer: a transformers causal LM (optionally peft-wrapped) and its left-padding tokenizer.
        reward_funcs: callables f(prompts, completions, completion_ids, **columns) -> list[float | None]; the
            dataset columns passed are `answer` plus each question's `columns`.
        config: the run configuration.
        train_dataset: training questions.
        reward_weights: one weight per reward function (default all 1).
        engine: a RolloutEngine (default: the one `rollout.engine` names, sampling from `model`).
        eval_dataset: held-out questions, evaluated every eval.every steps with the reward functions
            (logged as eval/accuracy and eval/stderr).
        grading_pool: the pool the reward functions grade in, whose timeouts and crashes are logged per step.
    Questions that are benchmark test questions are handled as `data.benchmark_overlap` says.
    """

    def __init__(self, model, tokenizer, reward_funcs: Sequence[Callable], config: ExGRPOConfig,
                 train_dataset: Sequence[Question], reward_weights: Sequence[float] | None = None,
                 engine: RolloutEngine | None = None, distributed: Distributed | None = None,
                 eval_dataset: Sequence[Question] | None = None, grading_pool: GradingPool | None = None):
        refuse_accelerate_fsdp(config.train.sharding)
        c, self.dist = config, distributed or init_distributed()
        model.to(self.dist.device)
        self.model, self.tokenizer, self.config, self.K = model, tokenizer, config, c.rollout.num_generations
        if c.train.threads:
            torch.set_num_threads(c.train.threads)
        self.prompt_ids = PromptEncoder.from_config(tokenizer, c.data)
        train_dataset = self._screen(train_dataset, "training")
        self.eval_dataset = self._screen(eval_dataset or [], "held-out")
        self.engine = engine or build_engine(c, model, tokenizer, lambda: c.data.max_prompt_length or max(
            (len(self.prompt_ids(q)) for q in [*train_dataset, *self.eval_dataset]), default=0))
        e, r = c.experience, c.rollout
        self.buffer = ExperienceBuffer.from_config(e, self.K)
        self.pool = QuestionPool(train_dataset, c.train.seed, retirement=self.buffer)
        self.guidance = Guidance.from_config(c.guidance, train_dataset, tokenizer, r.max_completion_length)
        self.solved: set[str] = set()  # questions with a correct rollout of the policy's own (coverage, guidance)
        self.replay_policy = replay_policy_from_config(e, self.buffer, self.K)
        self.pipeline = self._async_pipeline() if r.mode == "async" else None
        self.update = PolicyUpdate.from_config(  # async: the pipeline pushes after the step's update
            model, c, self.dist, on_optimizer_step=(lambda: None) if self.pipeline else
            lambda: self.engine.sync_weights(self.update.weights_version))
        self.scorer = GroupScorer(reward_funcs, tokenizer, RewardHealth.from_config(c.reward),
                                  reward_weights=reward_weights, grading_pool=grading_pool, distributed=self.dist)
        self.generation = GenerationRounds.from_config(c, self.engine, self.scorer, distributed=self.dist,
                                                       weights=self.update.rollout_weights)
        self.parity = ParityProbe.from_config(c)
        self.phase, self.step, self._resumed, self.stopped_by = WARMUP, 0, False, None
        self.history: list[dict] = []
        self.last_step: StepRecord | None = None
        self.last_evaluation: Accuracy | None = None  # the latest periodic evaluation

    def _async_pipeline(self) -> AsyncPipeline:
        """rollout.mode async: the engine runs on a worker thread, `max_staleness` steps ahead (docs/async.md)."""
        c = self.config
        if isinstance(self.engine, HFEngine):
            raise ConfigError(ASYNC_NEEDS_ITS_OWN_ENGINE)
        if self.dist.world_size > 1:
            raise ConfigError(ASYNC_IN_ONE_PROCESS)
        worker = RolloutWorker(self.engine, timeout=c.rollout.sync_timeout)
        return AsyncPipeline(worker, lambda step, in_flight: self.plan_step(step, in_flight),
                             lambda groups, step: self.generation.requests(groups, step),
                             SamplingSettings.from_config(c.rollout), c.rollout.max_staleness, c.train.steps)

    def _screen(self, questions: Sequence[Question], which: str) -> list[Question]:
        """The questions the run may use: benchmark test questions handled as data.benchmark_overlap says, and,
        with data.max_prompt_length, longer prompts dropped (released) with a warning."""
        d = self.config.data
        kept = screen_benchmark_questions(questions, d.benchmark_overlap, f"{which} questions", d.prompt_suffix)
        return drop_long_prompts(kept, self.prompt_ids, d.max_prompt_length, which) if d.max_prompt_length else kept

    # ------------------------------------------------------------------ the algorithm
    def train_step(self) -> tuple[dict, list[dict]]:
        """One step of ExGRPO (see the module docstring); returns its metrics and example completions."""
        c, timer, start = self.config, StageTimer(), time.perf_counter()
        planned, sampled_ahead = self._planned_step(timer)
        phase, version = planned.phase, self.update.weights_version
        generated = self.generation(planned.groups, self.step, self.settle,  # roll out, score, retire
                                    lambda n, asked: self.refill(n, phase, planned.rng, asked, timer), timer,
                                    weights_version=planned.version, sampled_ahead=sampled_ahead)
        groups, rewards, correct = generated.groups, generated.rewards, generated.correct
        batch = pack_groups(groups, self.tokenizer.pad_token_id)
        advantages = group_advantages(torch.tensor(rewards.total, dtype=torch.float32), c.objective.scale_rewards)
        update = self._update(batch, advantages.reshape(-1), phase, timer)
        # the parity probe compares engine and trainer on the same weights: not on rollouts of older ones
        parity = self.parity(self.step, batch.engine_logp, batch.engine_mask, update.behaviour_logp) \
            if planned.version == version else {}
        with timer("buffer"):
            if phase == MIXED:
                self.collect(groups, correct, batch, update.behaviour_logp, version)
        self.maybe_switch_phase(generated.stats.first_round_pass_at_1)
        self.step += 1
        self.last_step = record = StepRecord(phase, groups, rewards, correct, advantages, batch, update,
                                             generated.stats)
        metrics = step_metrics(record, self.buffer, step=self.step - 1, version=version,
                               fresh_remaining=self.pool.remaining, learning_rate=self.update.learning_rate,
                               skipped_updates=self.update.skipped_updates,
                               solved=len(self.solved), guidance=bool(self.guidance), timings=timer.metrics(),
                               elapsed=time.perf_counter() - start)
        metrics.update(parity)
        if self.pipeline:
            metrics.update({**staleness_metrics(groups, version), **self.pipeline.worker.take_times()})
        if c.train.check_replicas:
            metrics.update(check_replicas(self.dist, self.step, self.buffer.fingerprint(),
                                          None if self.update.sharded else self.model))
        log_samples = c.logging.sample_every and self.step % c.logging.sample_every == 0
        return metrics, sample_lines(groups, rewards.total, self.tokenizer) if log_samples else []

    def _planned_step(self, timer: StageTimer):
        """Steps 1-2 (sync), or the step planned max_staleness steps ago with a wait for its rollouts (async)."""
        if not self.pipeline:
            return self.plan_step(self.step, timer=timer), None
        self.pipeline.worker.take_times()  # idle times count from here
        return self.pipeline.next(self.step)

    def _update(self, batch, advantages: torch.Tensor, phase: str, timer: StageTimer):
        """Step 9; async: once the last push has copied the weights it changes, and pushed after."""
        c = self.config
        if self.pipeline:
            self.pipeline.weights_read()
        update = self.update(batch, advantages,
                             loss_settings(c.objective, c.rollout.max_completion_length, phase, c.guidance.gamma),
                             c.experience.importance_correction, np.random.default_rng([c.train.seed, self.step, 2]),
                             timer)
        if self.pipeline:
            self.pipeline.push(self.update.weights_version)
        return update

    def plan_step(self, step: int, in_flight: frozenset[str] = frozenset(),
                  timer: StageTimer | None = None) -> PlannedStep:
        """Steps 1-2 for step `step`: its experiential and fresh questions (none of those `in_flight`) and their
        groups, replays and demonstrations included, from the buffer, phase and weights as they are now."""
        c, timer = self.config, timer or StageTimer()
        rng = np.random.default_rng([c.train.seed, step])
        with timer("buffer"):
            experiential = self.sample_experiential(rng, step, exclude=in_flight) if self.phase == MIXED else []
        fresh = self.pool.draw(c.train.prompts_per_step - len(experiential), exclude=in_flight)
        groups = self.build_groups(experiential, fresh, self.phase, rng, timer, step)
        return PlannedStep(step, self.phase, groups, self.update.weights_version, rng)

    def sample_experiential(self, rng: np.random.Generator, step: int, n: int | None = None,
                            exclude: frozenset[str] = frozenset()) -> list[Question]:
        """Up to n (default floor(B * ratio)) questions to re-ask in step `step`, drawn by the replay policy
        (ExGRPO: from the correctness buckets), none of them in `exclude`."""
        c = self.config
        if n is None:
            n = num_experiential(c.train.prompts_per_step, c.train.prompts_per_step, c.experience.ratio)
        return [self.pool.questions[qid] for qid in self.replay_policy.experiential(n, rng, step, exclude)]

    def build_groups(self, experiential: list[Question], fresh: list[Question], phase: str,
                     rng: np.random.Generator, timer: StageTimer, step: int) -> list[Group]:
        """The step's groups, those whose question replays a stored trajectory first (member 0: the replay)."""
        policy = self.replay_policy
        replayed, plain = experiential, fresh
        if not policy.replays_trajectories:
            replayed, plain = [], experiential + fresh
        elif policy.replays_into_fresh and phase == MIXED:
            replayed = experiential + [q for q in fresh if q.id in self.buffer]
            plain = [q for q in fresh if q.id not in self.buffer]
        with timer("selection"):
            replays = self.select_replays(replayed, rng)
        groups = form_groups(list(zip(replayed, replays)), plain, self.prompt_ids)
        self.guidance.add(groups, step, self.solved)
        return groups

    def select_replays(self, questions: Sequence[Question], rng: np.random.Generator) -> list[Trajectory]:
        """For each question, the stored trajectory the selection rule picks under the current policy."""
        e = self.config.experience
        candidates = [(q, self.buffer.trajectories(q.id)) for q in questions]
        return select_replays(candidates, e.selection_metric, e.selection_mode, rng, score=self._score_candidates)

    def _score_candidates(self, pairs: list[tuple[Question, Trajectory]]) -> list[float]:
        """Selection scores of (question, stored trajectory) pairs; each rank scores a shard, all get every score."""
        e = self.config.experience
        mine = [(self.prompt_ids(q), t.token_ids.tolist()) for q, t in shard(pairs, self.dist)]
        return self.dist.gather(self.update.selection_scores(mine, e.selection_metric, self.tokenizer.pad_token_id,
                                                             e.selection_batch_size))

    def settle(self, groups: list[Group], correct: np.ndarray) -> int:
        """A generation round's outcome, dropped groups included: questions whose own members are all correct are
        retired (spec §2; returns how many now); each question's k goes to the replay policy; questions with a
        correct rollout of the policy's own are marked solved (coverage; guidance fallback)."""
        retired = 0
        for g, ok, own in zip(groups, correct, own_members(groups)):
            k = int(ok[own].sum())
            if k == own.sum() and not self.buffer.is_retired(g.question.id):
                self.buffer.retire(g.question.id)
                retired += 1
            self.replay_policy.observe(g.question.id, k, self.step)
            if k:
                self.solved.add(g.question.id)
        return retired

    def refill(self, n: int, phase: str, rng: np.random.Generator, asked: frozenset[str],
               timer: StageTimer) -> list[Group]:
        """n groups for dropped slots: with replace_from_buffer in the mixed phase, experiential questions not
        asked yet this step (with their replays), then fresh questions."""
        experiential = []
        if self.config.rollout.zero_variance == "replace_from_buffer" and phase == MIXED:
            experiential = self.sample_experiential(rng, self.step, n, asked)
        return self.build_groups(experiential, self.pool.draw(n - len(experiential)), phase, rng, timer, self.step)

    def collect(self, groups: list[Group], correct: np.ndarray, batch, behaviour_logp: torch.Tensor,
                version: int) -> None:
        """Move each group's question to its bucket and store its new correct trajectories with their (T,)
        behaviour log-probs (rows of `behaviour_logp`, packed like `batch`: the pre-update policy's, at weights
        `version`, which sampled them in sync mode and up to max_staleness steps after in async mode); count a
        use of each replayed trajectory. Demonstrations are neither counted in k nor stored: the buffer holds the
        policy's own trajectories."""
        lengths = batch.completion_mask.sum(-1).to(torch.long).tolist()
        row = 0
        for g, ok, own in zip(groups, correct, own_members(groups)):
            ids, lps = [], []
            for m in g.members:
                ids.append(np.asarray(m.completion_ids, dtype=np.int32))
                lps.append(behaviour_logp[row, :lengths[row]].numpy())
                row += 1
            if g.members[0].replay is not None and g.question.id in self.buffer:
                self.buffer.record_replay(g.question.id, ids[0])
            self.buffer.update_group(g.question.id, [bool(x) for x in ok & own], ids, lps, step=self.step,
                                     version=version)  # ignores retired

    def maybe_switch_phase(self, pass_at_1: float) -> None:
        """The delayed start: switch for good to the mixed phase once batch Pass@1 > start_threshold (strict)."""
        e = self.config.experience
        if self.phase == WARMUP and e.ratio > 0 and pass_at_1 > e.start_threshold:
            self.phase = MIXED

    # ------------------------------------------------------------------ the run
    def train(self, tracker: Tracker | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Run until train.steps (or until every question is retired), checkpointing into logging.output_dir.

        The run directory is locked while training; a fresh (not resumed) run refuses a directory holding another
        run's files unless logging.overwrite. SIGINT/SIGTERM finish the current step, write a checkpoint and
        return. Returns per-step metrics. Under data parallelism only rank 0 logs and writes checkpoints.
        """
        c, directory = self.config, self.config.logging.output_dir
        with Shutdown() as cleanup:
            if self.dist.is_main:
                lock_run_directory(directory)
                cleanup.callback(unlock_run_directory, directory)
                if not self._resumed:
                    claim_run_directory(directory, c.logging.overwrite)
                write_text_atomic(Path(directory) / "config.json", json.dumps(c.to_dict(), indent=2))
                if tracker is None:
                    tracker = Tracker.from_config(c, start_step=self.step)
                    cleanup.callback(tracker.close)
            self._train_loop(tracker, on_step)
        return self.history

    def _train_loop(self, tracker: Tracker | None, on_step: Callable[[int, dict], None] | None) -> None:
        c, dp = self.config, self.dist
        with StopRequest() as stop:
            while self.step < c.train.steps and not dp.any_true(bool(stop.requested)):
                if self.pool.remaining == 0:
                    if tracker:
                        tracker.print(f"[yellow]Every training question is retired (solved {self.K}/{self.K}); "
                                      f"stopping at step {self.step}.")
                    break
                self._run_step(tracker, on_step)
            self.stopped_by = stop.requested  # None: the run ended by itself
            if stop.requested and tracker:
                tracker.print(f"[yellow]{stop.requested}: checkpointing at step {self.step} and exiting.")
            latest = latest_checkpoint(c.logging.output_dir) if dp.is_main else None  # rank 0's disk decides
            if dp.any_true(dp.is_main and (latest is None or latest.name != f"step-{self.step:06d}")):
                self.save()

    def _run_step(self, tracker: Tracker | None, on_step: Callable[[int, dict], None] | None) -> None:
        """A step plus what follows it: periodic evaluation, logging, checkpointing."""
        c = self.config
        metrics, samples = self.train_step()
        last = self.step >= c.train.steps or self.pool.remaining == 0  # the run ends with this step
        if c.eval.every and self.eval_dataset and (self.step % c.eval.every == 0 or last):
            accuracy = self.last_evaluation = self.evaluate()
            metrics.update({"eval/accuracy": accuracy.mean, "eval/stderr": accuracy.stderr})
            if tracker:
                tracker.print(f"step {self.step}: held-out {accuracy}")
        self.history.append(metrics)
        if tracker:
            tracker.log(self.step, metrics)
            if samples:
                tracker.log_samples(self.step, samples)
        if c.train.save_every and self.step % c.train.save_every == 0:
            self.save()
        if on_step is not None:
            on_step(self.step, metrics)

    def evaluate(self) -> Accuracy:
        """Held-out accuracy (avg@eval.samples at eval.temperature, graded by the reward functions)."""
        c = self.config
        questions = self.eval_dataset[: c.eval.max_questions] if c.eval.max_questions else self.eval_dataset
        sampling = SamplingSettings.from_config(c.rollout, temperature=c.eval.temperature)
        engine = self.pipeline.worker.as_engine() if self.pipeline else self.engine  # async: behind queued calls
        # async: the engine samples from its own copy, and a push queued before this evaluation reads the learner's
        # weights from the worker thread meanwhile, so they stay as they are (rollout_weights would store a LoRA
        # base in bf16 under bf16 training)
        with contextlib.nullcontext() if self.pipeline else self.update.rollout_weights():
            return evaluate_accuracy(engine, self.tokenizer, questions, self.scorer.reward_funcs, sampling,
                                     c.eval.samples, seed=derive_seed(c.train.seed, self.step, 4),
                                     success_threshold=c.reward.success_threshold, prompt_ids_of=self.prompt_ids)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything but the model weights and global RNGs: {"trainer": JSON-able progress and the resolved
        config, "optimizer": optimizer and scheduler state, "buffer": the experience buffer's state}."""
        update = self.update.state_dict()
        trainer = {"step": self.step, "phase": self.phase, "pool": self.pool.state_dict(),
                   "optimizer_steps": update.pop("optimizer_steps"), "skipped_updates": update.pop("skipped_updates"),
                   "replay_policy": self.replay_policy.state_dict(), "solved": sorted(self.solved),
                   "config": self.config.to_dict()}
        if self.pipeline:  # the steps in flight, with their rollouts (waited for)
            trainer["in_flight"] = self.pipeline.state_dict()
        return {"trainer": trainer, "optimizer": update, "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        trainer = state["trainer"]
        self.update.load_state_dict({**state["optimizer"], "optimizer_steps": trainer["optimizer_steps"],
                                     "skipped_updates": trainer["skipped_updates"]})
        self.buffer.load_state_dict(state["buffer"])
        self.step, self.phase = trainer["step"], trainer["phase"]
        self.pool.load_state_dict(trainer["pool"])
        self.replay_policy.load_state_dict(trainer.get("replay_policy", {}))
        self.solved = set(trainer.get("solved", []))
        if self.pipeline:
            self.pipeline.load_state_dict(trainer.get("in_flight", []), self.pool.questions, self.prompt_ids)

    def save(self) -> None:
        """Checkpoint the current step: every rank gathers the state (FSDP needs them all), rank 0 writes it."""
        state = self.state_dict()
        weights = full_model_state(self.model) if self.update.sharded else None
        if self.dist.is_main:
            save_checkpoint(self.config.logging.output_dir, self.step,
                            lambda directory: save_policy(self.model, self.tokenizer, directory, weights),
                            state, self.config.train.save_total_limit)
        self.dist.barrier()

    def resume(self, directory, verified: bool = False) -> None:
        """Continue from a checkpoint directory (exgrpo.runtime.checkpoint), checked against its manifest unless
        `verified` (by `exgrpo.training.run.start_point`, which also checks that the config is the run's own).
        Logged lines of later steps are dropped: they will be logged again."""
        require_on_every_rank(self.dist, Path(directory))
        self.load_state_dict(load_checkpoint(directory, self.model, verified))
        self._resumed = True
        if self.dist.is_main:
            truncate_metrics(self.config.logging.output_dir, self.step)
        if self.pipeline:
            self.pipeline.push(self.update.weights_version)
        else:
            self.engine.sync_weights(self.update.weights_version)

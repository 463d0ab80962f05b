"""The ExGRPO training loop (spec §1). `ExGRPOTrainer.train_step` is the algorithm, one line per stage:

  1. sample experiential questions from the buffer's correctness buckets (mixed phase only; the replay policy,
     `experience.replay_policy`, decides which);
  2. draw exactly B - n_exp fresh questions; form the groups, selecting for each experiential question the stored
     trajectory to replay (lowest mean token entropy under the current policy) as member 0, and adding the
     data's reference solutions where `guidance` asks for them;
  3-6. generation (`exgrpo.training.generation`): roll out the remaining members (K - 1 per experiential
     question), score every member, retire questions whose group is K/K correct; with `rollout.zero_variance`
     backfill or replace_from_buffer, drop groups whose rewards are all equal and refill their slots;
  7. pack the groups into tensors; 8. advantages R - mean over each group;
  9. update: M mini-batches of the mixed-policy loss (pre-update log-probs = behaviour log-probs);
  10. push the new weights to an engine holding a copy (the rollout source decides when it samples from them);
  11. collect the groups into the buffer (mixed phase only); 12. switch to the mixed phase once the batch Pass@1
  of the policy's own members > threshold (the delayed start); 13. metrics.
With experience.ratio = 0 the same loop is plain GRPO (PPO clipping throughout, buffer never used). Steps 1-2 are
the experience side's (`exgrpo.training.experience_side`); `exgrpo.training.schedule` runs them max_staleness steps
ahead (0 in sync mode; docs/async.md) and has the step's first round of rollouts sampled by the rollout source
chosen once, where the trainer is built.

A question's success count k is the number of correct members among the policy's own (its rollouts and a replayed
trajectory; demonstrations excluded): the bucket, the replay policy and retirement (k equal to the number of own
members) all read this k.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.config import ExGRPOConfig
from exgrpo.data import PromptEncoder, Question
from exgrpo.errors import Shutdown
from exgrpo.evaluation.contamination import usable_questions
from exgrpo.evaluation.heldout import Accuracy, evaluate_accuracy
from exgrpo.experience.buffer import read_state, write_state
from exgrpo.learner.objective import group_advantages
from exgrpo.learner.learner import COUNTERS, SKIPPED_STEP_COUNTERS, Learner
from exgrpo.models import save_policy
from exgrpo.records import Trajectory
from exgrpo.rewards import GradingPool
from exgrpo.rewards.scorer import GroupScorer
from exgrpo.rollout import RolloutEngine, SamplingSettings, derive_seed, engine_from_config
from exgrpo.rollout.parity import ParityProbe
from exgrpo.rollout.weights import copied_weights
from exgrpo.runtime.atomic import write_text_atomic
from exgrpo.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from exgrpo.runtime.distributed import Distributed, check_replicas, init_distributed, require_on_every_rank, shard
from exgrpo.runtime.provenance import end_session, start_session
from exgrpo.runtime.rundir import claim_run_directory, lock_run_directory, unlock_run_directory
from exgrpo.runtime.sharding import refuse_accelerate_fsdp
from exgrpo.runtime.signals import StopRequest
from exgrpo.runtime.timing import StageTimer
from exgrpo.runtime.tracking import Tracker, truncate_metrics
from exgrpo.tensors import TrajectoryScore
from exgrpo.training.entropy_drift import EntropyDriftWatch
from exgrpo.training.experience_side import ExperienceSide
from exgrpo.training.generation import GenerationRounds
from exgrpo.training.groups import pack_groups
from exgrpo.training.metrics import StepRecord, sample_lines, step_metrics
from exgrpo.training.schedule import Schedule, rollout_source

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
        train_dataset = usable_questions(train_dataset, c.data, self.prompt_ids, "training")
        self.eval_dataset = usable_questions(eval_dataset or [], c.data, self.prompt_ids, "held-out")
        self.engine = engine or engine_from_config(c, model, tokenizer, lambda: c.data.max_prompt_length or max(
            (len(self.prompt_ids(q)) for q in [*train_dataset, *self.eval_dataset]), default=0))
        self.experience = ExperienceSide(c, train_dataset, self.prompt_ids, tokenizer, score=self._score_candidates)
        self.learner = Learner.from_config(model, c, self.dist)
        self.scorer = GroupScorer.from_config(reward_funcs, tokenizer, c.reward, reward_weights=reward_weights,
                                              grading_pool=grading_pool, distributed=self.dist)
        self.generation = GenerationRounds.from_config(c, self.engine, self.scorer, distributed=self.dist,
                                                       weights=self.learner.rollout_weights)
        self.source = rollout_source(c, self.engine, self.generation, self.learner.full_weights, self.dist,
                                     functools.partial(copied_weights, self.model))
        self.schedule = Schedule(self.source, lambda step, in_flight, timer: self.experience.plan(
            step, self.learner.weights_version, in_flight, timer), c.train.steps)
        self.parity = ParityProbe.from_config(c, self.engine)
        self.entropy_drift = EntropyDriftWatch(c)
        self.step, self._resumed, self.stopped_by, self.history = 0, False, None, []  # history: per-step metrics
        self.last_step: StepRecord | None = None
        self.last_evaluation: Accuracy | None = None  # the latest periodic evaluation

    # ------------------------------------------------------------------ the algorithm
    def train_step(self) -> dict:
        """One step of ExGRPO, numbered as in the module docstring; returns its metrics."""
        c, timer, start = self.config, StageTimer(), time.perf_counter()
        planned, first_round = self.schedule.next(self.step, timer)  # 1-2 (planned max_staleness steps ahead)
        generated = self.generation(planned, first_round, self.experience, timer)  # 3-6
        batch = pack_groups(generated.groups, self.tokenizer.pad_token_id)  # 7
        advantages = group_advantages(torch.from_numpy(generated.rewards.total).float(), c.objective.scale_rewards)  # 8
        version = self.learner.weights_version  # the pre-update policy's: behaviour log-probs come from it
        update = self._update(batch, advantages, planned.phase, timer)  # 9
        with timer("push"):
            self.source.push(self.learner.weights_version)  # 10
        with timer("buffer"):
            self.experience.collect_step(planned, generated.groups, generated.correct, batch.completion_mask,  # 11
                                         update.old_logp, version)
        self.experience.switch_phase(generated.stats.first_round_pass_at_1)  # 12
        record = StepRecord(planned.phase, generated.groups, generated.rewards, generated.correct, advantages,
                            batch, update, generated.stats)
        metrics = self._metrics(record, planned, version, timer, time.perf_counter() - start)  # 13
        self.step, self.last_step = self.step + 1, record  # the step is done
        return metrics

    def _update(self, batch, advantages: torch.Tensor, phase: str, timer: StageTimer):
        """Stage 9, once the last push no longer reads the weights it changes."""
        self.source.weights_read()
        return self.learner(batch, advantages.reshape(-1), phase,
                            np.random.default_rng([self.config.train.seed, self.step, 2]), timer)

    def _metrics(self, record: StepRecord, planned, version: int, timer: StageTimer, elapsed: float) -> dict:
        """Stage 13: the metrics of step `self.step` (0-based here, 1-based in what is logged), with the engine parity
        probe's, the source's and the replica check's."""
        c, experience, step = self.config, self.experience, self.step
        metrics = step_metrics(record, experience.buffer, step=step, version=version,
                               fresh_remaining=experience.question_pool.remaining,
                               ever_correct=len(experience.ever_correct), learning_rate=self.learner.learning_rate,
                               skipped={name: getattr(self.learner, name) for name in SKIPPED_STEP_COUNTERS},
                               guidance=bool(experience.guidance), timings=timer.metrics(), elapsed=elapsed)
        if planned.version == version:  # engine and trainer on the same weights: not on rollouts of older ones
            metrics.update(self.parity(step, record.batch.engine_logp, record.batch.engine_mask,
                                       record.update.old_logp))
        metrics.update(self.source.step_metrics(record.groups, version))
        self.entropy_drift.observe(step + 1, metrics)
        if c.train.check_replicas:
            metrics.update(check_replicas(self.dist, step + 1, experience.buffer.fingerprint(), self.learner.replica))
        return metrics

    def _score_candidates(self, pairs: list[tuple[Question, Trajectory]], metric: TrajectoryScore) -> list[float]:
        """Selection scores of (question, stored trajectory) pairs; each rank scores a shard, all get every score."""
        mine = [(self.prompt_ids(q), t.token_ids.tolist()) for q, t in shard(pairs, self.dist)]
        return self.dist.gather(self.learner.selection_scores(mine, metric, self.tokenizer.pad_token_id,
                                                             self.config.experience.selection_batch_size))

    # ------------------------------------------------------------------ the run
    def train(self, tracker: Tracker | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Run until train.steps (or until every question is retired), checkpointing into logging.output_dir.

        The run directory is locked while training; a fresh (not resumed) run refuses a directory holding another
        run's files unless logging.overwrite. Each call appends a session (its start and end, the code running it)
        to the directory's provenance.json (`exgrpo.runtime.provenance`). SIGINT/SIGTERM finish the current step,
        write a checkpoint and return. Returns per-step metrics. Under data parallelism only rank 0 logs and writes
        checkpoints.
        """
        c, directory = self.config, self.config.logging.output_dir
        with Shutdown() as cleanup:
            if self.dist.is_main:
                lock_run_directory(directory)
                cleanup.callback(unlock_run_directory, directory)
                if not self._resumed:
                    claim_run_directory(directory, c.logging.overwrite)
            self._resumed = True  # the directory holds this run now: a later train() call continues it
            # overwriting is an action at the start, done now: not a setting of the run (its config.json and
            # checkpoints say false, so `--resume` takes them as they are)
            self.config = c = replace(c, logging=replace(c.logging, overwrite=False))
            if self.dist.is_main:
                write_text_atomic(Path(directory) / "config.json", json.dumps(c.to_dict(), indent=2))
                start_session(directory, self.step)
                if tracker is None:
                    tracker = Tracker.from_config(c, start_step=self.step)
                    cleanup.callback(tracker.close)
            self._train_loop(tracker, on_step)
            if self.dist.is_main:
                end_session(directory, self.step, self.stopped_by)
        return self.history

    def _train_loop(self, tracker: Tracker | None, on_step: Callable[[int, dict], None] | None) -> None:
        c, dp = self.config, self.dist
        with StopRequest() as stop:
            while self.step < c.train.steps and not dp.any_true(bool(stop.requested)):
                if self.experience.question_pool.remaining == 0:
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
        metrics = self.train_step()
        last = self.step >= c.train.steps or self.experience.question_pool.remaining == 0  # the run ends with this step
        if c.eval.every and self.eval_dataset and (self.step % c.eval.every == 0 or last):
            accuracy = self.last_evaluation = self.evaluate()
            metrics.update({"eval/accuracy": accuracy.mean, "eval/stderr": accuracy.stderr})
            if tracker:
                tracker.print(f"step {self.step}: held-out {accuracy}")
                tracker.log_samples(self.step, accuracy.samples, held_out=True)
        self.history.append(metrics)
        if tracker:
            tracker.log(self.step, metrics)
            if c.logging.sample_every and self.step % c.logging.sample_every == 0:
                record = self.last_step
                tracker.log_samples(self.step, sample_lines(record.groups, record.rewards.total, self.tokenizer))
        if c.train.save_every and self.step % c.train.save_every == 0:
            self.save()
        if on_step is not None:
            on_step(self.step, metrics)

    def evaluate(self) -> Accuracy:
        """Held-out accuracy (avg@eval.samples at eval.temperature, graded by the reward functions)."""
        c = self.config
        questions = self.eval_dataset[: c.eval.max_questions] if c.eval.max_questions else self.eval_dataset
        sampling = SamplingSettings.from_config(c.rollout, temperature=c.eval.temperature)
        with self.source.evaluation_engine() as engine:
            return evaluate_accuracy(engine, self.tokenizer, questions, self.scorer.reward_funcs, sampling,
                                     c.eval.samples, seed=derive_seed(c.train.seed, self.step, 4),
                                     success_threshold=c.reward.success_threshold, prompt_ids_of=self.prompt_ids,
                                     truncated_reward=self.scorer.truncated_reward)

    def close(self) -> None:
        """Stop the rollout source (async: its worker thread) and release the engine; no training afterwards."""
        self.source.close()
        self.engine.close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything but the model weights and global RNGs: {"trainer": JSON-able progress, the steps in flight
        with their rollouts (waited for) and the resolved config, "optimizer": optimizer and scheduler state,
        "buffer": the experience buffer's state}."""
        learner, experience = self.learner.state_dict(), self.experience.state_dict()
        trainer = {"step": self.step, **experience["trainer"], **{name: learner.pop(name) for name in COUNTERS},
                   "config": self.config.to_dict()}
        if in_flight := self.schedule.state_dict():
            trainer["in_flight"] = in_flight
        return {"trainer": trainer, "optimizer": learner, "buffer": experience["buffer"]}

    def load_state_dict(self, state: dict) -> None:
        trainer = state["trainer"]
        # checkpoints written before skipped_zero_advantage_steps existed lack it
        self.learner.load_state_dict({**state["optimizer"], **{name: trainer.get(name, 0) for name in COUNTERS}})
        self.experience.load_state_dict(trainer, state["buffer"])
        self.step = trainer["step"]
        questions = self.experience.question_pool.questions
        self.schedule.load_state_dict(trainer.get("in_flight", []), questions, self.prompt_ids)

    def save(self) -> None:
        """Checkpoint the current step: every rank gathers the state (FSDP needs them all), rank 0 writes it."""
        state = self.state_dict()
        weights = self.learner.checkpoint_weights()
        if self.dist.is_main:
            save_checkpoint(self.config.logging.output_dir, self.step,
                            lambda directory: save_policy(self.model, self.tokenizer, directory, weights),
                            functools.partial(write_state, state["buffer"]), state, self.config.train.save_total_limit)
        self.dist.barrier()

    def resume(self, directory, verified: bool = False) -> None:
        """Continue from a checkpoint directory (exgrpo.runtime.checkpoint), checked against its manifest unless
        `verified` (by `exgrpo.training.launch.start_point`, which also checks that the config is the run's own).
        Logged lines of later steps are dropped: they will be logged again."""
        require_on_every_rank(self.dist, Path(directory))
        self.load_state_dict(load_checkpoint(directory, self.model, read_state, verified))
        self._resumed = True
        if self.dist.is_main:
            truncate_metrics(self.config.logging.output_dir, self.step)
        self.source.push(self.learner.weights_version)

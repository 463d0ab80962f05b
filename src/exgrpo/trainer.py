"""The ExGRPO training loop (spec §1). `ExGRPOTrainer.train_step` is the algorithm, one line per stage:

  1. sample experiential questions from the buffer's correctness buckets (mixed phase only);
  2. select, for each, the stored trajectory to replay (lowest mean token entropy under the current policy);
  3. draw exactly B - n_exp fresh questions; form the groups (a replay is member 0 of its group);
  4. roll out K fresh samples per fresh question, K-1 per experiential one;
  5. score every member with the reward functions; 6. retire questions whose group is K/K correct;
  7. pack the groups into tensors; 8. advantages R - mean over each group;
  9. update: M mini-batches of the mixed-policy loss (pre-update log-probs = behaviour log-probs);
  10. collect the groups into the buffer (mixed phase only); 11. switch to the mixed phase once batch Pass@1 >
  threshold (the delayed start); 12. metrics.
With experience.ratio = 0 the same loop is plain GRPO (PPO clipping throughout, buffer never used).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.atomic import write_text_atomic
from exgrpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from exgrpo.config import ConfigError, ExGRPOConfig
from exgrpo.data import PromptEncoder, Question
from exgrpo.distributed import Distributed, init_distributed, shard
from exgrpo.errors import ExgrpoWarning, RunDirectoryError
from exgrpo.evaluation.contamination import screen_benchmark_questions
from exgrpo.evaluation.heldout import Accuracy, evaluate_accuracy
from exgrpo.experience import ExperienceBuffer, Trajectory, num_experiential, sample_questions, select_replays
from exgrpo.groups import Group, GroupRewards, Member, form_groups, pack_groups, score_groups
from exgrpo.metrics import step_metrics
from exgrpo.models import save_model
from exgrpo.objective import group_advantages
from exgrpo.policy import PackedBatch, candidate_scores
from exgrpo.question_pool import QuestionPool
from exgrpo.rewards import GradingPool
from exgrpo.rewards.health import RewardHealth
from exgrpo.sharding import full_model_state
from exgrpo.rundir import clear_run, holds_a_run, lock_run_directory, unlock_run_directory
from exgrpo.rollout import RolloutEngine, SamplingSettings, build_engine, derive_seed
from exgrpo.timing import StageTimer
from exgrpo.tracking import Tracker, truncate_metrics
from exgrpo.update import MIXED, WARMUP, PolicyUpdate, loss_settings

__all__ = ["ExGRPOTrainer", "Group", "Member", "MIXED", "WARMUP", "StepRecord"]


@dataclass
class StepRecord:
    """What the latest step worked on, for inspection (tests, notebooks)."""

    phase: str
    groups: list[Group]
    rewards: GroupRewards
    advantages: torch.Tensor  # (G, K)
    batch: PackedBatch


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
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and config.train.sharding != "fsdp":
            raise ConfigError("launched with an accelerate FSDP config: set train.sharding=fsdp (exgrpo shards with "
                              "FSDP2 itself; the accelerate config's FSDP settings are not read)")
        self.dist = distributed or init_distributed()
        model.to(self.dist.device)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.reward_funcs = list(reward_funcs)
        if not self.reward_funcs:
            raise ValueError("at least one reward function is required")
        self.reward_weights = list(reward_weights) if reward_weights is not None else [1.0] * len(self.reward_funcs)
        c = config
        overlap = c.data.benchmark_overlap
        train_dataset = screen_benchmark_questions(train_dataset, overlap, "training questions",
                                                   c.data.prompt_suffix)
        self.eval_dataset = screen_benchmark_questions(eval_dataset or [], overlap, "held-out questions",
                                                       c.data.prompt_suffix)
        self.last_evaluation: Accuracy | None = None  # the latest periodic evaluation
        self.grading_pool = grading_pool
        self.reward_health = RewardHealth(c.reward.min_value, c.reward.max_value, c.reward.success_threshold)
        if c.train.threads:
            torch.set_num_threads(c.train.threads)
        self.K = c.rollout.num_generations
        groups_per_mini_batch = c.train.prompts_per_step // c.train.mini_batches
        if groups_per_mini_batch < self.dist.world_size:
            raise ValueError(f"train.prompts_per_step / train.mini_batches = {groups_per_mini_batch} questions per "
                             f"mini-batch cannot be shared by {self.dist.world_size} data-parallel ranks")
        self.engine = engine or build_engine(c.rollout, model, tokenizer)
        self.sampling = SamplingSettings(c.rollout.max_completion_length, c.rollout.temperature,
                                         c.rollout.top_p, c.rollout.top_k)
        self.prompt_ids = PromptEncoder(tokenizer, remove_system=c.data.remove_system,
                                        system_prompt=c.data.system_prompt, think_prefix=c.data.think_prefix)
        if c.data.max_prompt_length:
            train_dataset = self._drop_long_prompts(train_dataset, "training")
            self.eval_dataset = self._drop_long_prompts(self.eval_dataset, "held-out")
        e = c.experience
        self.buffer = ExperienceBuffer(self.K, e.lbound, e.rbound, e.max_trajectories_per_question, e.max_questions)
        self.pool = QuestionPool(train_dataset, c.train.seed, retirement=self.buffer)
        self.update = PolicyUpdate(model, c.train, self.K, c.rollout.temperature, self.dist,
                                   loss_scale=c.objective.loss_scale, on_optimizer_step=self.engine.sync_weights)
        self.phase = WARMUP
        self.step = 0
        self._resumed = False
        self.history: list[dict] = []
        self.last_step: StepRecord | None = None

    def _drop_long_prompts(self, questions: Sequence[Question], which: str) -> list[Question]:
        """data.max_prompt_length: questions whose prompt is longer are dropped (released), with a warning."""
        limit = self.config.data.max_prompt_length
        kept = [q for q in questions if len(self.prompt_ids(q)) <= limit]
        if len(kept) < len(questions):
            warnings.warn(ExgrpoWarning(f"dropped {len(questions) - len(kept)} of {len(questions)} {which} "
                                        f"questions whose prompt is longer than data.max_prompt_length = {limit} "
                                        "tokens"), stacklevel=3)
        return kept

    # ------------------------------------------------------------------ the algorithm
    def train_step(self) -> tuple[dict, list[dict]]:
        """One step of ExGRPO (see the module docstring); returns its metrics and example completions."""
        c, timer, start = self.config, StageTimer(), time.perf_counter()
        rng = np.random.default_rng([c.train.seed, self.step])
        phase = self.phase
        with timer("buffer"):
            experiential = self.sample_experiential(rng) if phase == MIXED else []
        with timer("selection"):
            replays = self.select_replays(experiential, rng)
        fresh = self.pool.draw(c.train.prompts_per_step - len(experiential))
        groups = form_groups(list(zip(experiential, replays)), fresh, self.prompt_ids)
        with timer("rollout"):
            self.roll_out(groups)
        with timer("reward"):
            rewards = self.score(groups)
        correct = rewards.total >= c.reward.success_threshold
        retired_now = self.retire(groups, correct)
        batch = pack_groups(groups, self.tokenizer.pad_token_id)
        advantages = group_advantages(torch.tensor(rewards.total, dtype=torch.float32), c.objective.scale_rewards)
        update = self.update(batch, advantages.reshape(-1),
                             loss_settings(c.objective, c.rollout.max_completion_length, phase),
                             c.experience.importance_correction, np.random.default_rng([c.train.seed, self.step, 2]),
                             timer)
        with timer("buffer"):
            if phase == MIXED:
                self.collect(groups, correct, batch, update.behaviour_logp)
        self.maybe_switch_phase(float(correct.mean()))
        self.step += 1
        self.last_step = StepRecord(phase, groups, rewards, advantages, batch)
        metrics = step_metrics(phase, groups, rewards, correct, batch, update.stats, self.buffer, self.pool.remaining,
                               self.update.learning_rate, self.update.skipped_updates, retired_now,
                               timer.metrics(), time.perf_counter() - start)
        if c.train.check_replicas:
            metrics.update(self._check_replicas())
        log_samples = c.logging.sample_every and self.step % c.logging.sample_every == 0
        return metrics, self._samples(groups, rewards.total) if log_samples else []

    def sample_experiential(self, rng: np.random.Generator) -> list[Question]:
        """n_exp = min(|buffer|, floor(B * ratio)) questions drawn from the correctness buckets."""
        c = self.config
        n_exp = num_experiential(len(self.buffer), c.train.prompts_per_step, c.experience.ratio)
        ids = sample_questions(self.buffer.buckets(), n_exp, rng, self.K, c.experience.bucket_scheme,
                               c.experience.bucket_sigma, c.experience.bucket_mean)
        return [self.pool.questions[qid] for qid in ids]

    def select_replays(self, questions: Sequence[Question], rng: np.random.Generator) -> list[Trajectory]:
        """For each question, the stored trajectory the selection rule picks under the current policy."""
        e = self.config.experience
        candidates = [(q, self.buffer.trajectories(q.id)) for q in questions]
        return select_replays(candidates, e.selection_metric, e.selection_mode, rng, score=self._score_candidates)

    def _score_candidates(self, pairs: list[tuple[Question, Trajectory]]) -> list[float]:
        """Selection scores of (question, stored trajectory) pairs; each rank scores a shard, all get every score."""
        c = self.config
        mine = [(self.prompt_ids(q), t.token_ids.tolist()) for q, t in shard(pairs, self.dist)]
        was_training = self.model.training
        self.model.eval()
        with self.update.full_weights():
            scores = candidate_scores(lambda batch, entropy: self.update.logprobs(self.model, batch, slice(None),
                                                                                  entropy),
                                      mine, c.experience.selection_metric, self.tokenizer.pad_token_id,
                                      c.experience.selection_batch_size)
        self.model.train(was_training)
        return self.dist.gather(scores)

    def roll_out(self, groups: list[Group]) -> None:
        """Fill every group up to K members with fresh samples. Each rank samples its shard of the groups and
        every rank receives all of them; request (group g, member j) is seeded by (seed, step, g, j)."""
        c, dp = self.config, self.dist
        start, end = dp.shard_bounds(len(groups))
        requests = [(gi, j) for gi in range(start, end) for j in range(len(groups[gi].members), self.K)]
        with self.update.full_weights(), self.update.compute_precision():
            rollouts = self.engine.generate([groups[gi].prompt_ids for gi, _ in requests], self.sampling,
                                            [derive_seed(c.train.seed, self.step, gi, j) for gi, j in requests])
        sampled = dp.gather(list(zip(rollouts.completion_ids, rollouts.truncated)))
        slots = [g for g in groups for _ in range(self.K - len(g.members))]
        for g, (ids, truncated) in zip(slots, sampled):
            g.members.append(Member(ids, truncated))

    def score(self, groups: list[Group]) -> GroupRewards:
        """(G, K) rewards; each rank grades its shard of the groups, every rank receives all of them. Unhealthy
        rewards are warned about or stop the run (see exgrpo.rewards.health)."""
        start, end = self.dist.shard_bounds(len(groups))
        mine = score_groups(groups[start:end], self.tokenizer, self.reward_funcs, self.reward_weights)
        mine.grading = self.grading_pool.pop_stats() if self.grading_pool is not None else {}
        gathered = self.dist.gather([mine])
        graded = [r for r in gathered if len(r.total)]  # a rank may have had no groups
        rewards = GroupRewards(np.concatenate([r.total for r in graded]),
                               {name: np.concatenate([r.per_function[name] for r in graded])
                                for name in mine.per_function},
                               {k: sum(r.grading[k] for r in gathered) for k in mine.grading})
        self.reward_health.check(self.step + 1, rewards.per_function, rewards.total, rewards.grading)
        return rewards

    def retire(self, groups: list[Group], correct: np.ndarray) -> int:
        """Retire the questions of K/K-correct groups (spec §2); returns how many were retired now."""
        retired = 0
        for g, ok in zip(groups, correct):
            if ok.all() and not self.buffer.is_retired(g.question.id):
                self.buffer.retire(g.question.id)
                retired += 1
        return retired

    def collect(self, groups: list[Group], correct: np.ndarray, batch: PackedBatch,
                behaviour_logp: torch.Tensor) -> None:
        """Move each group's question to its bucket and store its new correct trajectories with their (T,)
        behaviour log-probs (rows of `behaviour_logp`, packed like `batch`)."""
        lengths = batch.completion_mask.sum(-1).to(torch.long).tolist()
        row = 0
        for g, ok in zip(groups, correct):
            ids, lps = [], []
            for m in g.members:
                ids.append(np.asarray(m.completion_ids, dtype=np.int32))
                lps.append(behaviour_logp[row, :lengths[row]].numpy())
                row += 1
            self.buffer.update_group(g.question.id, ok.tolist(), ids, lps, step=self.step)  # ignores retired ones

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
        c, dp = self.config, self.dist
        if dp.is_main:
            lock_run_directory(c.logging.output_dir)
        try:
            if dp.is_main:
                self._claim_run_directory()
            own_tracker = tracker is None and dp.is_main
            if own_tracker:
                tracker = Tracker(c.logging.output_dir, c.train.steps, tensorboard=c.logging.tensorboard,
                                  wandb=c.logging.wandb, progress=c.logging.progress, config=c.to_dict(),
                                  start_step=self.step)
            try:
                self._train_loop(tracker, on_step)
            finally:
                if own_tracker:
                    tracker.close()
        finally:
            if dp.is_main:
                unlock_run_directory(c.logging.output_dir)
        return self.history

    def _claim_run_directory(self) -> None:
        """A fresh run starts in a directory without another run's files (or clears them, with overwrite); then
        the resolved config is written."""
        c = self.config
        directory = c.logging.output_dir
        if not self._resumed:
            existing = holds_a_run(directory)
            if existing and not c.logging.overwrite:
                raise RunDirectoryError(
                    f"{directory} already holds a run ({', '.join(existing)}); continue it with `exgrpo train "
                    f"--resume {directory}`, or start over with logging.overwrite=true (deletes it)")
            clear_run(directory)
        write_text_atomic(Path(directory) / "config.json", json.dumps(c.to_dict(), indent=2))

    def _train_loop(self, tracker: Tracker | None, on_step: Callable[[int, dict], None] | None) -> None:
        c, dp = self.config, self.dist
        stop = _StopRequest()
        with stop:
            while self.step < c.train.steps and not dp.any_true(bool(stop.requested)):
                if self.pool.remaining == 0:
                    if tracker:
                        tracker.print(f"[yellow]Every training question is retired (solved {self.K}/{self.K}); "
                                      f"stopping at step {self.step}.")
                    break
                self._run_step(tracker, on_step)
            if stop.requested and tracker:
                tracker.print(f"[yellow]{stop.requested}: checkpointing at step {self.step} and exiting.")
            latest = latest_checkpoint(c.logging.output_dir)
            if latest is None or latest.name != f"step-{self.step:06d}":
                self.save()

    def _run_step(self, tracker: Tracker | None, on_step: Callable[[int, dict], None] | None) -> None:
        """A step plus what follows it: periodic evaluation, logging, checkpointing."""
        c = self.config
        metrics, samples = self.train_step()
        if c.eval.every and self.eval_dataset and self.step % c.eval.every == 0:
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
        sampling = SamplingSettings(c.rollout.max_completion_length, c.eval.temperature, c.rollout.top_p,
                                    c.rollout.top_k)
        with self.update.full_weights(), self.update.compute_precision():
            return evaluate_accuracy(self.engine, self.tokenizer, questions, self.reward_funcs, sampling,
                                     c.eval.samples, seed=derive_seed(c.train.seed, self.step, 4),
                                     success_threshold=c.reward.success_threshold, prompt_ids_of=self.prompt_ids)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything but the model weights and global RNGs: {"trainer": JSON-able progress and the resolved
        config, "optimizer": optimizer and scheduler state, "buffer": the experience buffer's state}."""
        update = self.update.state_dict()
        trainer = {"step": self.step, "phase": self.phase, "pool": self.pool.state_dict(),
                   "optimizer_steps": update.pop("optimizer_steps"), "skipped_updates": update.pop("skipped_updates"),
                   "config": self.config.to_dict()}
        return {"trainer": trainer, "optimizer": update, "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        trainer = state["trainer"]
        self.update.load_state_dict({**state["optimizer"], "optimizer_steps": trainer["optimizer_steps"],
                                     "skipped_updates": trainer["skipped_updates"]})
        self.buffer.load_state_dict(state["buffer"])
        self.step, self.phase = trainer["step"], trainer["phase"]
        self.pool.load_state_dict(trainer["pool"])

    def save(self) -> None:
        """Checkpoint the current step: every rank gathers the state (FSDP needs them all), rank 0 writes it."""
        state = self.state_dict()
        weights = full_model_state(self.model) if self.update.sharded else None
        if self.dist.is_main:
            save_checkpoint(self.config.logging.output_dir, self.step,
                            lambda directory: save_model(self.model, directory, weights),
                            state, self.config.train.save_total_limit)
        self.dist.barrier()

    def resume(self, directory) -> None:
        """Continue from a checkpoint directory (see exgrpo.checkpoint); the config must be the run's own (see
        `exgrpo.run.start_point`). Logged lines of later steps are dropped: they will be logged again."""
        self.load_state_dict(load_checkpoint(directory, self.model))
        self._resumed = True
        if self.dist.is_main:
            truncate_metrics(self.config.logging.output_dir, self.step)
        self.engine.sync_weights()

    # ------------------------------------------------------------------ reporting
    def _check_replicas(self) -> dict:
        """Every rank's buffer and (DDP) trainable-parameter hashes; they must agree."""
        h = hashlib.sha256()
        if not self.update.sharded:  # FSDP holds one copy of the weights, in shards: nothing to compare
            for p in self.model.parameters():
                if p.requires_grad:
                    h.update(p.detach().cpu().numpy().tobytes())
        hashes = self.dist.gather([(self.buffer.fingerprint(), h.hexdigest())])
        if len(set(hashes)) > 1:
            raise RuntimeError(f"data-parallel replicas diverged at step {self.step}: {hashes}")
        return {"replicas/buffer_hash": hashes[0][0], "replicas/param_hash": hashes[0][1],
                "replicas/count": float(len(hashes))}

    def _samples(self, groups: list[Group], rewards: np.ndarray, limit: int = 4) -> list[dict]:
        out = []
        for g, r in list(zip(groups, rewards))[:limit]:
            m = g.members[0]
            out.append({"question_id": g.question.id, "answer": g.question.answer, "replayed": m.replay is not None,
                        "completion": self.tokenizer.decode(m.completion_ids, skip_special_tokens=True),
                        "reward": float(r[0])})
        return out


class _StopRequest:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one interrupts."""

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

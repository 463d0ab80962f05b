"""The ExGRPO training loop (spec §1). `ExGRPOTrainer.train_step` is the algorithm, one line per stage:

  1. sample experiential questions from the buffer's correctness buckets (mixed phase only; the replay policy,
     `experience.policy`, decides which);
  2. draw exactly B - n_exp fresh questions; form the groups, selecting for each experiential question the stored
     trajectory to replay (lowest mean token entropy under the current policy) as member 0, and adding the
     data's reference solutions where `guidance` asks for them;
  3-6. `generate`: roll out the remaining members (K - 1 per experiential question), score every member with
     the reward functions, retire questions whose group is K/K correct; with `rollout.zero_variance` backfill or
     replace_from_buffer, drop groups whose rewards are all equal and refill their slots;
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
from exgrpo.config import ConfigError, ExGRPOConfig, compute_precision, engine_correction_cap, engine_precision
from exgrpo.data import PromptEncoder, Question
from exgrpo.distributed import Distributed, init_distributed, shard
from exgrpo.errors import ExgrpoWarning, RunDirectoryError, TrainingError
from exgrpo.evaluation.contamination import screen_benchmark_questions
from exgrpo.evaluation.heldout import Accuracy, evaluate_accuracy
from exgrpo.experience import ExperienceBuffer, Trajectory, build_replay_policy, num_experiential, select_replays
from exgrpo.groups import (Generation, Group, GroupRewards, Member, form_groups, pack_groups, score_groups,
                           zero_variance)
from exgrpo.guidance import demonstration_ids
from exgrpo.metrics import guidance_metrics, step_metrics, trajectory_entropy_metrics
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
        self.sampling = SamplingSettings(c.rollout.max_completion_length, c.rollout.temperature,
                                         c.rollout.top_p, c.rollout.top_k)
        self.prompt_ids = PromptEncoder(tokenizer, remove_system=c.data.remove_system,
                                        system_prompt=c.data.system_prompt, think_prefix=c.data.think_prefix)
        train_dataset = self._screen(train_dataset, "training")
        self.eval_dataset = self._screen(eval_dataset or [], "held-out")
        self.engine = engine or build_engine(c, model, tokenizer, lambda: c.data.max_prompt_length or max(
            (len(self.prompt_ids(q)) for q in [*train_dataset, *self.eval_dataset]), default=0))
        e = c.experience
        self.buffer = ExperienceBuffer(self.K, e.lbound, e.rbound, e.max_trajectories_per_question, e.max_questions)
        self.pool = QuestionPool(train_dataset, c.train.seed, retirement=self.buffer)
        self.demonstrations = self._load_demonstrations(train_dataset)
        self.solved: set[str] = set()  # questions with a correct rollout of the policy's own (coverage, guidance)
        self.replay_policy = build_replay_policy(e.policy, self.buffer, self.K, e.bucket_scheme, e.bucket_sigma,
                                                 e.bucket_mean, e.retest_every)
        self.update = PolicyUpdate(model, c.train, self.K, c.rollout.temperature, self.dist,
                                   loss_scale=c.objective.loss_scale, tis_cap=engine_correction_cap(c),
                                   on_optimizer_step=self.engine.sync_weights)
        self.phase = WARMUP
        self.step = 0
        self._resumed = False
        self.history: list[dict] = []
        self.last_step: StepRecord | None = None

    def _load_demonstrations(self, questions: Sequence[Question]) -> dict[str, list[list[int]]]:
        """guidance.field: each question's reference solutions as completion token ids (warns about dropped ones)."""
        c = self.config
        if not c.guidance.field:
            return {}
        limit = c.rollout.max_completion_length
        demonstrations, dropped = demonstration_ids(questions, c.guidance.field, self.tokenizer, limit)
        if dropped:
            warnings.warn(ExgrpoWarning(f"dropped {dropped} demonstrations longer than rollout.max_completion_length "
                                        f"= {limit} tokens"), stacklevel=3)
        return demonstrations

    def _screen(self, questions: Sequence[Question], which: str) -> list[Question]:
        """The questions the run may use: benchmark test questions handled as data.benchmark_overlap says, and,
        with data.max_prompt_length, longer prompts dropped (released) with a warning."""
        d = self.config.data
        questions = screen_benchmark_questions(questions, d.benchmark_overlap, f"{which} questions", d.prompt_suffix)
        limit = d.max_prompt_length
        if not limit:
            return questions
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
        fresh = self.pool.draw(c.train.prompts_per_step - len(experiential))
        groups = self.build_groups(experiential, fresh, phase, rng, timer)
        groups, rewards, generation = self.generate(groups, phase, rng, timer)  # roll out, score, retire
        correct = rewards.total >= c.reward.success_threshold
        batch = pack_groups(groups, self.tokenizer.pad_token_id)
        advantages = group_advantages(torch.tensor(rewards.total, dtype=torch.float32), c.objective.scale_rewards)
        update = self.update(batch, advantages.reshape(-1),
                             loss_settings(c.objective, c.rollout.max_completion_length, phase, c.guidance.gamma),
                             c.experience.importance_correction, np.random.default_rng([c.train.seed, self.step, 2]),
                             timer)
        parity = self.check_engine_parity(batch, update.behaviour_logp)
        with timer("buffer"):
            if phase == MIXED:
                self.collect(groups, correct, batch, update.behaviour_logp)
        self.maybe_switch_phase(generation.first_round_pass_at_1)
        self.step += 1
        self.last_step = StepRecord(phase, groups, rewards, advantages, batch)
        metrics = step_metrics(phase, groups, rewards, correct, batch, update.stats, self.buffer, self.pool.remaining,
                               self.update.learning_rate, self.update.skipped_updates, generation.retired,
                               timer.metrics(), time.perf_counter() - start)
        metrics.update(generation.metrics())
        metrics["coverage/solved"] = float(len(self.solved))
        metrics.update(trajectory_entropy_metrics(groups, correct, batch, update.token_entropy))
        if self.demonstrations:
            metrics.update(guidance_metrics(groups, rewards.total))
        metrics.update(parity)
        if c.train.check_replicas:
            metrics.update(self._check_replicas())
        log_samples = c.logging.sample_every and self.step % c.logging.sample_every == 0
        return metrics, self._samples(groups, rewards.total) if log_samples else []

    def sample_experiential(self, rng: np.random.Generator, n: int | None = None,
                            exclude: frozenset[str] = frozenset()) -> list[Question]:
        """Up to n (default floor(B * ratio)) questions to re-ask, drawn by the replay policy (ExGRPO: from the
        correctness buckets), none of them in `exclude`."""
        c = self.config
        if n is None:
            n = num_experiential(c.train.prompts_per_step, c.train.prompts_per_step, c.experience.ratio)
        ids = self.replay_policy.experiential(n + len(exclude), rng, self.step)
        return [self.pool.questions[qid] for qid in ids if qid not in exclude][:n]

    def build_groups(self, experiential: list[Question], fresh: list[Question], phase: str,
                    rng: np.random.Generator, timer: StageTimer) -> list[Group]:
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
        self.add_demonstrations(groups)
        return groups

    def add_demonstrations(self, groups: list[Group]) -> None:
        """guidance: up to guidance.members reference solutions become the first members of each group without a
        replay whose question has them (mode fallback: only while the policy has not solved it itself)."""
        g = self.config.guidance
        for group in groups:
            demos = self.demonstrations.get(group.question.id)
            if not demos or group.members or (g.mode == "fallback" and group.question.id in self.solved):
                continue
            group.members = [Member(list(demos[(self.step + j) % len(demos)]), demonstration=True)
                             for j in range(min(g.members, len(demos)))]

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

    def generate(self, groups: list[Group], phase: str, rng: np.random.Generator,
                 timer: StageTimer) -> tuple[list[Group], GroupRewards, Generation]:
        """Roll out, score and retire `groups`. With rollout.zero_variance backfill or replace_from_buffer, groups
        whose K rewards are all equal are dropped and their slots refilled, for at most max_generation_rounds
        rounds; retirement sees every group. If no group of the step is informative, the last round's are kept."""
        c = self.config
        mode, wanted = c.rollout.zero_variance, len(groups)
        rounds = 1 if mode == "keep" else c.rollout.max_generation_rounds
        generation, kept, kept_rewards, asked = Generation(), [], [], set()
        for _ in range(rounds):
            sampled = len(groups) * self.K - sum(len(g.members) for g in groups)
            with timer("rollout"):
                self.roll_out(groups, first_group=generation.groups)
            with timer("reward"):
                rewards = self.score(groups)
            correct = rewards.total >= c.reward.success_threshold
            zero = zero_variance(rewards.total)
            generation.record(groups, sampled, correct, zero, self.retire(groups, correct))
            self.observe(groups, correct)
            if mode == "keep":
                return groups, rewards, generation
            informative = np.flatnonzero(~zero)
            kept += [groups[i] for i in informative]
            kept_rewards.append(rewards.take(informative))
            asked.update(g.question.id for g in groups)
            if len(kept) == wanted or generation.rounds == rounds:
                break
            refill = self.refill(wanted - len(kept), phase, rng, asked, timer)
            if not refill:
                break
            groups = refill
        if not kept:
            return groups, rewards, generation
        return kept, GroupRewards.concat(kept_rewards), generation

    def observe(self, groups: list[Group], correct: np.ndarray) -> None:
        """Every rolled-out group's outcome, dropped ones included: to the replay policy, and to the set of
        questions the policy has solved itself (coverage; guidance fallback)."""
        for g, ok in zip(groups, correct):
            self.replay_policy.observe(g.question.id, int(ok.sum()), self.step)
            if any(hit and not m.demonstration for hit, m in zip(ok, g.members)):
                self.solved.add(g.question.id)

    def refill(self, n: int, phase: str, rng: np.random.Generator, asked: set[str],
               timer: StageTimer) -> list[Group]:
        """n groups for dropped slots: with replace_from_buffer in the mixed phase, experiential questions not
        asked yet this step (with their replays), then fresh questions."""
        experiential = []
        if self.config.rollout.zero_variance == "replace_from_buffer" and phase == MIXED:
            experiential = self.sample_experiential(rng, n, frozenset(asked))
        return self.build_groups(experiential, self.pool.draw(n - len(experiential)), phase, rng, timer)

    def roll_out(self, groups: list[Group], first_group: int = 0) -> None:
        """Fill every group up to K members with fresh samples. Each rank samples its shard of the groups and
        every rank receives all of them; request (group g, member j) is seeded by (seed, step, first_group + g,
        j), so every group of a step (later rounds included) has its own streams."""
        c, dp = self.config, self.dist
        start, end = dp.shard_bounds(len(groups))
        requests = [(gi, j) for gi in range(start, end) for j in range(len(groups[gi].members), self.K)]
        with self.update.full_weights(), self.update.compute_precision():
            rollouts = self.engine.generate([groups[gi].prompt_ids for gi, _ in requests], self.sampling,
                                            [derive_seed(c.train.seed, self.step, first_group + gi, j)
                                             for gi, j in requests])
        engine_logprobs = rollouts.logprobs or [None] * len(requests)
        sampled = dp.gather(list(zip(rollouts.completion_ids, rollouts.truncated, engine_logprobs)))
        slots = [g for g in groups for _ in range(self.K - len(g.members))]
        for g, (ids, truncated, logprobs) in zip(slots, sampled):
            g.members.append(Member(ids, truncated, engine_logprobs=logprobs))

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
            # a demonstration counts toward k but is not stored: the buffer holds the policy's own trajectories
            own = [bool(c) and not m.demonstration for c, m in zip(ok, g.members)]
            self.buffer.update_group(g.question.id, own, ids, lps, step=self.step)  # ignores retired ones

    def check_engine_parity(self, batch: PackedBatch, behaviour_logp: torch.Tensor) -> dict[str, float]:
        """The parity probe (rollout.parity_every): the engine's log-probs of what it sampled against the trainer's
        pre-update log-probs of the same tokens. A large difference means the engine is not running the trainer's
        weights (a sync that did not happen, a LoRA adapter not applied, a name or dtype mismatch): an error."""
        r = self.config.rollout
        if batch.engine_mask is None or not r.parity_every or self.step % r.parity_every:
            return {}
        diff = (batch.engine_logp - behaviour_logp).abs()[batch.engine_mask]
        if diff.numel() == 0:
            return {}
        mean, worst = float(diff.mean()), float(diff.max())
        threshold = r.parity_threshold or (0.05 if engine_precision(self.config) == compute_precision(self.config)
                                           else 0.1)
        if mean > threshold:
            raise TrainingError(f"step {self.step + 1}: the rollout engine's log-probs differ from the trainer's by "
                                f"{mean:.4f} nats on average (max {worst:.4f}; rollout.parity_threshold "
                                f"{threshold:g}): the engine is not running the trainer's weights")
        return {"rollout/logp_diff_mean": mean, "rollout/logp_diff_max": worst}

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
                   "replay_policy": self.replay_policy.state_dict(), "solved": sorted(self.solved),
                   "config": self.config.to_dict()}
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

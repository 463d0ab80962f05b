"""The ExGRPO training loop (spec §1), top to bottom like the algorithm.

One step:
  1. batch: n_exp experiential questions from the buffer (bucket sampler) + exactly B - n_exp fresh ones;
     for each experiential question, the stored trajectory with the lowest entropy under the current policy;
  2. rollouts: K per fresh question, K-1 per experiential one (its replay is spliced in as member 0);
  3. rewards; groups with K/K correct retire their question;
  4. behaviour log-probs from the pre-update forward pass; collection into the buffer (mixed phase only);
  5. advantages over each group; M mini-batches of the mixed-policy loss, one optimizer step each;
  6. metrics; the delayed start switches to the mixed phase once batch Pass@1 > threshold.
With experience.ratio = 0 the same loop is plain GRPO (PPO clipping throughout, buffer never used).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from exgrpo.config import ExGRPOConfig
from exgrpo.data import Question, render_prompt
from exgrpo.distributed import Distributed, init_distributed, shard
from exgrpo.evaluation import Accuracy, evaluate_accuracy
from exgrpo.experience import ExperienceBuffer, Trajectory, num_experiential, sample_questions
from exgrpo.experience.selection import select_index, trajectory_scores
from exgrpo.objective import LossSettings, group_advantages, merge_stats, mixed_policy_loss
from exgrpo.rewards import combine_rewards
from exgrpo.rollout import HFEngine, RolloutEngine, SamplingSettings, derive_seed
from exgrpo.tracking import Tracker, truncate_metrics

WARMUP, MIXED = "warmup", "mixed"


@dataclass
class Member:
    completion_ids: list[int]
    truncated: bool = False
    replay: Trajectory | None = None  # set on the replayed member of an experiential group


@dataclass
class Group:
    question: Question
    prompt_ids: list[int]
    members: list[Member] = field(default_factory=list)


class QuestionPool:
    """Fresh questions in a seeded shuffled order, epoch after epoch; retired questions are skipped for good."""

    def __init__(self, questions: Sequence[Question], seed: int):
        if not questions:
            raise ValueError("the training set is empty")
        ids = [q.id for q in questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be unique within the training set")
        self.questions = {q.id: q for q in questions}
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self.retired: set[str] = set()
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[str]:
        ids = list(self.questions)
        np.random.default_rng([self.seed, epoch]).shuffle(ids)
        return ids

    @property
    def remaining(self) -> int:
        return len(self.questions) - len(self.retired)

    def draw(self, n: int) -> list[Question]:
        """The next n non-retired questions (fewer only when fewer remain in the whole pool)."""
        out: list[Question] = []
        n = min(n, self.remaining)
        while len(out) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            qid = self._order[self.cursor]
            self.cursor += 1
            if qid not in self.retired:
                out.append(self.questions[qid])
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.retired = set(state["retired"])
        self._order = self._shuffled(self.epoch)


class ExGRPOTrainer:
    """Train a causal LM with ExGRPO.

    Args:
        model, tokenizer: a transformers causal LM (optionally peft-wrapped) and its left-padding tokenizer.
        reward_funcs: callables f(prompts, completions, completion_ids, **columns) -> list[float | None]; the
            dataset columns passed are `answer` plus each question's `columns`.
        config: the run configuration.
        train_dataset: training questions.
        reward_weights: one weight per reward function (default all 1).
        engine: a RolloutEngine (default: transformers generate on the training model).
        eval_dataset: held-out questions, evaluated every eval.every steps with the reward functions
            (logged as eval/accuracy and eval/stderr).
    """

    def __init__(self, model, tokenizer, reward_funcs: Sequence[Callable], config: ExGRPOConfig,
                 train_dataset: Sequence[Question], reward_weights: Sequence[float] | None = None,
                 engine: RolloutEngine | None = None, distributed: Distributed | None = None,
                 eval_dataset: Sequence[Question] | None = None):
        self.dist = distributed or init_distributed()
        model.to(self.dist.device)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.eval_dataset = list(eval_dataset or [])
        self.last_evaluation: Accuracy | None = None  # the latest periodic evaluation
        self.reward_funcs = list(reward_funcs)
        self.reward_weights = list(reward_weights) if reward_weights is not None else [1.0] * len(self.reward_funcs)
        if not self.reward_funcs:
            raise ValueError("at least one reward function is required")
        c = config
        if c.train.threads:
            torch.set_num_threads(c.train.threads)
        if c.objective.kl_coef:
            raise ValueError("objective.kl_coef > 0 needs a reference model, which this trainer does not load yet")
        self.K = c.rollout.num_generations
        self.engine = engine or HFEngine(model, tokenizer, c.rollout.generation_batch_size)
        self.sampling = SamplingSettings(c.rollout.max_completion_length, c.rollout.temperature,
                                         c.rollout.top_p, c.rollout.top_k)
        self.pool = QuestionPool(train_dataset, c.train.seed)
        self.buffer = ExperienceBuffer(self.K, c.experience.lbound, c.experience.rbound,
                                       c.experience.max_trajectories_per_question, c.experience.max_questions)
        self.experience_enabled = c.experience.ratio > 0
        self.phase = WARMUP
        self.step = 0
        self.optimizer_steps = 0
        self.skipped_updates = 0
        self._prompt_cache: dict[str, list[int]] = {}
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        groups_per_mini_batch = c.train.prompts_per_step // c.train.mini_batches
        if groups_per_mini_batch < self.dist.world_size:
            raise ValueError(f"train.prompts_per_step / train.mini_batches = {groups_per_mini_batch} questions per "
                             f"mini-batch cannot be shared by {self.dist.world_size} data-parallel ranks")
        # DDP averages gradients; the loss is scaled by the world size so the update equals the one-process one.
        self.train_model = torch.nn.parallel.DistributedDataParallel(model) if self.dist.enabled else model
        self.optimizer = torch.optim.AdamW(params, lr=c.train.learning_rate, weight_decay=c.train.weight_decay,
                                           betas=(c.train.adam_beta1, c.train.adam_beta2))
        from transformers import get_scheduler

        self.scheduler = get_scheduler(c.train.lr_scheduler, self.optimizer, num_warmup_steps=c.train.warmup_steps,
                                       num_training_steps=c.train.steps * c.train.mini_batches)
        self.history: list[dict] = []
        self.last_groups: list[Group] = []  # the groups of the latest step, for inspection

    # ------------------------------------------------------------------ public
    def train(self, tracker: Tracker | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Run until train.steps (or until every question is retired), checkpointing into logging.output_dir.

        SIGINT/SIGTERM finish the current step, write a checkpoint and return. Returns per-step metrics.
        Under data parallelism only rank 0 logs and writes checkpoints.
        """
        c, dp = self.config, self.dist
        run_dir = c.logging.output_dir
        own_tracker = tracker is None and dp.is_main
        if own_tracker:
            tracker = Tracker(run_dir, c.train.steps, tensorboard=c.logging.tensorboard, wandb=c.logging.wandb,
                              progress=c.logging.progress, config=c.to_dict(), start_step=self.step)
        stop = _StopRequest()
        try:
            with stop:
                while self.step < c.train.steps and not dp.any_true(bool(stop.requested)):
                    if self.pool.remaining == 0:
                        if tracker:
                            tracker.print(f"[yellow]Every training question is retired (solved {self.K}/{self.K}); "
                                          f"stopping at step {self.step}.")
                        break
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
                if stop.requested and tracker:
                    tracker.print(f"[yellow]{stop.requested}: checkpointing at step {self.step} and exiting.")
                latest = latest_checkpoint(run_dir)
                if latest is None or latest.name != f"step-{self.step:06d}":
                    self.save()
        finally:
            if own_tracker:
                tracker.close()
        return self.history

    def evaluate(self) -> Accuracy:
        """Held-out accuracy (avg@eval.samples at eval.temperature, graded by the reward functions)."""
        c = self.config
        questions = self.eval_dataset[: c.eval.max_questions] if c.eval.max_questions else self.eval_dataset
        sampling = SamplingSettings(c.rollout.max_completion_length, c.eval.temperature, c.rollout.top_p,
                                    c.rollout.top_k)
        return evaluate_accuracy(self.engine, self.tokenizer, questions, self.reward_funcs, sampling,
                                 c.eval.samples, seed=derive_seed(c.train.seed, self.step, 4),
                                 success_threshold=c.reward.success_threshold,
                                 prompt_ids_of=self._prompt_ids)

    def save(self) -> None:
        """Checkpoint the current step (rank 0 writes; every rank waits for it)."""
        if self.dist.is_main:
            save_checkpoint(self, self.config.logging.output_dir, self.config.train.save_total_limit)
        self.dist.barrier()

    def resume(self, directory) -> None:
        """Continue from a checkpoint directory (see exgrpo.checkpoint); the config must be the run's own."""
        load_checkpoint(self, directory)
        truncate_metrics(self.config.logging.output_dir, self.step)

    def train_step(self) -> tuple[dict, list[dict]]:
        c = self.config
        step_start = time.perf_counter()
        timings: dict[str, float] = {}
        dp = self.dist
        rng = np.random.default_rng([c.train.seed, self.step])
        phase = self.phase

        # 1. batch: experiential questions + their replays, then exactly B - n_exp fresh questions
        t = time.perf_counter()
        n_exp = 0
        exp_ids: list[str] = []
        if phase == MIXED:
            n_exp = num_experiential(len(self.buffer), c.train.prompts_per_step, c.experience.ratio)
            exp_ids = sample_questions(self.buffer.buckets(), n_exp, rng, self.K, c.experience.bucket_scheme,
                                       c.experience.bucket_sigma, c.experience.bucket_mean)
        timings["time/buffer"] = time.perf_counter() - t
        t = time.perf_counter()
        replays = self._select_replays(exp_ids, rng)
        timings["time/selection"] = time.perf_counter() - t
        fresh = self.pool.draw(c.train.prompts_per_step - len(exp_ids))
        exp_questions = [self.pool.questions[qid] for qid in exp_ids]
        groups = [Group(q, self._prompt_ids(q), [Member(r.token_ids.tolist(), replay=r)])
                  for q, r in zip(exp_questions, replays)]
        groups += [Group(q, self._prompt_ids(q)) for q in fresh]

        # 2. rollouts: K fresh samples per fresh question, K-1 per experiential question; each rank samples its
        #    shard of the groups, every rank receives all of them
        t = time.perf_counter()
        start, end = dp.shard_bounds(len(groups))
        requests = [(gi, j) for gi in range(start, end) for j in range(len(groups[gi].members), self.K)]
        rollouts = self.engine.generate([groups[gi].prompt_ids for gi, _ in requests], self.sampling,
                                        [derive_seed(c.train.seed, self.step, gi, j) for gi, j in requests])
        sampled = dp.gather(list(zip(rollouts.completion_ids, rollouts.truncated)))
        all_requests = [g for g in groups for _ in range(self.K - len(g.members))]
        for g, (ids, trunc) in zip(all_requests, sampled):
            g.members.append(Member(ids, trunc))
        timings["time/rollout"] = time.perf_counter() - t

        # 3. rewards (each rank grades its shard) and retirement
        t = time.perf_counter()
        rewards = np.array(dp.gather(self._rewards(groups[start:end]).tolist())).reshape(len(groups), self.K)
        correct = rewards >= c.reward.success_threshold
        timings["time/reward"] = time.perf_counter() - t
        retired_now = 0
        for g, ok in zip(groups, correct):
            if ok.all() and g.question.id not in self.pool.retired:
                self.pool.retired.add(g.question.id)
                self.buffer.retire(g.question.id)
                retired_now += 1

        # 4-5. advantages; behaviour log-probs (pre-update forward) and the update; collection into the buffer
        batch = self._pack([(g.prompt_ids, m) for g in groups for m in g.members])
        advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32), c.objective.scale_rewards).reshape(-1)
        update_stats, old_logp = self._update(batch, advantages, phase, timings)
        t = time.perf_counter()
        if phase == MIXED:
            self._collect(groups, correct, batch, old_logp)
        timings["time/buffer"] += time.perf_counter() - t

        # 6. metrics and the delayed start
        self.last_groups = groups
        pass_at_1 = float(correct.mean())
        if phase == WARMUP and self.experience_enabled and pass_at_1 > c.experience.start_threshold:
            self.phase = MIXED
        self.step += 1
        metrics = self._metrics(groups, rewards, correct, batch, update_stats, timings, phase, n_exp, retired_now,
                                time.perf_counter() - step_start)
        if c.train.check_replicas:
            metrics.update(self._check_replicas())
        log_samples = c.logging.sample_every and self.step % c.logging.sample_every == 0
        return metrics, self._samples(groups, rewards) if log_samples else []

    def _check_replicas(self) -> dict:
        """Every rank's buffer and trainable-parameter hashes; they must agree."""
        import hashlib

        h = hashlib.sha256()
        for p in self.model.parameters():
            if p.requires_grad:
                h.update(p.detach().cpu().numpy().tobytes())
        hashes = self.dist.gather([(self.buffer.fingerprint(), h.hexdigest())])
        if len(set(hashes)) > 1:
            raise RuntimeError(f"data-parallel replicas diverged at step {self.step}: {hashes}")
        return {"replicas/buffer_hash": hashes[0][0], "replicas/param_hash": hashes[0][1],
                "replicas/count": float(len(hashes))}

    # ------------------------------------------------------------------ pieces of a step
    def _prompt_ids(self, question: Question) -> list[int]:
        ids = self._prompt_cache.get(question.id)
        if ids is None:
            d = self.config.data
            text = render_prompt(self.tokenizer, question.messages, remove_system=d.remove_system,
                                 system_prompt=d.system_prompt, think_prefix=d.think_prefix)
            ids = self._prompt_cache[question.id] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    @torch.no_grad()
    def _select_replays(self, question_ids: list[str], rng: np.random.Generator) -> list[Trajectory]:
        """For each question, the stored trajectory the selection rule picks under the current policy."""
        e = self.config.experience
        candidates = {qid: self.buffer.trajectories(qid) for qid in question_ids}
        if e.selection_metric == "random":
            return [cands[select_index(None, len(cands), "random", e.selection_mode, rng)]
                    for cands in candidates.values()]
        flat = [(qid, i) for qid, cands in candidates.items() for i in range(len(cands))]
        mine = shard(flat, self.dist)  # each rank scores a shard of the candidates
        scores = []
        self.model.eval()
        for start in range(0, len(mine), e.selection_batch_size):
            chunk = mine[start : start + e.selection_batch_size]
            batch = self._pack([(self._prompt_ids(self.pool.questions[qid]),
                                 Member(candidates[qid][i].token_ids.tolist())) for qid, i in chunk])
            logp, entropy = self._token_logps(self.model, batch, with_entropy=e.selection_metric != "perplexity")
            values = logp if e.selection_metric == "perplexity" else entropy
            scores += trajectory_scores(values, batch["completion_mask"], e.selection_metric).cpu().tolist()
        self.model.train()
        scores = torch.tensor(self.dist.gather(scores))
        chosen, cursor = [], 0
        for qid, cands in candidates.items():
            q_scores = scores[cursor : cursor + len(cands)]
            cursor += len(cands)
            chosen.append(cands[select_index(q_scores, len(cands), e.selection_metric, e.selection_mode, rng)])
        return chosen

    def _rewards(self, groups: list[Group]) -> np.ndarray:
        prompts, completions, completion_ids, columns = [], [], [], {"answer": []}
        extra_keys = sorted({k for g in groups for k in g.question.columns} - {"answer"})
        for k in extra_keys:
            columns[k] = []
        for g in groups:
            prompt_text = self.tokenizer.decode(g.prompt_ids, skip_special_tokens=False)
            for m in g.members:
                prompts.append(prompt_text)
                completion_ids.append(m.completion_ids)
                completions.append(self.tokenizer.decode(m.completion_ids, skip_special_tokens=True))
                columns["answer"].append(g.question.answer)
                for k in extra_keys:
                    columns[k].append(g.question.columns.get(k))
        total, _ = combine_rewards(self.reward_funcs, self.reward_weights, prompts, completions, completion_ids,
                                   columns)
        return total

    def _pack(self, sequences: list[tuple[list[int], Member]]) -> dict[str, torch.Tensor]:
        """Left-padded prompts + right-padded completions as (N, P+T) inputs, with (N, T) completion tensors."""
        pad = self.tokenizer.pad_token_id
        P = max(len(p) for p, _ in sequences)
        T = max(1, max(len(m.completion_ids) for _, m in sequences))
        N = len(sequences)
        input_ids = torch.full((N, P + T), pad, dtype=torch.long)
        attention = torch.zeros((N, P + T), dtype=torch.long)
        recorded = torch.zeros((N, T))
        replay = torch.zeros((N, T), dtype=torch.bool)
        for i, (prompt, m) in enumerate(sequences):
            ids = m.completion_ids
            input_ids[i, P - len(prompt):P] = torch.tensor(prompt)
            input_ids[i, P:P + len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[i, P - len(prompt):P + len(ids)] = 1
            if m.replay is not None:
                replay[i, :len(ids)] = True
                recorded[i, :len(ids)] = torch.from_numpy(m.replay.logprobs)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
                "completion_ids": input_ids[:, P:], "completion_mask": attention[:, P:].float(),
                "replay_mask": replay, "recorded_logp": recorded}

    def _token_logps(self, model, batch: dict, with_entropy: bool, rows: slice | torch.Tensor = slice(None)):
        """(n, T) log-probs of the completion tokens under the policy (at the rollout temperature), and entropies.

        Consecutive rows with the same prompt (a group's members, a question's stored candidates) run it once:
        its KV cache is indexed out to every row, so gradients from all of them flow back through one prompt pass.
        """
        device = self.dist.device
        input_ids, attention, positions = (batch[k][rows].to(device)
                                           for k in ("input_ids", "attention_mask", "position_ids"))
        targets = batch["completion_ids"][rows].to(device)
        T = targets.shape[1]
        P = input_ids.shape[1] - T
        prompt = torch.cat([input_ids[:, :P], attention[:, :P]], dim=1)
        new_prompt = torch.ones(len(prompt), dtype=torch.bool, device=device)
        new_prompt[1:] = (prompt[1:] != prompt[:-1]).any(-1)
        if bool(new_prompt.all()):
            out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=T + 1,
                        use_cache=False)
            logits = out.logits[:, :-1]
        else:
            firsts = new_prompt.nonzero().squeeze(-1)
            owner = new_prompt.cumsum(0) - 1  # row -> index of its prompt among firsts
            # The prompt pass goes through the bare module: a DDP wrapper allows one forward per backward, and
            # each parameter still receives a single (summed) gradient from both passes.
            bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            head = bare(
                input_ids=input_ids[firsts, :P], attention_mask=attention[firsts, :P],
                position_ids=positions[firsts, :P], use_cache=True, logits_to_keep=1)
            cache = head.past_key_values
            cache.batch_select_indices(owner)
            out = model(input_ids=targets, attention_mask=attention, position_ids=positions[:, P:],
                        past_key_values=cache, use_cache=True)
            logits = torch.cat([head.logits[owner], out.logits[:, :-1]], dim=1)
        log_probs = torch.log_softmax(logits.float() / self.config.rollout.temperature, dim=-1)
        logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
        return logp, entropy

    def _loss_settings(self, phase: str) -> LossSettings:
        o = self.config.objective
        return LossSettings(
            clip_fresh=phase == WARMUP or o.clip_after_switch, epsilon_low=o.epsilon_low, epsilon_high=o.epsilon_high,
            beta=o.beta, shaping=o.policy_shaping, aggregation=o.aggregation,
            normalizer=o.normalizer or float(self.config.rollout.max_completion_length),
            entropy_coef=o.entropy_coef, kl_coef=o.kl_coef,
        )

    def _update(self, batch: dict, advantages: torch.Tensor, phase: str, timings: dict) -> tuple[dict, torch.Tensor]:
        """M mini-batches of whole groups, gradient accumulation over micro-batches, one optimizer step each.

        Each rank works on its shard of every mini-batch's groups. Returns the averaged loss statistics and the
        pre-update log-probs of the whole batch (the behaviour log-probs to record).
        """
        c, dp = self.config, self.dist
        settings = self._loss_settings(phase)
        mask = batch["completion_mask"]
        num_groups = mask.shape[0] // self.K
        order = np.random.default_rng([c.train.seed, self.step, 2]).permutation(num_groups)
        minis = []  # (all rows of the mini-batch, this rank's rows)
        for chunk in np.array_split(order, c.train.mini_batches):
            rows = [torch.arange(g * self.K, (g + 1) * self.K) for g in chunk.tolist()]
            start, end = dp.shard_bounds(len(rows))
            minis.append((torch.cat(rows), torch.cat(rows[start:end])))
        my_rows = torch.cat([mine for _, mine in minis])
        old_logp = torch.zeros_like(mask)
        t = time.perf_counter()
        if c.train.mini_batches > 1:  # later mini-batches need the pre-update log-probs of the whole batch
            self.model.eval()
            with torch.no_grad():
                for rows in my_rows.split(c.train.micro_batch_size):
                    old_logp[rows] = self._token_logps(self.model, batch, False, rows)[0].cpu()
            self.model.train()
        timings["time/logprob"] = time.perf_counter() - t
        t = time.perf_counter()
        parts: list[dict] = []
        loss_sum = 0.0
        grad_norms = []
        self.train_model.train()
        for mini, mine in minis:
            totals = {"total_tokens": float(mask[mini].sum()), "total_sequences": float(len(mini))}
            micro = mine.split(c.train.micro_batch_size)
            for i, rows in enumerate(micro):
                # DDP all-reduces gradients on the last backward of a mini-batch only
                sync = contextlib.nullcontext() if not dp.enabled or i == len(micro) - 1 else self.train_model.no_sync()
                with sync:
                    logp, entropy = self._token_logps(self.train_model, batch, True, rows)
                    if c.train.mini_batches == 1:  # the training forward *is* the pre-update forward
                        old_logp[rows] = logp.detach().cpu()
                    recorded = torch.where(batch["replay_mask"][rows], batch["recorded_logp"][rows], old_logp[rows]) \
                        if c.experience.importance_correction else old_logp[rows]
                    device = logp.device
                    loss, stats = mixed_policy_loss(
                        logp, old_logp[rows].to(device), recorded.to(device), advantages[rows].to(device),
                        mask[rows].to(device), batch["replay_mask"][rows].to(device), settings, entropy=entropy,
                        **totals,
                    )
                    (loss * dp.world_size).backward()
                loss_sum += loss.item()
                parts.append(stats)
            grad_norms.append(self._optimizer_step())
        timings["time/update"] = time.perf_counter() - t
        gathered = dp.gather([(parts, loss_sum)])
        update_stats = merge_stats([p for ps, _ in gathered for p in ps])
        update_stats["loss"] = sum(loss for _, loss in gathered)  # as optimised: summed over micro-batches
        update_stats["grad_norm"] = float(np.mean(grad_norms))
        if dp.enabled:
            old_logp = self._gather_rows(old_logp, my_rows)
        return update_stats, old_logp

    def _gather_rows(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `values` assembled into one tensor on every rank."""
        out = values.clone()
        for index, part in self.dist.gather([(rows.tolist(), values[rows])]):
            out[index] = part
        return out

    def _optimizer_step(self) -> float:
        c = self.config.train
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm))
        if not math.isfinite(norm) or norm > c.skip_grad_norm:
            self.skipped_updates += 1
        else:
            self.optimizer.step()
            self.engine.sync_weights()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer_steps += 1
        return norm

    def _collect(self, groups: list[Group], correct: np.ndarray, batch: dict, old_logp: torch.Tensor) -> None:
        mask = batch["completion_mask"]
        row = 0
        for g, ok in zip(groups, correct):
            ids, lps = [], []
            for m in g.members:
                n = int(mask[row].sum())
                ids.append(np.asarray(m.completion_ids, dtype=np.int32))
                lps.append(old_logp[row, :n].numpy())
                row += 1
            self.buffer.update_group(g.question.id, ok.tolist(), ids, lps, step=self.step)  # ignores retired ones

    # ------------------------------------------------------------------ reporting
    def _metrics(self, groups, rewards, correct, batch, update_stats, timings, phase, n_exp, retired_now, elapsed):
        lengths = batch["completion_mask"].sum(-1)
        truncated = [m.truncated for g in groups for m in g.members if m.replay is None]
        group_std = rewards.std(axis=1)
        metrics = {
            "phase": phase,
            "phase_mixed": float(phase == MIXED),
            "reward": float(rewards.mean()),
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float((group_std == 0).mean()),
            "batch/solved": float(correct.mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(np.mean(truncated)) if truncated else 0.0,
            "learning_rate": float(self.scheduler.get_last_lr()[0]),
            "skipped_updates": float(self.skipped_updates),
            "experience/questions": float(len(self.buffer)),
            "experience/trajectories": float(self.buffer.num_trajectories),
            "experience/retired": float(len(self.pool.retired)),
            "experience/retired_this_step": float(retired_now),
            "experience/replayed": float(n_exp),
            "experience/replay_fraction": n_exp / max(len(groups), 1),
            "experience/selection_time": timings["time/selection"],
            "fresh_questions_remaining": float(self.pool.remaining),
            "time/step": elapsed,
            "tokens_per_second": float(lengths.sum()) / max(elapsed, 1e-9),
            **{f"experience/bucket_{k}": float(v) for k, v in self.buffer.bucket_histogram().items()},
            **timings,
            **update_stats,
        }
        return metrics

    def _samples(self, groups, rewards, limit: int = 4) -> list[dict]:
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

"""The learner: the trainable model, its optimizer and the update of one training step, and the model's weights as
the rest of the run reads them (full and in the compute precision for rollouts on the training model, gathered for a
push, forward passes for replay selection).

The update (spec §4.3): M mini-batches of whole groups, gradient accumulation over
micro-batches, one clipped AdamW step per mini-batch; and the pre-update log-probs that become the behaviour
log-probs of collected trajectories.

Under data parallelism each rank works on its shard of every mini-batch's groups; how the model is spread over the
ranks (one process, DDP or FSDP2: loss scale, gradient reduction, norm, full weights) is a strategy chosen once,
when the learner is built (exgrpo.learner.parallel).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from exgrpo.config import ExGRPOConfig, TrainConfig, engine_correction_cap
from exgrpo.runtime.distributed import Distributed
from exgrpo.errors import ExgrpoWarning, TrainingError
from exgrpo.learner.objective import LossSettings, MicroBatch, merge_stats, mixed_policy_loss
from exgrpo.learner.forward import PACKED, candidate_scores, packs_rows, token_logprobs
from exgrpo.runtime.sharding import decoder_layers
from exgrpo.learner.parallel import parallelism
from exgrpo.records import MIXED, WARMUP
from exgrpo.tensors import PackedBatch, TrajectoryScore
from exgrpo.runtime.timing import StageTimer



def phase_losses(config: ExGRPOConfig) -> dict[str, LossSettings]:
    """Each phase's objective (spec §4): PPO clipping of fresh tokens in the warm-up only (unless
    objective.clip_after_switch); replayed tokens' ratio to their recorded behaviour unless
    experience.importance_correction is off; the engine correction as `exgrpo.config.engine_correction_cap` says."""
    o = config.objective
    return {phase: LossSettings(
        clip_fresh=phase == WARMUP or o.clip_after_switch, epsilon_low=o.epsilon_low, epsilon_high=o.epsilon_high,
        beta=o.beta, shaping=o.policy_shaping, aggregation=o.aggregation,
        normalizer=o.normalizer or float(config.rollout.max_completion_length), entropy_coef=o.entropy_coef,
        entropy_per_micro_batch=o.loss_scale == "per_rank", guidance_gamma=config.guidance.gamma,
        importance_correction=config.experience.importance_correction, tis_cap=engine_correction_cap(config),
    ) for phase in (WARMUP, MIXED)}


def plan_micro_batches(rows: torch.Tensor, prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor,
                       max_rows: int, max_tokens: int | None) -> list[torch.Tensor]:
    """Split `rows` into micro-batches of at most `max_rows` rows and, with `max_tokens`, at most that many
    padded tokens (rows x (widest prompt + longest completion) among them). Under a token budget, rows are taken
    longest first, so long and short rows do not share a micro-batch; a single row above the budget gets its own.
    Without one, rows keep their order.

    Args:
        rows: (n,) row indices; prompt_lengths, completion_lengths: (N,) of every row of the batch.
    """
    if len(rows) == 0:
        return []
    if max_tokens is None:
        return list(rows.split(max_rows))
    order = sorted(rows.tolist(), key=lambda r: -int(prompt_lengths[r] + completion_lengths[r]))
    micro, out, width_p, width_t = [], [], 0, 0
    for r in order:
        p, t = int(prompt_lengths[r]), int(completion_lengths[r])
        if micro and (len(micro) == max_rows or (len(micro) + 1) * (max(width_p, p) + max(width_t, t)) > max_tokens):
            out.append(torch.tensor(micro))
            micro, width_p, width_t = [], 0, 0
        micro.append(r)
        width_p, width_t = max(width_p, p), max(width_t, t)
    if micro:
        out.append(torch.tensor(micro))
    return out


@dataclass
class UpdateResult:
    stats: dict[str, float]  # merged loss statistics, `loss` (summed over micro-batches) and mean `grad_norm`
    old_logp: torch.Tensor  # (N, T) pre-update log-probs of every row: what collection stores as behaviour log-probs
    token_entropy: torch.Tensor  # (N, T) token entropies from the training forward passes (0 off completions)


@dataclass(frozen=True)
class _Update:
    """One update's inputs, as its micro-steps read them."""
    batch: PackedBatch  # N rows
    advantages: torch.Tensor  # (N,)
    settings: LossSettings  # the phase's objective
    old_logp: torch.Tensor | None  # (N, T) pre-update log-probs; None: each training forward is that pass
    timer: StageTimer


@dataclass(frozen=True)
class _MicroResult:
    """What one micro-batch's forward and backward give: its loss, statistics and per-token values, on the CPU."""
    rows: torch.Tensor  # (B,) rows of the batch
    loss: float
    stats: dict[str, float]
    old_logp: torch.Tensor  # (B, T) pre-update log-probs
    entropy: torch.Tensor  # (B, T) token entropies of the training forward


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (transformers' gradient checkpointing)."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def warn_if_bf16_is_slow_here(model: torch.nn.Module) -> None:
    """bf16 pays on a CPU with AMX tiles, which multiply bf16 matrices several times faster than fp32 ones; without
    them (avx512_bf16 alone) bf16 products are the slower ones, and a bf16 update of SmolLM2-135M took 1.4-1.75x as
    long as an fp32 one (docs/benchmarks.md): say so rather than let `train.dtype=bf16` quietly slow the run."""
    if next(model.parameters()).device.type == "cpu" and not torch.cpu._is_amx_tile_supported():
        warnings.warn(ExgrpoWarning("train.dtype=bf16 on a CPU without AMX: bf16 matrix products are slower than "
                                    "fp32 ones here, so training runs slower than with train.dtype=fp32"),
                      stacklevel=3)


def store_frozen_linear_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen Linear weights (a LoRA base) in `dtype` for good; returns how many were cast.

    Under bf16 autocast every use of a frozen fp32 weight casts it again (autocast caches only the casts of weights
    that require grad): in every forward of every micro-batch and at every decode step of a rollout. Stored in bf16,
    the matmuls see the same values (autocast rounds to the same dtype the same way) and nothing is cast. Weights
    shared with an embedding are left alone: the lookup would then return `dtype` activations, which autocast does
    not do. The trainable weights and their optimizer state stay in fp32.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    frozen = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
              and m.weight.dtype != dtype and id(m.weight) not in embeddings]
    for w in frozen:
        w.data = w.data.to(dtype)
    return len(frozen)


def _at_rows(batch: PackedBatch, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(N, T) per-token values of the batch from (rows, (B, T) values) pieces; 0 on rows no piece has."""
    out = torch.zeros_like(batch.completion_mask)
    for rows, values in pieces:
        out[rows] = values
    return out


SKIPPED_STEP_COUNTERS = ("skipped_optimizer_steps", "skipped_zero_advantage_steps")
COUNTERS = ("optimizer_steps", *SKIPPED_STEP_COUNTERS)
"""The learner's step counters, saved with its optimizer state."""


def compile_decoder_layers(model) -> None:
    """train.compile: each decoder layer compiled in place (dynamic shapes), so a wrapper calls the compiled layers
    and their weights keep their names."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"train.compile: {type(model).__name__} names no decoder-layer class (_no_split_modules) "
                         "to compile")
    for layer in layers:
        layer.compile(dynamic=True)


class Learner:
    """Owns the (sharded or replicated) trainable model, its optimizer and scheduler; applies one step's update
    (`__call__`) and counts it in `weights_version`.

    Args:
        model: the policy (possibly peft-wrapped); its trainable parameters are optimised. With FSDP it is
            sharded in place here, before the optimizer is built.
        train: optimizer, schedule, batching, precision, sharding and clipping settings.
        num_generations: K; mini-batches hold whole groups of K consecutive rows.
        temperature: the rollout temperature (log-probs are those of the sampling distribution).
        dist: the data-parallel context.
        losses: each phase's objective (`phase_losses`), keyed by phase.
        loss_scale: "global" or "per_rank" (see `exgrpo.learner.parallel`).
    """

    @classmethod
    def from_config(cls, model, config: ExGRPOConfig, dist: Distributed) -> "Learner":
        """The learner a run's config describes: train.*, K and temperature of rollout.*, each phase's objective
        (`phase_losses`) and objective.loss_scale."""
        return cls(model, config.train, config.rollout.num_generations, config.rollout.temperature, dist,
                   phase_losses(config), loss_scale=config.objective.loss_scale)

    def __init__(self, model, train: TrainConfig, num_generations: int, temperature: float, dist: Distributed,
                 losses: dict[str, LossSettings], loss_scale: str = "global"):
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters")
        per_mini_batch = train.prompts_per_step // train.mini_batches
        if per_mini_batch < dist.world_size:
            raise ValueError(f"train.prompts_per_step / train.mini_batches = {per_mini_batch} questions per "
                             f"mini-batch cannot be shared by {dist.world_size} data-parallel ranks")
        self.model, self.train, self.K, self.temperature, self.dist = model, train, num_generations, temperature, dist
        self.losses = losses
        if train.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.parallel = parallelism(model, train, dist, loss_scale)
        if train.compile:
            compile_decoder_layers(model)
        self.train_model = self.parallel.train_model
        self._autocast = train.dtype == "bf16" and not self.parallel.casts_parameters
        if self._autocast:
            store_frozen_linear_weights(model, torch.bfloat16)
            warn_if_bf16_is_slow_here(model)
        # rows that share a prompt are packed after it where the model allows (no padding, one forward); else they
        # share its KV cache, which activation checkpointing turns off
        self.prompt_sharing = PACKED if packs_rows(model) else \
            "never" if train.activation_checkpointing else self.parallel.prompt_sharing
        # with dropout, the training forward is not the sampling policy: behaviour log-probs need their own pass
        self.separate_behaviour_pass = train.mini_batches > 1 or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=train.learning_rate, weight_decay=train.weight_decay,
                                           betas=(train.adam_beta1, train.adam_beta2))
        from transformers import get_scheduler

        self.scheduler = get_scheduler(train.lr_scheduler, self.optimizer, num_warmup_steps=train.warmup_steps,
                                       num_training_steps=train.steps * train.mini_batches)
        self.optimizer_steps = 0
        self.skipped_optimizer_steps = 0
        self.skipped_zero_advantage_steps = 0  # train.zero_advantage_steps=skip; not bounded like the above

    @property
    def weights_version(self) -> int:
        """The optimizer steps applied to the weights so far (skipped ones change nothing)."""
        return self.optimizer_steps - self.skipped_optimizer_steps - self.skipped_zero_advantage_steps

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @property
    def replica(self) -> torch.nn.Module | None:
        """The model as every rank holds it, to compare across ranks; None when each rank holds a shard."""
        return None if self.parallel.shards_weights else self.model

    def checkpoint_weights(self) -> dict | None:
        """The full weights a checkpoint writes, gathered (every rank must call it); None: the model's own."""
        return self.parallel.checkpoint_weights()

    def full_weights(self):
        """A context for forward passes that ranks run different numbers of times (generation, scoring)."""
        return self.parallel.full_weights()

    @contextlib.contextmanager
    def rollout_weights(self):
        """The context to sample in with the training model: its full weights, in the compute precision."""
        with self.full_weights(), self.compute_precision():
            yield

    def compute_precision(self):
        """A context in which forward passes run in the training precision (bf16 autocast over fp32 weights)."""
        return torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self._autocast)

    def logprobs(self, model, batch: PackedBatch, rows: torch.Tensor | slice, with_entropy: bool):
        """`token_logprobs` with this run's precision, chunking and prompt sharing."""
        with self.compute_precision():
            return token_logprobs(model, batch, self.temperature, rows, with_entropy, device=self.dist.device,
                                  chunk_tokens=self.train.logprob_chunk_tokens, prompt_sharing=self.prompt_sharing)

    def selection_scores(self, candidates: list[tuple[list[int], list[int]]], metric: TrajectoryScore, pad_id: int,
                         batch_size: int) -> list[float]:
        """Replay-selection scores of (prompt ids, trajectory ids) pairs under the current policy (eval mode: no
        dropout), in no-grad passes of `batch_size` candidates (see `exgrpo.learner.forward.candidate_scores`)."""
        was_training = self.model.training
        self.model.eval()
        with self.full_weights():
            scores = candidate_scores(lambda batch, entropy: self.logprobs(self.model, batch, slice(None), entropy),
                                      candidates, metric, pad_id, batch_size)
        self.model.train(was_training)
        return scores

    def __call__(self, batch: PackedBatch, advantages: torch.Tensor, phase: str, rng: np.random.Generator,
                 timer: StageTimer) -> UpdateResult:
        """Update on `batch` (N = G*K rows, groups in order) with (N,) `advantages` by the objective of `phase`;
        `rng` splits the groups into mini-batches."""
        if phase not in self.losses:
            raise ValueError(f"the learner has no objective for the {phase} phase (it was given {sorted(self.losses)})")
        minis = self._mini_batches(len(batch) // self.K, rng)
        my_rows = torch.cat([mine for _, mine in minis])
        with timer("logprob"):
            old_logp = self._pre_update_logprobs(batch, my_rows) if self.separate_behaviour_pass else None
        update = _Update(batch, advantages, self.losses[phase], old_logp, timer)
        results, loss_sum, grad_norms, zero_advantage = [], 0.0, [], 0
        with timer("update"):
            self.train_model.train()
            for mini, mine in minis:
                micro_results = self._accumulate(update, mini, mine)
                results += micro_results
                loss_sum += sum(r.loss for r in micro_results)
                has_signal = bool(advantages[mini].any())
                zero_advantage += not has_signal
                with timer("optimizer"):
                    grad_norms.append(self._optimizer_step(has_signal))
        gathered_parts = self.dist.gather([([r.stats for r in results], loss_sum)])
        stats = merge_stats([p for ps, _ in gathered_parts for p in ps])
        stats["loss"] = sum(loss for _, loss in gathered_parts)  # as optimised: summed over micro-batches
        stats["grad_norm"] = float(np.mean(grad_norms))
        stats["zero_advantage_steps"] = float(zero_advantage)
        if old_logp is None:
            old_logp = _at_rows(batch, [(r.rows, r.old_logp) for r in results])
        entropy = _at_rows(batch, [(r.rows, r.entropy) for r in results])
        return UpdateResult(stats, self.parallel.assemble_rows(old_logp, my_rows),
                            self.parallel.assemble_rows(entropy, my_rows))

    def _mini_batches(self, num_groups: int, rng: np.random.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(all rows of the mini-batch, this rank's rows) for each of the M mini-batches of shuffled groups; fewer
        mini-batches when fewer than M groups are left. A rank's share may be empty (fewer groups than ranks)."""
        minis = []
        for chunk in np.array_split(rng.permutation(num_groups), self.train.mini_batches):
            if len(chunk) == 0:
                continue
            rows = [torch.arange(g * self.K, (g + 1) * self.K) for g in chunk.tolist()]
            start, end = self.dist.shard_bounds(len(rows))
            mine = torch.cat(rows[start:end]) if end > start else torch.empty(0, dtype=torch.long)
            minis.append((torch.cat(rows), mine))
        return minis

    def _micro_batches(self, batch: PackedBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        T = batch.completion_ids.shape[1]
        prompt_lengths = batch.attention_mask[:, :-T].sum(-1)
        completion_lengths = batch.completion_mask.sum(-1)
        return plan_micro_batches(rows, prompt_lengths, completion_lengths, self.train.micro_batch_size,
                                  self.train.max_tokens_per_micro_batch)

    def _pre_update_logprobs(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        """(N, T), filled on `rows`, from a no-grad pass in eval mode (the sampling policy: no dropout): later
        mini-batches need the pre-update log-probs of the whole batch, and with dropout the training forward is not
        the sampling policy."""
        old_logp = torch.zeros_like(batch.completion_mask)
        self.model.eval()
        with torch.no_grad(), self.full_weights():
            for micro in self._micro_batches(batch, rows):
                old_logp[micro] = self.logprobs(self.model, batch, micro, with_entropy=False)[0].cpu()
        self.model.train()
        return old_logp

    def _accumulate(self, update: _Update, mini: torch.Tensor, mine: torch.Tensor) -> list[_MicroResult]:
        """Forward/backward over this rank's rows `mine` of one mini-batch `mini`; gradients accumulate exactly.

        Every rank runs the same number of backward passes where the collectives need it (FSDP: each pass;
        DDP: one), padding with passes over a row of the mini-batch whose loss is multiplied by zero.
        """
        totals = {"total_tokens": float(update.batch.completion_mask[mini].sum()), "total_sequences": float(len(mini))}
        micro_batches = self._micro_batches(update.batch, mine)
        passes = self.parallel.backward_passes(len(micro_batches))
        results = []
        for i in range(passes):
            with self.parallel.gradient_sync(last=i == passes - 1):
                if i < len(micro_batches):
                    results.append(self._micro_step(update, micro_batches[i], totals))
                else:  # padding pass: joins the collectives, adds nothing
                    logp = self.logprobs(self.train_model, update.batch, mini[:1], with_entropy=False)[0]
                    logp.sum().mul(0.0).backward()
        return results

    def _micro_step(self, update: _Update, rows: torch.Tensor, totals: dict[str, float]) -> _MicroResult:
        """Forward and backward of one micro-batch: `rows` of the batch, `totals` those of its mini-batch."""
        with update.timer("forward"):
            logp, entropy = self.logprobs(self.train_model, update.batch, rows, with_entropy=True)
        micro = MicroBatch.of(update.batch, rows, update.advantages, logp.device, **totals)
        # without a separate behaviour pass this forward is the pre-update policy's
        old_logp = logp.detach() if update.old_logp is None else update.old_logp[rows].to(logp.device)
        loss, stats = mixed_policy_loss(logp, old_logp, micro, update.settings, entropy)
        if not torch.isfinite(loss):
            raise TrainingError(f"the loss is not finite ({loss.item()}); the update is not applied and "
                                "the last checkpoint is the last good state")
        (loss * self.parallel.loss_multiplier).backward()
        return _MicroResult(rows, loss.item(), stats, old_logp.cpu(), entropy.detach().float().cpu())

    def _optimizer_step(self, has_signal: bool) -> float:
        """Applies the accumulated gradients unless skipped; `has_signal`: some advantage of the mini-batch is not 0.
        A skipped step still advances the learning-rate schedule (the schedule counts optimizer steps planned)."""
        norm = self.parallel.clip_gradients(self.params, self.train.max_grad_norm)
        applied = math.isfinite(norm) and norm <= self.train.skip_grad_norm
        stepped = False
        if not has_signal and self.train.zero_advantage_steps == "skip":
            self.skipped_zero_advantage_steps += 1
        elif not applied:
            self.skipped_optimizer_steps += 1
            if self.skipped_optimizer_steps > self.train.max_skipped_optimizer_steps:
                raise TrainingError(f"{self.skipped_optimizer_steps} optimizer steps skipped (gradient norm {norm:g}: "
                                    f"non-finite or above train.skip_grad_norm {self.train.skip_grad_norm:g}), more "
                                    f"than train.max_skipped_optimizer_steps {self.train.max_skipped_optimizer_steps}")
        else:
            self.optimizer.step()
            stepped = True
            if not self.parallel.all_finite(self.params):
                raise TrainingError(f"the weights are not finite after an optimizer step (learning rate "
                                    f"{self.learning_rate:g}); the last checkpoint is the last good state")
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            if not stepped:  # torch warns of a schedule stepped before the optimizer: here that is the intent
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.optimizer_steps += 1
        return norm

    def state_dict(self) -> dict:
        """Optimizer state keyed by parameter name (independent of sharding), scheduler, counters. Every rank
        must call it under FSDP."""
        return {"optimizer": self.parallel.optimizer_state(self.optimizer), "scheduler": self.scheduler.state_dict(),
                **{name: getattr(self, name) for name in COUNTERS}}

    def load_state_dict(self, state: dict) -> None:
        self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        for name in COUNTERS:
            setattr(self, name, state[name])

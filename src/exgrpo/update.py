"""The policy update of one training step (spec §4.3): M mini-batches of whole groups, gradient accumulation over
micro-batches, one clipped AdamW step per mini-batch; and the pre-update log-probs that become the behaviour
log-probs of collected trajectories.

Under data parallelism each rank works on its shard of every mini-batch's groups; DDP averages gradients and the
loss is scaled by the world size, so the update equals the one-process one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from exgrpo.config import ObjectiveConfig, TrainConfig
from exgrpo.distributed import Distributed
from exgrpo.errors import TrainingError
from exgrpo.timing import StageTimer
from exgrpo.objective import LossSettings, merge_stats, mixed_policy_loss
from exgrpo.policy import PackedBatch, token_logprobs

WARMUP, MIXED = "warmup", "mixed"


def loss_settings(objective: ObjectiveConfig, max_completion_length: int, phase: str) -> LossSettings:
    """The objective of a phase: PPO clipping of fresh tokens in the warm-up only (unless clip_after_switch)."""
    o = objective
    return LossSettings(
        clip_fresh=phase == WARMUP or o.clip_after_switch, epsilon_low=o.epsilon_low, epsilon_high=o.epsilon_high,
        beta=o.beta, shaping=o.policy_shaping, aggregation=o.aggregation,
        normalizer=o.normalizer or float(max_completion_length), entropy_coef=o.entropy_coef,
    )


@dataclass
class UpdateResult:
    stats: dict[str, float]  # merged loss statistics, `loss` (summed over micro-batches) and mean `grad_norm`
    behaviour_logp: torch.Tensor  # (N, T) pre-update log-probs of every row of the batch


class PolicyUpdate:
    """Owns the optimizer and scheduler of the trainable parameters and applies one step's update.

    Args:
        model: the policy (possibly peft-wrapped); its trainable parameters are optimised.
        train: optimizer, schedule, mini/micro-batch and clipping settings.
        group_size: K; mini-batches hold whole groups of K consecutive rows.
        temperature: the rollout temperature (log-probs are those of the sampling distribution).
        dist: the data-parallel context.
        on_optimizer_step: called after every applied optimizer step (e.g. an engine reloading weights).
    """

    def __init__(self, model, train: TrainConfig, group_size: int, temperature: float, dist: Distributed,
                 on_optimizer_step: Callable[[], None] = lambda: None):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self.model, self.train, self.K, self.temperature, self.dist = model, train, group_size, temperature, dist
        self.on_optimizer_step = on_optimizer_step
        self.train_model = torch.nn.parallel.DistributedDataParallel(model) if dist.enabled else model
        self.optimizer = torch.optim.AdamW(params, lr=train.learning_rate, weight_decay=train.weight_decay,
                                           betas=(train.adam_beta1, train.adam_beta2))
        from transformers import get_scheduler

        self.scheduler = get_scheduler(train.lr_scheduler, self.optimizer, num_warmup_steps=train.warmup_steps,
                                       num_training_steps=train.steps * train.mini_batches)
        self.optimizer_steps = 0
        self.skipped_updates = 0

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def __call__(self, batch: PackedBatch, advantages: torch.Tensor, settings: LossSettings,
                 importance_correction: bool, rng: np.random.Generator, timer: StageTimer) -> UpdateResult:
        """Update on `batch` (N = G*K rows, groups in order) with (N,) `advantages`; `rng` splits the groups into
        mini-batches. Replayed tokens' ratio is against their recorded log-probs when `importance_correction`."""
        minis = self._mini_batches(len(batch) // self.K, rng)
        my_rows = torch.cat([mine for _, mine in minis])
        with timer("logprob"):
            old_logp = self._pre_update_logprobs(batch, my_rows)
        with timer("update"):
            parts, loss_sum, grad_norms = [], 0.0, []
            self.train_model.train()
            for mini, mine in minis:
                loss, stats = self._accumulate(batch, advantages, settings, importance_correction, old_logp, mini,
                                               mine, timer)
                loss_sum += loss
                parts += stats
                with timer("optimizer"):
                    grad_norms.append(self._optimizer_step())
        gathered = self.dist.gather([(parts, loss_sum)])
        stats = merge_stats([p for ps, _ in gathered for p in ps])
        stats["loss"] = sum(loss for _, loss in gathered)  # as optimised: summed over micro-batches
        stats["grad_norm"] = float(np.mean(grad_norms))
        if self.dist.enabled:
            old_logp = self._gather_rows(old_logp, my_rows)
        return UpdateResult(stats, old_logp)

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

    def _pre_update_logprobs(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        """(N, T), filled on `rows`. With one mini-batch the training forward is the pre-update forward, so this
        pass is skipped and `_accumulate` fills them in."""
        old_logp = torch.zeros_like(batch.completion_mask)
        if self.train.mini_batches > 1:  # later mini-batches need the pre-update log-probs of the whole batch
            self.model.eval()
            with torch.no_grad():
                for micro in rows.split(self.train.micro_batch_size):
                    old_logp[micro] = self._logprobs(self.model, batch, micro, with_entropy=False)[0].cpu()
            self.model.train()
        return old_logp

    def _logprobs(self, model, batch: PackedBatch, rows: torch.Tensor, with_entropy: bool):
        return token_logprobs(model, batch, self.temperature, rows, with_entropy, device=self.dist.device)

    def _accumulate(self, batch: PackedBatch, advantages: torch.Tensor, settings: LossSettings,
                    importance_correction: bool, old_logp: torch.Tensor, mini: torch.Tensor, mine: torch.Tensor,
                    timer: StageTimer) -> tuple[float, list[dict]]:
        """Forward/backward over this rank's micro-batches of one mini-batch; gradients accumulate exactly."""
        mask = batch.completion_mask
        totals = {"total_tokens": float(mask[mini].sum()), "total_sequences": float(len(mini))}
        if len(mine) == 0:  # other ranks hold this mini-batch's groups; join DDP's gradient all-reduce anyway
            logp, _ = self._logprobs(self.train_model, batch, mini[:1], with_entropy=False)
            (logp.sum() * 0.0).backward()
            return 0.0, []
        micro_batches = mine.split(self.train.micro_batch_size)
        loss_sum, parts = 0.0, []
        for i, rows in enumerate(micro_batches):
            last = i == len(micro_batches) - 1  # DDP all-reduces gradients on the last backward of a mini-batch
            sync = contextlib.nullcontext() if not self.dist.enabled or last else self.train_model.no_sync()
            with sync:
                with timer("forward"):
                    logp, entropy = self._logprobs(self.train_model, batch, rows, with_entropy=True)
                if self.train.mini_batches == 1:
                    old_logp[rows] = logp.detach().cpu()
                recorded = torch.where(batch.replay_mask[rows], batch.recorded_logp[rows], old_logp[rows]) \
                    if importance_correction else old_logp[rows]
                device = logp.device
                loss, stats = mixed_policy_loss(
                    logp, old_logp[rows].to(device), recorded.to(device), advantages[rows].to(device),
                    mask[rows].to(device), batch.replay_mask[rows].to(device), settings, entropy=entropy, **totals)
                if not torch.isfinite(loss):
                    raise TrainingError(f"the loss is not finite ({loss.item()}); the update is not applied and "
                                        "the last checkpoint is the last good state")
                (loss * self.dist.world_size).backward()
            loss_sum += loss.item()
            parts.append(stats)
        return loss_sum, parts

    def _optimizer_step(self) -> float:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm))
        if not math.isfinite(norm) or norm > self.train.skip_grad_norm:
            self.skipped_updates += 1
            if self.skipped_updates > self.train.max_skipped_updates:
                raise TrainingError(f"{self.skipped_updates} optimizer steps skipped (gradient norm {norm:g}: "
                                    f"non-finite or above train.skip_grad_norm {self.train.skip_grad_norm:g}), more "
                                    f"than train.max_skipped_updates {self.train.max_skipped_updates}")
        else:
            self.optimizer.step()
            if not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):  # one device sync
                raise TrainingError(f"the weights are not finite after an optimizer step (learning rate "
                                    f"{self.learning_rate:g}); the last checkpoint is the last good state")
            self.on_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer_steps += 1
        return norm

    def _gather_rows(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `values` assembled into one tensor on every rank."""
        out = values.clone()
        for index, part in self.dist.gather([(rows.tolist(), values[rows])]):
            out[index] = part
        return out

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps, "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps, self.skipped_updates = state["optimizer_steps"], state["skipped_updates"]

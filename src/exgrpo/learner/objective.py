"""The ExGRPO objective as pure functions over tensors (spec §4).

Shapes: G groups of K members; B sequences (B = G*K in a full batch, any subset in a mini-batch); T the padded
completion length. ``mask`` is 1 on a sequence's completion tokens; ``replay_mask`` is 1 on replayed tokens.

Per token:
* fresh tokens, warm-up phase:  -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A),  r = exp(logp - old_logp)
* fresh tokens, mixed phase:    -A*r  (unclipped, as released; ``clip_fresh=True`` keeps PPO clipping)
* replayed tokens:              -A*f(w),  f(w) = w / (w + beta),  w = exp(logp - recorded_logp), never clipped
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from exgrpo.config.schema import Aggregation, ScaleRewards
from exgrpo.tensors import PackedBatch

#: objective.scale_rewards: (centred R - mean, rewards R, eps) -> advantages, both (G, K)
ADVANTAGE_SCALES: dict[ScaleRewards, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "none": lambda centred, rewards, eps: centred,  # released default
    "group": lambda centred, rewards, eps: centred / (rewards.std(dim=1, keepdim=True) + eps),
}


def group_advantages(rewards: torch.Tensor, scale: ScaleRewards = "none", eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: (G, K) rewards of G groups of K members.
        scale: "none" gives R - mean (released default); "group" gives (R - mean) / (std + eps).
    Returns:
        (G, K) advantages; a group whose rewards are all equal gets 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (num_groups, K), got shape {tuple(rewards.shape)}")
    return ADVANTAGE_SCALES[scale](rewards - rewards.mean(dim=1, keepdim=True), rewards, eps)


def policy_shaping(w: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """f(w) = w / (w + beta): damps large importance weights and lifts small ones (spec §4.2)."""
    return w / (w + beta)


def truncated_importance_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, engine_mask: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """(B, T) min(pi_old / pi_engine, cap) where the engine sampled the token (1 elsewhere), detached: the
    correction of a rollout engine whose distribution differs slightly from the trainer's (truncated IS)."""
    w = torch.exp(old_logp - engine_logp).clamp(max=cap)
    return torch.where(engine_mask, w, torch.ones_like(w)).detach()


@torch.no_grad()
def importance_weight_stats(weights: torch.Tensor, mask: torch.Tensor, cap: float) -> dict[str, float]:
    """tis/ess, the normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1], and tis/truncated_fraction,
    the share of weights at the cap, over the (B, T) `weights` where `mask` (none there: no statistics)."""
    w = weights[mask.bool()].double()  # in fp32, weights all within 1e-7 of 1 can give an ESS above 1
    if not len(w):
        return {}
    return {"tis/ess": min(1.0, float(w.sum() ** 2 / (len(w) * (w ** 2).sum()))),
            "tis/truncated_fraction": float((w >= cap).float().mean())}


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class LossSettings:
    clip_fresh: bool = True  # PPO clipping of fresh tokens (the trainer turns it off in the mixed phase)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.1  # policy-shaping constant; None-like behaviour is `shaping=False`
    shaping: bool = True  # False replays with the plain ratio w (ablation)
    aggregation: Aggregation = "sum_constant"
    normalizer: float = 8192.0  # the constant of "sum_constant" (released: max completion length)
    entropy_coef: float = 0.001
    entropy_per_micro_batch: bool = False  # the bonus over each micro-batch's own tokens, summed (released)
    guidance_gamma: float = 0.1  # shaping constant of demonstration tokens: f(pi) = pi / (pi + gamma)
    importance_correction: bool = True  # replayed tokens' ratio to their recorded behaviour (else the pre-update)
    tis_cap: float | None = None  # fresh tokens weighted by min(pi_old / pi_engine, tis_cap); None: no correction


@dataclass(frozen=True)
class MicroBatch:
    """What the loss reads of B sequences besides the policy's log-probs (T completion positions).

    advantages: (B,) one per sequence. mask: (B, T) 1 on completion tokens. replay_mask: (B, T) bool, True on
    replayed tokens (a subset of mask). recorded_logp: (B, T) behaviour log-probs recorded at collection (read on
    replayed tokens). engine_logp, engine_mask: (B, T) the rollout engine's log-probs of the tokens it sampled and
    where it reported them, or None. demonstration_mask: (B, T) external demonstrations' tokens (see
    `token_losses`), or None. total_tokens, total_sequences: the whole mini-batch's when this is one micro-batch of
    it (None: its own), so that accumulated gradients equal the unsplit ones.
    """

    advantages: torch.Tensor
    mask: torch.Tensor
    replay_mask: torch.Tensor
    recorded_logp: torch.Tensor
    engine_logp: torch.Tensor | None = None
    engine_mask: torch.Tensor | None = None
    demonstration_mask: torch.Tensor | None = None
    total_tokens: float | None = None
    total_sequences: float | None = None

    @classmethod
    def of(cls, batch: PackedBatch, rows: torch.Tensor, advantages: torch.Tensor, device: torch.device,
           total_tokens: float | None = None, total_sequences: float | None = None) -> "MicroBatch":
        """`rows` of a packed batch with their (N,) `advantages`, sliced once onto `device`."""
        def mine(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows].to(device)

        return cls(mine(advantages), mine(batch.completion_mask), mine(batch.replay_mask), mine(batch.recorded_logp),
                   mine(batch.engine_logp), mine(batch.engine_mask), mine(batch.demonstration_mask),
                   total_tokens, total_sequences)


def token_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    recorded_logp: torch.Tensor,
    advantages: torch.Tensor,
    replay_mask: torch.Tensor,
    settings: LossSettings,
    demonstration_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy-gradient losses (B, T) and the per-token quantities behind them.

    Args:
        logp: (B, T) log-probs of the taken tokens under the policy being optimised.
        old_logp: (B, T) log-probs under the policy before this step's update (fresh tokens' ratio).
        recorded_logp: (B, T) behaviour log-probs recorded at collection (replayed tokens' ratio).
        advantages: (B,) one advantage per sequence.
        replay_mask: (B, T) bool, True on replayed tokens.
        demonstration_mask: (B, T) bool, True on external demonstrations' tokens (a subset of replay_mask): no
            behaviour probability exists, so they are weighted by LUFFY's f(pi) = pi / (pi + gamma) instead.
    """
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    if settings.clip_fresh:
        clipped = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
        fresh = -torch.min(ratio * adv, clipped * adv)
    else:
        fresh = -ratio * adv
    w = torch.exp(logp - recorded_logp)
    shaped = policy_shaping(w, settings.beta) if settings.shaping else w
    if demonstration_mask is not None:
        shaped = torch.where(demonstration_mask, policy_shaping(torch.exp(logp), settings.guidance_gamma), shaped)
    replay = -shaped * adv
    losses = torch.where(replay_mask, replay, fresh)
    return losses, {"ratio": ratio, "w": w, "shaped": shaped}


def _sum_constant(values, mask, settings, total_tokens, total_sequences) -> torch.Tensor:
    """sum / normalizer (Dr.GRPO-style, released default; micro-batch results add up exactly)."""
    return (values * mask).sum() / settings.normalizer


def _token_mean(values, mask, settings, total_tokens, total_sequences) -> torch.Tensor:
    """sum / total_tokens."""
    denominator = mask.sum() if total_tokens is None else total_tokens
    return (values * mask).sum() / max(float(denominator), 1.0)


def _seq_mean_token_mean(values, mask, settings, total_tokens, total_sequences) -> torch.Tensor:
    """Sum of per-sequence token means / total_sequences."""
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    denominator = mask.shape[0] if total_sequences is None else total_sequences
    return per_seq.sum() / max(float(denominator), 1.0)


#: objective.aggregation: (values, mask, settings, total_tokens, total_sequences) -> scalar
AGGREGATIONS: dict[Aggregation, Callable[..., torch.Tensor]] = {
    "sum_constant": _sum_constant, "token_mean": _token_mean, "seq_mean_token_mean": _seq_mean_token_mean,
}


def aggregate(
    token_values: torch.Tensor, mask: torch.Tensor, settings: LossSettings,
    total_tokens: float | None = None, total_sequences: float | None = None,
) -> torch.Tensor:
    """Reduce (B, T) token values to a scalar by `settings.aggregation` (see `AGGREGATIONS`).

    total_tokens / total_sequences are those of the whole mini-batch when it is split into micro-batches for
    gradient accumulation (default: this batch's), so that accumulated gradients equal the unsplit ones.
    """
    reduce = AGGREGATIONS[settings.aggregation]
    return reduce(token_values, mask.to(token_values.dtype), settings, total_tokens, total_sequences)


def mixed_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, micro: MicroBatch, settings: LossSettings,
                      entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The ExGRPO loss of a micro-batch (B sequences, T completion positions) and detached statistics:

        L = agg_t( where(replayed, -A f(w), -A r) * tis ) - entropy_coef * token-mean entropy

    with r the fresh tokens' ratio to the pre-update policy (PPO-clipped when `settings.clip_fresh`), w the replayed
    tokens' ratio to their recorded behaviour policy (`token_losses`), tis the engine correction of fresh tokens.

    Args:
        logp: (B, T) log-probs of the taken tokens under the policy being optimised.
        old_logp: (B, T) log-probs under the policy before this step's update.
        entropy: (B, T) current-policy token entropies, for the bonus; the bonus is a token mean over the whole
            mini-batch, or with `entropy_per_micro_batch` over this micro-batch's tokens (so micro-batch bonuses add
            up, as released: spec §4.3).
    Returns:
        (loss scalar with grad, stats of plain floats).
    """
    mask = micro.mask.to(logp.dtype)
    replay_mask = micro.replay_mask.bool() & mask.bool()
    # replayed tokens' ratio is to the policy that sampled them, or (ablation) to the pre-update one
    recorded = torch.where(micro.replay_mask.bool(), micro.recorded_logp, old_logp) if settings.importance_correction \
        else old_logp
    losses, parts = token_losses(logp, old_logp, recorded, micro.advantages, replay_mask, settings,
                                 micro.demonstration_mask)
    if settings.tis_cap is not None and micro.engine_mask is not None:
        engine_weight = truncated_importance_weights(old_logp, micro.engine_logp, micro.engine_mask, settings.tis_cap)
        losses = torch.where(replay_mask, losses, losses * engine_weight)
        parts["engine_weight"] = engine_weight
    loss = aggregate(losses, mask, settings, micro.total_tokens, micro.total_sequences)
    if entropy is not None and settings.entropy_coef:
        whole = micro.total_tokens is None or settings.entropy_per_micro_batch
        n_tokens = mask.sum() if whole else torch.tensor(float(micro.total_tokens))
        loss = loss - settings.entropy_coef * ((entropy * mask).sum() / n_tokens.clamp(min=1))
    return loss, _stats(parts, micro, mask, replay_mask, settings, entropy)


@torch.no_grad()
def _stats(parts, micro: MicroBatch, mask, replay_mask, settings, entropy) -> dict[str, float]:
    """Fresh tokens' ratios (and engine weights), replayed trajectories' importance weights, the entropy."""
    ratio, w, shaped = parts["ratio"], parts["w"], parts["shaped"]
    fresh_mask = mask * (~replay_mask).to(mask.dtype)
    # demonstrations are off-policy but not replays
    replayed = replay_mask if micro.demonstration_mask is None else replay_mask & ~micro.demonstration_mask.bool()
    stats: dict[str, float] = {"tokens": float(mask.sum()), "fresh_tokens": float(fresh_mask.sum()),
                               "replay_tokens": float(replayed.sum())}
    fresh = fresh_mask.bool()
    if fresh.any():
        r = ratio[fresh]
        adv = micro.advantages.unsqueeze(-1).expand_as(ratio)[fresh]
        low = (r < 1 - settings.epsilon_low) & (adv < 0)
        high = (r > 1 + settings.epsilon_high) & (adv > 0)
        stats.update({
            "ratio/mean": float(r.mean()), "ratio/min": float(r.min()), "ratio/max": float(r.max()),
            "clip_ratio/low_mean": float(low.float().mean()) if settings.clip_fresh else 0.0,
            "clip_ratio/high_mean": float(high.float().mean()) if settings.clip_fresh else 0.0,
            "clip_ratio/region_mean": float((low | high).float().mean()) if settings.clip_fresh else 0.0,
        })
        if "engine_weight" in parts:
            ew = parts["engine_weight"][fresh]
            stats.update({"tis/weight_mean": float(ew.mean()), "tis/weight_min": float(ew.min())})
    if "engine_weight" in parts:
        stats.update(importance_weight_stats(parts["engine_weight"], micro.engine_mask & ~micro.replay_mask.bool(),
                                             settings.tis_cap))
    if replayed.any():
        wr = w[replayed]
        stats.update({
            "replay/ratio_mean": float(wr.mean()), "replay/ratio_min": float(wr.min()),
            "replay/ratio_max": float(wr.max()), "replay/shaped_weight_mean": float(shaped[replayed].mean()),
        })
    if entropy is not None:
        stats["entropy"] = float(masked_mean(entropy, mask))
    return stats


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine the stats of several micro-batches as if computed over their union.

    Means are weighted by the tokens they average over (fresh, replayed or all), minima and maxima reduce.
    """
    merged: dict[str, float] = {}
    keys = {k for p in parts for k in p} - {"tokens", "fresh_tokens", "replay_tokens"}
    for key in keys:
        present = [p for p in parts if key in p]
        if key.endswith("_min") or key.endswith("/min"):
            merged[key] = min(p[key] for p in present)
        elif key.endswith("_max") or key.endswith("/max"):
            merged[key] = max(p[key] for p in present)
        else:
            if key.startswith(("ratio/", "clip_ratio/", "tis/")):
                weights = [p["fresh_tokens"] for p in present]
            elif key.startswith("replay/"):
                weights = [p["replay_tokens"] for p in present]
            else:  # entropy: over all completion tokens
                weights = [p["tokens"] for p in present]
            total = sum(weights)
            merged[key] = sum(w * p[key] for w, p in zip(weights, present)) / total if total else 0.0
    return merged

"""The parity probe: the engine's log-probs of what it sampled against the trainer's pre-update log-probs of the
same tokens. A large difference means the engine is not running the trainer's weights (a sync that did not happen,
a LoRA adapter not applied, a name or dtype mismatch)."""

from __future__ import annotations

import torch

from exgrpo.config import ExGRPOConfig, compute_precision, engine_precision
from exgrpo.errors import TrainingError

SAME_PRECISION_THRESHOLD, MIXED_PRECISION_THRESHOLD = 0.05, 0.1  # nats, mean over the step's sampled tokens


class ParityProbe:
    @classmethod
    def from_config(cls, config: ExGRPOConfig) -> "ParityProbe":
        r = config.rollout
        return cls(every=r.parity_every, threshold=r.parity_threshold,
                   same_precision=engine_precision(config) == compute_precision(config))

    def __init__(self, *, every: int, threshold: float | None, same_precision: bool):
        self.every = every
        self.threshold = threshold or (SAME_PRECISION_THRESHOLD if same_precision else MIXED_PRECISION_THRESHOLD)

    def __call__(self, step: int, engine_logp: torch.Tensor | None, engine_mask: torch.Tensor | None,
                 trainer_logp: torch.Tensor) -> dict[str, float]:
        """rollout/logp_diff_* of step `step` (0-based) over the (N, T) `engine_mask` tokens; raises past the
        threshold. Nothing on steps the probe skips or without engine log-probs."""
        if engine_mask is None or not self.every or step % self.every:
            return {}
        diff = (engine_logp - trainer_logp).abs()[engine_mask]
        if diff.numel() == 0:
            return {}
        mean, worst = float(diff.mean()), float(diff.max())
        if mean > self.threshold:
            raise TrainingError(f"step {step + 1}: the rollout engine's log-probs differ from the trainer's by "
                                f"{mean:.4f} nats on average (max {worst:.4f}; rollout.parity_threshold "
                                f"{self.threshold:g}): the engine is not running the trainer's weights")
        return {"rollout/logp_diff_mean": mean, "rollout/logp_diff_max": worst}

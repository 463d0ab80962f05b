"""The parity probe: the engine's log-probs of what it sampled against the trainer's pre-update log-probs of the
same tokens. It catches gross errors (a model or tokenizer mismatch, a LoRA adapter not applied, a dtype or kernel
problem); a weight sync that did not happen is caught exactly by the engine's own weight check
(`Push.confirm` in `exgrpo.rollout.push`), which does not depend on how far one update moves the log-probs."""

from __future__ import annotations

import torch

from exgrpo.config import ExGRPOConfig, compute_precision, engine_precision
from exgrpo.errors import TrainingError
from exgrpo.rollout.base import RolloutEngine

# Nats, the mean over a step's sampled tokens, per (engine, trainer) compute precision: well above what correctly
# synced engines show (docs/engines.md, measured on SmolLM2-135M), well below a model that is not the trainer's.
THRESHOLDS = {("float32", "float32"): 0.01, ("bfloat16", "float32"): 0.25, ("bfloat16", "bfloat16"): 0.25}
DEFAULT_THRESHOLD = 0.25  # other pairs (float16)


class ParityProbe:
    @classmethod
    def from_config(cls, config: ExGRPOConfig, engine: RolloutEngine) -> "ParityProbe":
        """rollout.parity_* for `engine`; never for an engine that reports no log-probs."""
        r = config.rollout
        pair = (engine_precision(config), compute_precision(config))
        return cls(every=r.parity_every if engine.reports_logprobs else 0,
                   threshold=r.parity_threshold or THRESHOLDS.get(pair, DEFAULT_THRESHOLD))

    def __init__(self, *, every: int, threshold: float):
        self.every, self.threshold = every, threshold

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
                                f"{self.threshold:g}): the engine does not sample from the trainer's policy (another "
                                "model, an adapter not applied, a dtype or kernel problem)")
        return {"rollout/logp_diff_mean": mean, "rollout/logp_diff_max": worst}

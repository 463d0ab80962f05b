"""Which stored trajectory of a question is replayed (spec §3, §9.1).

The trainer scores every stored candidate with the current policy (a batched no-grad forward pass) and hands
the per-token values here. The default is the lowest *mean* token entropy. The released code effectively ranks by
a sum of entropies (a masking bug, spec §9.1); "entropy_sum" reproduces that ranking for ablations.
"""

from __future__ import annotations

import numpy as np
import torch

METRICS = ("entropy", "entropy_sum", "perplexity", "random")
MODES = ("argmin", "argmax")


def trajectory_scores(values: torch.Tensor, mask: torch.Tensor, metric: str = "entropy") -> torch.Tensor:
    """Score candidates from per-token values.

    Args:
        values: (N, T) per-token entropies (metrics "entropy", "entropy_sum") or log-probs ("perplexity").
        mask: (N, T) 1 for the candidate's response tokens.
        metric: "entropy" (mean), "entropy_sum" (released variant) or "perplexity" (exp(-mean log-prob)).
    Returns:
        (N,) scores.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum(-1)
    count = mask.sum(-1).clamp(min=1)
    if metric == "entropy":
        return total / count
    if metric == "entropy_sum":
        return total
    if metric == "perplexity":
        return torch.exp(-total / count)
    raise ValueError(f"unknown selection metric {metric!r}; expected one of {METRICS}")


def select_index(scores: torch.Tensor | None, num_candidates: int, metric: str, mode: str,
                 rng: np.random.Generator) -> int:
    """Index of the candidate to replay: argmin/argmax of scores, or uniform for metric "random"."""
    if metric == "random":
        return int(rng.integers(num_candidates))
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}; expected one of {MODES}")
    assert scores is not None and len(scores) == num_candidates
    return int(torch.argmin(scores) if mode == "argmin" else torch.argmax(scores))

"""The tensors every layer shares: a packed batch of sequences (prompt + completion), the row utilities around it
and per-sequence scores from per-token values. Used by the learner (forward passes, scoring replay candidates), the
rollout engines (shared prompts), the experience side (what a selection metric scores) and the training loop
(packing groups).

Shapes: N sequences; P the padded prompt width; T the padded completion width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class PackedBatch:
    """N sequences, each a left-padded prompt followed by a right-padded completion.

    input_ids, attention_mask, position_ids: (N, P+T) long.
    completion_ids: (N, T) long, the completion part of input_ids.
    completion_mask: (N, T) float, 1 on completion tokens.
    replay_mask: (N, T) bool, True on the tokens of replayed (stored) trajectories.
    recorded_logp: (N, T) float, the behaviour log-probs stored with replayed trajectories (0 elsewhere).
    engine_logp, engine_mask: (N, T) the rollout engine's log-probs of the sampled tokens and where it reported
        them (fresh rollouts of an engine that reports log-probs); None otherwise.
    demonstration_mask: (N, T) bool, True on the tokens of external demonstrations (a subset of replay_mask);
        None when the batch has none.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    replay_mask: torch.Tensor
    recorded_logp: torch.Tensor
    engine_logp: torch.Tensor | None = None
    engine_mask: torch.Tensor | None = None
    demonstration_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pack(sequences: Sequence[tuple[Sequence[int], Sequence[int], np.ndarray | None]], pad_id: int) -> PackedBatch:
    """Pack (prompt ids, completion ids, recorded log-probs or None) triples; a triple with recorded log-probs is a
    replayed trajectory."""
    P = max(len(p) for p, _, _ in sequences)
    T = max(1, max(len(c) for _, c, _ in sequences))
    N = len(sequences)
    input_ids = torch.full((N, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((N, P + T), dtype=torch.long)
    recorded = torch.zeros((N, T))
    replay = torch.zeros((N, T), dtype=torch.bool)
    for i, (prompt, completion, logprobs) in enumerate(sequences):
        input_ids[i, P - len(prompt):P] = torch.tensor(prompt)
        input_ids[i, P:P + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention[i, P - len(prompt):P + len(completion)] = 1
        if logprobs is not None:
            replay[i, :len(completion)] = True
            recorded[i, :len(completion)] = torch.from_numpy(logprobs)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return PackedBatch(input_ids, attention, position_ids, input_ids[:, P:], attention[:, P:].float(), replay,
                       recorded)


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of an (N, W) tensor in order of first appearance.

    Returns (first, owner): `first` (D,) the index of each distinct row's first occurrence; `owner` (N,) the
    position in `first` of each row's distinct row, so `rows[first][owner] == rows`.
    """
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    n = len(rows)
    first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(n), reduce="amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    return first[order], rank[inverse]


@dataclass(frozen=True)
class TrajectoryScore:
    """A score of each of N sequences from one per-token value of the policy over its completion tokens: the
    (N,) token sums and token counts (at least 1) reduced to (N,) scores by `reduce`; `uses_entropy` says which
    value (token entropies, else the tokens' log-probs)."""

    uses_entropy: bool
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(N,) scores of the (N, T) per-token `values` where `mask` is 1."""
        mask = mask.to(values.dtype)
        return self.reduce((values * mask).sum(-1), mask.sum(-1).clamp(min=1))

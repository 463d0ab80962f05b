"""The policy's view of a batch: packed token tensors and the forward pass that gives per-token log-probs and
entropies. Used by the update (training and pre-update log-probs) and by replay selection (scoring candidates).

Shapes: N sequences; P the padded prompt width; T the padded completion width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from exgrpo.experience.selection import trajectory_scores


@dataclass(frozen=True)
class PackedBatch:
    """N sequences, each a left-padded prompt followed by a right-padded completion.

    input_ids, attention_mask, position_ids: (N, P+T) long.
    completion_ids: (N, T) long, the completion part of input_ids.
    completion_mask: (N, T) float, 1 on completion tokens.
    replay_mask: (N, T) bool, True on the tokens of replayed (stored) trajectories.
    recorded_logp: (N, T) float, the behaviour log-probs stored with replayed trajectories (0 elsewhere).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    replay_mask: torch.Tensor
    recorded_logp: torch.Tensor

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


def token_logprobs(model, batch: PackedBatch, temperature: float, rows: slice | torch.Tensor = slice(None),
                   with_entropy: bool = False, device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, T) log-probs of the completion tokens of `rows` under `model` at `temperature`, and (n, T) entropies.

    Rows that share a prompt (a group's members, a question's stored candidates) run it once: its KV cache is
    indexed out to every row, so gradients from all of them flow back through one prompt pass. Padding positions
    hold arbitrary values: mask them with `batch.completion_mask`.
    """
    input_ids, attention, positions = (t[rows].to(device)
                                       for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
    targets = batch.completion_ids[rows].to(device)
    T = targets.shape[1]
    P = input_ids.shape[1] - T
    first, owner = distinct_rows(torch.cat([input_ids[:, :P], attention[:, :P]], dim=1))
    if len(first) == len(input_ids):
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=T + 1,
                    use_cache=False)
        logits = out.logits[:, :-1]
    else:
        # The prompt pass goes through the bare module: a DDP wrapper allows one forward per backward, and
        # each parameter still receives a single (summed) gradient from both passes.
        bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        head = bare(input_ids=input_ids[first, :P], attention_mask=attention[first, :P],
                    position_ids=positions[first, :P], use_cache=True, logits_to_keep=1)
        cache = head.past_key_values
        cache.batch_select_indices(owner)
        out = model(input_ids=targets, attention_mask=attention, position_ids=positions[:, P:],
                    past_key_values=cache, use_cache=True)
        logits = torch.cat([head.logits[owner], out.logits[:, :-1]], dim=1)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return logp, entropy


@torch.no_grad()
def candidate_scores(model, candidates: Sequence[tuple[Sequence[int], Sequence[int]]], metric: str,
                     temperature: float, pad_id: int, batch_size: int, device: torch.device | str = "cpu"
                     ) -> list[float]:
    """Replay-selection scores (see `exgrpo.experience.selection.trajectory_scores`) of (prompt ids, stored
    trajectory ids) pairs under the current policy, in no-grad forwards of `batch_size` candidates."""
    scores: list[float] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(candidates), batch_size):
        batch = pack([(p, t, None) for p, t in candidates[start : start + batch_size]], pad_id)
        logp, entropy = token_logprobs(model, batch, temperature, with_entropy=metric != "perplexity", device=device)
        values = logp if metric == "perplexity" else entropy
        scores += trajectory_scores(values, batch.completion_mask, metric).cpu().tolist()
    model.train(was_training)
    return scores

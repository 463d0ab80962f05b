"""The policy's view of a batch: the forward pass that gives per-token log-probs and entropies of a packed batch
(`exgrpo.tensors.PackedBatch`). Used by the update (training and pre-update log-probs) and by replay selection
(scoring candidates).

Shapes: N sequences; P the padded prompt width; T the padded completion width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from exgrpo.tensors import PackedBatch, TrajectoryScore, distinct_rows, pack

#: Whether rows that share a prompt run it once through its KV cache (the learner chooses): (distinct prompts,
#: rows) -> share. "packed" runs no cache: see `pack_rows`.
PROMPT_SHARING: dict[str, Callable[[int, int], bool]] = {
    "auto": lambda distinct, rows: distinct < rows,  # when some rows share one
    "always": lambda distinct, rows: True,
    "never": lambda distinct, rows: False,
}
PACKED = "packed"
#: The longest sequence of packed rows, in tokens, unless one prompt and completion is longer: attention over a
#: packed sequence grows with its square, the linear layers only with its length.
PACKED_SEQUENCE_TOKENS = 1024


def packs_rows(model) -> bool:
    """Whether `model` can run the packed layout: an attention that takes a 4D mask as given (sdpa, eager) and no
    sliding-window layers (one mask serves every layer)."""
    config = _unwrapped(model).config
    sliding = any(t != "full_attention" for t in getattr(config, "layer_types", None) or []) or \
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return config._attn_implementation in ("sdpa", "eager") and not sliding


def token_logprobs(model, batch: PackedBatch, temperature: float, rows: slice | torch.Tensor = slice(None),
                   with_entropy: bool = False, device: torch.device | str = "cpu", chunk_tokens: int | None = None,
                   prompt_sharing: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, T) log-probs of the completion tokens of `rows` under `model` at `temperature`, and (n, T) entropies.

    Only the columns the rows use are computed (the batch's padding beyond them is cut off). Rows that share a
    prompt (a group's members, a question's stored candidates) run it once. With `prompt_sharing` "packed" (where
    `packs_rows`) the prompt is followed by its rows' completions in one sequence, so no token is padding
    (`pack_rows`); otherwise its KV cache is indexed out to every row, so gradients from all of them flow
    back through one prompt pass ("auto" when some rows share one, "always", or "never", e.g. under activation
    checkpointing, which disables the cache).
    `chunk_tokens`: compute the output head, log-softmax and entropy in chunks of that many completion tokens,
    recomputed in backward, so (tokens x vocabulary) logits never exist at once; None computes them in one go.
    Padding positions hold 0: mask them with `batch.completion_mask`.
    """
    T_full = batch.completion_ids.shape[1]
    input_ids, attention, positions, targets, mask = _trimmed(batch, rows, device)
    if prompt_sharing == PACKED:
        hidden = _packed_final_states(model, input_ids, attention, targets, mask)
        logp, entropy = _flat_head(_output_head(model), hidden, targets, mask, temperature, with_entropy,
                                   chunk_tokens or len(hidden))
        return _pad_to(logp, T_full), (_pad_to(entropy, T_full) if with_entropy else None)
    shares = PROMPT_SHARING[prompt_sharing]
    want_hidden = chunk_tokens is not None
    final = _final_states(model, input_ids, attention, positions, targets, shares, want_hidden)
    if want_hidden:
        logp, entropy = _flat_head(_output_head(model), final[mask.bool()], targets, mask, temperature,
                                   with_entropy, chunk_tokens)
    else:
        logp, entropy = _head_values(final, targets, temperature, with_entropy)
    return _pad_to(logp * mask, T_full), (_pad_to(entropy * mask, T_full) if with_entropy else None)


def _final_states(model, input_ids, attention, positions, targets, shares: Callable[[int, int], bool],
                  want_hidden: bool):
    """(n, T, ·) the states that predict each of the T completion tokens: last-layer hidden states when
    `want_hidden` (for a chunked head), else logits. With prompt sharing (`shares(distinct prompts, rows)`), each
    distinct prompt runs once and its KV cache is indexed out to the rows that share it."""
    T = targets.shape[1]
    P = input_ids.shape[1] - T
    first, owner = distinct_rows(torch.cat([input_ids[:, :P], attention[:, :P]], dim=1))
    share = shares(len(first), len(input_ids))
    extra = {"output_hidden_states": True} if want_hidden else {}
    if not share:
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                    logits_to_keep=1 if want_hidden else T + 1, use_cache=False, **extra)
        return out.hidden_states[-1][:, P - 1:-1] if want_hidden else out.logits[:, :-1]
    # The prompt pass goes through the bare module: a DDP wrapper allows one forward per backward, and each
    # parameter still receives a single (summed) gradient from both passes.
    head = _unwrapped(model)(input_ids=input_ids[first, :P], attention_mask=attention[first, :P],
                             position_ids=positions[first, :P], use_cache=True, logits_to_keep=1, **extra)
    cache = head.past_key_values
    cache.batch_select_indices(owner)
    out = model(input_ids=targets, attention_mask=attention, position_ids=positions[:, P:],
                past_key_values=cache, use_cache=True, logits_to_keep=1 if want_hidden else 0, **extra)
    if want_hidden:
        return torch.cat([head.hidden_states[-1][owner, -1:], out.hidden_states[-1][:, :-1]], dim=1)
    return torch.cat([head.logits[owner], out.logits[:, :-1]], dim=1)


@dataclass
class PackedRows:
    """Rows laid out as S sequences of L tokens, each a prompt once and then completions of rows that share it.

    input_ids, position_ids: (S, L); each completion's positions are those it has in its own row.
    allowed: (S, 1, L, L) bool, True where a query token attends to a key: a completion to the prompt and to its
        own earlier tokens; padding to padding (a token with nothing to attend to would give NaN).
    predictors: (tokens,) the index in the flattened (S * L) sequences of the state predicting each completion
        token, in row-major order of the rows' completion masks.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    predictors: torch.Tensor


def pack_rows(input_ids, attention, targets, mask, max_tokens: int = PACKED_SEQUENCE_TOKENS) -> PackedRows:
    """The packed layout of n rows (trimmed: (n, P + T) ids and attention, (n, T) targets and mask): a sequence
    holds up to `max_tokens` tokens, or one prompt and one completion where that is longer."""
    T = targets.shape[1]
    P = input_ids.shape[1] - T
    first, owner = distinct_rows(torch.cat([input_ids[:, :P], attention[:, :P]], dim=1))
    completion_lengths = mask.sum(-1).long().tolist()
    tokens: list[list[torch.Tensor]] = []  # each sequence's parts: its prompt, then completions
    segments: list[list[int]] = []  # per token of each sequence: 0 on the prompt, j on its j-th completion
    positions: list[list[int]] = []
    predictors: dict[int, list[tuple[int, int]]] = {}  # per row, per token: (sequence, index) of its predictor
    for d, row in enumerate(first.tolist()):
        prompt = input_ids[row, P - int(attention[row, :P].sum()):P]
        p, fresh = len(prompt), True
        for r in (owner == d).nonzero().flatten().tolist():
            c = completion_lengths[r]
            if fresh or len(segments[-1]) + c > max(max_tokens, p + c):
                tokens.append([prompt])
                segments.append([0] * p)
                positions.append(list(range(p)))
                fresh = False
            s, start = len(tokens) - 1, len(segments[-1])
            predictors[r] = [(s, p - 1)] + [(s, start + t) for t in range(c - 1)] if c else []
            tokens[s].append(targets[r, :c])
            segments[s] += [len(tokens[s]) - 1] * c
            positions[s] += range(p, p + c)
    L = max(len(seg) for seg in segments)
    device = input_ids.device
    segment = torch.tensor([seg + [-1] * (L - len(seg)) for seg in segments], device=device)
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    return PackedRows(
        torch.stack([_pad_to(torch.cat(parts)[None], L)[0] for parts in tokens]),
        torch.tensor([pos + [0] * (L - len(pos)) for pos in positions], device=device),
        (causal & ((key == 0) | (key == query)))[:, None],
        torch.tensor([s * L + i for r in sorted(predictors) for s, i in predictors[r]], device=device,
                     dtype=torch.long))


def _packed_final_states(model, input_ids, attention, targets, mask) -> torch.Tensor:
    """(tokens, hidden) the last-layer states that predict the completion tokens (in `mask`'s order), from the
    packed layout (`pack_rows`): every value is the padded layout's."""
    packed = pack_rows(input_ids, attention, targets, mask)
    allowed = packed.allowed
    if _unwrapped(model).config._attn_implementation == "eager":  # eager adds the mask to the scores
        allowed = torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed,
                                                                                torch.finfo(torch.float32).min)
    out = model(input_ids=packed.input_ids, attention_mask=allowed, position_ids=packed.position_ids,
                use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1].flatten(0, 1)[packed.predictors]


def _trimmed(batch: PackedBatch, rows, device):
    """The rows' input ids, attention, positions, completion ids and completion mask, cut to the widest prompt
    and the longest completion among them (at least one completion column)."""
    T = batch.completion_ids.shape[1]
    P = batch.input_ids.shape[1] - T
    attention = batch.attention_mask[rows]
    prompt_width = int(attention[:, :P].sum(-1).max())
    completion_width = max(1, int(batch.completion_mask[rows].sum(-1).max()))
    columns = slice(P - prompt_width, P + completion_width)
    return (batch.input_ids[rows][:, columns].to(device), attention[:, columns].to(device),
            batch.position_ids[rows][:, columns].to(device),
            batch.completion_ids[rows][:, :completion_width].to(device),
            batch.completion_mask[rows][:, :completion_width].to(device))


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def _head_values(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """Log-probs of `targets` and entropies from logits (..., V), in fp32."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else torch.zeros_like(logp)
    return logp, entropy


def _unwrapped(model):
    """The module inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _output_head(model):
    return _unwrapped(model).get_output_embeddings()


def _flat_head(head, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float,
               with_entropy: bool, chunk_tokens: int):
    """(n, T) log-probs and entropies (0 off `mask`) from `hidden` (tokens, H), the states predicting the (n, T)
    `targets` where `mask` is 1, in row-major order; the head runs on `chunk_tokens` at a time, each chunk's
    logits recomputed in backward when there is more than one."""
    valid = mask.bool()
    t = targets[valid]
    if chunk_tokens >= len(hidden):
        parts = [_head_values(head(hidden), t, temperature, with_entropy)]
    else:
        parts = [torch.utils.checkpoint.checkpoint(lambda h, y: _head_values(head(h), y, temperature, with_entropy),
                                                   hidden[i:i + chunk_tokens], t[i:i + chunk_tokens],
                                                   use_reentrant=False)
                 for i in range(0, len(hidden), chunk_tokens)]
    logp = mask.new_zeros(targets.shape, dtype=torch.float32)
    entropy = torch.zeros_like(logp)
    logp = logp.masked_scatter(valid, torch.cat([p for p, _ in parts]))
    entropy = entropy.masked_scatter(valid, torch.cat([e for _, e in parts]))
    return logp, entropy


@torch.no_grad()
def candidate_scores(forward: Callable[[PackedBatch, bool], tuple[torch.Tensor, torch.Tensor | None]],
                     candidates: Sequence[tuple[Sequence[int], Sequence[int]]], metric: TrajectoryScore,
                     pad_id: int, batch_size: int) -> list[float]:
    """Replay-selection scores by `metric` (`exgrpo.experience.selection.SELECTION_METRICS`) of (prompt ids, stored
    trajectory ids) pairs, in no-grad `forward(batch, with_entropy) -> (log-probs, entropies)` passes of
    `batch_size` candidates (the caller puts the model in eval mode)."""
    scores: list[float] = []
    for start in range(0, len(candidates), batch_size):
        batch = pack([(p, t, None) for p, t in candidates[start : start + batch_size]], pad_id)
        logp, entropy = forward(batch, metric.uses_entropy)
        scores += metric(entropy if metric.uses_entropy else logp, batch.completion_mask).cpu().tolist()
    return scores

"""Forming a step's groups (experiential ones first, each holding its replay as member 0) and packing them into
the learner's tensors."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch

from exgrpo.data import Question
from exgrpo.records import Group, Member, Trajectory
from exgrpo.tensors import PackedBatch, pack


def form_groups(experiential: Sequence[tuple[Question, Trajectory]], fresh: Sequence[Question],
                prompt_ids: Callable[[Question], list[int]]) -> list[Group]:
    """Experiential groups first, each holding its replay as member 0, then the fresh groups (still empty)."""
    groups = [Group(q, prompt_ids(q), [Member(t.token_ids.tolist(), replay=t)]) for q, t in experiential]
    return groups + [Group(q, prompt_ids(q)) for q in fresh]


def pack_groups(groups: Sequence[Group], pad_id: int) -> PackedBatch:
    """Every member of every group, in order: row g*K + j is member j of group g."""
    members = [m for g in groups for m in g.members]

    def recorded(m: Member) -> np.ndarray | None:  # a demonstration is off-policy with no behaviour log-probs
        if m.demonstration:
            return np.zeros(len(m.completion_ids), np.float32)
        return None if m.replay is None else m.replay.logprobs

    batch = pack([(g.prompt_ids, m.completion_ids, recorded(m)) for g in groups for m in g.members], pad_id)
    if any(m.demonstration for m in members):
        rows = torch.tensor([m.demonstration for m in members]).unsqueeze(-1)
        batch = replace(batch, demonstration_mask=batch.replay_mask & rows)
    if not any(m.engine_logp is not None for m in members):
        return batch
    engine = torch.zeros_like(batch.recorded_logp)
    has = torch.zeros_like(batch.replay_mask)
    for i, m in enumerate(members):
        if m.engine_logp is not None:
            engine[i, :len(m.engine_logp)] = torch.tensor(m.engine_logp)
            has[i, :len(m.engine_logp)] = True
    return replace(batch, engine_logp=engine, engine_mask=has)

"""Shared test parts: the tiny in-process model, a scripted rollout engine and small question sets."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch

from exgrpo.data import Question
from exgrpo.models import load_policy
from exgrpo.rollout import Rollouts

torch.set_num_threads(2)


class ScriptedEngine:
    """A RolloutEngine whose completions come from `respond(prompt_ids, n) -> (completion ids, truncated)`, n being
    how many times that prompt was asked for before. Records every call (count, sampling, seeds) and weight sync."""

    def __init__(self, respond: Callable[[list[int], int], tuple[list[int], bool]]):
        self.respond = respond
        self.calls: list[tuple] = []
        self.syncs = 0
        self._asked: Counter = Counter()

    def generate(self, prompt_ids, sampling, seeds) -> Rollouts:
        self.calls.append((len(prompt_ids), sampling, list(seeds)))
        completions, truncated = [], []
        for prompt in prompt_ids:
            key = tuple(prompt)
            ids, cut = self.respond(list(prompt), self._asked[key])
            self._asked[key] += 1
            completions.append(list(ids))
            truncated.append(cut)
        return Rollouts(completions, truncated)

    def sync_weights(self) -> None:
        self.syncs += 1


@pytest.fixture
def scripted_engine():
    """The ScriptedEngine class (build one with a respond function)."""
    return ScriptedEngine


@pytest.fixture
def tiny_policy():
    """A fresh tiny random-weight Llama and its character-level tokenizer (deterministic: seed 0)."""
    return load_policy("tiny:0")


def make_questions(n: int, prefix: str = "q") -> list[Question]:
    return [Question(f"{prefix}{i}", ({"role": "user", "content": f"{prefix} {i}"},), str(i), {}) for i in range(n)]


@pytest.fixture
def questions():
    """A factory of n simple questions with ids q0, q1, ... and answers "0", "1", ..."""
    return make_questions

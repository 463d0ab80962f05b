"""Fresh questions: the training set in a seeded shuffled order, epoch after epoch, skipping retired questions."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from exgrpo.data.questions import Question


class Retirement(Protocol):
    """Who decides that a question is retired (the experience buffer: a K/K group retires its question)."""

    def is_retired(self, question_id: str) -> bool: ...

    @property
    def num_retired(self) -> int: ...


class QuestionPool:
    """Draws fresh questions; the retired set is the `retirement` ledger's, never a copy of it."""

    def __init__(self, questions: Sequence[Question], seed: int, retirement: Retirement):
        if not questions:
            raise ValueError("the training set is empty")
        ids = [q.id for q in questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be unique within the training set")
        self.questions = {q.id: q for q in questions}
        self.retirement = retirement
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[str]:
        ids = list(self.questions)
        np.random.default_rng([self.seed, epoch]).shuffle(ids)
        return ids

    @property
    def remaining(self) -> int:
        """Questions not retired yet."""
        return len(self.questions) - self.retirement.num_retired

    def draw(self, n: int, exclude: frozenset[str] = frozenset()) -> list[Question]:
        """The next n non-retired questions not in `exclude` (questions in flight, which lose this turn), fewer only
        when fewer remain in the whole pool. When the others cannot fill n, the questions in flight are drawn too, as
        a sync run would ask them again: a pool no larger than the steps in flight still gives whole batches."""
        out: list[Question] = []
        if self.remaining - sum(not self.retirement.is_retired(qid) for qid in exclude) < n:
            exclude = frozenset()
        n = min(n, self.remaining)
        while len(out) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            qid = self._order[self.cursor]
            self.cursor += 1
            if not self.retirement.is_retired(qid) and qid not in exclude:
                out.append(self.questions[qid])
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._shuffled(self.epoch)

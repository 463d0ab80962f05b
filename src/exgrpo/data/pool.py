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
    """Draws fresh questions; the retired set is the `retirement` ledger's, never a copy of it.

    A retired question leaves the pool at once, or with `at_epoch_boundary` as the released code removes it (spec
    §2 (c)): at the start of the next epoch, and only while the pool then holds more than `batch_size` + 20
    questions; until then it can still be drawn as a fresh question.
    """

    TOLERANCE = 20  # the released BATCH_TOLERANCE

    def __init__(self, questions: Sequence[Question], seed: int, retirement: Retirement,
                 at_epoch_boundary: bool = False, batch_size: int = 0):
        if not questions:
            raise ValueError("the training set is empty")
        ids = [q.id for q in questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be unique within the training set")
        self.questions = {q.id: q for q in questions}
        self.retirement, self.at_epoch_boundary, self.batch_size = retirement, at_epoch_boundary, batch_size
        self.removed: set[str] = set()  # at_epoch_boundary: the retired questions removed at an epoch's start
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[str]:
        ids = list(self.questions)
        np.random.default_rng([self.seed, epoch]).shuffle(ids)
        return ids

    def _in_pool(self, qid: str) -> bool:
        return qid not in self.removed if self.at_epoch_boundary else not self.retirement.is_retired(qid)

    @property
    def remaining(self) -> int:
        """Questions still in the pool."""
        if self.at_epoch_boundary:
            return len(self.questions) - len(self.removed)
        return len(self.questions) - self.retirement.num_retired

    def draw(self, n: int, exclude: frozenset[str] = frozenset()) -> list[Question]:
        """The next n questions of the pool not in `exclude` (questions in flight, which lose this turn), fewer only
        when fewer remain in the whole pool. When the others cannot fill n, the questions in flight are drawn too, as
        a sync run would ask them again: a pool no larger than the steps in flight still gives whole batches."""
        out: list[Question] = []
        if self.remaining - sum(self._in_pool(qid) for qid in exclude) < n:
            exclude = frozenset()
        n = min(n, self.remaining)
        while len(out) < n:
            if self.cursor == len(self._order):
                self._next_epoch()
            qid = self._order[self.cursor]
            self.cursor += 1
            if self._in_pool(qid) and qid not in exclude:
                out.append(self.questions[qid])
        return out

    def _next_epoch(self) -> None:
        self.epoch, self.cursor = self.epoch + 1, 0
        self._order = self._shuffled(self.epoch)
        if self.at_epoch_boundary and self.remaining > self.batch_size + self.TOLERANCE:
            self.removed = {qid for qid in self.questions if self.retirement.is_retired(qid)}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "removed": sorted(self.removed)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.removed = set(state.get("removed", []))  # checkpoints before 2026-12-03 retired at once: none
        self._order = self._shuffled(self.epoch)

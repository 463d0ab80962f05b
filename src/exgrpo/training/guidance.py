"""External guidance (LUFFY, Yan et al., 2025, arXiv 2504.14945): reference solutions shipped with the data join
a question's group as off-policy members. Their behaviour probabilities are unknown, so the objective weighs their
tokens by f(pi) = pi / (pi + gamma) of the current policy's probability (see docs/replay.md)."""

from __future__ import annotations

import warnings
from typing import Sequence

from exgrpo.config import GuidanceConfig
from exgrpo.data import DataError, Question
from exgrpo.errors import ExgrpoWarning
from exgrpo.records import Group, Member


def demonstration_ids(questions: Sequence[Question], field: str, tokenizer,
                      max_length: int) -> tuple[dict[str, list[list[int]]], int]:
    """Per question id, its demonstrations as completion token ids (the text and EOS, as a rollout that stopped
    would be), and how many demonstrations were dropped for being longer than `max_length` tokens.

    The column holds a string or a list of strings; a missing, null or empty value gives the question none.
    """
    if questions and not any(field in q.columns for q in questions):
        raise DataError(f"guidance.field {field!r} is not a column of the training data (columns: "
                        f"{sorted(questions[0].columns)})")
    eos = tokenizer.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    out, dropped = {}, 0
    for q in questions:
        value = q.columns.get(field)
        texts = [value] if isinstance(value, str) else value or []
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise DataError(f"question {q.id}: guidance.field {field!r} must hold a string or a list of strings "
                            f"(got {type(value).__name__})")
        ids = []
        for text in texts:
            if text.strip():
                tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
                if len(tokens) > max_length:
                    dropped += 1
                else:
                    ids.append(tokens)
        if ids:
            out[q.id] = ids
    return out, dropped


class Guidance:
    """The run's demonstrations (per question id, completion token ids) and how they join groups: up to `members`
    of them become the first members of a group that replays nothing; with mode `fallback` only while the policy
    has no correct rollout of its own for the question."""

    def __init__(self, demonstrations: dict[str, list[list[int]]], *, members: int = 1, mode: str = "always"):
        self.demonstrations, self.members, self.mode = demonstrations, members, mode

    @classmethod
    def from_config(cls, config: GuidanceConfig, questions: Sequence[Question], tokenizer,
                    max_length: int) -> "Guidance":
        """`config.field`'s demonstrations of `questions` (none without a field); warns about dropped ones."""
        if not config.field:
            return cls({})
        demonstrations, dropped = demonstration_ids(questions, config.field, tokenizer, max_length)
        if dropped:
            warnings.warn(ExgrpoWarning(f"dropped {dropped} demonstrations longer than "
                                        f"rollout.max_completion_length = {max_length} tokens"), stacklevel=3)
        return cls(demonstrations, members=config.members, mode=config.mode)

    def __bool__(self) -> bool:
        return bool(self.demonstrations)

    def add(self, groups: Sequence[Group], step: int, ever_correct: set[str]) -> None:
        """Put demonstrations into `groups` (rotating through a question's demonstrations with `step`);
        `ever_correct`: the questions with a correct rollout of the policy's own so far."""
        for group in groups:
            demos = self.demonstrations.get(group.question.id)
            if not demos or group.members or (self.mode == "fallback" and group.question.id in ever_correct):
                continue
            group.members = [Member(list(demos[(step + j) % len(demos)]), demonstration=True)
                             for j in range(min(self.members, len(demos)))]

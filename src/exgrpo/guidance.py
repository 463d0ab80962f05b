"""External guidance (LUFFY, Yan et al., 2025, arXiv 2504.14945): reference solutions shipped with the data join
a question's group as off-policy members. Their behaviour probabilities are unknown, so the objective weighs their
tokens by f(pi) = pi / (pi + gamma) of the current policy's probability (see docs/replay.md)."""

from __future__ import annotations

from typing import Sequence

from exgrpo.data import DataError, Question


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

"""Graders of the answers that are not math: the option a multiple-choice completion chooses (ARC-c, GPQA) and
reasoning-gym's own scorers for its tasks."""

from __future__ import annotations

import functools
import re


# An option label: a letter (A-D, sometimes E) or, in 22 ARC-c rows, a digit 1-4.
_ANSWER_LINE = re.compile(r"answer\s*:\s*\(?\s*([a-z0-9])\s*\)?\.?", re.IGNORECASE)
# Wrappers a model puts around a boxed letter: \text{C}, \textbf{(C)}, \mathrm{C}, $C$.
_LETTER_NOISE = re.compile(r"\\[A-Za-z]+|[{}()$.\s]")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def choice_letter(completion: str) -> str:
    """The option a completion chooses, upper-cased; "" if none.

    The option is the single letter or digit in the last \\boxed{...}; if that box holds none (or there is no
    box), it is a last line of the form "ANSWER: X" (the GPQA prompt's format).
    """
    boxed = last_boxed(completion)
    label = _LETTER_NOISE.sub("", boxed) if boxed is not None else ""
    if not re.fullmatch(r"[A-Za-z0-9]", label):
        lines = completion.strip().splitlines()
        match = _ANSWER_LINE.fullmatch(lines[-1].strip()) if lines else None
        label = match.group(1) if match else ""
    return label.upper()


def grade_choice(completion: str, gold: str) -> float:
    """1.0 if the chosen option (see `choice_letter`) equals `gold` (a letter, case-insensitive, or a digit)."""
    label = choice_letter(completion)
    return float(label != "" and label == gold.strip().strip("()").upper())


# --- reasoning-gym -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _rg_scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def extract_final_answer(completion: str) -> str:
    """The answer part of a completion, as reasoning-gym scorers expect it (a bare answer string).

    Text after the last ``</think>`` only; then the last ``<answer>...</answer>`` (reasoning-gym's own format), else
    the last ``\\boxed{...}``, else the last non-empty line; stripped.
    """
    text = completion.rsplit("</think>", 1)[-1]
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def score_reasoning_gym(completion: str, entry: dict) -> float:
    """Score a completion with reasoning-gym's own scorer for the entry's task (``columns["rg_entry"]``).

    The scorer gets `extract_final_answer(completion)`. Scorers give exact matches 1.0 and some give partial
    credit (e.g. the default scorer gives len(gold)/len(answer) when the gold is a substring), so the result is in
    [0, 1]. A scorer that raises on a malformed answer scores 0.0.
    """
    scorer = _rg_scorer(entry["metadata"]["source_dataset"])
    try:
        return float(scorer(extract_final_answer(completion), entry))
    except Exception:  # scorers parse free-form model text; a crash means an unusable answer, not a bug here
        return 0.0

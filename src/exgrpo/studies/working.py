"""A completion's working, judged: what its checkable steps (`exgrpo.rewards.arithmetic.steps`) make of a correct
answer: *valid* (at least one checkable step, all right), *lucky* (a wrong step) or *no working*. Used by the
premise check (bench/premise_check.py, docs/premise-check.md) and by study reports, which classify the paid
completions a run logged (arithmetic tasks such as reasoning-gym's chain_sum)."""

from __future__ import annotations

from exgrpo.rewards.arithmetic import steps


def classify(text: str) -> str:
    """"valid" (checkable steps, all right), "lucky" (a wrong step) or "no_working" (no checkable step)."""
    found = steps(text)
    if not found:
        return "no_working"
    return "valid" if all(s["ok"] for s in found) else "lucky"

"""Restatements: answers that copy the question's arithmetic instead of computing it (the training reward only).

math-verify evaluates the expression it finds in a completion, so "To calculate 752 * -611 + 290 ..." grades as
the answer -459182 (docs/results.md, "Read this first"), and a policy trained on that reward learns to copy the
question. The training reward refuses such an answer where the gold is a number. The same form built from other
numbers is an answer and counts: ``2^{10}`` for "how many subsets has a set of ten elements?", or ``5^{2}`` for a
question that mentions a 5 and, elsewhere, a 2. Benchmark evaluation never applies this rule: the released
evaluation grader does not.
"""

from __future__ import annotations

import re
from collections import Counter
from decimal import Decimal

import sympy

from exgrpo.rewards.arithmetic import NUMBER

_SUBSCRIPT = re.compile(r"_\{[^{}]*\}|_\w")  # indices (z_{2}, a_1) are names, not quantities
_LAYOUT = re.compile(r"\s|\$|\\left|\\right|\\[,;!]|[{}]")
_PLAIN_FRACTION = re.compile(r"\s*-?\s*\d+\s*/\s*\d+\s*")
_NEUTRAL = {Decimal(0), Decimal(1)}  # "+ 0x", "* 1": padding that must not hide a copy


def written_numbers(text: str) -> list[Decimal]:
    """The unsigned numbers written in `text`, in order, without 0 and 1 and without subscripts:
    "752 * -611 + 0x" -> [752, 611]; "z_{2} = 15" -> [15]."""
    return [n for n in map(Decimal, re.findall(NUMBER, _SUBSCRIPT.sub("", text))) if n not in _NEUTRAL]


def is_restatement(value: object, text: str, question: str) -> bool:
    """True when an answer is arithmetic still to be evaluated that the question already holds.

    `value` and `text` are math-verify's parse of the answer: the sympy object and the text it was read from. Of
    an equation (``x = 752 * -611 + 290``), the right side is judged. It needs evaluating when its value is a
    compound expression: not a number or a symbol, nor a number as written (a plain fraction ``p/q`` or a
    percentage). The question holds it when the question's text contains the answer's (spaces, ``$``, braces and
    ``\\left``/``\\right`` aside), or when the answer's numbers (at least two; 0, 1 and subscripts left out, so
    that padding such as ``+ 0x`` hides nothing) are the question's numbers at consecutive places, in any order.
    """
    if not isinstance(text, str) or not isinstance(question, str):
        raise TypeError(f"is_restatement needs the answer's text and the question as str, got "
                        f"{type(text).__name__} and {type(question).__name__}")
    if isinstance(value, sympy.Equality):
        value, text = value.rhs, text.rsplit("=", 1)[-1]
    if not isinstance(value, sympy.Expr) or value.is_Atom:
        return False
    if value.has(sympy.UnevaluatedExpr) or _PLAIN_FRACTION.fullmatch(text):  # n% is n * UnevaluatedExpr(1/100)
        return False
    # math-verify can pair a value with text it was not read from ("To get 100 + 6 + 62, I ... (10)." reads as
    # 6 + 62 + 100 with the text "(10)."), so the value's own numbers are judged too
    return (_LAYOUT.sub("", text) in _LAYOUT.sub("", question) or _numbers_stand_together(text, question)
            or _numbers_stand_together(str(value), question))


def _numbers_stand_together(text: str, question: str) -> bool:
    """At least two numbers in `text`, which are those at consecutive places among `question`'s, in any order."""
    numbers = Counter(written_numbers(text))
    count = sum(numbers.values())
    in_question = written_numbers(question)
    return count >= 2 and any(Counter(in_question[i:i + count]) == numbers
                              for i in range(len(in_question) - count + 1))

"""Reading a completion's arithmetic: how numbers and arithmetic are written, and the checkable steps
("lhs = rhs") a text writes. One reader for the training reward (`exgrpo.rewards.graders`), the restatement rule
(`exgrpo.rewards.restatement`) and the studies' working reader (`exgrpo.studies.working`)."""

from __future__ import annotations

import ast
import math
import re

#: an unsigned number: "3", "2.5"
NUMBER = r"\d+(?:\.\d+)?"
#: a number that may carry a minus sign: "-3"
SIGNED_NUMBER = rf"-?{NUMBER}"
#: a number as a completion states it: "-3", "2.5", "1,000", "1,000.5" (also before a full stop: "is 1,000.")
STATED_NUMBER = rf"-?\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?(?!\d)|{SIGNED_NUMBER}"
#: arithmetic on one line stated as an answer: numbers joined by operators and "=" ("15 - 6 = 9"; "71 = 48 + 23")
CHAIN = rf"(?:{STATED_NUMBER})(?:[ \t]*[-+*/×÷=][ \t]*\(?(?:{STATED_NUMBER})\)?)*"
#: an operator and its operand
OPERATION = rf"[ \t]*[-+*/×÷][ \t]*\(?{SIGNED_NUMBER}\)?"
#: arithmetic written out: numbers joined by operators ("7 - 2 + 0")
ARITHMETIC = re.compile(rf"{SIGNED_NUMBER}(?:{OPERATION})+")
#: "=" and the rest of the arithmetic on the line (group 1)
RESULT = r"[ \t]*=([-\d \t.+*/×÷()=]*)"
#: an arithmetic token: a number, an operator ("x" and "×" multiply), a parenthesis, or a stray full stop (which
#: makes a list of tokens no expression: "2. 3 + 4")
TOKEN = re.compile(rf"{NUMBER}|[-+*/×x÷()]|\.")

_LATEX = {r"\times": "*", r"\cdot": "*", r"\div": "/", r"\left": "", r"\right": "", "−": "-", "–": "-"}
#: a stretch of arithmetic in running text: numbers, operators, parentheses, "=", spaces (a word or ":" ends it)
_RUN = re.compile(r"[0-9.+\-*/×x÷()= \t]+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def last_side(result: str) -> str:
    """The last side of what follows an equation's "=" ("15 - 6 = 9." -> "9")."""
    return result.rsplit("=", 1)[-1].strip().rstrip(".").strip()


def places_written(number: str, text: str) -> list[re.Match]:
    """Every place `text` writes `number` (not as part of a longer number)."""
    return list(re.finditer(rf"(?<![\d.]){re.escape(number)}(?!\.?\d)", text))


def steps(text: str) -> list[dict]:
    """Every checkable "lhs = rhs" in `text`: both sides arithmetic, at least one with an operator.

    A chain "a + b = c + d = e" gives two steps. The left side is the longest arithmetic suffix before the "=",
    the right side the longest prefix after it, so list numbers ("2. 3 + 4 = 7"), a leading word or an opening
    parenthesis do not spoil a step. "x" and "×" between numbers multiply; LaTeX \\times, \\cdot, \\div are read.
    Each step: {"lhs", "rhs" (values), "text", "ok" (equal within 1e-6 relative)}.
    """
    for latex, plain in _LATEX.items():
        text = text.replace(latex, plain)
    found = []
    for line in text.splitlines():
        for run in _RUN.finditer(line):
            parts = run.group().split("=")
            if len(parts) < 2:
                continue
            tokens = [TOKEN.findall(p) for p in parts]
            for i in range(len(parts) - 1):
                left, right = _longest(tokens[i], suffix=True), _longest(tokens[i + 1], suffix=False)
                if left is None or right is None or not (left[1] or right[1]):
                    continue
                ok = math.isclose(left[0], right[0], rel_tol=1e-6, abs_tol=1e-9)
                found.append({"lhs": left[0], "rhs": right[0], "text": f"{parts[i].strip()} = {parts[i + 1].strip()}",
                              "ok": ok})
    return found


def _longest(tokens: list[str], suffix: bool) -> tuple[float, bool] | None:
    """The longest suffix (left of an "=") or prefix (right of one) of `tokens` that is an expression."""
    for cut in range(len(tokens)):
        part = tokens[cut:] if suffix else tokens[:len(tokens) - cut]
        got = _evaluate(part)
        if got is not None:
            return got
    return None


def _evaluate(tokens: list[str]) -> tuple[float, bool] | None:
    """(value, has a binary operator) of a token list, or None when it is not one arithmetic expression."""
    text = " ".join("*" if t in "×x" else "/" if t == "÷" else t for t in tokens)
    if not text or "." in tokens:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
        value = _value(tree)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    has_op = any(isinstance(n, ast.BinOp) for n in ast.walk(tree))
    return value, has_op


def _value(node) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic")
